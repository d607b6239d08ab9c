"""A resuming trainer decides whether the weight store is its run's from what it reads: another
run's store is refused as it is, byte for byte, and the run's own is healed only once it passed
(a pointer a crash left behind its newest manifest, a withdrawal whose process died)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.sync.test_healed_head import snapshot
from tests.sync.test_repair import Dying
from tests.trainer.trainer_fixtures import put_batches, trainer_config
from whetstone.errors import CheckpointError, ConfigError
from whetstone.run.report import load_run
from whetstone.store import LocalStore
from whetstone.sync import WeightStore
from whetstone.sync.weight_store import Head
from whetstone.trainer.loop import run_trainer
from whetstone.trainer.setup import open_trainer
from whetstone.training.checkpoint import latest_checkpoint
from whetstone.utils.metrics import read_metrics


@pytest.fixture
def run(tmp_path, tiny_moe, batches):
    """A run that trained 4 steps (checkpoints at steps 2 and 4) and published versions 0..4."""
    put_batches(tmp_path / "batches", batches[:4])
    assert run_trainer(trainer_config(tmp_path, tiny_moe, max_steps=4, checkpoint_interval=2))["step"] == 4
    return tmp_path


def point_at(weights: WeightStore, version: int) -> None:
    """The pointer as a publisher that died between a later manifest and the pointer left it."""
    pointer = {"version": version, "manifest": weights.manifest_digest(version)}
    weights.objects.put("latest.json", json.dumps(pointer).encode())


def withdraw_dying(weights_root, first: int, dies_at: int) -> WeightStore:
    """`withdraw(first)` died at its `dies_at`-th write or delete: its record stands."""
    weights = WeightStore(Dying(weights_root))
    weights.objects.dies_at = dies_at
    with pytest.raises(RuntimeError):
        weights.withdraw(first)
    assert weights.withdrawal() == first
    return WeightStore(LocalStore(weights_root))


def other_store(run, name: str, state: str) -> WeightStore:
    """Another run's weight store (made from a copy of `run`'s) in `state`: it reaches version 2
    with its pointer behind at 1, or it holds 0..4 with a withdrawal of 2.. whose process died
    right after its record (the pointer still names 4) or after moving the pointer."""
    shutil.copytree(run / "weights", run / name)
    weights = WeightStore(LocalStore(run / name))
    if state == "pointer behind":
        for version in (4, 3):
            weights.delete_version(version)
        point_at(weights, 1)
        return weights
    return withdraw_dying(run / name, 2, {"withdrawal, pointer unmoved": 2, "withdrawal, pointer moved": 3}[state])


@pytest.mark.parametrize("state", ["pointer behind", "withdrawal, pointer unmoved", "withdrawal, pointer moved"])
def test_another_runs_store_is_refused_unchanged(run, tiny_moe, state):
    weights = other_store(run, "other", state)
    before = snapshot(run / "other")
    reaches = 2 if state == "pointer behind" else 1
    config = trainer_config(run, tiny_moe, max_steps=4, sync={"store": str(run / "other"), "publish_dtype": "float32"})
    with pytest.raises(CheckpointError, match=rf"at step 4, .* only reaches version {reaches}: not this run's store"):
        run_trainer(config)
    assert snapshot(run / "other") == before
    assert weights.healed_head().version == reaches  # as the trainer read it


def test_a_store_past_max_steps_is_refused_unchanged(run, tiny_moe):
    """The run's store with the newest checkpoint lost and the pointer behind version 4's manifest."""
    shutil.rmtree(latest_checkpoint(run / "trainer" / "checkpoints"))  # back to step 2
    point_at(WeightStore(LocalStore(run / "weights")), 2)
    before = snapshot(run / "weights")
    with pytest.raises(ConfigError, match=r"max_steps = 3, but the weight store .* already holds version 4"):
        run_trainer(trainer_config(run, tiny_moe, max_steps=3, checkpoint_interval=2))
    assert snapshot(run / "weights") == before


def test_the_runs_own_store_is_healed_and_its_newest_version_replayed(run, tiny_moe):
    """Its pointer left behind version 4's manifest by a crash: 4 is the run's newest, steps 2 and
    3 are replayed, and setup moves the pointer."""
    shutil.rmtree(latest_checkpoint(run / "trainer" / "checkpoints"))  # back to step 2
    weights = WeightStore(LocalStore(run / "weights"))
    newest = Head(4, weights.manifest_digest(4))
    point_at(weights, 3)
    session = open_trainer(trainer_config(run, tiny_moe, max_steps=4, checkpoint_interval=2))
    assert session.state.step == 2 and session.replay_until == 4
    assert weights.head() == newest and weights.versions() == [0, 1, 2, 3, 4]


def test_the_runs_own_store_with_a_standing_withdrawal_is_finished_and_replayed_to_before_it(run, tiny_moe):
    shutil.rmtree(latest_checkpoint(run / "trainer" / "checkpoints"))  # back to step 2
    weights = withdraw_dying(run / "weights", 4, dies_at=2)  # the record only: the pointer still names 4
    kept = Head(3, weights.manifest_digest(3))
    config = trainer_config(run, tiny_moe, max_steps=4, checkpoint_interval=2)
    session = open_trainer(config)
    assert session.state.step == 2 and session.replay_until == 3
    assert weights.withdrawal() is None and weights.head() == kept and weights.versions() == [0, 1, 2, 3]

    # step 3 is trained again (its version 4 withdrawn), step 2 replayed: step 3's earlier record,
    # of the withdrawn version, goes; the records of the steps before stay as they were written
    metrics = run / "trainer" / "metrics.jsonl"
    before = metrics.read_bytes()
    assert [r["step"] for r in read_metrics(metrics)] == [0, 1, 2, 3]
    assert run_trainer(config)["version"] == 4
    records = read_metrics(metrics)
    assert [(r["step"], r["replayed"], r.get("version")) for r in records] == [
        (0, False, 1),
        (1, False, 2),
        (2, False, 3),
        (2, True, None),
        (3, False, 4),
    ]
    assert metrics.read_bytes().startswith(b"".join(before.splitlines(keepends=True)[:3]))
    assert [r["step"] for r in load_run(run).trainer] == [0, 1, 2, 3]  # what the report reads
