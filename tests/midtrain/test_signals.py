"""SIGTERM and Ctrl-C stop mid-training after the step in progress: that step is checkpointed,
the signal's exception is raised (no export, no summary of a finished run) and the same command
resumes the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from whetstone.config import dump_toml
from whetstone.midtrain import loop
from whetstone.midtrain.loop import train
from whetstone.training.checkpoint import list_checkpoints
from whetstone.utils.metrics import read_metrics
from whetstone.utils.processes import free_port

LONG = ("run.steps=100000", "run.checkpoint_interval=100000", "run.eval_interval=100000")
"""A run the signal cuts short: no checkpoint or evaluation of its own before it."""


def trained_steps(run_dir: Path) -> list[int]:
    return [record["step"] for record in read_metrics(run_dir / "metrics.jsonl") if "loss" in record]


def test_sigterm_checkpoints_the_step_in_progress_exits_143_and_the_same_command_resumes(make_config, tmp_path):
    config_file = tmp_path / "midtrain.toml"
    config_file.write_text(dump_toml(make_config(*LONG)))
    run_dir = make_config().run.run_dir
    metrics, output = run_dir / "metrics.jsonl", tmp_path / "output.txt"
    with output.open("wb") as sink:  # a file, not a pipe: the progress bar writes on
        process = subprocess.Popen(
            [sys.executable, "-m", "whetstone.cli", "midtrain", str(config_file)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            deadline = time.monotonic() + 120
            while not (metrics.exists() and trained_steps(run_dir)):
                assert process.poll() is None, output.read_text()[-3000:]
                assert time.monotonic() < deadline, "no step within 120 s"
                time.sleep(0.05)
            process.send_signal(signal.SIGTERM)
            code = process.wait(60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    said = output.read_text()
    assert code == 128 + signal.SIGTERM, said[-3000:]
    assert said.rstrip().endswith("stopped by SIGTERM") and "Traceback" not in said
    reached = trained_steps(run_dir)[-1]
    assert f"SIGTERM at step {reached}: checkpointed" in said
    assert [path.name for path in list_checkpoints(run_dir / "checkpoints")] == [f"step_{reached:08d}"]
    assert not (run_dir / "model").exists() and not (run_dir / "summary.json").exists()

    resumed = train(make_config(*LONG, f"run.steps={reached + 2}"))
    assert resumed["resumed_from"].endswith(f"step_{reached:08d}") and resumed["finished"]
    assert trained_steps(run_dir) == list(range(1, reached + 3))  # none lost, none repeated


@pytest.mark.parametrize("when", ["during a step", "after the last step"])
def test_ctrl_c_raises_keyboard_interrupt_once_the_step_is_checkpointed(make_config, monkeypatch, when):
    config = make_config("run.steps=4", "run.checkpoint_interval=100")
    run_dir = config.run.run_dir
    step, summarize = loop._step, loop.summarize

    def step_with_ctrl_c(session):
        if session.state.step == 1:  # in the second step
            signal.raise_signal(signal.SIGINT)
        return step(session)

    def summarize_with_ctrl_c(*args):
        signal.raise_signal(signal.SIGINT)
        return summarize(*args)

    if when == "during a step":
        monkeypatch.setattr(loop, "_step", step_with_ctrl_c)
    else:
        monkeypatch.setattr(loop, "summarize", summarize_with_ctrl_c)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train(config)
    assert signal.getsignal(signal.SIGINT) is handler
    checkpoints = [path.name for path in list_checkpoints(run_dir / "checkpoints")]
    if when == "during a step":  # stopped after it, not exported: the caller does not go on
        assert trained_steps(run_dir) == [1, 2] and checkpoints == ["step_00000002"]
        assert not (run_dir / "model").exists() and not (run_dir / "summary.json").exists()
    else:  # the run is whole, but asked to stop: its caller stops too
        assert checkpoints == ["step_00000004"] and json.loads((run_dir / "summary.json").read_text())["finished"]
    monkeypatch.undo()
    assert train(config)["finished"] and trained_steps(run_dir) == [1, 2, 3, 4]


def test_ranks_that_see_sigterm_in_different_steps_stop_together_after_rank_0s(make_config, tmp_path):
    # a 2-rank gloo job (the ranks started as torchrun would start them): rank 1 sees SIGTERM in
    # step 2, rank 0 in step 4; rank 0 decides for both, so both checkpoint step 4 and stop
    config = make_config(*LONG)
    config_file = tmp_path / "midtrain.toml"
    config_file.write_text(dump_toml(config))
    job = Path(__file__).with_name("signal_ranks_job.py")
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env["MASTER_PORT"] = str(free_port())
    outputs = [tmp_path / f"rank-{rank}.txt" for rank in range(2)]
    ranks = []
    for rank, output in enumerate(outputs):
        with output.open("wb") as sink:
            ranks.append(
                subprocess.Popen(
                    [sys.executable, str(job), str(config_file)],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        codes = [rank.wait(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    said = [output.read_text() for output in outputs]
    assert codes == [128 + signal.SIGTERM] * 2, said
    assert all(text.rstrip().endswith("stopped by SIGTERM") for text in said), said
    run_dir = config.run.run_dir
    assert trained_steps(run_dir) == [1, 2, 3, 4]
    assert [path.name for path in list_checkpoints(run_dir / "checkpoints")] == ["step_00000004"]
    assert not (run_dir / "model").exists() and not (run_dir / "summary.json").exists()
