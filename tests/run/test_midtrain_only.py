"""`whetstone run CONFIG --midtrain-only`: the run's mid-training alone, with its synth
demonstrations (which `whetstone midtrain` has no config for), as one process, as the ranks of a
torchrun job or as the ranks the run's placement asks for; a whole `whetstone run` under torchrun
is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.run.run_support import tiny_settings
from whetstone.config import load_config
from whetstone.run.config import PipelineConfig
from whetstone.run.pipeline import midtrain_stage

DEMOS = ("demos.count=2", "midtrain.data.seq_len=512")  # rows that hold a transcript's prompt and answer
NO_RL_TASKS = 'rl.orchestrator.tasks.source="/no/such/tasks.jsonl"'  # refused by a whole run, not by its mid-training


def whetstone_run(settings: list[str], *options: str, nproc: int = 1, env: dict | None = None):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command = command if nproc > 1 else [sys.executable]
    command += ["-m", "whetstone.cli", "run", *options]
    for setting in settings:
        command += ["--set", setting]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize(
    ("nproc", "placed"),
    [(1, 1), (2, 1), (1, 2)],
    ids=["one process", "torchrun's 2 ranks", "2 ranks the run places"],
)
def test_the_runs_mid_training_alone_takes_its_demonstrations(tmp_path, nproc, placed):
    settings = tiny_settings(tmp_path, *DEMOS, f"placement.midtrain_ranks={placed}", NO_RL_TASKS)
    done = whetstone_run(settings, "--midtrain-only", "--json", nproc=nproc)
    assert done.returncode == 0, done.stderr[-4000:]
    (summary,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]  # rank 0 alone
    assert summary["finished"] and summary["world_size"] == nproc * placed
    run = tmp_path / "runs" / "tiny"
    assert summary["model_dir"] == str(run / "midtrain" / "model") and not (run / "summary.json").exists()
    (manifest,) = (tmp_path / "cache").glob("*/manifest.json")
    assert json.loads(manifest.read_text())["demos"]["transcripts"] == 2

    # the whole run then finds mid-training finished: its stage resumes the last checkpoint, trains nothing
    again = midtrain_stage(load_config(PipelineConfig, None, settings).resolved())
    assert again["resumed_from"].endswith(f"step_{summary['step']:08d}") and again["tokens"] == summary["tokens"]
    assert again["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)


def test_mid_training_alone_is_checked_for_what_it_reads_first(tmp_path):
    settings = tiny_settings(tmp_path, NO_RL_TASKS, "placement.midtrain_ranks=2")
    done = whetstone_run([*settings, f'midtrain.data.directories=[{{path="{tmp_path / "gone"}"}}]'], "--midtrain-only")
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and "mid-training cannot start: midtrain.data.directories[0].path" in said
    assert "rl.orchestrator.tasks" not in said and not (tmp_path / "runs" / "tiny" / "logs").exists()  # no rank started


def test_a_whole_run_under_torchrun_is_refused(tmp_path):
    done = whetstone_run(tiny_settings(tmp_path), env={"WORLD_SIZE": "2", "RANK": "1"})
    assert done.returncode == 2
    said = " ".join(done.stderr.split())  # as rich wrapped it
    assert "whetstone run under torchrun: only its mid-training runs on ranks (--midtrain-only)" in said
    assert not (tmp_path / "runs").exists()  # nothing started
