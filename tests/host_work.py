"""A watch over what a piece of code does on the host, for device-agnostic code tested on a CPU.

On a GPU, a tensor built without `device=` lands on the host (and then fails against the
model's tensors, or costs a copy), and reading a value back (`.item()`, `.tolist()`, `bool(t)`)
waits for the device. On a CPU neither shows: both just work. `watch_host_work()` records them
as they happen, so a CPU test can assert that a forward, a training step or a decode step
builds nothing on the host and reads back only what it must.

    with watch_host_work() as work:
        model(ids)
    assert work.host_tensors == []
    assert len(work.syncs) <= layers

It wraps torch's factories and read-back methods for the duration of the block (in every
thread, backward passes included) and records the calls made from whetstone's own code.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

FACTORIES = (
    "tensor",
    "as_tensor",
    "arange",
    "zeros",
    "ones",
    "empty",
    "full",
    "rand",
    "randn",
    "randint",
    "randperm",
    "linspace",
    "eye",
)
"""torch functions that build a tensor on the default device unless given `device=`."""

SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")
"""Tensor methods that need the device's values on the host (`nonzero`: its size)."""


def _caller() -> str | None:
    """file:line function of the nearest whetstone frame that made the call, or None."""
    frame = sys._getframe(2)
    filename = frame.f_code.co_filename
    if "/whetstone/" in filename and "/tests/" not in filename:
        return f"{filename.split('/whetstone/')[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
    return None


@dataclass
class HostWork:
    host_tensors: list[str] = field(default_factory=list)
    """Where whetstone built a tensor without a device (file:line function)."""
    syncs: list[str] = field(default_factory=list)
    """Where whetstone read a value back to the host."""


@contextmanager
def watch_host_work():
    """Record host tensors and read-backs made directly by whetstone's code inside the block
    (a tensor whose device comes from another tensor, `x.new_zeros`, `zeros_like`, is fine)."""
    work = HostWork()
    saved = []

    def factory(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if kwargs.get("device") is None and (where := _caller()):
                work.host_tensors.append(where)
            return original(*args, **kwargs)

        return wrapper

    def sync(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if where := _caller():
                work.syncs.append(where)
            return original(*args, **kwargs)

        return wrapper

    for name in FACTORIES:
        saved.append((torch, name, getattr(torch, name)))
        setattr(torch, name, factory(getattr(torch, name)))
    saved.append((torch, "nonzero", torch.nonzero))
    torch.nonzero = sync(torch.nonzero)
    for name in SYNCS:
        saved.append((torch.Tensor, name, getattr(torch.Tensor, name)))
        setattr(torch.Tensor, name, sync(getattr(torch.Tensor, name)))
    try:
        yield work
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


@contextmanager
def no_gpu_waits(device: torch.device | str = "cuda"):
    """On CUDA, any wait for the GPU inside the block raises (torch's sync debug mode, which
    catches read-backs `watch_host_work` cannot see: those torch makes in C++). Off CUDA it
    checks nothing."""
    if torch.device(device).type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
