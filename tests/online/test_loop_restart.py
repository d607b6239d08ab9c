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
from whetstone.online.loop import OnlineLoop
from whetstone.online.samples import feedback_batch
from whetstone.online.weights import rollback
from whetstone.store.feedback import FeedbackStore
from whetstone.utils.metrics import read_metrics

BF16_STORE = NO_GATE | {"sync": {"publish_dtype": "bfloat16"}}
"""Published weights are bf16 copies of the masters: a restart from them alone would lose bits."""


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def moments(loop: OnlineLoop) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors, named by parameter and key."""
    names = {id(p): name for name, p in loop.model.named_parameters()}
    return {f"{names[id(p)]}.{key}": value for p, state in loop.optimizer.state.items() for key, value in state.items()}


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
