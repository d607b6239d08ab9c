"""Moving small inputs (the engine's token ids, positions and sampling parameters per step, the
trainer's row indices) from Python lists or numpy arrays to the device without waiting for the
device.

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
    if isinstance(data, np.ndarray):  # torch will not build a pinned tensor from numpy: pin a copy
        host = torch.from_numpy(data).to(dtype)
        if device.type == "cuda":
            host = host.pin_memory()
    else:
        host = torch.tensor(data, dtype=dtype, device="cpu", pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def copy_into(target: torch.Tensor, data: list) -> None:
    """Write `data` (shaped like `target`) into `target`, in its dtype, without waiting."""
    host = torch.tensor(data, dtype=target.dtype, device="cpu", pin_memory=target.device.type == "cuda")
    target.copy_(host, non_blocking=True)
