"""Batch-invariant kernels for CUDA, in Triton: invariant numerics on a GPU.

On a GPU, cuBLAS and torch's reductions choose a kernel (tile shape, split-K, split of a row's
reduction) by the shape of the whole batch, so a row's bits change with the rows beside it.
Each kernel here has one configuration whatever the batch: the tile sizes are constants of the
dtype, no reduction is split by the number of rows, and the sizes that vary with the batch
(rows, tokens, keys) are not specialised on (`do_not_specialize`), so one compiled kernel
serves a lone decode row and a trainer's 8192. A row's result is then computed by the same
instructions in the same order wherever it sits:

- `matmul`: x @ w.T by [BLOCK_M, BLOCK_N] output tiles, each summing the full K in BLOCK_K
  steps, in order (no split-K), fp32 accumulation;
- `grouped_matmul`: the MoE experts' matmuls over token-slots sorted by expert, in the same tiles;
  a tile never spans two experts, and its rows start wherever its expert's rows do, so a row's
  result does not depend on how many tokens chose its expert. The tile layout is computed on
  the device: nothing is read back, which is why fast numerics use it too where torch's grouped
  mm would read back (fp32 on CUDA, GPUs outside 9.x/10.x: `experts._grouped_matmul`);
- `rms_norm`, `softmax`, `log_softmax`: one program per row, which reduces the row in blocks of
  a fixed width, in order (the norm in one kernel: its mean square, rstd, the rounding to the
  rows' dtype and the weight);
- `attention`: flash attention over keys in chunks of KEY_CHUNK absolute positions, always in
  key order from position 0. A chunk with no visible key leaves the running max, sum and output
  exactly as they were, so a one-token decode over a KV cache, a chunked prefill and a full
  causal forward give a query the same bits. Causal or masked is an argument, not a constant:
  the trainer's forward and the engine's run one compiled kernel. Under autocast it computes in
  the autocast dtype, as SDPA does;
- `moe_combine`: each token's expert outputs weighted by their gates and added in fp32 in top-k
  order, one kernel for the whole layer.

Element-wise ops (RoPE, SiLU, residuals) are invariant already and stay torch's; the router's
top-k is a stable sort (`invariant.top_k`) on every device.
The backwards are the plain ones: only the forward must match the engine. The experts' backward
uses torch's grouped mm where it stays on the device, and elsewhere (fp32, GPUs outside 9.x and
10.x) `grouped_matmul` for the rows' gradients and `grouped_weight_grad` for the weights', so a
training step reads nothing back there either.

`on_cpu()` runs these kernels on CPU tensors too, under Triton's interpreter (`TRITON_INTERPRET=1`
before Triton is imported): the tests check the kernels' indexing and invariance that way on a
machine without a GPU. Triton is imported when a kernel is first needed; the CPU paths never
need it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from whetstone.errors import WhetstoneError

KEY_CHUNK = 64
"""Keys per attention chunk (BLOCK_N of the flash loop), counted from absolute position 0."""
ROW_BLOCK = 2048
"""Elements per step of a row reduction (row means, softmaxes)."""

_ON_CPU: ContextVar[bool] = ContextVar("whetstone_triton_on_cpu", default=False)


@contextmanager
def on_cpu() -> Iterator[None]:
    """Run invariant numerics on CPU tensors with these kernels (Triton's interpreter) inside the
    block: the CUDA path, checked on a machine without a GPU."""
    token = _ON_CPU.set(True)
    try:
        yield
    finally:
        _ON_CPU.reset(token)


def applies(x: torch.Tensor) -> bool:
    """Whether invariant numerics on `x` use these kernels: CUDA tensors, or any under `on_cpu`."""
    return x.device.type == "cuda" or _ON_CPU.get()


@functools.cache
def _kernels():
    """The kernels' module (`invariant_kernels`: Triton imported on first use)."""
    try:
        from whetstone.model import invariant_kernels
    except ImportError as error:
        raise WhetstoneError(
            "invariant numerics on a GPU need Triton (`pip install triton`; CUDA builds of torch bring it)"
        ) from error
    return invariant_kernels


PRODUCT_LAUNCH = dict(num_warps=4, num_stages=3, enable_fp_fusion=True)
"""The launch options of the product kernels (matmuls, attention); ROW_LAUNCH those of the row
kernels (norm, softmax, combine), whose multiplies and adds are rounded each on its own, as
torch's element-wise ops round them (and the CPU formulas). Every option is given, so neither
Triton's defaults nor its environment (TRITON_DEFAULT_FP_FUSION) can change what compiles."""
ROW_LAUNCH = dict(num_warps=4, num_stages=3, enable_fp_fusion=False)


def matmul_tiles(dtype: torch.dtype) -> dict:
    """The one tile configuration of a matmul in `dtype` (never chosen by shape), launch options
    included."""
    if dtype == torch.float32:  # IEEE fp32 on the CUDA cores
        return dict(IEEE=True, BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, **PRODUCT_LAUNCH)
    return dict(IEEE=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, **PRODUCT_LAUNCH)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_dtypes(*tensors: torch.Tensor) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
        raise WhetstoneError(f"invariant kernels take operands of one float dtype, got {sorted(map(str, dtypes))}")


INT32_OFFSETS = 2**31
"""The matmul kernels index a weight matrix's elements (an output column times its row stride)
in int32, as Triton does by default: each weight matrix must stay below this many elements
(a 152k vocabulary x 8192 head is 1.2G). Rows and experts are indexed in int64."""


GRID_Y = 65535
"""CUDA's limit on a launch grid's second dimension: attention launches at most this many
(sequence, kv head) pairs at once, a batch past it in several launches (the same programs)."""


def _check_weight_offsets(weight: torch.Tensor) -> None:
    """A clear error for a weight matrix the kernels' int32 offsets cannot reach all of."""
    last = (weight.shape[-2] - 1) * weight.stride(-2) + (weight.shape[-1] - 1) * weight.stride(-1)
    if last >= INT32_OFFSETS:
        raise WhetstoneError(
            f"invariant kernels index a weight matrix in int32: {tuple(weight.shape[-2:])} reaches "
            f"offset {last}, past 2^31 - 1"
        )


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] in x's dtype, fp32 accumulation, batch-invariant."""
    _check_dtypes(x, weight)
    _check_weight_offsets(weight)
    rows, depth = x.shape
    columns = weight.shape[0]
    out = x.new_empty(rows, columns)
    if rows == 0:
        return out
    config = matmul_tiles(x.dtype)
    grid = (_cdiv(rows, config["BLOCK_M"]), _cdiv(columns, config["BLOCK_N"]))
    _kernels().matmul[grid](
        x, weight, out, rows, columns, depth, *x.stride(), *weight.stride(), *out.stride(), **config
    )
    return out


