"""What the subscriber hands the engine: the new values to write in place, and how to write them.

A `WeightUpdate` is decoded and verified in the subscriber's background thread; the engine only
calls `apply_update` between decode steps, which overwrites values (`index_put_` for deltas,
`copy_` for whole tensors) and never adds: the result is the published bits exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from whetstone.errors import WhetstoneError
from whetstone.sync.bits import dtype_from_name, from_int_view
from whetstone.sync.chunks import Segment
from whetstone.sync.codec import CorruptDataError, Decoded
from whetstone.sync.manifest import Manifest


@dataclass
class TensorUpdate:
    """New values of one tensor: at flat `indices` (int64), or all of it when `indices` is None."""

    values: torch.Tensor
    indices: torch.Tensor | None
    shape: tuple[int, ...]


@dataclass
class WeightUpdate:
    version: int
    base: int | None
    """The version this update must be applied on; None for a full replacement."""
    tensors: dict[str, TensorUpdate] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)

    @property
    def values_written(self) -> int:
        return sum(t.values.numel() for t in self.tensors.values())


@torch.no_grad()
def apply_update(state: dict[str, torch.Tensor], update: WeightUpdate, convert: bool = True) -> None:
    """Overwrite `state`'s tensors in place with the update's values.

    Targets may have another dtype than the published one (an fp32 engine fed bf16 weights),
    and live on another device (a GPU): the values are converted on write. Tensors new in this
    version are added to the dict, on the host. `convert=False` is for a copy that must hold the
    published tensors exactly (the subscriber's own, which later deltas are decoded against): a
    whole tensor of another dtype replaces the target instead of being rounded into it.

    All or nothing: an update that does not fit the weights (values at indices of a tensor they
    lack, or hold in another shape) raises before anything is written.
    """
    _check_fits(state, update)
    for name, change in update.tensors.items():
        target = state.get(name)
        if change.indices is None:
            if (
                target is None
                or tuple(target.shape) != change.shape
                or (not convert and target.dtype != change.values.dtype)
            ):
                state[name] = change.values.reshape(change.shape).clone()
            else:
                target.copy_(change.values.view(change.shape))
            continue
        values = change.values.to(target.device, target.dtype)
        indices = change.indices.to(target.device)
        if target.is_contiguous():
            target.view(-1).index_put_((indices,), values)
        else:
            flat = target.contiguous().view(-1)
            flat.index_put_((indices,), values)
            target.copy_(flat.view(target.shape))
    for name in update.removed:
        state.pop(name, None)


def _check_fits(state: dict[str, torch.Tensor], update: WeightUpdate) -> None:
    """Raise naming the first tensor of `update` that `state` cannot take as it stands."""
    for name, change in update.tensors.items():
        if change.indices is None:
            if any(dim < 0 for dim in change.shape) or change.values.numel() != math.prod(change.shape):
                raise WhetstoneError(
                    f"update {update.version} carries {change.values.numel()} values for tensor {name!r} "
                    f"of shape {change.shape}"
                )
            continue
        target = state.get(name)
        if target is None or tuple(target.shape) != change.shape:
            raise WhetstoneError(
                f"update {update.version} changes tensor {name!r} of shape {change.shape}, "
                f"but the weights hold {'no such tensor' if target is None else tuple(target.shape)}"
            )


def merge_updates(updates: list[WeightUpdate]) -> WeightUpdate:
    """One update equivalent to applying `updates` in order (later values win)."""
    merged = WeightUpdate(updates[0].version, updates[0].base)
    for update in updates:
        merged.version = update.version
        for name, change in update.tensors.items():
            earlier = merged.tensors.get(name)
            if earlier is None or change.indices is None:
                merged.tensors[name] = change
            elif earlier.indices is None:
                whole = {name: earlier.values.reshape(earlier.shape).clone()}
                apply_update(whole, WeightUpdate(update.version, None, {name: change}))
                merged.tensors[name] = TensorUpdate(whole[name].view(-1), None, earlier.shape)
            else:
                merged.tensors[name] = _merge_sparse(earlier, change)
            if name in merged.removed:
                merged.removed.remove(name)
        for name in update.removed:
            merged.tensors.pop(name, None)
            merged.removed.append(name)
    return merged


def _merge_sparse(earlier: TensorUpdate, later: TensorUpdate) -> TensorUpdate:
    indices = torch.cat([earlier.indices, later.indices])
    values = torch.cat([earlier.values, later.values.to(earlier.values.dtype)])
    # Keep the last write of each index: first occurrence in the reversed order.
    _, first = np.unique(indices.flip(0).numpy(), return_index=True)
    keep = torch.from_numpy(len(indices) - 1 - first)
    return TensorUpdate(values[keep], indices[keep], later.shape)


def build_update(
    manifest: Manifest, pieces: list[tuple[Segment, Decoded]], base: dict[str, torch.Tensor] | None
) -> WeightUpdate:
    """Turn a version's decoded segments into an update, checking they cover every tensor once.
    A tensor decoded in one piece (most of them) is handed over without a copy."""
    by_tensor: dict[str, list[tuple[Segment, Decoded]]] = {}
    for segment, decoded in pieces:
        by_tensor.setdefault(segment.tensor, []).append((segment, decoded))
    update = WeightUpdate(manifest.version, manifest.base)
    for info in manifest.tensors:
        dtype, shape = dtype_from_name(info.dtype), tuple(info.shape)
        numel = math.prod(shape)
        parts = by_tensor.pop(info.name, [])
        if len(parts) > 1:
            parts.sort(key=lambda part: part[0].start)
        covered = 0
        for segment, _ in parts:
            if segment.start != covered:
                raise CorruptDataError(f"tensor {info.name!r}: chunks leave a gap or overlap at value {covered}")
            covered = segment.stop
        if covered != numel:
            raise CorruptDataError(f"tensor {info.name!r}: chunks carry {covered} of its {numel} values")
        if not parts:
            continue  # an empty tensor that no chunk carries: nothing to write
        whole = [decoded.indices is None for _, decoded in parts]
        if all(whole):
            values = _joined([decoded.values for _, decoded in parts])
            update.tensors[info.name] = TensorUpdate(from_int_view(values, dtype), None, shape)
        elif not any(whole):
            indices = _joined([decoded.indices for _, decoded in parts])
            if indices.size:
                values = _joined([decoded.values for _, decoded in parts])
                update.tensors[info.name] = TensorUpdate(from_int_view(values, dtype), torch.from_numpy(indices), shape)
        else:
            raise CorruptDataError(f"tensor {info.name!r} is coded partly whole and partly as a delta")
    if by_tensor:
        raise CorruptDataError(f"chunks carry tensors the manifest does not list: {sorted(by_tensor)}")
    if base is not None:
        listed = {info.name for info in manifest.tensors}
        update.removed = [name for name in base if name not in listed]
    return update


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
