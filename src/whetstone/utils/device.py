"""Which device a role computes on: `auto` (CUDA when present, else the CPU), `cpu`, `cuda`,
or `cuda:N`. Every role's config has a `device` field resolved here, so a machine with a GPU
uses it without being told and one without runs as before."""

from __future__ import annotations

import re
from contextlib import nullcontext
from typing import Annotated

import torch
from pydantic import AfterValidator

from whetstone.errors import ConfigError

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _check_device_name(name: str) -> str:
    """`name` if it is a device name, as torch reads it: torch refuses an index with a leading
    zero (a RuntimeError), and reads one past its largest (127) as another GPU's."""
    if not _DEVICE.fullmatch(name) or (name.startswith("cuda:") and not _torch_reads_back(name)):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N' (N from 0 to 127), got {name!r}")
    return name


def _torch_reads_back(name: str) -> bool:
    try:
        return str(torch.device(name)) == name
    except RuntimeError:
        return False


DeviceName = Annotated[str, AfterValidator(_check_device_name)]
"""A config field's type for a device name (checked when the config loads)."""


def resolve_device(name: str = "auto") -> torch.device:
    """The torch device `name` means here; `cuda` asked for on a machine without one is an error
    that says so (a run would otherwise fail later, deep in a forward)."""
    _check_device_name(name)
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device = {name!r}, but torch sees no CUDA device here (use 'auto' or 'cpu')")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device = {name!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device from now on (nothing off CUDA): a
    role's process on cuda:N (the trainer, mid-training) launches what names no device there, as
    `on_device` does for a block."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def on_device(device: torch.device):
    """A block in which `device` is the thread's current CUDA device (nothing changes off CUDA).
    Work that names no device goes to the current one, cuda:0 unless set: Triton's launches, a CUDA
    graph's capture, an event recorded on the current stream. A role on cuda:N runs under this."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def autocast(dtype: str, device: torch.device | str = "cpu"):
    """bf16 compute under autocast on `device` (weights stay fp32), or plain fp32."""
    device_type = torch.device(device).type
    if dtype == "bfloat16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return nullcontext()


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes in on x's device, or None outside autocast."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
