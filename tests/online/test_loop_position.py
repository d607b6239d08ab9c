"""The loop's position in the feedback store: tied to that store (a recreated or restored database
is refused, not silently skipped), never reading an event twice (a new output_dir), saying which
events a killed update lost, riding out a failing database, and pruning by the database's clock."""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
import time
from pathlib import Path

import pytest

from tests.online.online_fixtures import NO_GATE
from whetstone.errors import WhetstoneError
from whetstone.online.loop import OnlineLoop
from whetstone.store.feedback import FeedbackStore, FeedbackStoreError


def remove_database(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def corrupt(path: Path) -> None:
    """Overwrite the SQLite file's header (its journal checkpointed first)."""
    connection = sqlite3.connect(path)
    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    connection.close()
    with open(path, "r+b") as file:
        file.write(b"garbage!" * 64)


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_a_recreated_feedback_store_is_refused_naming_both_ids(world):
    world.feedback(16)
    assert world.loop.update()["events"] == 16  # the cursor is at event 16 of this database
    path, old = Path(world.config.feedback_store), FeedbackStore.open(world.config.feedback_store).marks().store_id
    responses = [event.response for event in world.loop.feedback.rated_after(0, 4)]
    remove_database(path)
    server = FeedbackStore.open(str(path))  # a server creates it anew: events numbered from 1 again
    server.record(responses)
    for response in responses:
        server.add_feedback(response.response_id, response.choice, "thumbs_up")
    new = server.marks().store_id

    for check in (world.loop.due, lambda: OnlineLoop(world.config)):  # the running loop, and a restarted one
        with pytest.raises(WhetstoneError) as refused:
            check()
        message = str(refused.value)
        assert f"its id is {new}" in message and f"(event 16) in the store with id {old}" in message
        assert "recreated or replaced" in message and "state.json away" in message
    state = Path(world.config.output_dir) / "state.json"
    state.rename(state.with_suffix(".old"))  # what the message says to do: read the new database
    fresh = OnlineLoop(world.config)
    assert fresh.state["store"] == new and len(fresh.read_feedback()[0]) == 4


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_a_feedback_store_restored_from_an_older_copy_is_refused(world, tmp_path):
    world.feedback(8)
    path, backup = Path(world.config.feedback_store), tmp_path / "backup.db"
    with sqlite3.connect(path) as source, sqlite3.connect(backup) as copy:
        source.backup(copy)  # events 1-8
    world.feedback(8)
    world.loop.update()  # the cursor is at event 16
    remove_database(path)
    shutil.copy(backup, path)
    with pytest.raises(WhetstoneError) as refused:
        world.loop.due()
    assert "holds events up to 8, but this loop has read up to event 16" in str(refused.value)
    assert "restored from an older copy" in str(refused.value)


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_a_loop_without_a_state_starts_after_the_events_a_loop_read(world, tmp_path, caplog):
    world.feedback(16)
    world.loop.update()
    assert FeedbackStore.open(world.config.feedback_store).marks().consumed == 16
    elsewhere = world.config.model_copy(update={"output_dir": str(tmp_path / "online-new")})  # or state.json lost
    with caplog.at_level(logging.WARNING, logger="whetstone.online"):
        fresh = OnlineLoop(elsewhere)
    assert fresh.state["cursor"] == 16 and not fresh.due() and fresh.read_feedback() == ([], 0)
    assert "starting after feedback event 16" in caplog.text
    world.feedback(16)
    assert fresh.update()["events"] == 16  # the new events only
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="whetstone.online"):
        assert world.loop.due() is False  # the first loop skips what the second read, and says so
    assert world.loop.state["cursor"] == 32 and "were read by another online loop" in caplog.text


class Killed(BaseException):
    """The loop's process dying mid-update (SIGKILL, out of memory)."""


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_the_events_of_an_update_that_did_not_finish_are_said_lost(world, caplog, monkeypatch):
    world.feedback(16)

    def killed(batch):
        raise Killed

    monkeypatch.setattr(world.loop, "step", killed)
    with pytest.raises(Killed):
        world.loop.update()
    with caplog.at_level(logging.WARNING, logger="whetstone.online"):
        restarted = OnlineLoop(world.config)
    assert "update 0 read feedback events 1..16 (16 events) and did not finish" in caplog.text
    assert restarted.state["cursor"] == 16  # never read again (nor trained twice)
    world.feedback(16)
    record = restarted.update()
    assert record["lost_events"] == 16 and record["events"] == 16 and record["decision"] == "published"
    state = json.loads((Path(world.config.output_dir) / "state.json").read_text())
    assert "consuming" not in state and "lost_events" not in state
    assert "lost_events" not in restarted.update()  # said once


@pytest.mark.parametrize("world", [NO_GATE | {"feedback_retry_s": 1.0}], indirect=True)
def test_a_failing_feedback_store_is_tried_again_then_named(world, caplog, monkeypatch):
    world.feedback(16)
    count, failures = world.loop.feedback.count_after, []

    def locked(seq):  # fails twice, then the database is back
        if len(failures) < 2:
            failures.append(seq)
            raise FeedbackStoreError("the feedback store x: counting new feedback failed: locked", "locked")
        return count(seq)

    monkeypatch.setattr(world.loop.feedback, "count_after", locked)
    with caplog.at_level(logging.WARNING, logger="whetstone.online"):
        assert world.loop.due()
    assert caplog.text.count("trying again in") == 2
    monkeypatch.undo()

    corrupt(Path(world.config.feedback_store))
    started = time.monotonic()
    with pytest.raises(FeedbackStoreError, match="failed: file is not a database") as failed:
        world.loop.update()
    assert time.monotonic() - started >= 1.0  # feedback_retry_s
    assert str(world.loop.feedback.name) in str(failed.value) and "SELECT" not in str(failed.value)


@pytest.mark.parametrize("world", [NO_GATE | {"feedback_retry_s": 1.0}], indirect=True)
def test_a_feedback_database_deleted_under_the_loop_is_named_lost_not_waited_for(world, caplog):
    world.feedback(16)
    world.loop.update()
    path = Path(world.config.feedback_store)
    remove_database(path)
    with caplog.at_level(logging.WARNING, logger="whetstone.online"), pytest.raises(FeedbackStoreError) as lost:
        world.loop.due()
    message = str(lost.value)
    assert message.startswith(f"the feedback store's database at {path.resolve()} has lost its tables (no file is")
    assert "Put the file back" in message and "unable to open" not in message
    assert "trying again" not in caplog.text  # a deleted file does not come back by waiting
    assert not any(Path(f"{path}{suffix}").exists() for suffix in ("", "-wal", "-shm"))  # nor is created again


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)  # retention_days = 7
def test_pruning_goes_by_the_databases_clock(world, monkeypatch):
    world.feedback(16)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 8 * 86400)  # the loop's machine is 8 days ahead
    record = world.loop.update()
    assert record["kept"] == 16 and record["pruned_responses"] == record["pruned_feedback"] == 0
