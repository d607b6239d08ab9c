"""A step's figures read back to the host in one go.

On a GPU, every `.item()` waits for the device to finish all the work queued before it, so a
step that reads back each micro-batch's loss and counts stalls the queue once per figure. The
step keeps its figures as device tensors instead and reads them all back at its end, with one
transfer. Plain numbers pass through untouched.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def read_back(values: Mapping[str, torch.Tensor | float | int]) -> dict[str, float]:
    """Every value as a Python number (tensors: 0-d or one element, read back together as
    float64, exact for counts up to 2^53), in the order given."""
    tensors = {name: value for name, value in values.items() if isinstance(value, torch.Tensor)}
    host: dict[str, float] = {}
    if tensors:
        device = next(iter(tensors.values())).device
        stacked = torch.stack([value.detach().reshape(()).to(device, torch.float64) for value in tensors.values()])
        host = dict(zip(tensors, stacked.tolist()))
    return {name: host[name] if name in host else value for name, value in values.items()}
