import os
import platform
import subprocess
import sys

import pytest
import torch

from whetstone.utils.runtime import configure_process

# A role's process as it starts: the setting (or not), then 40 steps of a training head's
# allocations (32 MiB logits, their softmax, a gradient-sized product), each freed after the
# step; prints the minor page faults of the loop.
_TRAINING_LOOP_FAULTS = """
import resource, sys, torch
from whetstone.utils.runtime import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
hidden, weight = torch.randn(2048, 256), torch.randn(4096, 256)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    logits = hidden @ weight.t()
    probs = logits.softmax(-1)
    grad = probs * 2
    del logits, probs, grad
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _training_loop_faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _TRAINING_LOOP_FAULTS, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_large_blocks_are_reused_instead_of_mapped_afresh():
    # glibc's default maps every block over 32 MB afresh: ~24k faults a step here (~980k in all);
    # kept, the heap holds the blocks (measured 42-67k in all, the first steps' growth).
    default, kept = _training_loop_faults("default"), _training_loop_faults("keep")
    assert default > 40 * 3 * 8192 * 0.9
    assert kept < default / 4


@pytest.fixture
def other_thread_count():
    """Torch set to 3 threads, a count neither test below asks for (other tests leave it at 1,
    which would make the asserts hold whatever `configure_process` did); restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(threads)


def test_configure_process_sets_the_thread_count(other_thread_count):
    configure_process(2)
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores, to pin the process to one")
def test_all_cores_are_the_cores_a_pinned_process_may_use(other_thread_count):
    usable = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(usable)})  # a role placed on one core
        configure_process(0)
        assert torch.get_num_threads() == 1
    finally:
        os.sched_setaffinity(0, usable)


def test_auto_dtype_is_bfloat16_only_where_the_cpu_multiplies_bf16_natively(monkeypatch):
    from whetstone.utils import runtime

    assert runtime.resolve_dtype("float32") == "float32" and runtime.resolve_dtype("bfloat16") == "bfloat16"
    assert runtime.resolve_dtype("auto") == ("bfloat16" if runtime.native_bf16() else "float32")
    # A CPU without AVX512-BF16 or AMX, or a torch without the probes: float32.
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, probe, raising=False)
    assert not runtime.native_bf16() and runtime.resolve_dtype("auto") == "float32"
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert runtime.native_bf16() and runtime.resolve_dtype("auto") == "bfloat16"


def test_auto_dtype_on_a_gpu_is_bfloat16_only_where_it_computes_in_it(monkeypatch):
    from whetstone.utils import runtime

    gpu = {"major": 0}

    def supported(including_emulation=True):  # torch's answer: emulation counts, on any GPU
        return including_emulation or gpu["major"] >= 8

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    for major, expected in ((7, "float32"), (8, "bfloat16"), (9, "bfloat16")):  # V100/T4, A100, H100
        gpu["major"] = major
        assert runtime.resolve_dtype("auto", torch.device("cuda", 0)) == expected
