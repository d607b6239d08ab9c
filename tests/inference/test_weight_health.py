"""A server following a weight store says when it cannot take the newest version (/health 503,
/metrics, a log line), and takes the version once the store is repaired. The real app with its
real subscriber thread, in-process (FastAPI's TestClient runs the lifespan)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from fastapi.testclient import TestClient

import whetstone.inference.engine as engine_module
from tests.inference.inference_fixtures import make_engine, tiny_model, wait_until
from tests.sync.test_publish_subscribe import corrupt
from whetstone.errors import WhetstoneError
from whetstone.inference.config import EngineConfig, ServeConfig
from whetstone.inference.launch import build_app
from whetstone.inference.swap import RETRY_FIRST_S, WeightFollower
from whetstone.model.hf import load_hf
from whetstone.sync import Publisher, Subscriber, SyncConfig, WeightStore

TIMEOUT_S = 120  # the machine is shared: generous, the conditions are awaited, not slept on


def nudged(state: dict[str, torch.Tensor], amount: float) -> dict[str, torch.Tensor]:
    return {k: v + amount if v.is_floating_point() else v.clone() for k, v in state.items()}


def published_version_0(tmp_path):
    """A weight store (polled every 0.05 s) with version 0, whole: its config, the store, its
    publisher and the model published (`tiny_model(seed=9)`, to change for later versions)."""
    config = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="keep", poll_interval=0.05)
    store = WeightStore.open(config)
    publisher = Publisher(store, config)
    trained = tiny_model(seed=9)
    publisher.publish(trained.state_dict())
    return config, store, publisher, trained


def writes_of_version_1_fail(monkeypatch, times: int | None = None) -> list[int]:
    """The engine's writes of version 1 raise part-way (a tensor's values one short; the engine
    puts back what it wrote), the first `times` of them (None: all); the list of those made to
    fail."""
    real_prepare, broken = engine_module.prepare, []

    def failing(update, tensors):
        prepared = real_prepare(update, tensors)
        if update.version == 1 and (times is None or len(broken) < times):
            broken.append(update.version)
            target, indices, values = prepared.writes[0]
            prepared.writes[0] = (target, indices, values[:-1])
        return prepared

    monkeypatch.setattr(engine_module, "prepare", failing)
    return broken


def preparing_runs_out_of_memory(monkeypatch, version: int, times: int | None = None) -> list[int]:
    """The engine's preparation of `version` (its device and pinned copies) raises out of memory,
    the first `times` times (None: every time), as on a GPU short of room for a while; the list
    of those made to fail."""
    real_prepare, failures = engine_module.prepare, []

    def out_of_memory(update, tensors):
        if update.version == version and (times is None or len(failures) < times):
            failures.append(update.version)
            raise torch.OutOfMemoryError("CUDA out of memory (for now)")
        return real_prepare(update, tensors)

    monkeypatch.setattr(engine_module, "prepare", out_of_memory)
    return failures


def version_1_refused_then_version_2_taken(config, store, publisher, trained, engine):
    """Start `engine` and a follower of `store`; publish version 1 (changing values only it
    changes), wait until the follower has it refused, then version 2 (a delta of other values)
    and wait until the engine serves it, so it went in with version 1. The follower (stopped) and
    its problem while version 1 was refused, which had to leave the engine at version 0; the
    served weights must then be all of `trained`'s."""
    engine.start()
    follower = WeightFollower(Subscriber(store, config), engine, poll_seconds=0.05).start()
    experts = trained.layers[1].mlp.experts.down_proj
    try:
        wait_until(lambda: engine.version == 0, TIMEOUT_S)
        with torch.no_grad():
            experts[0, :3] += 0.5  # only version 1 changes these
        publisher.publish(trained.state_dict())
        wait_until(lambda: 1 in follower.refused, TIMEOUT_S)
        problem = follower.report().problem
        assert engine.version == 0
        with torch.no_grad():
            experts[1, :3] += 0.5  # version 2, a delta of these only
        publisher.publish(trained.state_dict())
        wait_until(lambda: engine.version == 2, TIMEOUT_S)
    finally:
        follower.stop()
        engine.stop()
    served = engine.model.state_dict()
    assert all(torch.equal(served[name], value) for name, value in trained.state_dict().items())
    return follower, problem


