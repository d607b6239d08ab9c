"""An update killed after it published its version and before it recorded that: a restart finds
the version in the weight store and says its events were trained on, not lost, names the update
in the next metrics record, and goes on with the moments of the version the update stepped from."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.online.online_fixtures import NO_GATE
from whetstone.online.loop import OnlineLoop


class Killed(BaseException):
    """The loop's process dying mid-update (SIGKILL, out of memory)."""


def kill(*args, **kwargs):
    raise Killed


def moments(loop: OnlineLoop) -> dict[str, torch.Tensor]:
    """Copies of the optimizer's state tensors, named by parameter and key."""
    names = {id(p): name for name, p in loop.model.named_parameters()}
    return {
        f"{names[id(p)]}.{key}": value.clone()
        for p, state in loop.optimizer.state.items()
        for key, value in state.items()
    }


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_the_events_of_an_update_killed_after_its_publish_are_not_said_lost(world, caplog, monkeypatch):
    world.feedback(16)
    monkeypatch.setattr(world.loop, "consumed", kill)  # after the publish, before state.json says it is done
    with pytest.raises(Killed):
        world.loop.update()
    assert world.loop.weights.latest() == 1
    with caplog.at_level(logging.WARNING, logger="whetstone.online"):
        restarted = OnlineLoop(world.config)
    assert "update 0 read feedback events 1..16 (16 events), trained on them and published version 1" in caplog.text
    assert "not trained on" not in caplog.text
    assert restarted.version == 1 and restarted.state["cursor"] == 16 and "lost_events" not in restarted.state
    world.feedback(16)
    record = restarted.update()
    assert "lost_events" not in record and record["update"] == 1 and record["version_before"] == 1


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_the_events_of_an_update_killed_while_publishing_are_said_lost(world, caplog, monkeypatch):
    world.feedback(16)
    monkeypatch.setattr(world.loop.publisher, "publish", kill)  # before the version is in the store
    with pytest.raises(Killed):
        world.loop.update()
    assert world.loop.weights.latest() == 0
    with caplog.at_level(logging.WARNING, logger="whetstone.online"):
        restarted = OnlineLoop(world.config)
    assert "update 0 read feedback events 1..16 (16 events) and did not finish" in caplog.text
    assert restarted.version == 0 and restarted.state["lost_events"] == 16


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_a_version_an_unrecorded_update_published_goes_on_with_the_moments_it_stepped_from(world, caplog, monkeypatch):
    world.feedback(16)
    assert world.loop.update()["decision"] == "published"  # version 1, checkpointed
    stepped_from = moments(world.loop)
    world.feedback(16)
    monkeypatch.setattr(world.loop, "checkpoint", kill)  # version 2 published, killed writing its checkpoint
    with pytest.raises(Killed):
        world.loop.update()
    assert world.loop.weights.latest() == 2

    with caplog.at_level(logging.INFO, logger="whetstone.online"):
        restarted = OnlineLoop(world.config)
    assert restarted.version == 2 and "fresh optimizer" not in caplog.text
    assert "version 2: the store's weights, with the optimizer moments of version 1" in caplog.text
    assert stepped_from and same_tensors(moments(restarted), stepped_from)  # not a fresh AdamW's
    assert same_tensors(restarted.model.state_dict(), world.loop.model.state_dict())  # version 2's weights
    assert (Path(world.config.output_dir) / "checkpoints" / "step_00000002").is_dir()  # for a later restart

    world.feedback(16)
    record = restarted.update()
    assert record["update"] == 2 and record["version_before"] == 2 and "lost_events" not in record
    assert record["unrecorded_updates"] == [{"update": 1, "version": 2, "events": 16}]
    assert "unrecorded_updates" not in restarted.state  # reported once
