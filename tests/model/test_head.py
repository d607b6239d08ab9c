"""Target log-probabilities straight from hidden states (the training path)."""

import pytest
import torch

from whetstone.errors import WhetstoneError
from whetstone.model import Transformer, ops
from whetstone.model.head import target_logprobs


def test_equals_log_softmax_and_its_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    targets[1, 3] = -100  # ignored: logprob 0, no gradient
    probe = torch.randn(2, 5, dtype=torch.float64)

    got, entropy = target_logprobs(hidden, weight, targets)
    assert entropy is None
    reference = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    reference = reference.masked_fill(targets < 0, 0.0)
    torch.testing.assert_close(got, reference)
    grads = torch.autograd.grad((got * probe).sum(), (hidden, weight))
    expected = torch.autograd.grad((reference * probe).sum(), (hidden, weight))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)
    assert grads[0][1, 3].abs().sum() == 0


def test_entropy_and_its_gradients_equal_the_full_softmax():
    torch.manual_seed(1)
    hidden = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    targets[0, 2] = -100
    probe_lp, probe_h = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)

    logprobs, entropy = target_logprobs(hidden, weight, targets, with_entropy=True)
    log_p = torch.log_softmax(hidden @ weight.T, -1)
    reference_lp = log_p.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(targets < 0, 0.0)
    reference_h = -(log_p.exp() * log_p).sum(-1).masked_fill(targets < 0, 0.0)
    torch.testing.assert_close(entropy, reference_h)
    assert entropy[0, 2] == 0 and bool((entropy[targets >= 0] > 0).all())
    got = torch.autograd.grad((logprobs * probe_lp + entropy * probe_h).sum(), (hidden, weight))
    expected = torch.autograd.grad((reference_lp * probe_lp + reference_h * probe_h).sum(), (hidden, weight))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_model_targets_give_logprobs_instead_of_logits(make_config):
    cfg = make_config()
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    targets = torch.roll(ids, -1, dims=1)
    out = model(ids, targets=targets)
    assert out.logits is None and out.logprobs.shape == (2, 7) and out.logprobs.dtype == torch.float32
    expected = torch.log_softmax(model(ids).logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.logprobs, expected, atol=1e-5, rtol=1e-5)


def test_bf16_autocast_keeps_the_softmax_in_fp32(make_config):
    cfg = make_config()
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, targets=ids)
    assert out.logprobs.dtype == torch.float32
    out.logprobs.sum().backward()
    assert model.embed_tokens.weight.grad.dtype == torch.float32


def test_bf16_logprobs_come_from_bf16_logits_normalised_in_fp32(monkeypatch):
    # Under bf16 the head keeps bf16 probabilities, made chunk by chunk (3 rows per chunk here):
    # the logprobs are the fp32 log_softmax of the bf16 logits, the gradients those of that formula
    # to bf16 rounding.
    import whetstone.model.head as head

    monkeypatch.setattr(head, "REDUCED_CHUNK_BYTES", 3 * 4 * 37)
    torch.manual_seed(2)
    hidden = torch.randn(2, 5, 16).bfloat16().requires_grad_()
    weight = torch.randn(37, 16).bfloat16().requires_grad_()
    targets = torch.randint(0, 37, (2, 5))
    targets[0, 4] = -100
    probe = torch.randn(2, 5)
    got, _ = target_logprobs(hidden, weight, targets)
    logits = (hidden @ weight.T).float()
    reference = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    reference = reference.masked_fill(targets < 0, 0.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-6)
    grads = torch.autograd.grad((got * probe).sum(), (hidden, weight))
    expected = torch.autograd.grad((reference * probe).sum(), (hidden, weight))
    for g, e in zip(grads, expected):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), e.float(), rtol=0.02, atol=0.02)
    assert grads[0][0, 4].abs().sum() == 0


def test_bf16_training_pads_the_trained_rows_and_keeps_the_results(monkeypatch):
    # Under training_kernels the rows through the head are padded to an ops.shape_tile size with
    # ignored dummies: the logprobs and gradients are those of the trained rows alone.
    import whetstone.model.head as head

    torch.manual_seed(3)
    hidden = torch.randn(3, 20, 16).bfloat16().requires_grad_()
    weight = torch.randn(37, 16).bfloat16().requires_grad_()
    targets = torch.randint(0, 37, (3, 20))
    targets[:, :3] = -100  # 51 trained rows: padded to 52
    probe = torch.randn(3, 20)
    plain, _ = target_logprobs(hidden, weight, targets)
    expected = torch.autograd.grad((plain * probe).sum(), (hidden, weight))
    rows_in = []
    apply = head._TargetLogprobs.apply
    monkeypatch.setattr(head._TargetLogprobs, "apply", lambda h, *args: rows_in.append(h.shape[0]) or apply(h, *args))
    with ops.training_kernels():
        padded, _ = target_logprobs(hidden, weight, targets)
    assert rows_in == [52]
    torch.testing.assert_close(padded, plain, rtol=0, atol=1e-6)
    for got, want in zip(torch.autograd.grad((padded * probe).sum(), (hidden, weight)), expected):
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)


def test_targets_of_the_wrong_shape_are_rejected(make_config):
    cfg = make_config()
    with pytest.raises(WhetstoneError, match="targets have shape"):
        Transformer(cfg)(torch.zeros(2, 4, dtype=torch.long), targets=torch.zeros(2, 3, dtype=torch.long))


def test_chunks_are_sized_for_the_device_and_do_not_change_invariant_bits(monkeypatch):
    # a CPU's chunk fits its cache (a few rows of a large vocabulary); a GPU's is large, so that
    # a step is not thousands of tiny launches; under invariant numerics the chunk changes no bit
    import whetstone.model.head as head

    assert head._chunk_rows(32768, torch.device("cpu"), head.CHUNK_BYTES) == 8
    assert head._chunk_rows(32768, torch.device("cuda", 0), head.CHUNK_BYTES) == 2048
    torch.manual_seed(3)
    hidden, weight = torch.randn(2, 9, 16), torch.randn(37, 16)
    targets = torch.randint(0, 37, (2, 9))
    results = []
    for chunk_bytes in (4 * 37, 5 * 4 * 37, 1 << 30):  # 1 row, 5 rows, every row in one chunk
        monkeypatch.setattr(head, "CHUNK_BYTES", chunk_bytes)
        with ops.numerics("invariant"):
            results.append(target_logprobs(hidden, weight, targets, with_entropy=True))
    for logprobs, entropy in results[1:]:
        assert torch.equal(logprobs, results[0][0]) and torch.equal(entropy, results[0][1])
