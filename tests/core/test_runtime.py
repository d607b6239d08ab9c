import platform
import resource

import pytest
import torch

from whetstone.utils.runtime import configure_process, keep_freed_memory


def _page_faults_to_fill(megabytes: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(megabytes << 20, dtype=torch.uint8).fill_(1)  # allocated, written, freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_freed_large_block_is_reused_without_page_faults():
    assert keep_freed_memory()
    _page_faults_to_fill(64)  # the heap grows to hold it once
    # glibc's default maps every block over 32 MB afresh: 16384 faults for 64 MiB, each time.
    assert _page_faults_to_fill(64) < 1000


def test_configure_process_sets_the_thread_count():
    threads = torch.get_num_threads()
    try:
        configure_process(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
