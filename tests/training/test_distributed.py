"""training.distributed's sharded checkpoints and frozen models, and the trainer's step figures
over ranks, in a real 2-rank torchrun job (gloo on the CPU; tests/training/ranks_job.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("ranks_job.py")


def test_two_ranks_resume_shard_a_frozen_model_and_sum_up_a_step(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*command, str(JOB), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for rank in ranks:
        # rank 0 read the checkpoint into a plain copy whose AdamW is torch's default; every
        # rank's optimizer keeps its fused one (on CUDA, the one the trainer asked for)
        assert rank["fused"] == [True] * len(rank["fused"]), rank
        # the reference model's embeddings and final norm are shards again after a forward
        assert rank["frozen_whole_after_forward"] == [], rank
        # the step's figures: shares summed, |delta|'s p99 and max those of both ranks' rows
        step, whole = rank["step"], rank["whole"]
        assert step["loss"] == 3.0 and step["grad_norm"] == 3.0
        assert step["diff_p99"] == whole["diff_p99"] and step["diff_max"] == whole["diff_max"]
        assert step["diff_over_ln2"] == whole["diff_over_ln2"] > 0
        assert step["diff_mean"] == pytest.approx(whole["diff_mean"], rel=1e-12)
