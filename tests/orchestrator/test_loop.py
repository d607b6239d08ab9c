"""The orchestrator end to end at tiny scale: real inference servers following a real weight store,
real synth tasks in real sandboxes, graded; batches into a LocalStore. The test publishes the
weight versions a trainer would."""

import asyncio
import json
import threading

import pytest

from tests.orchestrator.orchestrator_support import (
    Trainer,
    coin_tasks,
    orchestrator_config,
    synth_tasks,
    thread_servers,
)
from whetstone.envs.harness import RolloutConfig
from whetstone.envs.harness.pool import ServerPool
from whetstone.errors import WhetstoneError
from whetstone.orchestrator import Orchestrator
from whetstone.orchestrator.loop import NothingToTrainOn
from whetstone.rl.batch import batch_from_bytes
from whetstone.rl.batch_store import batch_key
from whetstone.store import LocalStore

META_KEYS = {"index", "trainer_step", "staleness_histogram", "groups", "reward_mean", "samples", "rollouts"}


def read_batch(store, index):
    return batch_from_bytes(store.get(batch_key(index)), batch_key(index))


async def idle_until_published(orchestrator: Orchestrator, store: LocalStore, trainer: Trainer, last: int) -> list[int]:
    """Run `orchestrator` until batch `last` is put; then it must start nothing (no server call, no
    group buffered, no next batch) until the trainer publishes the next version."""
    run = asyncio.create_task(orchestrator.run())
    while not store.exists(batch_key(last)):
        assert not run.done(), run
        await asyncio.sleep(0.05)
    calls = sum(server.calls for server in orchestrator.pool.servers)
    await asyncio.sleep(1.0)
    assert sum(server.calls for server in orchestrator.pool.servers) == calls
    assert orchestrator.buffered_groups == 0 and not store.exists(batch_key(last + 1))
    await asyncio.to_thread(trainer.publish)
    return await asyncio.wait_for(run, 120)


def test_batches_zero_and_one_carry_the_contract(world):
    tmp_path, model_dir, _ = world
    with thread_servers(model_dir, tmp_path / "weights") as servers:
        config = orchestrator_config(tmp_path, model_dir, [s.url for s in servers])
        orchestrator = Orchestrator(config, coin_tasks(1) + synth_tasks(1))
        assert asyncio.run(orchestrator.run()) == [0, 1]
        used = [server.calls for server in orchestrator.pool.servers]

    store = LocalStore(tmp_path / "batches")
    assert store.list("batches/") == [batch_key(0), batch_key(1)]
    for index in (0, 1):
        batch = read_batch(store, index)
        meta = batch.meta
        assert META_KEYS <= set(meta) and meta["index"] == meta["trainer_step"] == index
        assert meta["samples"] == len(batch) == 2 and meta["rollouts"] == 2  # one kept group of two
        groups = meta["groups"]
        dropped = sum(count for key, count in groups.items() if key.startswith("dropped_"))
        assert groups["rollouts"] == 2 * groups["groups"] and groups["kept_rollouts"] + dropped == groups["rollouts"]
        assert "dropped_failed" not in groups  # every rollout ran and was graded
        assert meta["staleness_histogram"] == {f"staleness_{index}": 2, "dropped_stale": 0}  # sampled at v0

        # One group: a solved rollout (reward 1) against an unsolved one (0), GRPO advantages +-1.
        assert {row["group_id"] for row in batch.rows} == {batch.rows[0]["group_id"]}
        assert sorted(row["reward"] > 0.5 for row in batch.rows) == [False, True]
        assert sorted(round(row["advantage"], 3) for row in batch.rows) == [-1.0, 1.0]
        trained = batch.loss_mask
        assert trained.any() and (batch.versions[trained] == 0).all() and (batch.behavior_logprobs[trained] < 0).all()
        assert batch.routes is not None and batch.routes.shape[:2] == batch.input_ids.shape
        assert batch.num_loss_tokens == meta["loss_tokens"]
    assert all(calls > 0 for calls in used)  # both servers were kept busy


@pytest.mark.slow
def test_waits_for_the_trainer_and_trains_only_on_fresh_samples(world):
    """With max_off_policy_steps = 0, batch 1 needs version 1: the orchestrator waits for it,
    starting nothing meanwhile (sampled by version 0, it could only be dropped as stale)."""
    tmp_path, model_dir, trainer = world
    store = LocalStore(tmp_path / "batches")

    async def scenario(urls):
        config = orchestrator_config(tmp_path, model_dir, urls, staleness={"max_off_policy_steps": 0})
        orchestrator = Orchestrator(config, coin_tasks(2))
        assert await idle_until_published(orchestrator, store, trainer, last=0) == [0, 1]

    with thread_servers(model_dir, tmp_path / "weights") as servers:
        asyncio.run(scenario([s.url for s in servers]))
    batch = read_batch(store, 1)
    # Every sample is fresh. A server may still sample a rollout with version 0 just after the
    # publish (it polls the store), and that rollout is dropped: the group may be left with one.
    histogram = batch.meta["staleness_histogram"]
    assert batch.meta["weight_version"] == 1 and histogram["staleness_0"] == batch.meta["samples"] >= 1
    assert (batch.versions[batch.loss_mask] == 1).all()


