"""What a second `whetstone run` in the same folder takes from the first: an evaluation's report
only when it evaluated the same policy, and nothing from the orchestrator's last status."""

import json

import pytest
import torch

from whetstone.envs.eval import run as eval_run
from whetstone.run.config import PipelineConfig
from whetstone.run.pipeline import Pipeline
from whetstone.training.checkpoint import TrainState, save_checkpoint
from whetstone.training.optim import build_optimizer


class FakeRole:
    """A role process that is running, or has exited with `code`."""

    def __init__(self, name: str, running: bool, code: int = 0):
        self.name, self._running, self.code = name, running, code

    @property
    def running(self) -> bool:
        return self._running

    def stop(self, grace_s: float = 30.0) -> int:
        self._running = False
        return self.code

    def check(self) -> None:
        if not self._running and self.code:
            raise RuntimeError(f"{self.name} exited with code {self.code}")


def test_an_orchestrator_that_fails_is_not_taken_for_the_last_runs_stop(tmp_path):
    pipeline = Pipeline(PipelineConfig(output_dir=str(tmp_path), name="r"))
    status = tmp_path / "r" / "orchestrator" / "status.json"
    status.parent.mkdir(parents=True)
    status.write_text(json.dumps({"stopped": "the last run's: max_fruitless_batches"}))
    roles = {"trainer": FakeRole("trainer", True), "orchestrator": FakeRole("orchestrator", False, code=1)}
    pipeline.start = lambda name, *args, **kwargs: roles[name]
    pipeline.write_demos = lambda: None
    with pytest.raises(RuntimeError, match="orchestrator exited with code 1"):
        pipeline.rl()
    assert not status.exists()


def trainer_checkpoint(pipeline: Pipeline, step: int) -> None:
    torch.manual_seed(step)
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    save_checkpoint(pipeline.run_dir / "trainer" / "checkpoints", model, optimizer, TrainState(step=step), {}, keep=2)
    pipeline.rl_steps = step


def test_an_evaluation_is_run_again_when_the_policy_or_its_temperatures_changed(tmp_path, monkeypatch):
    pipeline = Pipeline(PipelineConfig(output_dir=str(tmp_path), name="r"))
    pipeline.model_dir.mkdir(parents=True)
    (pipeline.model_dir / "model.safetensors").write_bytes(b"mid-trained")
    runs = []

    def evaluate(config, tasks, description):
        report = {"pass_at_k": {"1": len(runs) / 10}, "temperatures": config.evaluated_temperatures}
        runs.append(description)
        out = tmp_path / "r" / "eval" / description.removeprefix("held-out eval (").removesuffix(")")
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report))
        return report

    monkeypatch.setattr(eval_run, "evaluate_with_progress", evaluate)
    monkeypatch.setattr(eval_run, "load_eval_tasks", lambda config: [])

    trainer_checkpoint(pipeline, 10)
    first = pipeline.evaluate("after", 1.5)
    assert pipeline.evaluate("after", 1.5) == first and len(runs) == 1  # the same policy: resumed past
    trainer_checkpoint(pipeline, 28)  # RL went further: another policy, another learned scale
    again = pipeline.evaluate("after", 1.8)
    assert len(runs) == 2 and again["temperatures"][-1] == pytest.approx(1.8)
    assert json.loads((tmp_path / "r" / "eval" / "after" / "evaluated.json").read_text())["weight_version"] == 28
    assert pipeline.evaluate("after", 1.8) == again and len(runs) == 2
    # the same checkpoint at other temperatures (another learned scale): evaluated again
    rescaled = pipeline.evaluate("after", 2.5)
    assert len(runs) == 3 and rescaled["temperatures"][-1] == pytest.approx(2.5)
    assert pipeline.evaluate("after", 2.5) == rescaled and len(runs) == 3

    pipeline.evaluate("before")
    assert pipeline.evaluate("before") is not None and len(runs) == 4
    (pipeline.model_dir / "model.safetensors").write_bytes(b"mid-trained again")  # a new mid-trained model
    rerun = Pipeline(PipelineConfig(output_dir=str(tmp_path), name="r"))
    rerun.evaluate("before")
    assert runs == ["held-out eval (after)"] * 3 + ["held-out eval (before)"] * 2
    # a report without a record of what it evaluated is not trusted either
    (tmp_path / "r" / "eval" / "before" / "evaluated.json").unlink()
    rerun.evaluate("before")
    assert len(runs) == 6


