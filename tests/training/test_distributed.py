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


FAILING_JOB = JOB.with_name("failing_ranks_job.py")


@pytest.mark.slow  # a real 2-process torchrun job, ~15 s on 2 shared cores
def test_every_rank_raises_what_rank_0_met_reading_or_writing_a_checkpoint(tmp_path):
    # Rank 0 alone writes and reads checkpoint files. Its failure is every rank's: the others
    # raise the same error at once, rather than going on into a collective rank 0 never joins
    # (and waiting there the process group's hour, or being killed without a word of why).
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    job = subprocess.Popen(
        [*command, str(FAILING_JOB), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        _, stderr = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        job.terminate()  # torchrun ends its ranks (each in a session of its own) before it exits
        job.communicate(timeout=60)
        pytest.fail("the ranks hung: one waited in a collective for a rank that had failed")
    assert job.returncode == 0, stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    blocked, model_file = tmp_path / "blocked", tmp_path / "checkpoints" / "step_00000001" / "model.safetensors"
    for rank in ranks:
        assert rank["save"].startswith(f"CheckpointError: cannot write checkpoint {blocked / 'step_00000002'}"), rank
        assert rank["load"] == f"DamagedCheckpoint: checkpoint file {model_file} is corrupt (sha256 mismatch)", rank