def test_a_server_that_rejects_a_version_says_so_and_takes_it_once_repaired(served_model_dir, tmp_path, caplog):
    sync = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="keep", poll_interval=0.05)
    store = WeightStore.open(sync)
    publisher = Publisher(store, sync)
    served = load_hf(served_model_dir).state_dict()
    publisher.publish(served)  # version 0: what the server loads anyway
    bad = publisher.publish(nudged(served, 1e-3))  # version 1, a delta
    corrupt(store, bad.chunks[0].key, "flip")
    config = ServeConfig(
        model_path=str(served_model_dir), threads=1, sync=sync, engine=EngineConfig(max_batch=2, context_limit=256)
    )
    with caplog.at_level(logging.INFO), TestClient(build_app(config)) as http:
        wait_until(lambda: http.get("/health").status_code == 503, TIMEOUT_S)
        body = http.get("/health").json()
        assert body["status"] == "weights stale" and body["weight_version"] == 0 and body["latest_weight_version"] == 1
        assert "cannot take weight version 1: version 1 was rejected" in body["weights_problem"]
        assert "fails its checksum" in body["rejected_versions"]["1"]
        metrics = http.get("/metrics").text
        assert 'whetstone_weights_stale{model="tiny-chat"} 1' in metrics
        assert 'whetstone_weight_version_rejected{model="tiny-chat",version="1"} 1' in metrics
        assert 'whetstone_weight_versions_rejected_total{model="tiny-chat"} 1' in metrics
        assert 'whetstone_weight_version_latest{model="tiny-chat"} 1' in metrics
        assert "rejected version 1, staying on 0" in caplog.text
        wait_until(lambda: "serving weight version 0: cannot take weight version 1" in caplog.text, TIMEOUT_S)

        store.withdraw(1)
        repaired = publisher.publish(nudged(served, 2e-3))  # its chain is gone: a keyframe, as version 1
        assert (repaired.version, repaired.kind) == (1, "full")
        wait_until(lambda: http.get("/health").json()["weight_version"] == 1, TIMEOUT_S)
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok" and "weights_problem" not in health.json()
        metrics = http.get("/metrics").text
        assert 'whetstone_weights_stale{model="tiny-chat"} 0' in metrics and 'version="1"' not in metrics
        wait_until(lambda: "weights caught up: serving version" in caplog.text, TIMEOUT_S)  # after the withdraw


def test_a_server_whose_newest_version_stays_unavailable_says_so_and_takes_it_once_restored(served_model_dir, tmp_path):
    sync = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="keep", poll_interval=0.05, unavailable_after=0.2)
    store = WeightStore.open(sync)
    publisher = Publisher(store, sync)
    served = load_hf(served_model_dir).state_dict()
    publisher.publish(served)  # version 0: what the server loads anyway
    missing = store.objects.root / publisher.publish(nudged(served, 1e-3)).chunks[0].key  # version 1
    saved = missing.read_bytes()
    missing.unlink()  # deleted for good, or a partial copy
    config = ServeConfig(
        model_path=str(served_model_dir), threads=1, sync=sync, engine=EngineConfig(max_batch=2, context_limit=256)
    )
    with TestClient(build_app(config)) as http:
        wait_until(lambda: http.get("/health").status_code == 503, TIMEOUT_S)
        body = http.get("/health").json()
        assert body["status"] == "weights stale" and body["weight_version"] == 0 and body["latest_weight_version"] == 1
        assert "cannot take weight version 1: version 1 has been unavailable for 0.2 s" in body["weights_problem"]
        assert "no object" in body["weights_problem"] and body["rejected_versions"] == {}
        assert 'whetstone_weights_stale{model="tiny-chat"} 1' in http.get("/metrics").text

        missing.write_bytes(saved)
        wait_until(lambda: http.get("/health").json()["weight_version"] == 1, TIMEOUT_S)
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok" and "weights_problem" not in health.json()


