"""Per-process runtime settings: each role owns its cores and keeps its freed memory."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# glibc mallopt(3) parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def configure_process(threads: int) -> None:
    """Called once at the start of each role's process: `threads` intra-op threads for torch
    (and the BLAS under it), 0 meaning all the cores it may use; and freed memory kept for reuse."""
    import torch

    threads = threads or usable_cores()
    torch.set_num_threads(threads)
    keep_freed_memory()


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a role pinned by `placement` has
    only its own), not every core of the machine."""
    return len(os.sched_getaffinity(0))


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX). There bf16 matmuls run
    2-3x as fast as fp32 ones; elsewhere torch falls back to a path ~25x slower than fp32."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, hence looked up with a default
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def resolve_dtype(dtype: str, device=None) -> str:
    """A training compute dtype with `auto` resolved for `device` (a torch.device; None = the
    CPU): bfloat16 on a GPU that computes in it (every one since Ampere) and where the CPU
    multiplies bf16 natively, float32 elsewhere. Mid-training and `whetstone bench train` share it."""
    if dtype != "auto":
        return dtype
    if device is not None and device.type == "cuda":
        import torch

        # not emulated: torch's default also says yes for GPUs before Ampere, which emulate it slowly
        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float32"
    return "bfloat16" if native_bf16() else "float32"


def keep_freed_memory() -> bool:
    """Serve large allocations from the heap and keep what is freed, instead of glibc's default
    of a fresh mmap for every block over 32 MB (the logits of a training batch, their softmax and
    gradient) and returning it at free. A fresh mapping costs a page fault per 4 KiB on first
    write: ~11 ms per 32 MB tensor here, 15-20% of a training step of the default model. This
    is what PyTorch's CPU tuning guide gets from jemalloc/tcmalloc, without a preload. The cost:
    the heap keeps what it grew to (60-160 MB more resident in a training loop of the default
    model), and it is not a guarantee: small objects may settle in a freed block, so the next
    large one grows the heap instead (tests/utils/test_runtime.py measures the usual pattern).
    Returns whether it applied (glibc only; elsewhere the allocator is left alone)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
