"""training.distributed's sharded checkpoints and frozen models, in a real 2-rank torchrun job
(gloo on the CPU; tests/training/sharded_job.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).with_name("sharded_job.py")


def test_a_sharded_resume_keeps_the_optimizers_own_adamw_and_a_frozen_root_is_resharded(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*command, str(JOB), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for rank in ranks:
        # rank 0 read the checkpoint into a plain copy whose AdamW is torch's default; every
        # rank's optimizer keeps its fused one (on CUDA, the one the trainer asked for)
        assert rank["fused"] == [True] * len(rank["fused"]), rank
        # the reference model's embeddings and final norm are shards again after a forward
        assert rank["frozen_whole_after_forward"] == [], rank
