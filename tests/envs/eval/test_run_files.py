"""The files `evaluate` leaves in its output_dir: report.json appears only beside the trajectories
and report.md of the same evaluation, whatever fails on the way and whatever an earlier
evaluation left there. The rollouts are stood in for: what is checked is what gets written."""

from __future__ import annotations

import errno
import json

import pytest

from whetstone.envs.eval import run as eval_run
from whetstone.envs.eval.config import EvalConfig
from whetstone.envs.trajectory import Trajectory, load_trajectories
from whetstone.errors import WhetstoneError

OLD = {"model": "the-last-evaluation"}


def earlier_evaluation(out):
    """A folder holding a complete earlier evaluation."""
    out.mkdir()
    (out / "report.json").write_text(json.dumps(OLD))
    (out / "report.md").write_text("# Evaluation of `the-last-evaluation`\n")
    (out / "trajectories.jsonl").write_text(Trajectory(task_id="old", solved=True).model_dump_json() + "\n")


@pytest.fixture
def rollouts(monkeypatch):
    async def fake(config, tasks, on_done):
        return {config.evaluated_temperatures[0]: [Trajectory(task_id="new", solved=False)]}, "the-new-model"

    monkeypatch.setattr(eval_run, "_rollouts", fake)


def config(out, **fields) -> EvalConfig:
    return EvalConfig(output_dir=str(out), samples=1, k=[1], **fields)


@pytest.mark.parametrize("failing", ["trajectories.jsonl", "report.json", "report.md"])
def test_a_failed_write_leaves_no_report_json_of_another_evaluation(tmp_path, monkeypatch, rollouts, failing):
    out = tmp_path / "eval"
    earlier_evaluation(out)
    writers = {"atomic_write_text": eval_run.atomic_write_text, "atomic_write_json": eval_run.atomic_write_json}

    def failing_writer(name):
        def write(path, *args):
            if path.name == failing:
                raise OSError(errno.ENOSPC, "No space left on device")
            return writers[name](path, *args)

        return write

    for name in writers:
        monkeypatch.setattr(eval_run, name, failing_writer(name))
    monkeypatch.setattr(
        eval_run,
        "save_trajectories",
        lambda path, ts: eval_run.atomic_write_text(path, "".join(t.model_dump_json() + "\n" for t in ts)),
    )
    with pytest.raises(WhetstoneError, match=failing):
        eval_run.evaluate(config(out), [])
    # report.json marks a finished evaluation: it is absent, not the last one's beside this one's files
    assert not (out / "report.json").exists()


def test_an_evaluation_that_saves_no_trajectories_leaves_none_of_an_earlier_one(tmp_path, rollouts):
    out = tmp_path / "eval"
    earlier_evaluation(out)
    report = eval_run.evaluate(config(out, save_trajectories=False), [])
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))
    assert "the-new-model" in (out / "report.md").read_text()
    assert not (out / "trajectories.jsonl").exists()


def test_a_finished_evaluation_writes_all_three_files_of_itself(tmp_path, rollouts):
    out = tmp_path / "eval"
    earlier_evaluation(out)
    eval_run.evaluate(config(out), [])
    assert json.loads((out / "report.json").read_text())["model"] == "the-new-model"
    assert "the-new-model" in (out / "report.md").read_text()
    assert [t.task_id for t in load_trajectories(out / "trajectories.jsonl")] == ["new"]


def test_the_report_shows_no_password_of_a_server_address(tmp_path, rollouts):
    out = tmp_path / "eval"
    eval_run.evaluate(config(out, servers=["http://eval:hunter2@10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"]), [])
    for name in ("report.json", "report.md"):
        text = (out / name).read_text()
        assert "hunter2" not in text and "http://eval:***@10.0.0.1:8000/v1" in text, name
    report = json.loads((out / "report.json").read_text())
    assert report["endpoint"] == "http://eval:***@10.0.0.1:8000/v1, http://10.0.0.2:8000/v1"
