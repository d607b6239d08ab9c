"""A restarted loop continues where it stopped: its cursor, and the fp32 masters and AdamW moments
of the version it last published, so its next update is the one an uninterrupted loop would take.
Masters and moments of another version (or store) are never mixed with the store's weights."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from tests.online.online_fixtures import NO_GATE
from whetstone.errors import WhetstoneError
from whetstone.model.hf import load_hf
from whetstone.online.loop import OnlineLoop
from whetstone.online.samples import feedback_batch
from whetstone.online.weights import rollback
from whetstone.store.feedback import FeedbackStore
from whetstone.sync import Publisher, SyncConfig, WeightStore
from whetstone.utils.metrics import read_metrics

BF16_STORE = NO_GATE | {"sync": {"publish_dtype": "bfloat16"}}
"""Published weights are bf16 copies of the masters: a restart from them alone would lose bits."""


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def moments(loop: OnlineLoop) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors, named by parameter and key."""
    names = {id(p): name for name, p in loop.model.named_parameters()}
    return {f"{names[id(p)]}.{key}": value for p, state in loop.optimizer.state.items() for key, value in state.items()}


def publish_model(sync: SyncConfig, model_path: str, versions: int) -> None:
    """Publish `model_path`'s weights `versions` times into `sync.store` (versions of another run)."""
    publisher = Publisher(WeightStore.open(sync), sync)
    for _ in range(versions):
        publisher.publish(load_hf(model_path).state_dict(), full=True)


def next_batch(world):
    """The batch of the feedback the loop has not read yet."""
    rated = FeedbackStore.open(world.config.feedback_store).rated_after(world.loop.state["cursor"], 64)
    return feedback_batch(rated, world.config, world.loop.version).batch


@pytest.mark.parametrize(
    "world", [BF16_STORE, BF16_STORE | {"logit_scale_lr": 0.0}], indirect=True, ids=["logit-scale", "no-logit-scale"]
)
def test_a_restarted_loop_takes_the_same_next_update_as_an_uninterrupted_one(world):
    world.feedback(16)
    assert world.loop.update()["decision"] == "published"  # version 1, with Adam moments
    world.feedback(16)
    batch = next_batch(world)

    restarted = OnlineLoop(world.config)
    assert restarted.version == 1 and restarted.state == world.loop.state
    assert same_tensors(moments(restarted), moments(world.loop)) and moments(restarted)
    assert same_tensors(restarted.model.state_dict(), world.loop.model.state_dict())  # fp32, not the bf16 copy
    if world.config.logit_scale_lr:  # the learned scale's moments come back too
        assert restarted.logit_scale.state() == world.loop.logit_scale.state() and world.loop.logit_scale.steps == 1

    shutil.rmtree(Path(world.config.output_dir) / "checkpoints")
    fresh = OnlineLoop(world.config)  # what a restart did before: the store's bf16 weights, no moments
    assert moments(fresh) == {}

    for loop in (world.loop, restarted, fresh):
        loop.step(batch)
    assert same_tensors(restarted.model.state_dict(), world.loop.model.state_dict())
    assert not same_tensors(fresh.model.state_dict(), world.loop.model.state_dict())


