"""The serving layout: matmul weights stored column-major, values and shapes unchanged.

A decode step multiplies a handful of rows by every weight, so its time is mostly MKL bringing
weights in from memory. With a weight's transpose contiguous (`x @ W.T` then reads `W.T` as a
plain row-major matrix) the same fp32 GEMM runs 25-40% faster on weights that are not in cache
(measured on this CPU, 1-16 rows: a [16, 256] x [256, 512] product 124 -> 91 us, the batch-1
output head 540 -> 212 us). Only strides change, so every reader of the model (state_dict,
checkpoints, indexing) sees the same tensors.

A fast engine lays its model out this way; training keeps the row-major layout its gradients
have, and so does an engine with invariant numerics, whose matmuls must be the trainer's calls.
Writing into such a tensor goes through `flat_storage` with `storage_indices` (sparse writes) or
`in_storage_order` (whole tensors), which put values in storage order (hot weight swap,
`inference/swap.py`).

A fast engine that computes in bf16 also holds its matmul weights in bf16 (`serving_copy`):
the values bf16 autocast would cast them to at every forward, so the same bits without that cast
(on a GPU, reading and writing every weight again each decode step) and at half the memory.
Embedding tables and norms keep their dtype, as autocast leaves them.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def is_column_major(t: torch.Tensor) -> bool:
    """Whether the last two dims of `t` are stored transposed (and densely)."""
    return t.dim() >= 2 and t.transpose(-1, -2).is_contiguous() and not t.is_contiguous()


MIN_OUTPUTS = 64
"""Weights with fewer output rows (a router over a few experts) keep their layout: they cost
little to read, and for fewer than 12 output columns MKL sums a column-major operand in another
order (measured), which would break invariant numerics' bit-identity with the trainer."""


def _matmul_weights(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter used as a matmul operand with at least MIN_OUTPUTS rows, except an
    embedding table that is only looked up (an untied input embedding keeps rows contiguous)."""
    lookup_only = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "lm_head", None)
    if head is not None:
        lookup_only.discard(id(head.weight))  # tied: the head's matmul is read every step
    # parameters() yields a tied weight once
    return [p for p in model.parameters() if p.dim() >= 2 and p.shape[-2] >= MIN_OUTPUTS and id(p) not in lookup_only]


def to_column_major(model: nn.Module) -> nn.Module:
    """Store `model`'s matmul weights column-major, in place (see the module docstring).

    The new storage is made outside inference mode even when called inside it, so the model
    stays usable for training (an inference tensor cannot be saved for backward)."""
    with torch.inference_mode(False), torch.no_grad():
        for param in _matmul_weights(model):
            if not is_column_major(param):
                param.data = param.data.transpose(-1, -2).contiguous().transpose(-1, -2)
    return model


def autocast_tables(model: nn.Module) -> frozenset[str]:
    """The names in `model.state_dict()` of its embedding tables (a tied output head among them):
    the matrices bf16 autocast and `serving_copy` leave in their dtype."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return frozenset(name for name, t in model.state_dict(keep_vars=True).items() if id(t) in tables)


def serving_copy(model: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """`model` on `device` with its matmul weights (every parameter of two or more dims except
    the embedding tables, a tied output head being one) in `dtype` (None: their own). Tensors
    already on `device` in that dtype are shared with `model` (a trainer may hold the same
    object), which stays on its device and keeps its other tensors; the model itself where
    nothing needs a copy. Each weight goes to the device cast, so a host model is never whole on
    the GPU beside its bf16 copy. The copies take no gradient: they serve."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    memo: dict[int, object] = {}
    with torch.inference_mode(False), torch.no_grad():
        for param in model.parameters():
            matmul = param.dim() >= 2 and id(param) not in tables
            target = dtype if matmul and dtype is not None else param.dtype
            if param.device == device and param.dtype == target:
                memo[id(param)] = param
            else:
                memo[id(param)] = nn.Parameter(param.detach().to(device, target), requires_grad=False)
        for buffer in model.buffers():
            memo[id(buffer)] = buffer if buffer.device == device else buffer.to(device)
        if all(memo[id(p)] is p for p in model.parameters()) and all(memo[id(b)] is b for b in model.buffers()):
            return model
        return copy.deepcopy(model, memo).to(device)


def cat_rows(weights: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(weights)` (along the output rows) in the weights' own layout, in one copy: for
    weights derived from served ones, e.g. attention's fused q/k/v matrix."""
    if all(is_column_major(w) for w in weights):
        return torch.cat([w.mT for w in weights], dim=-1).mT
    return torch.cat(weights)


def _storage_permutation(t: torch.Tensor) -> list[int]:
    """The order of dims that makes `t` contiguous (outermost stride first)."""
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def flat_storage(t: torch.Tensor) -> torch.Tensor:
    """A flat view of the memory of a dense tensor in any dim order, in storage order."""
    if t.is_contiguous():
        return t.view(-1)
    storage = t.permute(_storage_permutation(t))
    if not storage.is_contiguous():
        raise ValueError(f"tensor of shape {tuple(t.shape)} and strides {t.stride()} is not dense")
    return storage.view(-1)


def in_storage_order(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` (shaped like `t`) flattened in `t`'s storage order, to write with `flat_storage`."""
    if t.is_contiguous():
        return values.reshape(-1)
    return values.reshape(t.shape).permute(_storage_permutation(t)).reshape(-1)


def storage_indices(t: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Flat row-major (logical) indices into `t` as positions in `flat_storage(t)`."""
    if t.is_contiguous():
        return indices
    coords = torch.unravel_index(indices, t.shape)
    position = torch.zeros_like(indices)
    for coord, stride in zip(coords, t.stride()):
        position += coord * stride
    return position
