"""Causal attention as explicit bf16 matmuls, for training on CPU in reduced precision.

torch's fused CPU attention (flash) runs its bf16 inner products at about the speed of its fp32
ones, while this CPU's bf16 GEMMs (AVX512-BF16) run 2-3x faster than fp32 ones. At training
lengths (hundreds of tokens) the whole [queries, keys] score matrix is small, so computing it with
batched GEMMs and a separate softmax is faster: 1.5-2x for a layer's forward and backward at
8 x 256 tokens (docs/model.md). Query blocks skip most of the causal mask's upper triangle, and
the backward is written out (per block one softmax-backward kernel and four GEMMs), where
autograd would keep and replay every intermediate op.

Numerically this is "eager" attention in bf16, as transformers computes it with
`attn_implementation="eager"`: scores and softmax output rounded to bf16, GEMMs accumulating in
fp32. That rounds differently from the flash kernel the inference engine runs (logprobs a few
1e-4 apart on average, where flash on both sides agrees to 1e-5), so only forwards inside
`ops.training_kernels()` take it: mid-training, not the RL trainer. And only where it pays
(`applies`): no mask (plain causal attention over the same tokens), a reduced-precision compute
dtype, a CPU tensor, and a score matrix small enough to keep for the backward (it is O(T^2)
memory, flash is O(T)).
"""

from __future__ import annotations

import functools

import torch

from whetstone.utils.device import autocast_dtype

MAX_LENGTH = 1024
"""Longest sequence this path takes: beyond it the kept probabilities (T^2 per head) outgrow
what flash attention's O(T) memory saves in time."""

BLOCK = 128
"""Query positions per block (see `_blocks`)."""

REDUCED = (torch.bfloat16, torch.float16)
"""The reduced-precision compute dtypes (also the head's, `model/head.py`)."""


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: the autocast dtype of q's device inside autocast, else q's."""
    return autocast_dtype(q) or q.dtype


def applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `attention` is the faster path for causal attention of q [B, Hq, T, D] over k."""
    length = q.shape[2]
    return q.device.type == "cpu" and length == k.shape[2] and length <= MAX_LENGTH and compute_dtype(q) in REDUCED


def _causal_bias(start: int, end: int, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[(end - start) * group, end]: 0 where a row (position in [start, end), head within the
    group) may attend, -inf after it. A view of the bias of the whole block from `start`: a
    block's bias is the top-left corner of a longer one, so a block cut short by the sequence's
    end (one per training length) adds nothing to the cache."""
    return _block_bias(start, start + BLOCK, group, dtype, device)[: (end - start) * group, :end]


@functools.lru_cache(maxsize=64)
def _block_bias(start: int, end: int, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`_causal_bias` of a whole block, made anew. The 64 used last are kept: a group, dtype and
    device take MAX_LENGTH / BLOCK (8) blocks of at most BLOCK * group * MAX_LENGTH elements
    each (2 MiB in bf16 at a group of 8); a bias per block and length would be hundreds of MiB."""
    with torch.inference_mode(False):  # a normal tensor, usable by forwards in and out of inference mode
        position = torch.arange(start, end, device=device).repeat_interleave(group)
        allowed = torch.arange(end, device=device)[None, :] <= position[:, None]
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def _blocks(length: int) -> list[tuple[int, int]]:
    """Query positions in blocks of BLOCK: block [s, e) attends to keys [0, e) only, which skips
    most of the score matrix's masked upper triangle (a quarter of it at two blocks)."""
    return [(start, min(start + BLOCK, length)) for start in range(0, length, BLOCK)]


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, T, D] -> [B * Hkv, T * group, D], rows ordered (position, head within the group):
    the query heads that share a key/value head are one GEMM against it, and a block of
    positions is a block of rows."""
    batch, heads, length, dim = x.shape
    group = heads // kv_heads
    by_head = x.transpose(1, 2).reshape(batch, length, kv_heads, group, dim)  # [B, T, Hkv, group, D]
    return by_head.transpose(1, 2).reshape(-1, length * group, dim)


def _ungrouped(x: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """The inverse of `_grouped`: [B, Hq, T, D]."""
    kv_heads = x.shape[0] // batch
    group = heads // kv_heads
    length, dim = x.shape[1] // group, x.shape[2]
    by_position = x.view(batch, kv_heads, length, group, dim).permute(0, 2, 1, 3, 4)  # [B, T, Hkv, group, D]
    return by_position.reshape(batch, length, heads, dim).transpose(1, 2)


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        batch, heads, length, dim = q.shape
        kv_heads = k.shape[1]
        group, scale = heads // kv_heads, dim**-0.5
        queries = _grouped(q, kv_heads)
        keys, values = k.reshape(-1, length, dim), v.reshape(-1, length, dim)
        out = torch.empty_like(queries)
        probs = []
        for start, end in _blocks(length):
            rows = slice(start * group, end * group)
            scores = torch.baddbmm(
                _causal_bias(start, end, group, q.dtype, q.device),
                queries[:, rows],
                keys[:, :end].transpose(1, 2),
                alpha=scale,
            )
            probs.append(torch.softmax(scores, dim=-1))
            torch.bmm(probs[-1], values[:, :end], out=out[:, rows])
        ctx.save_for_backward(queries, keys, values, *probs)
        ctx.layout = (batch, heads, scale)
        return _ungrouped(out, batch, heads)

    @staticmethod
    def backward(ctx, grad_out):
        queries, keys, values, *probs = ctx.saved_tensors
        batch, heads, scale = ctx.layout
        grad = _grouped(grad_out.to(queries.dtype), keys.shape[0] // batch)
        group = queries.shape[1] // keys.shape[1]
        grad_queries = torch.empty_like(queries)
        grad_keys, grad_values = torch.zeros_like(keys), torch.zeros_like(values)
        for (start, end), block_probs in zip(_blocks(keys.shape[1]), probs):
            rows = slice(start * group, end * group)
            grad_scores = torch.bmm(grad[:, rows], values[:, :end].transpose(1, 2))
            grad_scores = torch._softmax_backward_data(grad_scores, block_probs, -1, block_probs.dtype)
            torch.bmm(grad_scores, keys[:, :end], out=grad_queries[:, rows])
            grad_keys[:, :end].baddbmm_(grad_scores.transpose(1, 2), queries[:, rows], alpha=scale)
            grad_values[:, :end].baddbmm_(block_probs.transpose(1, 2), grad[:, rows])
        kv_shape = (batch, -1, *keys.shape[1:])
        return _ungrouped(grad_queries.mul_(scale), batch, heads), grad_keys.view(kv_shape), grad_values.view(kv_shape)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention: q [B, Hq, T, D], k and v [B, Hkv, T, D] -> [B, Hq, T, D],
    in `compute_dtype(q)` (check `applies` first)."""
    dtype = compute_dtype(q)
    with torch.autocast(q.device.type, enabled=False):
        return _CausalAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype))