@pytest.mark.parametrize("world", [NO_GATE | {"logit_scale_lr": 0.2, "loss": {"kl_coef": 0.1}}], indirect=True)
def test_a_restarted_loops_kl_reference_is_its_policy_before_the_learned_scale(world):
    # the step applies the scale to the reference's logits, so the reference must not carry it
    from whetstone.trainer.step import StepSettings, _reference_logprobs, forward_logprobs

    world.feedback(16)
    assert world.loop.update()["decision"] == "published"
    restarted = OnlineLoop(world.config)
    assert restarted.logit_scale.log_scale != 0
    world.feedback(16)
    batch, settings = next_batch(world), StepSettings.of(world.config)
    with torch.no_grad():
        policy = forward_logprobs(restarted.model, batch, settings.replay, settings.dtype, settings.numerics)
        reference = _reference_logprobs(restarted.reference, batch, settings, restarted.logit_scale)
    assert torch.allclose(policy.logprobs, reference, atol=1e-5)


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_a_rollback_published_while_the_loop_adopts_a_version_is_adopted(world, monkeypatch):
    import whetstone.online.loop as loop_module

    world.feedback(16)
    assert world.loop.update()["decision"] == "published"  # version 1
    rollback(world.config.sync, 0)  # version 2
    load, landed = loop_module.load_version, []

    def load_then_roll_back(*args):  # an operator's second rollback lands during the adoption
        state = load(*args)
        if not landed:
            landed.append(rollback(world.config.sync, 1).version)
        return state

    monkeypatch.setattr(loop_module, "load_version", load_then_roll_back)
    assert [world.loop.follow_store()] == landed == [3]
    assert same_tensors(
        world.loop.model.state_dict(), loop_module.load_version(world.loop.weights, world.config.sync, 3)
    )


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_masters_and_moments_of_other_weights_are_not_resumed(world, caplog):
    world.feedback(16)
    world.loop.update()  # checkpoint of version 1
    rollback(world.config.sync, 0)  # version 2 = version 0's weights
    checkpoints = Path(world.config.output_dir) / "checkpoints"
    (checkpoints / "step_00000001").rename(checkpoints / "step_00000002")  # e.g. another store's version 2
    state = json.loads((checkpoints / "step_00000002" / "state.json").read_text())
    (checkpoints / "step_00000002" / "state.json").write_text(json.dumps(state | {"step": 2}))

    with caplog.at_level(logging.INFO, logger="whetstone.online"):
        restarted = OnlineLoop(world.config)
    assert restarted.version == 2 and moments(restarted) == {}
    assert "a fresh optimizer" in caplog.text and "is not of the store's version 2" in caplog.text

    (checkpoints / "step_00000002" / "optimizer.safetensors").write_bytes(b"torn")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="whetstone.online"):
        assert moments(OnlineLoop(world.config)) == {}
    assert "is corrupt" in caplog.text


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_a_loop_whose_state_json_is_gone_numbers_its_updates_on(world, caplog):
    """state.json moved away (as the loop asks when its feedback store was recreated) or lost:
    the next update is not numbered 0 again beside the records of updates 0.. in metrics.jsonl
    (and their TensorBoard and W&B steps)."""
    folder = Path(world.config.output_dir)
    world.feedback(16)
    assert OnlineLoop(world.config.model_copy(update={"max_updates": 1})).run()["updates"] == 1
    (folder / "state.json").rename(folder / "state.json.old")
    with caplog.at_level(logging.WARNING, logger="whetstone.online"):
        restarted = OnlineLoop(world.config.model_copy(update={"max_updates": 2}))
    assert restarted.state["updates"] == 1 and restarted.state["cursor"] == 16  # the store's consumed mark
    assert f"numbering updates from 1, after the newest in {folder / 'metrics.jsonl'}" in caplog.text
    world.feedback(16)
    assert restarted.run()["updates"] == 2
    assert [record["update"] for record in read_metrics(folder / "metrics.jsonl")] == [0, 1]


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
@pytest.mark.parametrize(
    ("versions", "problem"), [(3, "its version 1 is another publish (manifest "), (1, "its version 1 is not in it")]
)
def test_another_weight_store_than_the_loops_is_refused_naming_both(world, tmp_path, versions, problem):
    """state.json's lineage (whose weights each version holds) is of the store the loop
    published to: a restarted loop refuses another run's store, ahead of it or behind."""
    world.feedback(16)
    assert world.loop.update()["version"] == 1
    folder, config = Path(world.config.output_dir), world.config
    ours = str(Path(config.sync.store).resolve())
    config = config.model_copy(update={"sync": config.sync.model_copy(update={"store": str(tmp_path / "other")})})
    publish_model(config.sync, config.model_path, versions)
    here = str(Path(config.sync.store).resolve())

    with pytest.raises(WhetstoneError) as refused:
        OnlineLoop(config)
    message = str(refused.value)
    assert f"the weight store {here} is not the one this loop published to" in message
    assert "continues version 1 (manifest " in message and f"of the weight store {ours}, and {problem}" in message
    assert f"point sync.store at it; to go on with this one, move {folder / 'state.json'} away" in message
    assert WeightStore.open(config.sync).versions() == list(range(versions))  # nothing published into it

    (folder / "state.json").rename(folder / "state.json.old")  # what the message says to do
    assert OnlineLoop(config).state["updates"] == 1  # numbered on after the update before


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
@pytest.mark.parametrize(("versions", "problem"), [(3, "another publish (manifest "), (1, "not in it")])
def test_the_loops_own_store_changed_while_it_was_stopped_is_followed_saying_so(world, versions, problem, caplog):
    """The same location is the loop's own store whatever happened to it meanwhile (republished
    as the documented repair does, or wiped): the loop goes on from its newest version, as a
    running loop follows the store."""
    world.feedback(16)
    assert world.loop.update()["version"] == 1
    config = world.config
    shutil.rmtree(config.sync.store)
    Path(config.sync.store).mkdir()
    publish_model(config.sync, config.model_path, versions)
    with caplog.at_level(logging.WARNING, logger="whetstone.online"):
        restarted = OnlineLoop(config)
    assert f"changed while the loop was stopped: its version 1 is {problem}" in caplog.text
    assert restarted.version == versions - 1
    world.feedback(16)
    assert restarted.update()["version"] == versions


