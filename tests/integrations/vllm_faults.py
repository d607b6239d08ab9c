"""A worker extension for test_vllm.py: whetstone's, with vLLM's weight reload failing part-way
on demand, as an out-of-memory error would (no input makes vLLM's reload fail for real).

test_vllm.py links this file into the vLLM server's PYTHONPATH and names `vllm_faults.FaultyWrites`
as its worker extension; the file named by $WHETSTONE_TEST_WRITE_FAULTS says what fails:

  absent       nothing
  "alternate"  every reload that does not follow a failed one (a version's write fails, writing
               the served version back works)
  "all"        every reload
"""

from __future__ import annotations

import os
from pathlib import Path

from whetstone.integrations.vllm_worker import WeightStoreFollower

FAULTS_ENV = "WHETSTONE_TEST_WRITE_FAULTS"
LOADED_BEFORE_FAILING = 3
"""Tensors vLLM's reload takes before it fails: the model then holds parts of two versions."""


class FailingReloads:
    """vLLM's worker as `ServedWeights` uses it, its `reload_weights` failing as the fault file says."""

    def __init__(self, worker, faults: Path):
        self._worker, self._faults, self._failed_last = worker, faults, False

    def __getattr__(self, name: str):
        return getattr(self._worker, name)

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool):
        mode = self._faults.read_text().strip() if self._faults.exists() else ""
        fail = mode == "all" or (mode == "alternate" and not self._failed_last)
        self._failed_last = fail
        if fail:
            weights_iterator = failing_after(weights_iterator, LOADED_BEFORE_FAILING)
        return self._worker.reload_weights(weights_iterator=weights_iterator, is_checkpoint_format=is_checkpoint_format)


def failing_after(pieces, count: int):
    for number, piece in enumerate(pieces):
        if number == count:
            raise RuntimeError("out of memory (injected by the test) during the reload")
        yield piece


class FaultyWrites(WeightStoreFollower):
    def whetstone_follow(self, sync_json: str, version: str):
        status = super().whetstone_follow(sync_json, version)
        served = self._whetstone.engine
        if not isinstance(served.worker, FailingReloads):
            served.worker = FailingReloads(served.worker, Path(os.environ[FAULTS_ENV]))
        return status
