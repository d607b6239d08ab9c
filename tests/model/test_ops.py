"""The hand-written norms against the formula they implement."""

import pytest
import torch

from whetstone.model import ops
from whetstone.model.attention import Attention
from whetstone.model.config import ModelConfig


def reference_rms_norm(x, weight, eps=1e-6):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_rms_norm_matches_qwen3_bit_for_bit_and_has_exact_gradients():
    # fp32 goes through torch's fused kernel: the same bits at every width (its reduction order
    # could differ from mean()'s on long rows), with and without autograd.
    for width in (16, 128, 1000, 4096):
        x, weight = torch.randn(4, 3, width) * 3, torch.randn(width)
        assert torch.equal(ops.rms_norm(x, weight, 1e-6), reference_rms_norm(x, weight)), width
        graph = ops.rms_norm(x.clone().requires_grad_(), weight.clone().requires_grad_(), 1e-6)
        assert torch.equal(graph.detach(), reference_rms_norm(x, weight)), width
    x = torch.randn(4, 3, 16, requires_grad=True)
    weight = torch.randn(16, requires_grad=True)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: ops.rms_norm(a, b, 1e-6), (x64, w64))


def test_rms_norm_under_autocast_normalises_in_fp32():
    # bf16 rows: normalised in fp32 by torch's fused kernel without a weight, rounded, then the
    # weight: the formula's bits at every width, with and without autograd
    for width in (16, 64, 128, 1000, 4096):
        x = torch.randn(8, 3, width) * 3
        weight = torch.randn(width, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.nn.functional.linear(x, torch.eye(width))
            assert y.dtype == torch.bfloat16
            expected = reference_rms_norm(y, weight)
            assert torch.equal(ops.rms_norm(y, weight, 1e-6), expected), width
            with torch.no_grad():
                assert torch.equal(ops.rms_norm(y, weight, 1e-6), expected), width


def test_rope_rotates_pairs_and_keeps_norms():
    x = torch.randn(1, 5, 2, 8)
    cos, sin = ops.rope_tables(torch.arange(5)[None], head_dim=8, theta=10000.0, dtype=torch.float32)
    rotated = ops.apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated[:, 0], x[:, 0])  # position 0: no rotation
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))


def test_rms_norm_without_autograd_is_the_same_arithmetic():
    # Decoding skips the autograd.Function; the numbers must not change by a single bit.
    x, weight = torch.randn(4, 3, 16), torch.randn(16)
    with_graph = ops.rms_norm(x.requires_grad_(), weight, 1e-6)
    with torch.inference_mode():
        assert torch.equal(ops.rms_norm(x.detach(), weight, 1e-6), with_graph.detach())


def test_mixed_dtype_ops_are_cast_first_with_the_same_bits():
    # bf16 layer outputs meet the fp32 residual stream and fp32 norm weights under autocast:
    # casting first gives the mixed-dtype op's bits on a fast same-dtype kernel.
    x, update = torch.randn(4, 8, 32), torch.randn(4, 8, 32).bfloat16()
    assert torch.equal(ops.residual(x, update), x + update) and ops.residual(x, update).dtype == torch.float32
    assert torch.equal(ops.residual(update, x), update + x)
    assert ops.residual(x, x.clone()).data_ptr() != x.data_ptr()  # a new tensor, x untouched
    heads, weight = torch.randn(4, 8, 2, 16).bfloat16(), torch.randn(16)
    normed = ops.rms_norm(heads, weight, 1e-6)
    assert normed.dtype == torch.float32 and torch.equal(normed, reference_rms_norm(heads, weight))


def test_rope_is_rotate_half_bit_for_bit():
    # rope_tables folds rotate-half's sign into its sin table: the same bits as HF's formula.
    x, positions = torch.randn(2, 5, 3, 8), torch.arange(3, 8).expand(2, 5)
    inverse = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    angles = torch.cat((positions[..., None].float() * inverse,) * 2, dim=-1)
    first, second = x.chunk(2, dim=-1)
    expected = x * angles.cos()[:, :, None] + torch.cat((-second, first), dim=-1) * angles.sin()[:, :, None]
    assert torch.equal(ops.apply_rope(x, *ops.rope_tables(positions, 8, 10000.0, torch.float32)), expected)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    ("numerics", "dtype"), [("fast", torch.bfloat16), ("invariant", torch.float32), ("invariant", torch.bfloat16)]
)
def test_query_and_key_norms_run_as_one_with_the_same_bits(numerics, dtype, device):
    # Attention norms its query and key heads in one call with a weight per head: the same bits
    # as q_norm and k_norm apart (bf16 rows: the formula; invariant: its kernel), and the same
    # gradients for both weights. (Fast fp32 rows take torch's fused kernel per norm, which is
    # q_norm and k_norm apart: nothing to compare.)
    cfg = ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    attention = Attention(cfg, 0).to(device)
    with torch.no_grad():
        attention.q_norm.weight.normal_()
        attention.k_norm.weight.normal_()
    qk = (torch.randn(2, 3, 6, 16, device=device) * 3).to(dtype).requires_grad_()
    with ops.numerics(numerics):
        joint = attention._norm_heads(qk)
        apart = torch.cat((attention.q_norm(qk[:, :, :4]), attention.k_norm(qk[:, :, 4:])), dim=2)
        if device == "cuda" and numerics == "fast":  # torch's CUDA kernels launch by the whole shape
            torch.testing.assert_close(joint, apart, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(joint, apart)
        grads = torch.autograd.grad(joint.square().sum(), (qk, attention.q_norm.weight, attention.k_norm.weight))
        expected = torch.autograd.grad(apart.square().sum(), (qk, attention.q_norm.weight, attention.k_norm.weight))
    for grad, reference in zip(grads, expected):
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_mixed_dtype_ops_on_cuda_skip_the_cast_with_the_same_bits():
    # On a GPU the mixed-dtype op is one kernel; it must give the bits of casting first.
    x, update = torch.randn(4, 8, 32, device="cuda"), torch.randn(4, 8, 32, device="cuda").bfloat16()
    assert ops.same_dtype(update, x) is update
    assert torch.equal(ops.residual(x, update), x + update.float())
    heads, weight = torch.randn(4, 8, 2, 16, device="cuda").bfloat16(), torch.randn(16, device="cuda")
    normed = torch.ops.aten._fused_rms_norm(heads.float(), [16], None, 1e-6)[0]  # the norm's own kernel
    assert torch.equal(ops.rms_norm(heads, weight, 1e-6), normed.bfloat16().float() * weight)
    out, gates = torch.randn(4, 3, 32, device="cuda").bfloat16(), torch.rand(4, 3, device="cuda")
    expected = (out.float() * gates.unsqueeze(-1)).sum(dim=1).bfloat16()
    assert torch.equal(ops.moe_combine(out, gates), expected)
