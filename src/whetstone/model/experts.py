"""MoE expert dispatch: where training time goes, so it gets its own forward and backward.

Token-slots (token, j-th choice) are sorted by expert, so each expert's rows are one contiguous
slice; the results go back to (token, top-k) order with one gather. Two ways to multiply the
slices, both with the backward written out:

- per expert (the CPU): one matmul per expert on its slice,
  writing straight into a preallocated output. Compared with letting autograd differentiate a
  Python loop over `weight[e]` slices, this avoids one full-size zero gradient per expert slice,
  the scatter-adds of indexing backward, and a graph node per op. The slice sizes are read back
  to the host (one `.tolist()` per layer).
- grouped (CUDA, `uses_grouped_mm`): each projection of all experts is one call, the slices
  delimited by offsets computed on the device. Nothing is read back, so a forward queues
  without waiting for the GPU and a decode step can be captured in a CUDA graph. Under `fast`
  numerics the call is `torch._grouped_mm` where it runs on the device: in bf16 on Hopper and
  datacenter Blackwell, one CUTLASS kernel per projection, and on the CPU
  (`grouped_mm_on_cpu()`, where tests check it against the per-expert path). For other CUDA
  dtypes (fp32) and other GPUs torch's grouped mm loops over the groups after reading the
  offsets back, so there the forward uses `invariant_triton.grouped_matmul` and the backward
  `invariant_triton.grouped_matmul` and `grouped_weight_grad`: a training step reads nothing
  back either. Under invariant numerics the forward is always `invariant_triton.grouped_matmul`,
  whose tiles never depend on how many tokens chose an expert.

On the CPU under invariant numerics each expert's slice is padded to whole tiles of the experts'
tile (`invariant.expert_tile`: EXPERT_ROW_TILE rows where the library computes such tiles' rows
alike) and a tail tile for the rows left (`invariant.expert_tail_tiles`: a smaller tile whose rows
the library computes as the whole tiles' rows, so an expert a decode step gives one token computes
a tile of 2 or 4 rows, not 8), dummy slots reading a zero row and nobody gathering their outputs,
and multiplied by `invariant.tiled_rows_mm`, so a row's result does not depend on how many tokens
chose its expert.
Reduced-precision training (`ops.training_kernels()`) pads the same way to a few sizes per power
of two (`ops.shape_tile`), so the matmuls reuse the kernels oneDNN built for earlier steps.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from whetstone.model import invariant, invariant_triton, ops
from whetstone.utils.device import autocast_dtype

_GROUPED_ON_CPU: ContextVar[bool] = ContextVar("whetstone_grouped_mm_on_cpu", default=False)


@contextmanager
def grouped_mm_on_cpu() -> Iterator[None]:
    """Dispatch the experts of CPU tensors as those of CUDA tensors inside the block (the grouped
    path of `uses_grouped_mm`; `expert_counts` by scatter-add): the CUDA path, checked on a
    machine without a GPU. On the CPU it is slower than the per-expert path."""
    token = _GROUPED_ON_CPU.set(True)
    try:
        yield
    finally:
        _GROUPED_ON_CPU.reset(token)


def uses_grouped_mm(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether expert_mlp multiplies (x, in its compute dtype) by all experts at once: under
    invariant numerics, where the Triton kernels apply (`invariant_triton.grouped_matmul`);
    otherwise on CUDA (or under `grouped_mm_on_cpu`), for rows whose byte strides the grouped
    kernels accept (multiples of 16)."""
    if ops.is_invariant():
        return invariant_triton.applies(x)
    if not (x.device.type == "cuda" or _GROUPED_ON_CPU.get()):
        return False
    return all(size * x.element_size() % 16 == 0 for size in (gate_up.shape[-1], down.shape[-1]))


def _grouped_matmul(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, torchs: bool) -> torch.Tensor:
    """rows [S, K] (grouped by expert, expert e's ending at offsets[e]) @ weight[e] [N, K].T per
    expert: torch._grouped_mm if `torchs`, else the Triton kernel."""
    if torchs:
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
    return invariant_triton.grouped_matmul(rows, weight, offsets)


def _grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, torchs: bool) -> torch.Tensor:
    """a[e's slots].T @ b[e's slots] per expert e -> [E, M, N], zeros for an expert no slot chose:
    torch._grouped_mm if `torchs`, else the Triton kernel."""
    if not torchs:
        return invariant_triton.grouped_weight_grad(a, b, offsets)
    unused = (offsets.diff(prepend=offsets.new_zeros(1)) == 0).view(-1, 1, 1)
    # set explicitly: torch's kernel need not write an empty group's output
    return torch._grouped_mm(a.t(), b, offs=offsets).masked_fill_(unused, 0)


