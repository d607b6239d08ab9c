"""MoE expert dispatch on CPU: where training time goes, so it gets its own forward and backward.

Token-slots (token, j-th choice) are sorted by expert; each expert runs one matmul on its
contiguous slice, writing straight into a preallocated output; the results go back to
(token, top-k) order with one gather. The backward mirrors it by hand. Compared with letting
autograd differentiate a Python loop over `weight[e]` slices, this avoids one full-size zero
gradient per expert slice, the scatter-adds of indexing backward, and a graph node per op.

Under invariant numerics each expert's slice is padded to a multiple of
`invariant.EXPERT_ROW_TILE` rows (dummy slots that read a zero row and whose outputs nobody
gathers) and multiplied by `invariant.expert_mm`, in tiles of one shape, so a row's result does not depend on how many
tokens chose its expert.
Reduced-precision training (`ops.training_kernels()`) pads the same way to a few sizes per power
of two (`ops.shape_tile`), so the matmuls reuse the kernels oneDNN built for earlier steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from whetstone.model import invariant, ops


def _spans(counts: list[int]):
    start = 0
    for expert, count in enumerate(counts):
        yield expert, start, start + count
        start += count


def _padded_groups(slot_expert: torch.Tensor, unsort: torch.Tensor, counts: list[int], tile):
    """The sorted layout with each expert's group padded to a multiple of `tile(count)` rows.

    Padding positions hold the dummy slot id S = number of slots (it reads a zero row of x, and
    a zero row of the output gradient); `unsort` points each real slot at its padded position."""
    padded = [count + (-count % tile(count)) for count in counts]
    shift, start, padded_start = [], 0, 0
    for count, padded_count in zip(counts, padded):
        shift.append(padded_start - start)
        start, padded_start = start + count, padded_start + padded_count
    slots = slot_expert.numel()
    unsort = unsort + torch.tensor(shift).index_select(0, slot_expert)
    order = torch.full((padded_start,), slots, dtype=unsort.dtype)
    order[unsort] = torch.arange(slots)
    return order, unsort, padded


def _zero_row_for_dummies(rows: torch.Tensor, order: torch.Tensor, slots: int) -> torch.Tensor:
    """`rows` plus a zero row (what dummy slots read) when the layout has dummy slots."""
    return F.pad(rows, (0, 0, 0, 1)) if order.numel() != slots else rows


def _grouped_forward(x, gate_up, down, order, unsort, counts, top_k, batch_invariant):
    """The forward of _GroupedSwiGLU: (output [N, k, H], the tensors its backward needs)."""
    inner = down.shape[-1]
    source = _zero_row_for_dummies(x, order, x.shape[0] * top_k)
    sorted_x = source.index_select(0, order // top_k)  # [S, H], slots grouped by expert
    hidden = x.new_empty(sorted_x.shape[0], 2 * inner)
    # Each expert's rows, transposed weight and output rows as views made in one call per tensor:
    # decoding runs this every step on a handful of rows, where indexing expert by expert would
    # cost more calls than the matmuls. An expert no slot chose gets no call.
    matmul = invariant.expert_mm if batch_invariant else torch.mm
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


class _GroupedSwiGLU(torch.autograd.Function):
    """y[t, j] = down[e] @ swiglu(gate_up[e] @ x[t]) for e = ids[t, j]; see expert_mlp.

    Row gathers use index_select (several times faster than x[idx] on CPU) and every
    intermediate is written into a preallocated buffer, slice by slice.
    """

    @staticmethod
    def forward(ctx, x, gate_up, down, order, unsort, counts, top_k, batch_invariant):
        out, saved = _grouped_forward(x, gate_up, down, order, unsort, counts, top_k, batch_invariant)
        ctx.save_for_backward(*saved)
        ctx.counts, ctx.top_k = counts, top_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast("cpu", enabled=False):  # dtypes are fixed by the forward
            return _GroupedSwiGLU._backward(ctx, grad_out)

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


def expert_mlp(x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Each token-slot's SwiGLU expert output, [N, k, H], not yet gate-weighted.

    x [N, H]; ids [N, k] expert per slot; gate_up [E, 2I, H] (gate rows first); down [E, H, I].
    Under CPU autocast the matmuls run in the autocast dtype, like nn.Linear would.
    """
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
    slot_expert = ids.reshape(-1)
    order = slot_expert.argsort(stable=True)
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(slot_expert, minlength=gate_up.shape[0]).tolist()
    batch_invariant = ops.is_invariant()
    if batch_invariant:
        order, unsort, counts = _padded_groups(slot_expert, unsort, counts, lambda count: invariant.EXPERT_ROW_TILE)
    elif ops.pads_shapes(x):
        order, unsort, counts = _padded_groups(slot_expert, unsort, counts, ops.shape_tile)
    args = (x, gate_up, down, order, unsort, counts, ids.shape[1], batch_invariant)
    differentiable = torch.is_grad_enabled() and (x.requires_grad or gate_up.requires_grad or down.requires_grad)
    with torch.autocast("cpu", enabled=False):
        if not differentiable:  # e.g. decoding: skip the autograd.Function's bookkeeping
            return _grouped_forward(*args)[0]
        return _GroupedSwiGLU.apply(*args)
