"""An update killed after it published its version and before it recorded that: a restart finds
the version in the weight store and says its events were trained on, not lost."""

from __future__ import annotations

import logging

import pytest

from tests.online.online_fixtures import NO_GATE
from whetstone.online.loop import OnlineLoop


class Killed(BaseException):
    """The loop's process dying mid-update (SIGKILL, out of memory)."""


def kill(*args, **kwargs):
    raise Killed


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
