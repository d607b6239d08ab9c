"""Moving inputs (the engine's token ids, positions and sampling parameters per step, the
trainer's row indices, training batches) from Python lists, numpy arrays or host tensors to the
device without waiting for the device.

`torch.tensor(data, device="cuda")` copies from pageable memory and then waits for the device's
queued work (the prefill just launched, say). Built in pinned host memory and copied with
`non_blocking=True`, the copy joins the stream's queue instead and the host goes on. On the CPU
this is `torch.tensor(data)`.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(data: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`data` (numbers or nested lists of them, or a numpy array) as a tensor on `device`."""
    if isinstance(data, np.ndarray):  # torch will not build a pinned tensor from numpy: a pinned copy
        return tensor_to_device(torch.from_numpy(data).to(dtype), device)
    host = torch.tensor(data, dtype=dtype, device="cpu", pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def tensor_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` through a pinned copy, so the copy joins the stream's queue (a
    copy from pageable memory may wait for the device); `t` itself where it is already. A view
    (a rank's rows of a batch) is pinned as one contiguous copy: `pin_memory` keeps its strides
    (pinning its whole span), and the copy of a non-contiguous host tensor to the device goes
    through a pageable temporary."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu" and not (t.is_pinned() and t.is_contiguous()):
        t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    return t.to(device, non_blocking=True)


def copy_into(target: torch.Tensor, data: list) -> None:
    """Write `data` (shaped like `target`) into `target`, in its dtype, without waiting."""
    host = torch.tensor(data, dtype=target.dtype, device="cpu", pin_memory=target.device.type == "cuda")
    target.copy_(host, non_blocking=True)
