"""The numerics every layer goes through, as small plain functions.

Each function is one decision about how a number is computed (matmul, norm, attention, the MoE
combine). Two modes, chosen per forward like autocast, by whoever calls the model:

    with ops.numerics("invariant"):   # the engine and the trainer, when numerics = "invariant"
        out = model(input_ids)

`fast` uses torch's own kernels. `invariant` uses `whetstone.model.invariant`: every row's
result is independent of the batch, the padding, prefill chunking and the KV cache, so the
inference engine and the trainer compute the same bits (docs/consistency.md). The mode lives in a
context variable: each thread (the engine's, the trainer's) sees only its own.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from whetstone.errors import WhetstoneError
from whetstone.model import causal_attention, invariant, invariant_triton

Numerics = Literal["fast", "invariant"]
_INVARIANT: ContextVar[bool] = ContextVar("whetstone_invariant_numerics", default=False)
_TRAINING_KERNELS: ContextVar[bool] = ContextVar("whetstone_training_kernels", default=False)


@contextmanager
def numerics(mode: Numerics) -> Iterator[None]:
    """Run the forwards inside the block with `mode` numerics (`fast` outside any block)."""
    if mode not in get_args(Numerics):
        raise WhetstoneError(f"numerics must be one of {get_args(Numerics)}, got {mode!r}")
    token = _INVARIANT.set(mode == "invariant")
    try:
        yield
    finally:
        _INVARIANT.reset(token)


@contextmanager
def training_kernels() -> Iterator[None]:
    """Let the forwards inside the block use kernels that are faster for plain training but
    round differently from the inference engine's (`causal_attention` in bf16), and pad row
    counts to a few sizes (`shape_tile`: expert groups, the head's trained rows). Mid-training
    uses them; the RL trainer does not, as its logprobs should match the engine's."""
    token = _TRAINING_KERNELS.set(True)
    try:
        yield
    finally:
        _TRAINING_KERNELS.reset(token)


def pads_shapes(x: torch.Tensor) -> bool:
    """Whether a forward on `x` pads row counts that change from step to step (tokens per expert,
    trained positions) to `shape_tile` sizes: reduced-precision CPU training (`training_kernels`)."""
    return _TRAINING_KERNELS.get() and x.dtype in causal_attention.REDUCED and x.device.type == "cpu"


def shape_tile(count: int) -> int:
    """What reduced-precision training pads a group of `count` rows to a multiple of: the rounded
    sizes are eight per power of two (at most 1/8 more rows, ~1/16 on average).

    oneDNN, which runs torch's bf16 matmuls on CPU, builds a kernel for every new shape and caches
    it; building one costs ~0.5 ms, more than a product of these sizes. Tokens per expert differ
    in every step, so unpadded groups build new kernels all the time. Measured on the default
    run's model and corpus: a bf16 step took 105-120 ms unpadded, 62-68 ms padded (fp32: ~100 ms;
    fp32 matmuls go to MKL, which builds nothing per shape)."""
    return 1 << max(count.bit_length() - 4, 0)


def is_invariant() -> bool:
    """Whether the current forward runs with invariant numerics."""
    return _INVARIANT.get()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (no bias anywhere in this model)."""
    if _INVARIANT.get():
        return invariant.linear(x, weight)
    return F.linear(x, weight)


def fused_rms_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm(x, weight)` takes torch's fused kernel, which computes the same bits as
    the formula in `_rms_norm_forward` (tested) for fp32 rows and one weight of the rows' size;
    not under invariant numerics, whose mean has its own summation order."""
    return _fused_rms_norm_applies(x, weight, _INVARIANT.get())


def _fused_rms_norm_applies(x: torch.Tensor, weight: torch.Tensor, row_local: bool) -> bool:
    return not row_local and x.dtype == weight.dtype == torch.float32 and weight.dim() == 1


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, row_local: bool = False):
    if _fused_rms_norm_applies(x, weight, row_local):  # one call instead of six
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
    if row_local and invariant_triton.applies(x):  # the whole norm in one kernel
        return invariant_triton.rms_norm(x, weight, eps)
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    if row_local:
        rstd = torch.rsqrt(invariant.mean_last(x32.square()).add_(eps))
        normed = x32 * rstd
    else:  # torch's fused kernel without the weight: the formula's bits (tested), one call for four
        normed, rstd = torch.ops.aten._fused_rms_norm(x32, [x.shape[-1]], None, eps)
    # Qwen3 rounds to x's dtype before the weight
    return same_dtype(normed.to(x.dtype), weight) * weight, rstd


class _RMSNorm(torch.autograd.Function):
    """weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32 and cast back to x's dtype
    before the weight, exactly as Qwen3 does; the backward is written out (a handful of passes
    instead of autograd's twenty-odd small ops)."""

    @staticmethod
    def forward(ctx, x, weight, eps, row_local):
        out, rstd = _rms_norm_forward(x, weight, eps, row_local)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = x.to(rstd.dtype) * rstd
        grad32 = grad.to(rstd.dtype)
        grad_weight = None
        if ctx.needs_input_grad[1]:  # summed over the rows the weight is broadcast across
            grad_weight = (grad32 * normed).reshape(-1, *weight.shape).sum(0).to(weight.dtype)
        grad_normed = grad32 * weight.to(rstd.dtype)
        grad_x = (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True)).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (see _RMSNorm); `weight` [D], or one per row broadcast
    over x's leading dims (e.g. [heads, D] for x [B, T, heads, D])."""
    row_local = _INVARIANT.get()
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps, row_local)
    # Same arithmetic without the autograd.Function (decoding): torch.rms_norm is the fused
    # kernel's cheapest entry point (15 against 22 µs a call for a decode step's row).
    if _fused_rms_norm_applies(x, weight, row_local):
        return torch.rms_norm(x, [x.shape[-1]], weight, eps)
    return _rms_norm_forward(x, weight, eps, row_local)[0]