def _grouped_mm_stays_on_device(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm multiplies x's groups without reading the offsets back: on CUDA
    only bf16 on Hopper and datacenter Blackwell (compute capability 9.x and 10.x: its CUTLASS
    kernels; elsewhere its fallback copies the offsets to the host, which a CUDA graph cannot
    capture); on the CPU always (a loop, but no device to wait for), unless a test runs the
    Triton kernels there (`invariant_triton.on_cpu`)."""
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and _capability(x.device)[0] in (9, 10)
    return not invariant_triton.applies(x)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def expert_counts(slot_expert: torch.Tensor, experts: int) -> torch.Tensor:
    """Slots per expert, on the slots' device. torch.bincount is the fastest count on the CPU,
    but on CUDA it reads the largest id back to the host to size its output: a scatter-add there
    (and under `grouped_mm_on_cpu`)."""
    if slot_expert.device.type == "cpu" and not _GROUPED_ON_CPU.get():
        return torch.bincount(slot_expert, minlength=experts)
    counts = torch.zeros(experts, dtype=torch.int32, device=slot_expert.device)
    return counts.scatter_add_(0, slot_expert, torch.ones_like(slot_expert, dtype=torch.int32))


def _group_ends(sorted_experts: torch.Tensor, experts: int) -> torch.Tensor:
    """int32 [experts]: where each expert's group of slots ends in the sorted slots (the grouped
    matmuls' offsets), found by binary search on the device: two kernels, where counting the
    slots per expert and summing them up takes four."""
    bounds = torch.arange(experts, device=sorted_experts.device, dtype=sorted_experts.dtype)
    return torch.searchsorted(sorted_experts, bounds, right=True, out_int32=True)


def _spans(counts: list[int]):
    start = 0
    for expert, count in enumerate(counts):
        yield expert, start, start + count
        start += count


def _padded_groups(slot_expert: torch.Tensor, unsort: torch.Tensor, counts: list[int], padded_count):
    """The sorted layout with each expert's group of `count` slots padded to `padded_count(count)` rows.

    Padding positions hold the dummy slot id S = number of slots (it reads a zero row of x, and
    a zero row of the output gradient); `unsort` points each real slot at its padded position."""
    padded = [padded_count(count) for count in counts]
    shift, start, padded_start = [], 0, 0
    for count, padded_count in zip(counts, padded):
        shift.append(padded_start - start)
        start, padded_start = start + count, padded_start + padded_count
    slots, device = slot_expert.numel(), slot_expert.device
    unsort = unsort + torch.tensor(shift, device=device).index_select(0, slot_expert)
    order = torch.full((padded_start,), slots, dtype=unsort.dtype, device=device)
    order[unsort] = torch.arange(slots, device=device)
    return order, unsort, padded


def _zero_row_for_dummies(rows: torch.Tensor, order: torch.Tensor, slots: int) -> torch.Tensor:
    """`rows` plus a zero row (what dummy slots read) when the layout has dummy slots."""
    return F.pad(rows, (0, 0, 0, 1)) if order.numel() != slots else rows


def _per_expert_forward(x, gate_up, down, order, unsort, counts, top_k, invariant_tile):
    """The forward of _PerExpertSwiGLU: (output [N, k, H], the tensors its backward needs).
    `invariant_tile`: the rows of the invariant kernel's whole tiles (`invariant.expert_tile`;
    each group's rows left form a tail tile, `invariant.tiled_rows_mm`), or 0 in fast numerics."""
    batch_invariant = bool(invariant_tile)
    inner = down.shape[-1]
    source = _zero_row_for_dummies(x, order, x.shape[0] * top_k)
    sorted_x = source.index_select(0, order // top_k)  # [S, H], slots grouped by expert
    hidden = x.new_empty(sorted_x.shape[0], 2 * inner)
    # Each expert's rows, transposed weight and output rows as views made in one call per tensor:
    # decoding runs this every step on a handful of rows, where indexing expert by expert would
    # cost more calls than the matmuls. An expert no slot chose gets no call.
    matmul = functools.partial(invariant.tiled_rows_mm, tile=invariant_tile) if batch_invariant else torch.mm
    for rows, weight, into in zip(sorted_x.split(counts), gate_up.transpose(1, 2).unbind(), hidden.split(counts)):
        if rows.shape[0]:
            matmul(rows, weight, out=into)
    gate, up = hidden[:, :inner], hidden[:, inner:]
    silu_gate = invariant.silu(gate) if batch_invariant else F.silu(gate)
    act = silu_gate * up
    out = x.new_empty(sorted_x.shape)
    for rows, weight, into in zip(act.split(counts), down.transpose(1, 2).unbind(), out.split(counts)):
        if rows.shape[0]:
            matmul(rows, weight, out=into)
    saved = (sorted_x, gate, up, silu_gate, act, gate_up, down, order, unsort)
    return out.index_select(0, unsort).view(x.shape[0], top_k, -1), saved


class _PerExpertSwiGLU(torch.autograd.Function):
    """y[t, j] = down[e] @ swiglu(gate_up[e] @ x[t]) for e = ids[t, j], one matmul per expert;
    see expert_mlp.

    Row gathers use index_select (several times faster than x[idx] on CPU) and every
    intermediate is written into a preallocated buffer, slice by slice.
    """

    @staticmethod
    def forward(ctx, x, gate_up, down, order, unsort, counts, top_k, invariant_tile):
        out, saved = _per_expert_forward(x, gate_up, down, order, unsort, counts, top_k, invariant_tile)
        ctx.save_for_backward(*saved)
        ctx.counts, ctx.top_k = counts, top_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):  # dtypes are fixed by the forward
            return _PerExpertSwiGLU._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        sorted_x, gate, up, silu_gate, act, gate_up, down, order, unsort = ctx.saved_tensors
        counts, top_k = ctx.counts, ctx.top_k
        inner = down.shape[-1]
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        grad_sorted = _zero_row_for_dummies(grad_flat, order, grad_flat.shape[0]).index_select(0, order)
        grad_down = torch.empty_like(down)
        grad_act = torch.empty_like(act)
        for expert, start, end in _spans(counts):
            torch.mm(grad_sorted[start:end].t(), act[start:end], out=grad_down[expert])
            torch.mm(grad_sorted[start:end], down[expert], out=grad_act[start:end])
        grad_hidden = grad_act.new_empty(grad_act.shape[0], 2 * inner)
        torch.ops.aten.silu_backward(grad_act * up, gate, grad_input=grad_hidden[:, :inner])
        torch.mul(grad_act, silu_gate, out=grad_hidden[:, inner:])
        grad_gate_up = torch.empty_like(gate_up)
        grad_sorted_x = torch.empty_like(sorted_x)
        for expert, start, end in _spans(counts):
            torch.mm(grad_hidden[start:end].t(), sorted_x[start:end], out=grad_gate_up[expert])
            torch.mm(grad_hidden[start:end], gate_up[expert], out=grad_sorted_x[start:end])
        # Each token appears top_k times: un-sort, then sum its slots.
        grad_x = grad_sorted_x.index_select(0, unsort).view(-1, top_k, grad_sorted_x.shape[-1]).sum(dim=1)
        return grad_x, grad_gate_up, grad_down, None, None, None, None, None


def _unsorted(sorted_rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows grouped by expert (row i is slot order[i]) back in slot order: one scatter, where a
    gather would need the inverse permutation made first (two more kernels a layer)."""
    return torch.empty_like(sorted_rows).index_copy_(0, order, sorted_rows)


def _grouped_mm_forward(x, gate_up, down, order, offsets, top_k):
    """The forward of _GroupedMMSwiGLU: (output [N, k, H], the [S, 2I] gate/up projections).

    Rows offsets[e-1]:offsets[e] of the sorted slots (from row 0 for e = 0) go through expert e;
    an expert with no rows gets none. torch's grouped mm where it stays on the device, except
    under invariant numerics; the Triton kernel otherwise."""
    torchs = _grouped_mm_stays_on_device(x) and not ops.is_invariant()
    hidden = _grouped_matmul(x.index_select(0, order // top_k), gate_up, offsets, torchs)
    inner = down.shape[-1]
    act = ops.silu(hidden[:, :inner]) * hidden[:, inner:]
    out = _grouped_matmul(act, down, offsets, torchs)
    return _unsorted(out, order).view(x.shape[0], top_k, -1), hidden


class _GroupedMMSwiGLU(torch.autograd.Function):
    """What _PerExpertSwiGLU computes, each projection of all experts one grouped matmul.

    The backward recomputes the sorted rows and the SwiGLU from the saved input and gate/up
    projections (a gather and two elementwise ops), so a layer keeps [S, 2I] for its backward
    rather than four [S, ...] tensors: on a GPU, memory is what bounds the batch. The backward
    need not be batch-invariant: it takes torch's grouped mm wherever that stays on the device."""

    @staticmethod
    def forward(ctx, x, gate_up, down, order, offsets, top_k):
        out, hidden = _grouped_mm_forward(x, gate_up, down, order, offsets, top_k)
        ctx.save_for_backward(x, hidden, gate_up, down, order, offsets)
        ctx.top_k, ctx.torchs = top_k, _grouped_mm_stays_on_device(x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):  # dtypes are fixed by the forward
            return _GroupedMMSwiGLU._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x, hidden, gate_up, down, order, offsets = ctx.saved_tensors
        top_k, inner, torchs = ctx.top_k, down.shape[-1], ctx.torchs
        grad_sorted = grad_out.reshape(-1, grad_out.shape[-1]).index_select(0, order)
        sorted_x = x.index_select(0, order // top_k)
        gate, up = hidden[:, :inner], hidden[:, inner:]
        silu_gate = F.silu(gate)
        grad_act = _grouped_matmul(grad_sorted, down.transpose(1, 2), offsets, torchs)
        grad_hidden = torch.empty_like(hidden)
        torch.ops.aten.silu_backward(grad_act * up, gate, grad_input=grad_hidden[:, :inner])
        torch.mul(grad_act, silu_gate, out=grad_hidden[:, inner:])
        # weight gradients: [features, S] x [S, features] per expert
        grad_down = _grouped_weight_grad(grad_sorted, silu_gate * up, offsets, torchs)
        grad_gate_up = _grouped_weight_grad(grad_hidden, sorted_x, offsets, torchs)
        grad_sorted_x = _grouped_matmul(grad_hidden, gate_up.transpose(1, 2), offsets, torchs)
        # Each token appears top_k times: un-sort, then sum its slots.
        grad_x = _unsorted(grad_sorted_x, order).view(-1, top_k, grad_sorted_x.shape[-1]).sum(dim=1)
        return grad_x, grad_gate_up, grad_down, None, None, None


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The inverse permutation of `order`."""
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=order.device)
    return unsort


def expert_mlp(x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Each token-slot's SwiGLU expert output, [N, k, H], not yet gate-weighted.

    x [N, H]; ids [N, k] expert per slot; gate_up [E, 2I, H] (gate rows first); down [E, H, I].
    Under autocast the matmuls run in the autocast dtype, like nn.Linear would.
    """
    if dtype := autocast_dtype(x):
        x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
    slot_expert = ids.reshape(-1)
    # the slots grouped by expert, in slot order within each
    sorted_experts, order = slot_expert.sort(stable=True)
    differentiable = torch.is_grad_enabled() and (x.requires_grad or gate_up.requires_grad or down.requires_grad)
    if uses_grouped_mm(x, gate_up, down):
        args = (x, gate_up, down, order, _group_ends(sorted_experts, gate_up.shape[0]), ids.shape[1])
        with torch.autocast(x.device.type, enabled=False):
            if not differentiable:  # e.g. decoding: skip the autograd.Function's bookkeeping
                return _grouped_mm_forward(*args)[0]
            return _GroupedMMSwiGLU.apply(*args)
    # the slice sizes, on the host: the one read-back of this path
    counts = expert_counts(slot_expert, gate_up.shape[0]).tolist()
    unsort = _inverse(order)
    invariant_tile = invariant.expert_tile(gate_up, down) if ops.is_invariant() else 0
    if invariant_tile:
        tails = invariant.expert_tail_tiles(invariant_tile, gate_up, down)
        padded = functools.partial(invariant.padded_rows, tile=invariant_tile, tails=tails)
        order, unsort, counts = _padded_groups(slot_expert, unsort, counts, padded)
    elif ops.pads_shapes(x):
        order, unsort, counts = _padded_groups(
            slot_expert, unsort, counts, lambda count: count + (-count % ops.shape_tile(count))
        )
    args = (x, gate_up, down, order, unsort, counts, ids.shape[1], invariant_tile)
    with torch.autocast(x.device.type, enabled=False):
        if not differentiable:  # e.g. decoding: skip the autograd.Function's bookkeeping
            return _per_expert_forward(*args)[0]
        return _PerExpertSwiGLU.apply(*args)
