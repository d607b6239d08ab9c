"""Tests marked `gpu` need a CUDA device: where torch sees none (CI, most machines) they are
skipped, so `pytest` runs the same everywhere and `pytest -m gpu` runs them on a GPU machine."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's kernels (invariant numerics on a GPU) run under its interpreter here, which must be
    # chosen before Triton is first imported (tests/triton_kernels.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_xdist_auto_num_workers(config):
    """`-n logical` and `-n auto`: one worker per CPU this process may run on (its affinity), not
    per CPU of the host, which a pinned process or a container sees too."""
    return len(os.sched_getaffinity(0))