def same_dtype(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """x ready for `x op other` with the bits of the mixed-dtype op (bf16 next to fp32 under
    autocast: residual adds, norm weights). On the CPU, x cast to the promoted dtype: the CPU's
    mixed-dtype kernels are ~20x slower than a cast and a same-dtype op. Elsewhere x as it is:
    a GPU's mixed-dtype op is one kernel that promotes as it reads, where the cast is another."""
    if x.device.type != "cpu":
        return x
    return x.to(torch.promote_types(x.dtype, other.dtype))


def residual(x: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """x + update, in the promoted dtype (the fp32 residual stream plus a bf16 layer output)."""
    return same_dtype(x, update) + same_dtype(update, x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    q [B, Hq, T, D]; k, v [B, Hkv, S, D]; mask [B, 1, T, S] boolean (True = may attend), or None
    for plain causal attention over the same T tokens. Returns [B, Hq, T, D].
    """
    if _INVARIANT.get():
        return invariant.attention(q, k, v, mask)
    # the training kernel: faster than torch's CPU flash in bf16
    if mask is None and _TRAINING_KERNELS.get() and causal_attention.applies(q, k):
        return causal_attention.attention(q, k, v)
    return torch_attention(q, k, v, mask)


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`attention` by torch's SDPA, on a kernel that keeps no [T, S] score matrix where one can.

    On CUDA no fused kernel takes grouped-query heads in fp32 (flash and cuDNN need 16 bits, the
    memory-efficient kernel takes no grouped heads), and SDPA's math fallback keeps [B, Hq, T, S]
    scores for the backward: there the kv heads are repeated for the memory-efficient kernel,
    and a masked attention folds the query heads into rows (`grouped_rows_attention`)."""
    if mask is not None:
        if q.device.type == "cuda":
            return grouped_rows_attention(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    grouped = q.shape[1] != k.shape[1]
    if grouped and q.device.type == "cuda" and q.dtype == torch.float32 and not torch.is_autocast_enabled("cuda"):
        group = q.shape[1] // k.shape[1]  # (under autocast SDPA runs in bf16, where flash takes grouped heads)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def grouped_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked grouped-query attention with each kv head's query heads folded into its query rows:
    q [B, Hkv * g, T, D] as [B, Hkv, g * T, D], the mask repeated once per head of the group.

    The same result as SDPA's `enable_gqa`, with as many query heads as kv heads: a masked
    attention CUDA's memory-efficient kernel takes (for a mask over grouped heads SDPA may fall
    back to its math path, which copies the keys and values once per query head)."""
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    rows = q.reshape(batch, kv_heads, group * length, dim)
    mask = mask.expand(batch, 1, length, k.shape[2]).repeat(1, 1, group, 1)  # row (g, t) takes t's mask
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask)
    return out.reshape(batch, heads, length, dim)  # CUDA's kernels may return it in another layout


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, in fp32."""
    return invariant.softmax(x) if _INVARIANT.get() else torch.softmax(x, dim=-1, dtype=torch.float32)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dimension, in fp32."""
    return invariant.log_softmax(x) if _INVARIANT.get() else torch.log_softmax(x, dim=-1, dtype=torch.float32)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row and their indices, largest first."""
    return invariant.top_k(x, k) if _INVARIANT.get() else x.topk(k, dim=-1)


def silu(x: torch.Tensor) -> torch.Tensor:
    return invariant.silu(x) if _INVARIANT.get() else F.silu(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return invariant.sigmoid(x) if _INVARIANT.get() else torch.sigmoid(x)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu(gate) * up


def moe_combine(expert_out: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's expert outputs, accumulated in fp32 in top-k order.

    expert_out [N, k, H] (slot j holds the j-th selected expert's output), gates [N, k].
    """
    if _INVARIANT.get():
        return invariant.moe_combine(expert_out, gates)
    gates = gates.float()
    weighted = same_dtype(expert_out, gates) * gates.unsqueeze(-1)
    return weighted.sum(dim=1).to(expert_out.dtype)


@functools.cache
def _inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor, usable by forwards in and out of inference mode
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        return 1.0 / (theta**exponents)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """The tables `apply_rope` takes for absolute positions [B, T] (half-split layout, as HF):
    cos [B, T, head_dim], and sin [B, T, head_dim] with its first half negated (rotate-half's
    sign, folded into the table once per forward instead of negating x in every layer)."""
    freqs = positions.unsqueeze(-1).float() * _inverse_frequencies(head_dim, theta, positions.device)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by the tables of `rope_tables` [B, T, D]: pairs are (i, i + D/2),
    x * cos + rotate_half(x) * sin, where rotate_half(x) = (-second half, first half)."""
    cos, signed_sin = cos.unsqueeze(2), signed_sin.unsqueeze(2)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((second, first), dim=-1) * signed_sin