@pytest.mark.parametrize("world", [NO_GATE | {"sync": {"keyframe_interval": 1}}], indirect=True)
def test_the_loops_weight_store_moved_or_its_version_collected_is_taken(world, tmp_path):
    world.feedback(16)
    assert world.loop.update()["version"] == 1
    moved = world.config.sync.model_copy(update={"store": str(tmp_path / "moved")})
    shutil.copytree(world.config.sync.store, moved.store)  # the same publishes elsewhere
    assert OnlineLoop(world.config.model_copy(update={"sync": moved})).version == 1

    rollback(world.config.sync, 0)  # versions 2 and 3, then version 1 collected while the loop is stopped
    rollback(world.config.sync, 1)
    assert WeightStore.open(world.config.sync).collect_garbage(keep_keyframes=1) == [0, 1, 2]
    assert OnlineLoop(world.config).version == 3


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_a_loop_that_lost_state_json_and_metrics_numbers_its_updates_after_its_checkpoints(world, caplog):
    """Without state.json and metrics.jsonl, the checkpoints say how many updates the loop took:
    its next update is not numbered 0 again beside the versions it published."""
    folder = Path(world.config.output_dir)
    for version in (1, 2):
        world.feedback(16)
        assert world.loop.update()["version"] == version
    (folder / "state.json").unlink()
    (folder / "metrics.jsonl").unlink(missing_ok=True)  # update() writes none: run() does
    with caplog.at_level(logging.WARNING, logger="whetstone.online"):
        restarted = OnlineLoop(world.config)
    checkpoint = folder / "checkpoints" / "step_00000002"
    assert (
        restarted.state["updates"] == 2
        and f"numbering updates from 2, after the newest in checkpoint {checkpoint}" in caplog.text
    )
    world.feedback(16)
    assert restarted.update()["update"] == 2

    # a checkpoint of an older whetstone, without the count, says nothing: its version need not be one (another
    # loop, or the RL trainer, may have published the versions before)
    (folder / "state.json").unlink()
    newest = folder / "checkpoints" / "step_00000003"
    state = json.loads((newest / "state.json").read_text())
    del state["data"]["updates"]
    (newest / "state.json").write_text(json.dumps(state))
    assert OnlineLoop(world.config).state["updates"] == 2
