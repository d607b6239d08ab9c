"""What an earlier run leaves in a run folder must not pass for the results of a later
`whetstone run` there: the exported model of a rerun that failed, a whole run's results after its
mid-trained model was replaced by `--midtrain-only`, and an older orchestrator's metrics when RL
explains why it made no step."""

import json

import pytest
from typer.testing import CliRunner

from tests.run.run_support import tiny_run, tiny_settings
from whetstone.cli import app
from whetstone.rl.batch_store import batch_key
from whetstone.run.local_ranks import PLACED_RANK_ENV
from whetstone.run.pipeline import Pipeline
from whetstone.store import open_store


def last_results(run_dir):
    """A finished run's results in `run_dir`: summary.json, report.html and the exported model/."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps({"heldout_pass1_after": 0.9}))
    (run_dir / "report.html").write_text("<p>the last run's report</p>")
    (run_dir / "model").mkdir()
    (run_dir / "model" / "model.safetensors").write_bytes(b"the last run's policy")


def test_mid_training_from_the_runs_own_exported_model_is_refused_before_it_is_removed(tmp_path):
    from whetstone.errors import ConfigError

    exported = tmp_path / "runs" / "tiny" / "model"
    last_results(exported.parent)
    (exported / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"midtrain\.run\.init_from: .* is in .*, the run's exported model"):
        Pipeline(tiny_run(tmp_path, f'midtrain.run.init_from="{exported}"')).run()
    assert (exported / "model.safetensors").read_bytes() == b"the last run's policy"


@pytest.mark.parametrize("retrained", [True, False], ids=["a new mid-trained model", "the same one"])
def test_mid_training_alone_removes_the_results_of_another_mid_trained_model(tmp_path, monkeypatch, retrained):
    """The results stay while they are of the mid-trained model in the folder."""
    settings = tiny_settings(tmp_path)
    pipeline = Pipeline(tiny_run(tmp_path))
    last_results(pipeline.run_dir)
    pipeline.model_dir.mkdir(parents=True)
    (pipeline.model_dir / "model.safetensors").write_bytes(b"mid-trained")

    def midtrain(self):
        if retrained:
            (self.model_dir / "model.safetensors").write_bytes(b"mid-trained further")
        return {"rank": 0}

    monkeypatch.setattr(Pipeline, "midtrain", midtrain)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv(PLACED_RANK_ENV, raising=False)
    result = CliRunner().invoke(app, ["run", "--midtrain-only", "--json", *(f"--set={s}" for s in settings)])
    assert result.exit_code == 0, result.output
    left = sorted(p.name for p in pipeline.run_dir.iterdir())
    assert left == (["midtrain"] if retrained else ["midtrain", "model", "report.html", "summary.json"])


class FakeRole:
    """A role process that runs until it is stopped."""

    def __init__(self, name: str):
        self.name, self.running = name, True

    def stop(self, grace_s: float = 30.0) -> int:
        self.running = False
        return 0

    def check(self) -> None:
        pass


@pytest.mark.parametrize("batch_zero", [False, True], ids=["no batch", "batch 0 in the store"])
def test_rl_without_a_step_is_explained_by_the_batch_store_not_older_metrics(tmp_path, batch_zero):
    """The batch store was emptied for RL to start over, the orchestrator's metrics of its batches
    kept: no batch 0 is the orchestrator's doing, whatever those metrics count."""
    pipeline = Pipeline(tiny_run(tmp_path, "rl.max_wall_time=0.5"))
    metrics = pipeline.run_dir / "orchestrator" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text('{"index": 0}\n{"index": 1}\n')  # batches the emptied store held
    if batch_zero:
        open_store(pipeline.config.rl.orchestrator.batch_store).put(batch_key(0), b"batch")
    pipeline.start = lambda name, *args, **kwargs: FakeRole(name)
    pipeline.write_demos = lambda: None
    rl = pipeline.rl()
    assert rl["steps"] == 0
    if batch_zero:
        assert rl["no_step_reason"] == (
            "the trainer did not finish its first step in 0.5 s (1 batch(es) put): raise rl.max_wall_time"
        )
    else:
        assert rl["no_step_reason"] == "the orchestrator put no batch in 0.5 s: no group of rollouts finished"