@pytest.mark.slow
def test_a_restarted_orchestrator_continues_the_batch_sequence(world):
    tmp_path, model_dir, _ = world
    with thread_servers(model_dir, tmp_path / "weights") as servers:
        config = orchestrator_config(tmp_path, model_dir, [s.url for s in servers], max_batches=1)
        assert asyncio.run(Orchestrator(config, coin_tasks(1)).run()) == [0]
        assert asyncio.run(Orchestrator(config, coin_tasks(1)).run()) == [1]
    assert read_batch(LocalStore(tmp_path / "batches"), 1).meta["index"] == 1


def test_starts_no_group_that_would_be_too_stale_to_train_on(world):
    """A trainer stuck at version 0 (bound 2; the servers hold version 0): groups start for batches
    0-2 only, whose samples will be within the bound; batch 3's start only once the trainer moves
    on. Nothing is generated to be dropped."""
    tmp_path, model_dir, trainer = world
    store = LocalStore(tmp_path / "batches")

    async def scenario(urls):
        orchestrator = Orchestrator(orchestrator_config(tmp_path, model_dir, urls, max_batches=4), coin_tasks(2))
        assert await idle_until_published(orchestrator, store, trainer, last=2) == [0, 1, 2, 3]

    with thread_servers(model_dir, tmp_path / "weights") as servers:
        asyncio.run(scenario([s.url for s in servers]))
    for index in range(4):
        assert read_batch(store, index).meta["staleness_histogram"]["dropped_stale"] == 0


@pytest.mark.parametrize(("served", "ahead_allowed"), [(5, 4), (4, 2), (3, 0), (None, 2)])
def test_groups_run_ahead_only_as_far_as_the_servers_version_allows(tmp_path, served, ahead_allowed):
    """Trainer on batch 5 (bound 2, 2 groups per batch): servers holding version 5 may start groups
    for batches 6 and 7; one version behind (or not saying), for batch 6 only; two behind, none
    (sampled by version 3, batch 6 would drop them)."""
    config = orchestrator_config(
        tmp_path, "unused", ["http://127.0.0.1:1"], groups_per_batch=2, rollout=RolloutConfig(concurrency=64)
    )
    orchestrator = Orchestrator(config, coin_tasks(1))
    orchestrator.latest_version, orchestrator._served_version, orchestrator._last_put = 5, served, 5
    allowed = 0
    while orchestrator._has_room():
        orchestrator._groups_running += 1
        orchestrator._unfinished += 2
        allowed += 1
    assert allowed == ahead_allowed
    orchestrator._groups_running = orchestrator._unfinished = 0
    orchestrator._last_put = 6  # batch 6 already put: room for batch 7's groups only
    assert orchestrator._has_room() == (ahead_allowed == 4)


def gate(tmp_path, bound: int, latest: int, served: int | None, last_put: int) -> Orchestrator:
    """An orchestrator whose trainer is on `latest`, its servers on `served`, batches up to
    `last_put` put; one group a batch."""
    config = orchestrator_config(tmp_path, "unused", ["http://127.0.0.1:1"], staleness={"max_off_policy_steps": bound})
    orchestrator = Orchestrator(config, coin_tasks(1))
    orchestrator.latest_version, orchestrator._served_version, orchestrator._last_put = latest, served, last_put
    return orchestrator


def test_on_policy_starts_no_group_while_the_trainer_trains(tmp_path):
    """Bound 0: while the trainer trains on batch 5 (put), a group sampled by version 5 could only
    land in batch 6, trained under version 6, and be dropped: none starts. Once version 6 is out,
    batch 6's group starts, even on servers still loading it (else nothing would ever fill it)."""
    assert not gate(tmp_path, bound=0, latest=5, served=5, last_put=5)._has_room()
    assert not gate(tmp_path, bound=0, latest=5, served=None, last_put=5)._has_room()
    assert gate(tmp_path, bound=0, latest=6, served=6, last_put=5)._has_room()
    assert gate(tmp_path, bound=0, latest=6, served=5, last_put=5)._has_room()
    assert gate(tmp_path, bound=0, latest=6, served=None, last_put=5)._has_room()
    waiting = gate(tmp_path, bound=0, latest=6, served=6, last_put=5)
    waiting._groups_running = 1  # batch 6's group is running: nothing more
    assert not waiting._has_room()


