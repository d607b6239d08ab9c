"""Per-process runtime settings: each role owns its cores."""

from __future__ import annotations

import os


def set_threads(threads: int) -> None:
    """Pin torch (and the BLAS under it) to `threads` intra-op threads in this process.

    0 means all cores. Called once at the start of each role's process.
    """
    import torch

    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