@pytest.mark.parametrize(
    "changed",
    [{"harness": {"max_turns": 2}}, {"eval": {"k": [1]}}, {"eval": {"rollout": {"sandbox": {"wall_clock_s": 5}}}}],
)
def test_what_an_evaluation_evaluated_names_its_harness_k_and_grading(tmp_path, changed):
    """A rerun with other harness limits, another k or other sandbox limits measures something
    else: its record differs, so the evaluation runs again rather than returning the last report."""

    def record(**settings):
        pipeline = Pipeline(PipelineConfig(output_dir=str(tmp_path), name="r", **settings))
        pipeline.model_digest = "same model"  # a cached property, set as if read
        return pipeline.evaluated("before", pipeline.eval_config("before", None))

    assert record() == record()
    assert record(**changed) != record()
    moved = record(eval={"rollout": {"sandbox": {"root_dir": str(tmp_path / "elsewhere")}, "concurrency": 3}})
    assert moved == record()  # where workspaces are kept, and how many run at once, change no result


def test_a_record_of_an_earlier_whetstone_is_matched_on_what_it_holds():
    """Records from before they named k, harness and grading: a run resumed across the upgrade is
    not evaluated again (before RL, past its first step, that would stop the run)."""
    from whetstone.run.pipeline import LATER_RECORD_KEYS, same_evaluation

    now = {"model_sha256": "m", "samples": 2, "k": [1], "harness": {"max_turns": 4}, "grading": {}}
    earlier = {key: value for key, value in now.items() if key not in LATER_RECORD_KEYS}
    assert same_evaluation(earlier, now) and same_evaluation(now, now)
    assert not same_evaluation({**earlier, "samples": 4}, now)  # what it does hold must match
    assert not same_evaluation({**now, "k": [1, 2]}, now) and not same_evaluation({}, now)


def test_the_evaluation_before_rl_is_not_run_against_rl_trained_weights(tmp_path, monkeypatch):
    """Once the weight store the servers follow holds a version past 0, a report before RL without
    a matching record is not evaluated again (it would measure RL-trained weights); one with a
    matching record is still resumed past."""
    from whetstone.errors import WhetstoneError
    from whetstone.run.pipeline import EVALUATED_FILE
    from whetstone.sync import Publisher, WeightStore

    pipeline = Pipeline(PipelineConfig(output_dir=str(tmp_path), name="r"))
    pipeline.model_dir.mkdir(parents=True)
    (pipeline.model_dir / "model.safetensors").write_bytes(b"mid-trained")
    runs = []

    def evaluate(config, tasks, description):
        runs.append(description)
        report = {"pass_at_k": {"1": 0.5}}
        (tmp_path / "r" / "eval" / "before").mkdir(parents=True, exist_ok=True)
        (tmp_path / "r" / "eval" / "before" / "report.json").write_text(json.dumps(report))
        return report

    monkeypatch.setattr(eval_run, "evaluate_with_progress", evaluate)
    monkeypatch.setattr(eval_run, "load_eval_tasks", lambda config: [])
    sync = pipeline.config.servers.serve.sync
    publisher = Publisher(WeightStore.open(sync), sync)
    publisher.publish({"w": torch.zeros(4)}, full=True)  # version 0: the mid-trained model
    first = pipeline.evaluate("before")
    assert len(runs) == 1
    publisher.publish({"w": torch.ones(4)})  # the trainer's first step
    assert pipeline.evaluate("before") == first and len(runs) == 1  # its record matches: resumed past
    swept = Pipeline(PipelineConfig(output_dir=str(tmp_path), name="r", eval={"temperatures": [0.5]}))
    with pytest.raises(WhetstoneError, match="holds RL-trained version 1"):  # settings other than its record's
        swept.evaluate("before")
    (tmp_path / "r" / "eval" / "before" / EVALUATED_FILE).unlink()  # a report of before the record
    with pytest.raises(WhetstoneError, match="holds RL-trained version 1"):
        pipeline.evaluate("before")
    assert len(runs) == 1


def test_an_evaluation_that_fails_after_writing_its_report_leaves_no_record_of_the_last_one(tmp_path, monkeypatch):
    """An evaluation writes report.json, then report.md: a failure between the two (a full disk, a
    Ctrl-C) leaves the new report, which a rerun with the last evaluation's settings must not take
    for that one's under its record."""

    def pipeline(temperatures):
        made = Pipeline(PipelineConfig(output_dir=str(tmp_path), name="r", eval={"temperatures": temperatures}))
        made.model_dir.mkdir(parents=True, exist_ok=True)
        (made.model_dir / "model.safetensors").write_bytes(b"mid-trained")
        return made

    failing = []

    def evaluate(config, tasks, description):
        report = {"pass_at_k": {"1": 0.5}, "temperatures": config.evaluated_temperatures}
        out = tmp_path / "r" / "eval" / "before"
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report))
        if failing:
            raise OSError("No space left on device: report.md")
        return report

    monkeypatch.setattr(eval_run, "evaluate_with_progress", evaluate)
    monkeypatch.setattr(eval_run, "load_eval_tasks", lambda config: [])
    assert pipeline([1.0, 0.5]).evaluate("before")["temperatures"] == [1.0, 0.5]
    failing.append(True)
    with pytest.raises(OSError, match="No space left"):
        pipeline([1.0, 0.2]).evaluate("before")
    failing.clear()
    assert pipeline([1.0, 0.5]).evaluate("before")["temperatures"] == [1.0, 0.5]  # evaluated again