def test_servers_far_behind_still_fill_the_batch_the_trainer_waits_for(tmp_path):
    """Servers 3 versions behind, bound 2: their groups are too stale for any batch but the trainer
    waits for batch 6 all the same; they start (and are dropped, counted, until the run stops saying
    why) rather than the run waiting in silence."""
    assert gate(tmp_path, bound=2, latest=6, served=3, last_put=5)._has_room()
    assert not gate(tmp_path, bound=2, latest=6, served=3, last_put=6)._has_room()


def test_the_follower_asks_the_versions_again_when_a_server_joins(tmp_path):
    """A server that joins (restarted, or announced) behind the servers' version counts at once:
    groups started for it as far ahead as the others allow would only be dropped as stale."""
    from types import SimpleNamespace

    class Pool:
        servers = [SimpleNamespace(url="a", alive=True, version=5)]

        async def health(self, server):
            return {"weight_version": server.version}

    async def scenario():
        config = orchestrator_config(tmp_path, "unused", ["http://127.0.0.1:1"], groups_per_batch=2)
        orchestrator, pool = Orchestrator(config, coin_tasks(1)), Pool()
        orchestrator.weights = SimpleNamespace(latest=lambda: 5)  # the trainer on version 5
        follower = asyncio.create_task(orchestrator._follow_trainer(pool))
        await asyncio.sleep(5 * config.poll_interval_s)
        assert orchestrator._server_lag() == 0
        pool.servers.append(SimpleNamespace(url="b", alive=True, version=3))
        await asyncio.sleep(5 * config.poll_interval_s)
        follower.cancel()
        return orchestrator._server_lag()

    assert asyncio.run(scenario()) == 2


def test_servers_that_do_not_follow_the_trainer_stop_the_run_saying_so(world):
    """Servers stuck on version 0 (they follow another store) while the trainer moves on: once
    their samples are too stale for the next batch, groups are generated and dropped; after
    `max_fruitless_batches` batches' worth of them the orchestrator stops, saying why."""
    tmp_path, model_dir, trainer = world
    Trainer(model_dir, tmp_path / "frozen").publish()
    orchestrator = None

    async def scenario(urls):
        nonlocal orchestrator
        # groups of 6 coin rollouts: 3 in a row without reward variance (a stop of its own) is unlikely
        config = orchestrator_config(tmp_path, model_dir, urls, group_size=6, max_fruitless_batches=3, max_batches=0)
        orchestrator = Orchestrator(config, coin_tasks(2))
        run = asyncio.create_task(orchestrator.run())
        while orchestrator.pool is None or not any(server.alive for server in orchestrator.pool.servers):
            await asyncio.sleep(0.05)
        for _ in range(3):  # batch 3 can then only take samples of version 1 or newer
            await asyncio.to_thread(trainer.publish)
        await run

    with (
        thread_servers(model_dir, tmp_path / "frozen") as servers,
        pytest.raises(NothingToTrainOn, match="too stale to train on .* do the servers follow the trainer"),
    ):
        asyncio.run(asyncio.wait_for(scenario([s.url for s in servers]), 180))
    assert orchestrator.status()["groups_dropped_stale"] >= 3 and orchestrator.put == [0, 1, 2]


def test_synchronous_mode_alternates_with_the_trainer(world):
    """`synchronous = true`: batch 1's groups start only once version 1 is published and served,
    though the staleness bound (2) would let them run ahead, and no group is generated beyond
    what each batch needs: every sample is on-policy and none is dropped as stale."""
    tmp_path, model_dir, trainer = world
    store = LocalStore(tmp_path / "batches")

    async def scenario(urls):  # idle while the trainer trains
        orchestrator = Orchestrator(orchestrator_config(tmp_path, model_dir, urls, synchronous=True), coin_tasks(2))
        assert await idle_until_published(orchestrator, store, trainer, last=0) == [0, 1]

    with thread_servers(model_dir, tmp_path / "weights") as servers:
        asyncio.run(scenario([s.url for s in servers]))
    for index in (0, 1):
        batch = read_batch(store, index)
        assert batch.meta["weight_version"] == index and batch.meta["groups"]["kept_groups"] == 1
        assert batch.meta["staleness_histogram"] == {"staleness_0": 2, "dropped_stale": 0}
        assert (batch.versions[batch.loss_mask] == index).all()