def test_a_follower_stopped_by_something_unforeseen_leaves_the_server_stale_for_good(
    served_model_dir, tmp_path, monkeypatch
):
    """A version it took from the subscriber may be lost with the thread: /health must not say "ok"."""
    sync = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="keep", poll_interval=0.05)
    store = WeightStore.open(sync)
    publisher = Publisher(store, sync)
    served = load_hf(served_model_dir).state_dict()
    publisher.publish(served)
    real_apply = WeightFollower._apply

    def apply(follower, update):
        if update.version == 1:
            raise MemoryError("no room to merge")
        real_apply(follower, update)

    monkeypatch.setattr(WeightFollower, "_apply", apply)
    config = ServeConfig(
        model_path=str(served_model_dir), threads=1, sync=sync, engine=EngineConfig(max_batch=2, context_limit=256)
    )
    with TestClient(build_app(config)) as http:
        wait_until(lambda: http.get("/health").json()["weight_version"] == 0, TIMEOUT_S)
        publisher.publish(nudged(served, 1e-3))
        wait_until(lambda: http.get("/health").status_code == 503, TIMEOUT_S)
        body = http.get("/health").json()
        assert body["status"] == "weights stale" and body["weight_version"] == 0
        assert body["weights_problem"] == (
            "the server stopped following the weight store (MemoryError: no room to merge): restart it"
        )


def test_serve_refuses_a_weight_store_that_does_not_exist(served_model_dir, tmp_path):
    missing = tmp_path / "wieghts"
    config = ServeConfig(model_path=str(served_model_dir), threads=1, sync=SyncConfig(store=str(missing)))
    with pytest.raises(WhetstoneError, match=f"no store at {missing}: the directory does not exist"):
        build_app(config)
    assert not missing.exists()


def test_a_version_the_engine_refuses_is_reported(model, tmp_path):
    config = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="keep", poll_interval=0.05)
    store = WeightStore.open(config)
    other = tiny_model(seed=9).state_dict() | {"extra.weight": torch.ones(3)}  # not this model's tensors
    Publisher(store, config).publish(other)
    engine = make_engine(model)
    engine.start()
    follower = WeightFollower(Subscriber(store, config), engine, poll_seconds=0.05).start()
    try:
        wait_until(lambda: follower.report().problem is not None, TIMEOUT_S)
    finally:
        follower.stop()
        engine.stop()
    report = follower.report()
    assert "the engine refused weight version 0" in report.problem and "no tensor 'extra.weight'" in report.problem
    assert report.rejections_total == 1 and 0 in report.rejected and engine.version == 0


def test_a_version_the_engine_could_not_take_for_now_goes_in_with_the_next(model, tmp_path, monkeypatch):
    # On a GPU, taking a version allocates device and pinned memory, which can fail for a while.
    # The subscriber hands each version over once: the next delta (coded against it) must not go
    # in without it, or the values only it changed stay stale.
    config, store, publisher, trained = published_version_0(tmp_path)
    engine = make_engine(model)
    preparing_runs_out_of_memory(monkeypatch, version=1)
    follower, problem = version_1_refused_then_version_2_taken(config, store, publisher, trained, engine)
    assert "the engine refused weight version 1" in problem
    assert follower.report().problem is None and follower.refusals == 1


