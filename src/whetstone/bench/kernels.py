"""How long the dense kernels of a piece of work take: the floor of any speedup over a baseline
that must run the same matmuls.

Two implementations of one model compute the same matrix products (same shapes, same FLOPs) and
the same attention, with the same BLAS. What one can do better than the other is everything
else: dispatch, elementwise work, memory traffic, Python. So `baseline_seconds /
dense_kernel_seconds(ours)` bounds the speedup any change to our non-dense code could reach: the
ratio if all of it took no time. The benchmarks report it beside the speedup they measure. The
profiler adds a microsecond or two to each op it records, so on small matmuls the sum runs a
few percent high and the ceiling a few percent low.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DENSE_KERNELS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    }
)
"""Matrix products and fused attention (forward and backward), as torch's profiler names them."""


def dense_kernel_seconds(work: Callable[[], object], calls: int = 1) -> float:
    """Wall seconds per call of `work()` spent inside `DENSE_KERNELS`, from torch's profiler (an
    op's time on the thread that launched it, which spans its intra-op parallel work)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(calls):
            work()
    micros = sum(event.self_cpu_time_total for event in profile.key_averages() if event.key in DENSE_KERNELS)
    return micros / 1e6 / calls