def test_a_record_of_what_was_evaluated_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """evaluated.json on a full disk (as an evaluation's own report): an error naming the file and
    what to do, not a traceback; nor is a report left under a record of another evaluation."""
    import errno

    from whetstone.errors import WhetstoneError
    from whetstone.run import pipeline as pipeline_module

    pipeline = Pipeline(PipelineConfig(output_dir=str(tmp_path), name="r"))
    pipeline.model_dir.mkdir(parents=True)
    (pipeline.model_dir / "model.safetensors").write_bytes(b"mid-trained")
    monkeypatch.setattr(eval_run, "evaluate_with_progress", lambda config, tasks, description: {"pass_at_k": {}})
    monkeypatch.setattr(eval_run, "load_eval_tasks", lambda config: [])
    monkeypatch.setattr(pipeline, "check_serving_initial_weights", lambda folder: None)

    def full_disk(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pipeline_module, "atomic_write_json", full_disk)
    record = tmp_path / "r" / "eval" / "before" / "evaluated.json"
    with pytest.raises(WhetstoneError, match=f"^cannot write {record}: No space left on device: free space"):
        pipeline.evaluate("before")
    assert not record.exists()


def test_a_rerun_that_fails_leaves_no_summary_report_or_model_of_the_last_run(tmp_path, monkeypatch):
    """summary.json and report.html are written once every stage ran: those of the run before
    are removed when a run starts, so a run that fails does not show that run's results as its own."""
    from tests.run.run_support import tiny_run
    from whetstone.errors import WhetstoneError

    pipeline = Pipeline(tiny_run(tmp_path))
    pipeline.run_dir.mkdir(parents=True)
    (pipeline.run_dir / "summary.json").write_text(json.dumps({"heldout_pass1_after": 0.9}))
    (pipeline.run_dir / "report.html").write_text("<p>the last run's report</p>")
    (pipeline.run_dir / "model").mkdir()  # the last run's exported policy
    (pipeline.run_dir / "model" / "model.safetensors").write_bytes(b"the last run's policy")

    def midtrain_fails():
        raise WhetstoneError("mid-training failed")

    monkeypatch.setattr(pipeline, "midtrain", midtrain_fails)
    with pytest.raises(WhetstoneError, match="mid-training failed"):
        pipeline.run()
    assert sorted(p.name for p in pipeline.run_dir.iterdir()) == ["config.toml"]


class FinishedRole(FakeRole):
    """A role that has exited (with code 0) by the time the pipeline looks."""

    def __init__(self, name: str, *args, **kwargs):
        super().__init__(name, running=False)


def test_the_summary_counts_trainer_steps_as_the_report_does(tmp_path, monkeypatch):
    """A step the trainer replayed after a restart is logged twice (the second `replayed`): the
    summary's `trainer_steps_logged` counts it once, as the report's "trainer steps" do, and
    gives the replays apart; its rewards are those of the steps' first records."""
    from types import SimpleNamespace

    from whetstone.run.report import load_run

    pipeline = Pipeline(PipelineConfig(output_dir=str(tmp_path), name="r"))
    pipeline.start = FinishedRole
    pipeline.write_demos = lambda: None
    pipeline.sampler = SimpleNamespace(latest={}, check=lambda: None)  # no server to wait for
    metrics = pipeline.run_dir / "trainer" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    records = [
        {"step": 0, "reward_mean": 0.1},
        {"step": 1, "reward_mean": 0.2},
        {"step": 1, "reward_mean": 0.2, "replayed": True},  # the restart replays step 1
        {"step": 2, "reward_mean": 0.3},
    ]
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    rl = pipeline.rl()
    run = load_run(pipeline.run_dir)
    assert (rl["trainer_steps_logged"], rl["trainer_steps_replayed"]) == (len(run.trainer), run.replayed) == (3, 1)
    assert (rl["reward_first"], rl["reward_last"]) == (0.1, 0.3)
