import platform
import subprocess
import sys

import pytest
import torch

from whetstone.utils.runtime import configure_process

# A role's process as it starts: the setting (or not), then a 64 MiB block allocated, written and
# freed twice; prints the minor page faults of the second time.
_SECOND_FILL_FAULTS = """
import resource, sys, torch
from whetstone.utils.runtime import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(faults())
"""


def _second_fill_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _SECOND_FILL_FAULTS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_freed_large_block_is_reused_without_page_faults():
    # glibc's default maps every block over 32 MB afresh: 16384 faults for 64 MiB, each time.
    assert _second_fill_faults("default") > 16000
    assert _second_fill_faults("keep") < 1000


def test_configure_process_sets_the_thread_count():
    threads = torch.get_num_threads()
    try:
        configure_process(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
