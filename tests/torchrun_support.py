"""Real multi-process jobs under torchrun (gloo on the CPU), as users start them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def torchrun(args: list[str], nproc: int = 2, succeeds: bool | None = True, timeout_s: float = 300):
    """`torchrun --standalone --nproc_per_node NPROC ARGS` (--standalone picks a free port), one
    thread per rank, its output captured. `succeeds`: whether it must end with success (True) or
    an error (False); None checks neither. The test fails if the ranks hang past `timeout_s` (one
    waiting in a collective for a rank that failed)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = job.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        job.terminate()  # torchrun ends its ranks (each in a session of its own) before it exits
        job.communicate(timeout=60)
        pytest.fail(f"the ranks still ran after {timeout_s:g} s: one waited in a collective for a rank that failed?")
    if succeeds is not None:
        assert (job.returncode == 0) == succeeds, stderr[-4000:]
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)