def test_a_version_refused_for_a_moment_is_taken_once_it_fits_without_a_newer_one(model, tmp_path, monkeypatch):
    # the last version of a run (or an online update): nothing newer comes to retry it with
    config, store, publisher, trained = published_version_0(tmp_path)
    engine = make_engine(model)
    failures = preparing_runs_out_of_memory(monkeypatch, version=1, times=1)
    engine.start()
    follower = WeightFollower(Subscriber(store, config), engine, poll_seconds=0.05).start()
    try:
        wait_until(lambda: engine.version == 0, TIMEOUT_S)
        with torch.no_grad():
            trained.layers[1].mlp.experts.down_proj[0, :3] += 0.5
        publisher.publish(trained.state_dict())
        wait_until(lambda: engine.version == 1, TIMEOUT_S)  # retried alone, a second later
    finally:
        follower.stop()
        engine.stop()
    assert failures == [1] and follower.refusals == 1 and follower.report().problem is None
    served = engine.model.state_dict()
    assert all(torch.equal(served[name], value) for name, value in trained.state_dict().items())


def test_a_version_the_engine_could_not_write_is_reported_and_sent_again(model, tmp_path, monkeypatch):
    # The engine takes the update, then its write fails between two steps (the weights are put
    # back): the follower must not count it delivered, nor let the next delta go in without it.
    config, store, publisher, trained = published_version_0(tmp_path)
    engine = make_engine(model)
    broken = writes_of_version_1_fail(monkeypatch, times=1)
    follower, problem = version_1_refused_then_version_2_taken(config, store, publisher, trained, engine)
    assert problem.startswith("the engine refused weight version 1: writing it failed (RuntimeError: ")
    assert broken == [1] and follower.report().problem is None and follower.refusals == 1


def test_a_write_that_keeps_failing_stays_reported_and_its_retries_wait_longer_each_time(
    model, tmp_path, monkeypatch, caplog
):
    # Each retry is taken by the engine, then fails to write: the server must not report "caught
    # up" between two failed retries, and the waits between retries double.
    config, store, publisher, trained = published_version_0(tmp_path)
    engine = make_engine(model)
    writes = writes_of_version_1_fail(monkeypatch)
    engine.start()
    follower = WeightFollower(Subscriber(store, config), engine, poll_seconds=0.05).start()
    problems = []
    try:
        wait_until(lambda: engine.version == 0, TIMEOUT_S)
        with torch.no_grad():
            trained.layers[1].mlp.experts.down_proj[0, :3] += 0.5
        with caplog.at_level(logging.INFO, logger="whetstone"):
            publisher.publish(trained.state_dict())
            wait_until(lambda: 1 in follower.refused, TIMEOUT_S)
            while len(writes) < 3:  # the first write and two retries, 1 s and 2 s later
                problems.append(follower.report().problem)
                time.sleep(0.01)
    finally:
        follower.stop()
        engine.stop()
    assert engine.version == 0 and None not in problems and "weights caught up" not in caplog.text
    assert follower._retry_in >= 4 * RETRY_FIRST_S  # two or three refusals so far: 1 s, 2 s, 4 s (8 s)


def test_a_version_refused_while_an_older_write_is_pending_stays_refused_once_that_write_is_done(
    model, tmp_path, monkeypatch
):
    # Version 5 is taken and waits for the engine's next step; version 6 is refused meanwhile (no
    # room for its copy while 5's is on the device). 5's write must not clear 6's refusal.
    from whetstone.inference.swap import full_update

    config = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="keep")
    engine = make_engine(model)  # not started: a version sent waits for a step
    preparing_runs_out_of_memory(monkeypatch, version=6)  # no room for its copy while 5's is there
    follower = WeightFollower(Subscriber(WeightStore.open(config), config), engine)
    state = tiny_model(seed=9).state_dict()
    follower._apply(full_update(state, version=5))
    follower._apply(full_update(nudged(state, 0.5), version=6))
    with torch.inference_mode():
        engine.step()  # writes 5
    follower._check_writes()
    assert engine.version == 5 and follower.refused.keys() == {6}
    assert follower.report().problem.startswith("the engine refused weight version 6: CUDA out of memory")
