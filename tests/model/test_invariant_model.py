"""The whole model under `numerics("invariant")`: a sequence's logits and routes are the same
bits alone or in a batch (any padding), in one forward or decoded token by token through the KV
cache after a chunked prefill (across the attention's key chunks); in fp32 and under bf16
autocast; dense, MoE and MoE with a shared expert. The same checks fail in `fast` mode. The
backward still trains: its gradients are deterministic and agree with fast mode's."""

import pytest
import torch

from tests.model.conftest import tiny_config
from whetstone.model import KVCache, Transformer, invariant, numerics

MODELS = {
    "dense": dict(num_experts=0),
    "moe": dict(),
    "moe-shared-expert": dict(shared_expert_intermediate_size=16),
}
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def compute(dtype):
    return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


def model_for(kind: str) -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny_config(max_position_embeddings=256, **MODELS[kind])).eval()


def token_ids(rows: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (rows, length), generator=torch.Generator().manual_seed(seed))


def decoded(
    model: Transformer, row: torch.Tensor, prefill: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits and routes of one sequence: prefill in chunks of `chunk`, then one token at a time."""
    cache = KVCache(model.cfg, 1, model.cfg.max_position_embeddings)
    pieces = [(s, min(s + chunk, prefill)) for s in range(0, prefill, chunk)] + [
        (t, t + 1) for t in range(prefill, row.numel())
    ]
    logits, routes = [], []
    for start, end in pieces:
        out = model(row[None, start:end], positions=torch.arange(start, end)[None], cache=cache, return_routes=True)
        logits.append(out.logits)
        routes.append(out.routes)
    return torch.cat(logits, 1), None if routes[0] is None else torch.cat(routes, 1)


def mismatches(model: Transformer, mode: str, dtype) -> list[str]:
    """Which of the invariance checks fail: batch vs alone, padded batch, cached decode."""
    ids = token_ids(5, 170)  # the attention adds keys up in chunks of 128 positions
    failures = []
    with torch.no_grad(), numerics(mode), compute(dtype):
        batch = model(ids, return_routes=True)
        alone = model(ids[2:3], return_routes=True)
        # The same sequence right-padded inside a longer, bigger batch.
        padded_ids = torch.cat([token_ids(3, 181, seed=2), torch.cat([ids[2:3], token_ids(1, 11, 3)], 1)])
        padded = model(padded_ids, return_routes=True)
        cached_logits, cached_routes = decoded(model, ids[2], prefill=140, chunk=48)
    if not torch.equal(batch.logits[2:3], alone.logits):
        failures.append("batch")
    if not torch.equal(padded.logits[3:, :170], alone.logits):
        failures.append("padding")
    if not torch.equal(cached_logits, alone.logits[0:1]):
        failures.append("kv-cache")
    if alone.routes is not None:
        if not (
            torch.equal(batch.routes[2:3], alone.routes)
            and torch.equal(cached_routes, alone.routes)
            and torch.equal(padded.routes[3:, :170], alone.routes)
        ):
            failures.append("routes")
    return failures


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", MODELS)
def test_invariant_logits_and_routes_do_not_depend_on_batch_padding_or_cache(kind, dtype):
    assert mismatches(model_for(kind), "invariant", dtype) == []


@pytest.mark.parametrize("scale", [0, 2, 3], ids=["one-row", "2x", "3x"])
def test_invariance_holds_with_the_tiles_another_library_would_get(scale, monkeypatch):
    # `invariant.row_tile` gives the base tiles on most library paths, a multiple of them where
    # the base's rows do not compute alike (16-row expert tiles on MKL's AVX2 path on Intel),
    # one-row tiles where no size does: the model with each kind (a multiple as checked here).
    checked = invariant.row_tile
    tiles = (lambda base, *weights: 1) if not scale else (lambda base, *weights: checked(base * scale, *weights))
    monkeypatch.setattr(invariant, "row_tile", tiles)
    model = model_for("moe")
    assert mismatches(model, "invariant", None) == []
    with torch.no_grad():
        fast = model(token_ids(2, 40)).logits
        with numerics("invariant"):
            same = model(token_ids(2, 40)).logits
    torch.testing.assert_close(same, fast, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fast_logits_do_depend_on_them(dtype):
    # So the test above can fail: torch's kernels sum in an order that depends on the shapes.
    assert mismatches(model_for("moe"), "fast", dtype) != []


def test_invariant_logits_do_not_depend_on_the_thread_count():
    model, ids = model_for("moe"), token_ids(4, 150)
    with torch.no_grad(), numerics("invariant"):
        torch.set_num_threads(2)
        two = model(ids, return_routes=True)
        torch.set_num_threads(1)
        one = model(ids[1:2], return_routes=True)
    assert torch.equal(two.logits[1:2], one.logits) and torch.equal(two.routes[1:2], one.routes)


def test_invariant_logits_are_the_fast_logits_up_to_rounding():
    model, ids = model_for("moe"), token_ids(2, 40)
    with torch.no_grad():
        fast = model(ids).logits
        with numerics("invariant"):
            same = model(ids).logits
    torch.testing.assert_close(same, fast, atol=1e-5, rtol=1e-4)


def test_target_logprobs_are_the_log_softmax_of_the_logits_bit_for_bit():
    # The trainer's fused head and the engine's lm_head + log_softmax (the sampler) agree.
    model, ids = model_for("moe"), token_ids(3, 30)
    targets = torch.roll(ids, -1, 1)
    targets[1, 20:] = -100  # ignored positions skip the head
    with torch.no_grad(), numerics("invariant"):
        logprobs = model(ids, targets=targets).logprobs
        logits = model(ids).logits
    expected = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    kept = targets >= 0
    assert torch.equal(logprobs[kept], expected[kept]) and (logprobs[~kept] == 0).all()


def gradients(model: Transformer, mode: str, dtype=None) -> list[torch.Tensor]:
    ids = token_ids(3, 50)
    model.zero_grad()
    with numerics(mode), compute(dtype):
        out = model(ids[:, :-1], targets=ids[:, 1:])
    (-out.logprobs.mean() + 0.01 * out.aux_loss).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", MODELS)
def test_invariant_backward_is_deterministic_and_agrees_with_fast(kind):
    model = model_for(kind).train()
    first, second = gradients(model, "invariant"), gradients(model, "invariant")
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    for ours, theirs in zip(first, gradients(model, "fast")):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-3)


def test_invariant_backward_under_bf16_autocast_agrees_with_fast():
    # Each gradient is compared at its own scale (many are far below any one absolute
    # tolerance): same direction and same size. bf16 rounds fast and invariant differently
    # (cosine about 0.9998, norms within 0.3% here), so the bounds leave room for other CPUs'
    # kernels while a lost, scaled or scrambled gradient still fails.
    model = model_for("moe").train()
    names = [name for name, _ in model.named_parameters()]
    ours_all, theirs_all = gradients(model, "invariant", torch.bfloat16), gradients(model, "fast", torch.bfloat16)
    for name, ours, theirs in zip(names, ours_all, theirs_all, strict=True):
        ours, theirs = ours.double().flatten(), theirs.double().flatten()
        assert theirs.norm() > 0, name
        cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=0).item()
        ratio = (ours.norm() / theirs.norm()).item()
        assert cosine > 0.99 and 0.95 < ratio < 1.05, (name, cosine, ratio)
