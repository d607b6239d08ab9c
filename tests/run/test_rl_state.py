"""What a later `whetstone run` takes from the RL of an earlier one in its folder: RL goes on only
from state begun from the mid-trained model the folder holds now, and starting RL over, as the
run advises it, leaves nothing of the last RL to go on from (its batches least of all: a trainer
started afresh trains its step n on the batch store's batch n)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.run.run_support import tiny_run
from whetstone.envs.eval import run as eval_run
from whetstone.errors import WhetstoneError
from whetstone.rl.batch_store import batch_key, next_batch_index
from whetstone.run.config import PipelineConfig
from whetstone.run.pipeline import RL_MODEL_FILE, Pipeline
from whetstone.store import open_store
from whetstone.sync import Publisher, WeightStore


class ServersStarted(Exception):
    """Stands in for the servers' start: the run got past every check before it."""


def mid_trained(pipeline: Pipeline, weights: bytes) -> None:
    pipeline.model_dir.mkdir(parents=True, exist_ok=True)
    (pipeline.model_dir / "model.safetensors").write_bytes(weights)


def last_rl(pipeline: Pipeline, *, steps: int = 2) -> None:
    """An earlier RL in the run folder: weight versions 0..`steps`, the batches it trained on,
    a trainer metrics record and the orchestrator's."""
    sync = pipeline.config.servers.serve.sync
    publisher = Publisher(WeightStore.open(sync), sync)
    for version in range(steps + 1):
        publisher.publish({"w": torch.full((4,), float(version))}, full=version == 0)
    orchestrator = pipeline.config.rl.orchestrator
    batches = open_store(orchestrator.batch_store)
    for index in range(steps):
        batches.put(batch_key(index), b"the last RL's batch")
    for path in (Path(pipeline.config.rl.trainer.output_dir) / "metrics.jsonl", Path(orchestrator.metrics_path)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step": 0, "index": 0}) + "\n")


def follow_the_advice(message: str) -> None:
    """Remove what the error's "start RL over (remove A, B and C)" names."""
    named = re.search(r"start RL over \(remove (.*)\)$", message).group(1)
    *rest, last = named.split(" and ")
    for path in [*" and ".join(rest).split(", "), last]:
        shutil.rmtree(path, ignore_errors=True)  # as `rm -rf`: a path never made is no error


def test_starting_rl_over_as_advised_leaves_no_batch_of_the_last_rl(tmp_path, monkeypatch):
    """The evaluation before RL cannot run again once the trainer published (the servers follow
    the store): the way out it names removes the batch store too, or the orchestrator would put
    no batch (its next index past `rl.steps`) and a fresh trainer train on the last RL's."""
    pipeline = Pipeline(PipelineConfig(output_dir=str(tmp_path), name="r", eval={"temperatures": [0.5]}))
    mid_trained(pipeline, b"mid-trained")
    last_rl(pipeline)
    monkeypatch.setattr(eval_run, "load_eval_tasks", lambda config: [])
    with pytest.raises(WhetstoneError, match="holds RL-trained version 2") as refused:
        pipeline.evaluate("before")
    follow_the_advice(str(refused.value))
    orchestrator = pipeline.config.rl.orchestrator
    assert next_batch_index(open_store(orchestrator.batch_store)) == 0
    assert WeightStore.open(pipeline.config.servers.serve.sync).latest() is None
    assert not Path(pipeline.config.rl.trainer.output_dir).exists()
    assert not Path(orchestrator.metrics_path).exists()  # no record of the last RL's batches in the report


def run_until_the_servers(pipeline: Pipeline, monkeypatch) -> Exception:
    """What `pipeline.run()` ends with, mid-training done already and the servers' start stood in
    for (`ServersStarted`: it got that far)."""

    def start_servers():
        raise ServersStarted

    monkeypatch.setattr(pipeline, "midtrain", lambda: {})
    monkeypatch.setattr(pipeline, "start_servers", start_servers)
    with pytest.raises((ServersStarted, WhetstoneError)) as ended:
        pipeline.run()
    return ended.value


def runs_until_the_servers(pipeline: Pipeline, monkeypatch) -> None:
    assert isinstance(run_until_the_servers(pipeline, monkeypatch), ServersStarted)


def refused(pipeline: Pipeline, monkeypatch, match: str) -> str:
    """The error `pipeline.run()` stops with before the servers start, matching `match`."""
    error = run_until_the_servers(pipeline, monkeypatch)
    assert isinstance(error, WhetstoneError) and re.search(match, str(error)), error
    return str(error)


@pytest.mark.parametrize("left", ["weight version 0", "a trainer checkpoint", "a batch"])
def test_rl_state_of_another_mid_trained_model_is_refused_naming_what_to_remove(tmp_path, monkeypatch, left):
    """After mid-training made another model (`--midtrain-only`, other settings), the trainer
    would resume a checkpoint of the last one and the servers load the store's weights of it
    (version 0 alone too: a server starting empty loads the newest keyframe). Refused before the
    servers start; once RL is started over as the error says, the run goes on."""
    first = Pipeline(tiny_run(tmp_path))
    mid_trained(first, b"mid-trained")
    runs_until_the_servers(first, monkeypatch)
    if left == "weight version 0":
        sync = first.config.servers.serve.sync
        Publisher(WeightStore.open(sync), sync).publish({"w": torch.zeros(4)}, full=True)
    elif left == "a trainer checkpoint":
        checkpoint = Path(first.config.rl.trainer.output_dir) / "checkpoints" / "step_00000002"
        checkpoint.mkdir(parents=True)
        (checkpoint / "state.json").write_text("{}")
    else:
        open_store(first.config.rl.orchestrator.batch_store).put(batch_key(0), b"rollouts of the last model")
    runs_until_the_servers(Pipeline(tiny_run(tmp_path)), monkeypatch)  # the same model: RL goes on

    again = Pipeline(tiny_run(tmp_path))
    mid_trained(again, b"mid-trained with other settings")
    message = refused(again, monkeypatch, r"RL's state in .* began from the mid-trained model of sha256")
    assert first.model_digest in message and again.model_digest in message
    follow_the_advice(message)
    runs_until_the_servers(again, monkeypatch)
    assert json.loads((again.run_dir / RL_MODEL_FILE).read_text())["model_sha256"] == again.model_digest


def test_rl_state_without_a_record_of_its_model_is_refused(tmp_path, monkeypatch):
    """Nothing in the trainer's checkpoints or the stores says which model RL began from; an
    empty store folder (opened by a run that stopped before RL) is no state."""
    pipeline = Pipeline(tiny_run(tmp_path))
    mid_trained(pipeline, b"mid-trained")
    open_store(pipeline.config.rl.orchestrator.weight_store)  # created empty
    runs_until_the_servers(pipeline, monkeypatch)
    (pipeline.run_dir / RL_MODEL_FILE).unlink(missing_ok=True)
    last_rl(pipeline)
    rerun = Pipeline(tiny_run(tmp_path))
    refused(rerun, monkeypatch, f"has no record of the mid-trained model it began from .*{RL_MODEL_FILE}")