def test_a_last_status_that_cannot_be_written_does_not_hide_why_the_run_ended(world, caplog, monkeypatch):
    tmp_path, model_dir, _ = world
    write_status = Orchestrator._write_status

    def full_disk(self, now=False):
        if now and self.stopped:  # the status written as the run ends
            raise WhetstoneError("cannot write status.json: No space left on device")
        write_status(self, now)

    monkeypatch.setattr(Orchestrator, "_write_status", full_disk)

    async def scenario(urls):
        config = orchestrator_config(tmp_path, model_dir, urls, max_fruitless_batches=1, max_batches=0)
        await Orchestrator(config, synth_tasks(2)).run()

    with (
        caplog.at_level("ERROR", logger="whetstone.orchestrator"),
        thread_servers(model_dir, tmp_path / "weights") as servers,
        pytest.raises(NothingToTrainOn),
    ):
        asyncio.run(asyncio.wait_for(scenario([s.url for s in servers]), 180))
    assert "last status could not be written: cannot write status.json: No space left on device" in caplog.text


def test_says_why_it_waits_when_no_group_gives_anything_to_train_on_and_gives_up(world, caplog):
    """A random model never solves a synth task: every group is dropped for no reward variance,
    and the orchestrator says so instead of waiting in silence, in its log and in its status file;
    after `max_fruitless_batches` batches' worth of such groups it stops, saying why."""
    tmp_path, model_dir, _ = world
    status_path = tmp_path / "orchestrator" / "status.json"
    orchestrator = None

    async def scenario(urls):
        nonlocal orchestrator
        config = orchestrator_config(
            tmp_path, model_dir, urls, status_path=str(status_path), max_fruitless_batches=6, max_batches=0
        )
        orchestrator = Orchestrator(config, synth_tasks(2))
        await orchestrator.run()

    with (
        caplog.at_level("WARNING", logger="whetstone.orchestrator"),
        thread_servers(model_dir, tmp_path / "weights") as servers,
        pytest.raises(NothingToTrainOn, match="max_fruitless_batches = 6 \\(0 waits for ever\\)"),
    ):
        asyncio.run(asyncio.wait_for(scenario([s.url for s in servers]), 180))
    assert "the last 4 groups gave nothing to train on (rollouts dropped: no_variance 8)" in caplog.text
    stopped = "the last 6 groups gave nothing to train on (rollouts dropped: no_variance 12)"
    assert orchestrator.stopped == f"{stopped}: stopped at orchestrator.max_fruitless_batches = 6"
    status = orchestrator.status()  # the run's totals, written once more as it stopped
    finished = status["groups_finished"]
    assert finished >= 6 and status["groups_kept"] == 0 and status["batches_put"] == 0
    assert status["rollouts_dropped"] == {"no_variance": 2 * finished} and status["stopped"] == orchestrator.stopped
    written = json.loads(status_path.read_text())
    assert written.pop("time") > 0 and written == status


def test_the_follower_asks_a_server_that_reports_no_version_once(world):
    """A server whose /health carries no weight version (vLLM's answers a bare 200) counts as one
    version behind, and is not asked again every poll for the rest of the run; the put loop then
    takes the trainer's version from the follower instead of reading the store itself."""
    import http.server
    import json

    tmp_path, model_dir, trainer = world
    health_hits = []

    class VllmLike(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                health_hits.append(1)
                body = b""
            else:
                body = json.dumps({"object": "list", "data": [{"id": "model", "max_model_len": 512}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), VllmLike)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    async def scenario():
        config = orchestrator_config(tmp_path, model_dir, [f"http://127.0.0.1:{httpd.server_port}/v1"])
        orchestrator = Orchestrator(config, coin_tasks(1))
        # no health round in the test's time: its probes of idle servers would count too
        orchestrator.pool = pool = await ServerPool.connect(config.servers, config.endpoint, health_interval_s=3600)
        follower = asyncio.create_task(orchestrator._follow_trainer(pool))
        await asyncio.sleep(20 * config.poll_interval_s)
        assert orchestrator._served_version is None and orchestrator._server_lag() == 1
        await asyncio.to_thread(trainer.publish)  # version 1: a put loop waiting for it hears it from the follower
        await asyncio.wait_for(orchestrator._wait_for_trainer(3), 10 * config.poll_interval_s + 5)
        follower.cancel()
        await pool.close()

    try:
        asyncio.run(scenario())
    finally:
        httpd.shutdown()
    assert len(health_hits) == 2  # one when the pool took the server in, one from the follower


def test_a_restarted_orchestrator_stops_at_the_runs_total_of_batches(world):
    """`total_batches` counts the batches earlier runs put: one restarted after the last of them
    puts nothing more (`max_batches` would put that many again)."""
    tmp_path, model_dir, _ = world
    store = LocalStore(tmp_path / "batches")
    store.put(batch_key(0), b"put by the orchestrator before its restart")
    config = orchestrator_config(tmp_path, model_dir, ["http://127.0.0.1:9/v1"], max_batches=2, total_batches=1)
    assert asyncio.run(Orchestrator(config, coin_tasks(1)).run()) == []
    assert store.list("batches/") == [batch_key(0)]