_last_layout: tuple = (lambda: None, 0, 0, None)
"""(a weak reference to the offsets, slots, block_m, layout) of the last `_tile_layout`: a
layer's second grouped matmul (and the backward's two) takes the same offsets tensor (never
written in place), so its layout, a score of small ops, is made once."""


def _tile_layout(offsets: torch.Tensor, total_slots: int, block_m: int):
    """(tile expert, tile first slot, tile end slot), int32, for a grid of cdiv(slots, block_m) +
    experts tiles; tiles past the last one have expert -1. `offsets[e]` is where expert e's slots
    end. The layout of the same offsets tensor as the last call's is that call's."""
    global _last_layout
    ref, slots, block, layout = _last_layout
    if ref() is offsets and (slots, block) == (total_slots, block_m):
        return layout
    layout = _make_tile_layout(offsets, total_slots, block_m)
    _last_layout = (weakref.ref(offsets), total_slots, block_m, layout)
    return layout


def _make_tile_layout(offsets: torch.Tensor, total_slots: int, block_m: int):
    ends = offsets.to(torch.int64)
    experts = ends.numel()
    counts = ends.diff(prepend=ends.new_zeros(1))
    tiles = counts.add(block_m - 1).div(block_m, rounding_mode="floor")
    tile_end = tiles.cumsum(0)  # one past each expert's last tile
    grid = _cdiv(total_slots, block_m) + experts
    index = torch.arange(grid, device=ends.device)
    expert = torch.searchsorted(tile_end, index, right=True)  # experts == past the last tile
    valid = expert < experts
    clamped = expert.clamp(max=experts - 1)
    within = index - (tile_end - tiles).index_select(0, clamped)
    first = (ends - counts).index_select(0, clamped) + within * block_m
    end = ends.index_select(0, clamped)
    as_int = functools.partial(torch.Tensor.to, dtype=torch.int32)
    return as_int(torch.where(valid, expert, -1)), as_int(first), as_int(end)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, K] (slots sorted by expert, expert e's rows offsets[e-1]:offsets[e], as
    `torch._grouped_mm`'s `offs`) @ weight[e] [N, K].T per expert -> [S, N] in x's dtype; no
    read-back, batch-invariant."""
    _check_dtypes(x, weight)
    _check_weight_offsets(weight)
    slots, depth = x.shape
    columns = weight.shape[1]
    out = x.new_empty(slots, columns)
    if slots == 0:
        return out
    config = matmul_tiles(x.dtype)
    tile_expert, tile_start, tile_end = _tile_layout(offsets, slots, config["BLOCK_M"])
    grid = (tile_expert.numel(), _cdiv(columns, config["BLOCK_N"]))
    _kernels().grouped_matmul[grid](
        x, weight, out, tile_expert, tile_start, tile_end, columns, depth, *x.stride(), *weight.stride(), *out.stride(),
        **config,
    )  # fmt: skip
    return out


def grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [S, M].T @ b [S, N] over each expert's slots (sorted by expert, as `grouped_matmul`'s
    `offsets`) -> [E, M, N] in a's dtype, zeros for an expert with no slot: the experts' weight
    gradients in the backward. Each expert's slots are summed in order, BLOCK_K at a time, by
    one kernel on the device (torch's grouped mm reads the offsets back in fp32 and off Hopper)."""
    _check_dtypes(a, b)
    rows, columns, experts = a.shape[1], b.shape[1], offsets.numel()
    out = a.new_empty(experts, rows, columns)
    config = matmul_tiles(a.dtype)
    grid = (experts, _cdiv(rows, config["BLOCK_M"]), _cdiv(columns, config["BLOCK_N"]))
    _kernels().grouped_weight_grad[grid](
        a, b, out, offsets, rows, columns, *a.stride(), *b.stride(), *out.stride(), **config
    )  # fmt: skip
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's RMSNorm of each row of x [..., D] (`ops.rms_norm`): (weight * (x * rstd rounded
    to x's dtype), in the dtype x and weight promote to; rstd [..., 1] fp32), one kernel, one
    program per row, the mean square summed in blocks of ROW_BLOCK in order. `weight` is [D], or
    [H, D] for x [..., H, D] (a weight per head)."""
    width = x.shape[-1]
    heads = 1 if weight.dim() == 1 else weight.shape[0]
    per_head = weight.dim() == 2 and x.dim() >= 2 and x.shape[-2] == heads
    if weight.shape[-1] != width or not (weight.dim() == 1 or per_head):
        raise WhetstoneError(
            f"rms_norm of rows {tuple(x.shape)} takes a weight [D] or [heads, D], got {tuple(weight.shape)}"
        )
    # [tokens, heads, D]: a view where the rows are evenly spaced (attention's heads inside the
    # fused q/k/v projection), else a copy; the last dim contiguous either way
    rows = (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, heads, width)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
    count = rows.shape[0] * heads
    if count:
        weight = weight.contiguous()
        _kernels().rms_norm[(count,)](
            rows,
            weight,
            out,
            rstd,
            width,
            heads,
            eps,
            rows.stride(0),
            rows.stride(1),
            width if heads > 1 else 0,
            BLOCK=row_block(width),
            **ROW_LAUNCH,
        )
    return out, rstd


def row_block(width: int) -> int:
    """The block a row of `width` is reduced in: the width rounded up to a power of two, at most ROW_BLOCK."""
    return min(ROW_BLOCK, 1 << max(width - 1, 0).bit_length())


def _softmax_forward(x: torch.Tensor, log: bool) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _kernels().softmax[(rows.shape[0],)](
            rows, out, rows.shape[1], rows.stride(0), out.stride(0), LOG=log, BLOCK=row_block(rows.shape[1]),
            **ROW_LAUNCH,
        )  # fmt: skip
    return out.view(x.shape)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log):
        out = _softmax_forward(x, log)
        ctx.save_for_backward(out)
        ctx.log = log
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        if ctx.log:
            return grad - out.exp() * grad.sum(-1, keepdim=True), None
        return out * (grad - (grad * out).sum(-1, keepdim=True)), None


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, in fp32, one program per row."""
    return _Softmax.apply(x, False) if torch.is_grad_enabled() and x.requires_grad else _softmax_forward(x, False)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dimension, in fp32, one program per row."""
    return _Softmax.apply(x, True) if torch.is_grad_enabled() and x.requires_grad else _softmax_forward(x, True)


COMBINE_BLOCK = 1024
"""Hidden units per program of `moe_combine`."""


def _moe_combine_forward(expert_out: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    tokens, slots, hidden = expert_out.shape
    if expert_out.stride(-1) != 1:
        expert_out = expert_out.contiguous()
    gates = gates.float().contiguous()
    out = expert_out.new_empty(tokens, hidden)
    if tokens and hidden:
        grid = (tokens, _cdiv(hidden, COMBINE_BLOCK))
        _kernels().moe_combine[grid](
            expert_out, gates, out, slots, hidden, expert_out.stride(0), expert_out.stride(1), gates.stride(0),
            out.stride(0), BLOCK=COMBINE_BLOCK, **ROW_LAUNCH,
        )  # fmt: skip
    return out


class _MoECombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, gates):
        ctx.save_for_backward(expert_out, gates)
        return _moe_combine_forward(expert_out, gates)

    @staticmethod
    def backward(ctx, grad):
        expert_out, gates = ctx.saved_tensors
        grad32 = grad.float().unsqueeze(1)
        grad_out = (grad32 * gates.float().unsqueeze(-1)).to(expert_out.dtype)
        grad_gates = (grad32 * expert_out.float()).sum(-1).to(gates.dtype)
        return grad_out, grad_gates


def moe_combine(expert_out: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """sum_j gates[:, j] * expert_out[:, j] for expert_out [N, k, H] and gates [N, k], added in
    fp32 in top-k order (slot 0 first), in expert_out's dtype: one kernel, where adding the
    slots with torch takes three small ops a slot (`invariant.moe_combine`)."""
    if torch.is_grad_enabled() and (expert_out.requires_grad or gates.requires_grad):
        return _MoECombine.apply(expert_out, gates)
    return _moe_combine_forward(expert_out, gates)


def _attention_forward(q, k, v, mask):
    _check_dtypes(q, k, v)
    dim = q.shape[-1]
    padded = max(16, 1 << (dim - 1).bit_length())  # the kernel's tiles take a power of two >= 16
    if padded != dim:  # zero columns add exact zeros to every dot product, and give zero outputs
        q, k, v = (F.pad(t, (0, padded - dim)) for t in (q, k, v))
        return _attention_forward_padded(q, k, v, mask, dim**-0.5)[..., :dim]
    return _attention_forward_padded(q, k, v, mask, dim**-0.5)


def _attention_forward_padded(q, k, v, mask, scale):
    batch, q_heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    rows = group * length
    out = torch.empty_like(q)
    config = attention_tiles(q.dtype, dim)
    causal = mask is None
    if causal:
        mask_strides = (0, 0, 0)  # the kernel reads this one byte for every key, and ignores it
        mask = torch.ones(1, dtype=torch.uint8, device=q.device)
    else:
        mask = mask.expand(batch, 1, length, keys).to(torch.uint8)
        mask_strides = (mask.stride(0), mask.stride(2), mask.stride(3))
    sequences = max(1, GRID_Y // kv_heads)  # per launch: the grid's second dimension is theirs
    for first in range(0, batch if rows else 0, sequences):
        part = slice(first, first + sequences)
        grid = (_cdiv(rows, config["BLOCK_M"]), q[part].shape[0] * kv_heads)
        _kernels().attention[grid](
            q[part], k[part], v[part], mask if causal else mask[part], out[part], keys, rows, group, kv_heads,
            scale, int(causal),
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), *mask_strides, out.stride(0), out.stride(1), out.stride(2),
            **config,
        )  # fmt: skip
    return out


def attention_tiles(dtype: torch.dtype, head_dim: int) -> dict:
    """The attention kernel's one configuration for `dtype` and a (padded) head size, launch
    options included."""
    ieee = dtype == torch.float32
    return dict(IEEE=ieee, HEAD_DIM=head_dim, BLOCK_M=32 if ieee else 64, BLOCK_N=KEY_CHUNK, **PRODUCT_LAUNCH)


def _reference_attention(q, k, v, mask):
    """The same function by torch's SDPA (differentiable): what the backward differentiates."""
    from whetstone.model.ops import torch_attention  # ops imports this module

    return torch_attention(q, k, v, mask)


class _Attention(torch.autograd.Function):
    """The invariant kernel forward; the backward differentiates torch's SDPA of the same inputs."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        ctx.save_for_backward(q, k, v, mask)
        return _attention_forward(q, k, v, mask)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3])]
        with torch.enable_grad():
            out = _reference_attention(*inputs, mask)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention, batch-invariant: q [B, Hq, T, D]; k, v [B, Hkv, S, D] with key j
    at absolute position j; mask [B, 1, T, S] (True = may attend) or None (causal, T = S).
    Under autocast it computes in the autocast dtype, as SDPA does there (the q/k norms' fp32
    weights make q and k fp32): bf16 tensor-core products, fp32 softmax and sums."""
    device = q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return _Attention.apply(q, k, v, mask)
        return _attention_forward(q, k, v, mask)
