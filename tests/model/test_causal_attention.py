"""The explicit causal attention of bf16 training against torch's own attention."""

import pytest
import torch
import torch.nn.functional as F

from whetstone.model import ModelConfig, Transformer, causal_attention, ops


def heads(batch=2, q_heads=4, kv_heads=2, length=13, dim=8, dtype=torch.float64, seed=0):
    """q, k, v laid out as the model makes them: [B, T, H, D] transposed to [B, H, T, D]."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, length, h, dim, generator=generator, dtype=dtype).transpose(1, 2).requires_grad_()
        for h in (q_heads, kv_heads, kv_heads)
    ]


def reference(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("block", [4, causal_attention.BLOCK])  # 4 blocks with a short last one, or one
def test_forward_and_written_out_backward_are_exact_in_float64(monkeypatch, block):
    monkeypatch.setattr(causal_attention, "BLOCK", block)
    q, k, v = heads()
    torch.testing.assert_close(causal_attention._CausalAttention.apply(q, k, v), reference(q, k, v), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(causal_attention._CausalAttention.apply, (q, k, v))
    # Multi-query (one key/value head) and plain multi-head attention too.
    for q_heads, kv_heads in ((4, 1), (3, 3)):
        q, k, v = heads(q_heads=q_heads, kv_heads=kv_heads, length=7)
        assert torch.autograd.gradcheck(causal_attention._CausalAttention.apply, (q, k, v))


def test_bf16_error_is_that_of_torchs_own_bf16_attention():
    exact = heads(length=40, dim=16)
    grad = torch.randn(2, 4, 40, 16, dtype=torch.float64)
    reference(*exact).backward(grad)
    truth = [reference(*exact).detach(), *(t.grad for t in exact)]

    def errors(attend):
        inputs = [t.detach().bfloat16().requires_grad_() for t in exact]
        out = attend(*inputs)
        out.backward(grad.bfloat16())
        return [(a.double() - b).abs().max().item() for a, b in zip([out, *(t.grad for t in inputs)], truth)]

    ours, torchs = errors(causal_attention.attention), errors(reference)
    for mine, theirs in zip(ours, torchs):  # output, dq, dk, dv
        assert mine <= 3 * theirs + 1e-3, (ours, torchs)


def test_applies_only_to_short_reduced_precision_causal_attention():
    q, k, _ = heads(length=16, dtype=torch.float32)
    assert not causal_attention.applies(q, k)  # fp32: torch's fused kernel is as fast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert causal_attention.applies(q, k)
        long_q, long_k, _ = heads(length=causal_attention.MAX_LENGTH + 1, dim=2, dtype=torch.float32)
        assert not causal_attention.applies(long_q, long_k)  # O(T^2) memory: flash instead
        assert not causal_attention.applies(q, k[:, :, :8])  # keys other than the queries' tokens (a cache)
        assert causal_attention.attention(q, k, k).dtype == torch.bfloat16
    assert causal_attention.applies(q.bfloat16(), k.bfloat16())


def test_bf16_training_kernels_take_it_and_match_torchs_attention(monkeypatch):
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        moe_intermediate_size=16,
    )
    model = Transformer(config)
    ids = torch.randint(0, 64, (2, 24))
    taken = []
    original = causal_attention._CausalAttention.apply
    monkeypatch.setattr(causal_attention._CausalAttention, "apply", lambda *args: taken.append(1) or original(*args))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = model(ids).logits.float()
        assert not taken  # outside training_kernels: the engine's kernel (the RL trainer matches it)
        with ops.training_kernels():
            ours = model(ids).logits.float()
            assert len(taken) == 2  # one call per layer
            with ops.numerics("invariant"):
                model(ids)
            assert len(taken) == 2  # invariant numerics keep their own attention
    torch.testing.assert_close(ours, fused, rtol=0.05, atol=0.05)


def test_mid_training_takes_it_in_bf16_only(monkeypatch):
    from whetstone.data.loader import Batch
    from whetstone.midtrain.step import token_losses

    config = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=0,
        intermediate_size=32,
    )
    model = Transformer(config)
    ids = torch.randint(0, 64, (2, 12))
    zeros = torch.zeros_like(ids)
    batch = Batch(ids, ids.roll(-1, 1), zeros, zeros, torch.zeros(2, dtype=torch.bool))
    taken = []
    original = causal_attention._CausalAttention.apply
    monkeypatch.setattr(causal_attention._CausalAttention, "apply", lambda *args: taken.append(1) or original(*args))
    token_losses(model, batch, "float32")
    assert not taken
    token_losses(model, batch, "bfloat16")[0].sum().backward()
    assert taken == [1]


def _cached_biases() -> int:
    """How many tensors the module's caches hold."""
    return sum(f.cache_info().currsize for f in vars(causal_attention).values() if hasattr(f, "cache_info"))


def test_the_kept_masks_do_not_grow_with_the_number_of_training_lengths(monkeypatch):
    monkeypatch.setattr(causal_attention, "BLOCK", 4)
    for f in vars(causal_attention).values():
        if hasattr(f, "cache_clear"):
            f.cache_clear()
    for length in range(1, 65):  # every length cuts its last block at another place
        q, k, v = heads(batch=1, length=length, dim=4, dtype=torch.float32)
        out = causal_attention._CausalAttention.apply(q, k, v)
        torch.testing.assert_close(out, reference(q, k, v))
    assert _cached_biases() == 64 // 4  # one per whole block, however many lengths cut it short
