"""The server pool against real inference servers (engine + HTTP app in threads of this process)."""

import asyncio
import contextlib
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from tests.envs.harness.harness_support import synth_task, tokenizer
from tests.orchestrator.orchestrator_support import ThreadServer, Trainer, model_folder, thread_servers
from whetstone.envs.harness import (
    AgentHarness,
    EndpointConfig,
    HarnessConfig,
    PolicyError,
    RolloutConfig,
    Sampling,
    ServerPool,
    run_rollouts,
)
from whetstone.envs.harness.policy import SeededPolicy
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.fleet import FleetRegistry, ServerRecord
from whetstone.store import LocalStore

ENDPOINT = EndpointConfig(retries=0, timeout_s=30)
SHORT = Sampling(max_tokens=4)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model folder and a weight store holding its version 0."""
    folder = tmp_path_factory.mktemp("pool")
    model_dir = model_folder(folder)
    Trainer(model_dir, folder / "weights").publish()
    return model_dir, folder / "weights"


async def until(condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_rollouts_go_to_the_least_loaded_server(world):
    async def scenario(urls):
        pool = await ServerPool.connect(urls, ENDPOINT)
        try:
            async with pool.lease() as a, pool.lease() as b, pool.lease() as c:
                assert [s.leases for s in pool.servers] == [2, 1]
                assert {a.server.url, b.server.url} == set(urls) and c.server is a.server
                completion = await c.complete([1, 2, 3], SHORT)
                assert len(completion.ids) == len(completion.versions) <= 4 and set(completion.versions) == {0}
                assert completion.routes is not None and pool.context_limit == 1024
            assert [s.leases for s in pool.servers] == [0, 0]
        finally:
            await pool.close()

    with thread_servers(*world) as servers:
        asyncio.run(scenario([s.url for s in servers]))


def test_a_dead_server_is_taken_out_its_call_rerun_elsewhere_and_taken_back_once_restarted(world):
    first, second = ThreadServer(*world).start(), ThreadServer(*world).start()

    async def scenario():
        pool = await ServerPool.connect([first.url, second.url], ENDPOINT, health_interval_s=0.1)
        try:
            async with pool.lease() as policy:
                assert policy.server.url == first.url
                await asyncio.to_thread(first.stop)
                completion = await policy.complete([1, 2, 3], SHORT)  # lost on the first, answered by the second
                assert completion.ids and policy.server.url == second.url
                # taken out once: by the failed call, or before it by the health round's probe
                assert pool.stats()["servers_alive"] == 1 and pool.calls_rerun <= 1 and pool.servers[0].failures == 1
                async with pool.lease() as other:
                    assert other.server.url == second.url  # the dead one gets no new rollout

                await asyncio.to_thread(first.start)  # same address, a new process of the server
                await until(lambda: pool.servers[0].alive)
                async with pool.lease() as rejoined:
                    assert rejoined.server.url == first.url  # back, and the least loaded
                    assert (await rejoined.complete([4, 5], SHORT)).ids
        finally:
            await pool.close()

    try:
        asyncio.run(scenario())
    finally:
        first.stop(), second.stop()


def test_a_request_the_server_refuses_fails_the_rollout_not_the_server(world):
    async def scenario(urls):
        pool = await ServerPool.connect(urls, ENDPOINT)
        try:
            async with pool.lease() as policy:
                with pytest.raises(PolicyError, match="HTTP 4"):
                    await policy.complete([1] * 2000, SHORT)  # longer than the 1,024-token context
            assert pool.stats()["servers_alive"] == 1 and pool.calls_rerun == 0
        finally:
            await pool.close()

    with thread_servers(*world, count=1) as servers:
        asyncio.run(scenario([s.url for s in servers]))


def test_a_server_too_far_behind_the_trainer_is_not_used(world):
    """A server still on version 0 while the trainer is at 5 would only make samples too stale to train on."""

    async def scenario(urls):
        pool = await ServerPool.connect(
            urls, ENDPOINT, health_interval_s=0.1, no_server_timeout_s=0.5, min_version=lambda: 3
        )
        try:
            with pytest.raises(WhetstoneError, match="no inference server has been healthy for 0.5 s"):
                async with pool.lease():
                    pass
        finally:
            await pool.close()

    with thread_servers(*world, count=1) as servers:
        asyncio.run(scenario([s.url for s in servers]))


def test_a_health_check_that_fails_at_connect_leaves_the_server_for_a_later_round(world):
    """The weight store behind `min_version` out as the pool connects: the pool still starts."""
    answers = iter([OSError("the weight store is out")])

    def min_version():
        failure = next(answers, None)
        if failure is not None:
            raise failure
        return None

    async def scenario(urls):
        pool = await ServerPool.connect(urls, ENDPOINT, health_interval_s=0.1, min_version=min_version)
        try:
            assert "its health check failed: OSError: the weight store is out" in pool.servers[0].problem
            async with pool.lease() as policy:  # the next health round takes it in
                assert policy.server.url == urls[0]
        finally:
            await pool.close()

    with thread_servers(*world, count=1) as servers:
        asyncio.run(scenario([s.url for s in servers]))


class FakeServers:
    """Inference servers faked on one HTTP server, told apart by path: server `name`'s API root is
    `/<name>/v1`. Its /health answers `health[name]` (status, body), its /v1/models one model
    with context limit `limits[name]` (1,024 unless set), its vLLM /collective_rpc `rpc[name]`
    (whetstone's worker status), and its /v1/completions one token once `release` is set (so a
    test can hold a call in flight), or HTTP 400 for a prompt + max_tokens over its limit, as
    the engine refuses it. `completions[name]` counts the completion requests it was sent."""

    def __init__(self):
        self.health: dict[str, tuple[int, dict]] = {}
        self.rpc: dict[str, dict] = {}
        self.limits: dict[str, int] = {}
        self.completions: Counter[str] = Counter()
        self.release = threading.Event()
        self.release.set()
        fakes = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                name, _, path = self.path.lstrip("/").partition("/")
                if path == "health":
                    self.answer(*fakes.health[name])
                elif path == "v1/models":
                    self.answer(200, {"data": [{"id": "fake", "max_model_len": fakes.limits.get(name, 1024)}]})
                else:
                    self.answer(404, {})

            def do_POST(self):
                name, _, path = self.path.lstrip("/").partition("/")
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if path == "collective_rpc":
                    self.answer(200, {"results": [fakes.rpc[name]]})
                elif path == "v1/completions":
                    fakes.completions[name] += 1
                    if len(body["prompt"]) + body["max_tokens"] > fakes.limits.get(name, 1024):
                        self.answer(400, {"error": {"message": "prompt + max_tokens exceeds the context limit"}})
                        return
                    fakes.release.wait(30)
                    choice = {"token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}, "weight_versions": [0]}
                    self.answer(200, {"choices": [choice]})
                else:
                    self.answer(404, {})

            def answer(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self._server.server_address[1]}"

    def url(self, name: str) -> str:
        return f"{self.base}/{name}/v1"

    def stop(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()


def current(version: int = 0) -> tuple[int, dict]:
    return 200, {"status": "ok", "weight_version": version}


def stale(version: int = 0) -> tuple[int, dict]:
    """What `whetstone serve` answers while it cannot take the store's newest version."""
    body = {"status": "weights stale", "weight_version": version, "latest_weight_version": version + 1}
    return 503, {**body, "weights_problem": f"version {version + 1} rejected"}


@pytest.fixture
def fakes():
    servers = FakeServers()
    yield servers
    servers.stop()


def test_a_server_stuck_on_old_weights_is_up_and_behind_while_a_stopped_one_is_down(fakes):
    fakes.health["stale"] = stale(14)
    fakes.health["stopped"] = 503, {"status": "engine stopped", "weight_version": 14}

    async def scenario():
        pool = ServerPool([fakes.url("stale"), fakes.url("stopped")], ENDPOINT)
        try:
            stale_health, stopped_health = [await pool.health(s) for s in pool.servers]
            assert stale_health["weight_version"] == 14 and stopped_health is None
            assert pool.servers[0].behind == "weights stale: version 15 rejected"
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_stale_server_gets_new_rollouts_only_when_no_current_server_has_room(fakes):
    fakes.health["stale"], fakes.health["fresh"] = stale(), current()

    async def scenario():
        pool = await ServerPool.connect([fakes.url("stale"), fakes.url("fresh")], ENDPOINT, health_interval_s=0.1)
        behind, fresh = pool.servers
        fresh.rollout_slots = 2  # as a fleet record lending two slots would set it
        try:
            assert behind.alive and behind.behind.startswith("weights stale")  # up, so it joins
            assert pool.stats()["servers_alive"] == 2 and pool.stats()["servers_behind"] == 1
            async with pool.lease() as a, pool.lease() as b:
                assert a.server is fresh and b.server is fresh  # though the stale one has none
                async with pool.lease() as c:
                    assert c.server is behind  # the current one is full: never wait on a stale one
                    assert (await c.complete([1, 2], SHORT)).ids
            fakes.health["fresh"] = 500, {}
            await until(lambda: not fresh.alive)
            async with pool.lease() as d:
                assert d.server is behind  # the current one is down
            fakes.health["fresh"] = current()
            await until(lambda: fresh.alive)
            async with pool.lease() as e:
                assert e.server is fresh
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_stale_server_that_catches_up_is_preferred_again(fakes):
    fakes.health["stale"], fakes.health["fresh"] = stale(), current()

    async def scenario():
        pool = await ServerPool.connect([fakes.url("stale"), fakes.url("fresh")], ENDPOINT, health_interval_s=0.1)
        behind, fresh = pool.servers
        try:
            async with pool.lease() as a:
                assert a.server is fresh
                fakes.health["stale"] = current(1)
                await until(lambda: not behind.behind)
                async with pool.lease() as b:
                    assert b.server is behind  # current again, and the least loaded
                assert pool.stats()["servers_behind"] == 0
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_server_behind_min_version_counts_as_stale(fakes):
    """The floor rises with the trainer: a server whose last reported version fell below it gets
    rollouts last at once, without waiting for a health round (none runs here)."""
    fakes.health["old"], fakes.health["new"] = current(4), current(5)
    floor = [None]

    async def scenario():
        pool = await ServerPool.connect(
            [fakes.url("old"), fakes.url("new")], ENDPOINT, health_interval_s=600, min_version=lambda: floor[0]
        )
        old, new = pool.servers
        try:
            assert old.alive and new.alive and pool.stats()["servers_behind"] == 0
            floor[0] = 5
            assert pool.behind(old) == "weight version 4 is older than 5" and pool.stats()["servers_behind"] == 1
            async with pool.lease() as a, pool.lease() as b:
                assert a.server is new and b.server is new
                fakes.health["old"] = current(5)
                await pool.probe_versions()
                async with pool.lease() as c:
                    assert c.server is old
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_busy_servers_state_is_refreshed_every_health_round(fakes):
    fakes.health["b"], fakes.health["a"] = current(), current()

    async def scenario():
        pool = await ServerPool.connect([fakes.url("b"), fakes.url("a")], ENDPOINT, health_interval_s=0.1)
        b, a = pool.servers
        try:
            async with pool.lease() as r1, pool.lease() as r2, pool.lease() as r3:
                assert (r1.server, r2.server, r3.server) == (b, a, b)
                fakes.release.clear()
                call = asyncio.create_task(r2.complete([1, 2], SHORT))  # held in flight on a
                await until(lambda: a.active_calls == 1)
                fakes.health["a"] = stale()
                await until(lambda: a.behind != "")
                assert a.active_calls == 1 and a.alive  # found while busy, and still in the pool
                async with pool.lease() as r4:
                    assert r4.server is b  # though a has fewer rollouts
                fakes.release.set()
                assert (await call).ids and r2.server is a  # the rollout on it stays
        finally:
            fakes.release.set()
            await pool.close()

    asyncio.run(scenario())


def test_a_vllm_server_reporting_weights_stale_gets_rollouts_last(fakes):
    fakes.health["stale"] = fakes.health["fresh"] = 200, {}
    fakes.rpc["stale"] = {"following": True, "weight_version": 3, "weights_problem": "version 4 rejected"}
    fakes.rpc["fresh"] = {"following": True, "weight_version": 4}

    async def scenario():
        endpoint = ENDPOINT.model_copy(update={"engine": "vllm"})
        pool = await ServerPool.connect([fakes.url("stale"), fakes.url("fresh")], endpoint, health_interval_s=0.1)
        behind, fresh = pool.servers
        try:
            assert (behind.version, behind.behind) == (3, "weights stale: version 4 rejected")
            async with pool.lease() as a:
                assert a.server is fresh
            fakes.rpc["stale"] = {"following": True, "weight_version": 4}
            await until(lambda: not behind.behind and behind.version == 4)
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_mistyped_server_address_is_a_server_out_of_the_pool_not_a_crash(fakes):
    fakes.health["good"] = current()
    typo = "http://gpu-3:port/v1"  # as from an unexpanded `$PORT`

    async def scenario():
        pool = await ServerPool.connect([fakes.url("good"), typo], ENDPOINT, health_interval_s=0.1)
        try:
            good, bad = pool.servers
            assert good.alive and not bad.alive and bad.problem == "no answer from http://gpu-3:port/health"
            async with pool.lease() as policy:
                assert policy.server is good and (await policy.complete([1, 2], SHORT)).ids
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_failed_health_round_does_not_stop_the_next(fakes, caplog):
    """A round that raises (here: its discovery, once) is logged; later rounds still take back a
    server that recovered."""
    fakes.health["a"] = fakes.health["b"] = 200, {}
    fakes.rpc["a"] = fakes.rpc["b"] = {"following": True, "weight_version": 0}

    async def scenario():
        endpoint = ENDPOINT.model_copy(update={"engine": "vllm"})
        pool = await ServerPool.connect([fakes.url("a"), fakes.url("b")], endpoint, health_interval_s=0.1)
        a, b = pool.servers
        try:
            fakes.health["a"] = 500, {}
            await until(lambda: not a.alive)
            discover, failed = pool.discover, []

            async def fails_once(*args, **kwargs):
                if not failed:
                    failed.append(True)
                    raise RuntimeError("the registry could not be read")
                return await discover(*args, **kwargs)

            pool.discover = fails_once
            await until(lambda: "health round of the server pool failed" in caplog.text or pool._watcher.done())
            fakes.health["a"] = 200, {}
            await until(lambda: a.alive, timeout_s=10)
            assert b.alive
        finally:
            await pool.close()

    asyncio.run(scenario())


def registry_of(weights) -> FleetRegistry:
    return FleetRegistry(LocalStore(weights))


def test_servers_announced_in_the_registry_join_and_a_stopped_ones_rollout_moves_on(world):
    eu = ThreadServer(*world, cluster="eu").start()
    us = None

    async def scenario():
        nonlocal us
        pool = await ServerPool.connect([], ENDPOINT, health_interval_s=0.1, registry=registry_of(world[1]))
        try:
            assert [(s.url, s.cluster, s.alive) for s in pool.servers] == [(eu.url, "eu", True)]
            us = await asyncio.to_thread(ThreadServer(*world, cluster="us").start)  # joins while the pool runs
            await until(lambda: len(pool.servers) == 2 and all(s.alive for s in pool.servers))
            async with pool.lease() as first, pool.lease() as second:
                on_us = first if first.server.url == us.url else second
                assert on_us.server.cluster == "us" and (await on_us.complete([1, 2], SHORT)).ids
                await asyncio.to_thread(us.stop)  # its record goes, and its rollout's next call moves
                completion = await on_us.complete([1, 2, 3], SHORT)
                assert completion.ids and on_us.server.url == eu.url
            await until(lambda: [s.url for s in pool.servers] == [eu.url])
            assert pool.rollouts == {"eu": 2}  # both rollouts finished on eu: counted once each
            stats = pool.cluster_stats(latest_version=0)
            assert stats["cluster_eu_servers"] == 1 and stats["cluster_eu_rollouts_per_s"] > 0
            assert stats["cluster_us_servers"] == 0
            await pool.probe_versions()
            assert pool.cluster_stats(latest_version=2)["cluster_eu_weight_version_lag"] == 2
        finally:
            await pool.close()

    try:
        asyncio.run(scenario())
    finally:
        eu.stop()
        if us is not None:
            us.stop()


def test_an_announced_server_whose_heartbeat_stops_is_dropped_though_it_still_answers(world):
    with thread_servers(*world, count=1) as (server,):
        registry = registry_of(world[1])
        record = ServerRecord.new(server.url, "borrowed")
        registry.announce(record)  # announced once, never refreshed: as from a machine cut off

        async def scenario():
            pool = await ServerPool.connect([], ENDPOINT, health_interval_s=0.1, registry=registry, stale_after_s=1.0)
            try:
                assert [s.cluster for s in pool.servers if s.alive] == ["borrowed"]
                await until(lambda: not pool.servers)
                with pytest.raises(PolicyError, match="none is announced"):
                    pool.require_one()
            finally:
                await pool.close()

        try:
            asyncio.run(scenario())
        finally:
            registry.forget(record)


def test_a_late_server_takes_rollouts_only_once_caught_up_through_the_weight_store(tmp_path):
    model_dir = model_folder(tmp_path)
    trainer = Trainer(model_dir, tmp_path / "weights")
    while trainer.publish() < 10:  # a keyframe and deltas; the server loads version 0 from its folder
        pass
    late = ThreadServer(model_dir, tmp_path / "weights", cluster="late").start()

    async def scenario():
        pool = await ServerPool.connect(
            [], ENDPOINT, health_interval_s=0.1, registry=registry_of(tmp_path / "weights"), min_version=lambda: 10
        )
        try:
            async with pool.lease() as policy:
                completion = await policy.complete([1, 2, 3], SHORT)
            assert completion.ids and set(completion.versions) == {10}
        finally:
            await pool.close()

    try:
        asyncio.run(scenario())
    finally:
        late.stop()


def test_a_servers_stats_keep_their_label_when_another_server_leaves(fakes, tmp_path):
    """Each server's `server<n>_` numbers stay under its label for the pool's life: one leaving
    the registry shifts no other's onto its label, and one coming back at its address gets its
    label and its counts again."""
    for name in "abc":
        fakes.health[name] = current()
    registry = registry_of(tmp_path)
    records = {name: ServerRecord.new(fakes.url(name), "eu") for name in "abc"}
    for record in records.values():
        registry.announce(record)

    async def scenario():
        pool = await ServerPool.connect([], ENDPOINT, registry=registry)
        try:
            a, b, c = pool.servers
            assert [a.url, b.url, c.url] == [fakes.url(name) for name in "abc"]
            async with pool.lease() as on_a, pool.lease() as on_b, pool.lease() as on_c:
                assert (on_a.server, on_b.server, on_c.server) == (a, b, c)
                await on_c.complete([1, 2], SHORT)
                await on_c.complete([1, 2], SHORT)
                await on_b.complete([1, 2], SHORT)
            assert {key: value for key, value in pool.stats().items() if key[6:7].isdigit()} == {
                "server0_calls": 0,
                "server0_failures": 0,
                "server1_calls": 1,
                "server1_failures": 0,
                "server2_calls": 2,
                "server2_failures": 0,
            }
            registry.forget(records["b"])
            await pool.discover()
            assert pool.servers == [a, c]
            stats = pool.stats()
            assert stats["server0_calls"] == 0 and stats["server2_calls"] == 2 and "server1_calls" not in stats
            registry.announce(records["b"])
            await pool.discover()
            stats = pool.stats()
            assert [s.url for s in pool.servers] == [a.url, c.url, b.url]
            assert (stats["server1_calls"], stats["server1_failures"], stats["server2_calls"]) == (1, 1, 2)
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_an_idle_server_that_stops_answering_is_dropped_at_the_next_health_round(world):
    """Its record stays fresh (a heartbeat from a machine whose server hung): the health round
    takes it out, not the heartbeat timeout; a record long silent is deleted from the registry."""
    first, second = ThreadServer(*world).start(), ThreadServer(*world).start()
    registry = registry_of(world[1])
    records = [ServerRecord.new(first.url, "eu"), ServerRecord.new(second.url, "eu")]
    for record in records:
        registry.announce(record)
    ghost = ServerRecord("ghost", "http://127.0.0.1:9/v1", "eu", 0.0, 0.0)  # died long ago
    registry.announce(ghost)

    async def scenario():
        pool = await ServerPool.connect(
            [], ENDPOINT, health_interval_s=0.1, registry=registry, stale_after_s=600, forget_after_s=300
        )
        try:
            assert ghost not in registry.records()  # deleted by the pool's first look at the registry
            await until(lambda: sum(s.alive for s in pool.servers) == 2)
            await asyncio.to_thread(first.stop)
            await until(lambda: [s.url for s in pool.servers if s.alive] == [second.url])
            async with pool.lease() as policy:
                assert policy.server.url == second.url and (await policy.complete([1, 2], SHORT)).ids
            assert pool.calls_rerun == 0  # no call had to fail to find out
        finally:
            await pool.close()

    try:
        asyncio.run(scenario())
    finally:
        first.stop(), second.stop()
        for record in records:
            registry.forget(record)


async def restart(fakes, server, name: str, limit: int) -> None:
    """Stop fake server `name` until the pool takes it out, then start it again with context limit `limit`."""
    fakes.health[name] = 500, {}
    await until(lambda: not server.alive)
    fakes.limits[name], fakes.health[name] = limit, current()
    await until(lambda: server.alive)


def test_the_context_limit_is_that_of_the_servers_in_the_pool_now(fakes):
    """A server restarted with a smaller limit lowers it, restarted with a larger one raises it
    again; a server taken out no longer counts. A new lease reports its own server's limit."""
    fakes.health["a"] = fakes.health["b"] = current()
    fakes.limits["a"], fakes.limits["b"] = 8192, 4096

    async def scenario():
        pool = await ServerPool.connect([fakes.url("a"), fakes.url("b")], ENDPOINT, health_interval_s=0.1)
        a, b = pool.servers
        try:
            assert pool.context_limit == 4096
            await restart(fakes, a, "a", 2048)
            assert pool.context_limit == 2048
            await restart(fakes, a, "a", 8192)
            assert pool.context_limit == 4096
            fakes.health["b"] = 500, {}
            await until(lambda: not b.alive)
            assert pool.context_limit == 8192
            async with pool.lease() as policy:
                assert policy.server is a and policy.context_limit == 8192
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_rollout_moved_to_a_server_with_a_smaller_context_fails_naming_both_limits(fakes):
    """Its call is not sent to a server that would refuse it; a call that fits still runs there."""
    fakes.health["big"], fakes.health["small"] = current(), (500, {})
    fakes.limits["big"], fakes.limits["small"] = 8192, 2048

    async def scenario():
        pool = await ServerPool.connect([fakes.url("big"), fakes.url("small")], ENDPOINT, health_interval_s=0.1)
        big, small = pool.servers
        try:
            async with pool.lease() as policy:
                assert policy.server is big and policy.context_limit == 8192
                fakes.health["small"] = current()
                await until(lambda: small.alive)
                fakes.health["big"] = 500, {}
                await until(lambda: not big.alive)
                with pytest.raises(
                    PolicyError, match=r"8192-token context limit.*limit of 2048 tokens.*= 3004 does not fit"
                ):
                    await policy.complete([1] * 3000, SHORT)
                assert policy.server is small and policy.context_limit == 2048
                assert fakes.completions["small"] == 0 and small.alive
                assert (await policy.complete([1, 2], SHORT)).ids
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_moved_rollout_prefers_a_server_whose_context_fits_what_it_started_with(fakes):
    """Though a server with a smaller context has fewer rollouts."""
    fakes.health["a"] = fakes.health["c"] = fakes.health["small"] = current()
    fakes.limits["a"], fakes.limits["c"], fakes.limits["small"] = 8192, 8192, 2048

    async def scenario():
        urls = [fakes.url("a"), fakes.url("c"), fakes.url("small")]
        pool = await ServerPool.connect(urls, ENDPOINT, health_interval_s=0.1)
        a, c, small = pool.servers
        try:
            async with pool.lease() as moved, pool.lease() as other:
                assert (moved.server, other.server) == (a, c) and small.leases == 0
                fakes.health["a"] = 500, {}
                await until(lambda: not a.alive)
                assert (await moved.complete([1] * 3000, SHORT)).ids
                assert moved.server is c and fakes.completions["small"] == 0
        finally:
            await pool.close()

    asyncio.run(scenario())


def windowed(context_tokens: int) -> AgentHarness:
    """The agent loop with a `context_tokens` window, one call per rollout."""
    return AgentHarness(HarnessConfig(context_tokens=context_tokens, max_turns=1), tokenizer())


def test_rollouts_whose_window_a_small_server_cannot_hold_go_to_the_servers_that_can(fakes):
    """A mixed fleet with `harness.context_tokens` above the small server's limit: every rollout
    runs on the large one, none fails on the small one."""
    fakes.health["small"] = fakes.health["big"] = current()
    fakes.limits["small"], fakes.limits["big"] = 2048, 8192

    async def scenario():
        pool = await ServerPool.connect([fakes.url("small"), fakes.url("big")], ENDPOINT, health_interval_s=0.1)
        try:
            trajectories = await run_rollouts(
                [synth_task()], pool, windowed(4096), RolloutConfig(concurrency=2), samples=2
            )
            assert [(t.status, t.error) for t in trajectories] == [("ok", None)] * 2
            assert fakes.completions["small"] == 0 and fakes.completions["big"] == 2
            async with pool.lease() as small, pool.lease(4096) as big:  # no window asked: least loaded
                assert (small.server.url, big.server.url) == (fakes.url("small"), fakes.url("big"))
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_window_no_server_holds_is_one_error_naming_the_limits_and_no_call_is_sent(fakes):
    fakes.health["a"] = fakes.health["b"] = current()
    fakes.limits["a"], fakes.limits["b"] = 2048, 3072

    async def scenario():
        pool = await ServerPool.connect([fakes.url("a"), fakes.url("b")], ENDPOINT, no_server_timeout_s=600)
        try:
            with pytest.raises(ConfigError) as raised:
                await asyncio.wait_for(
                    run_rollouts([synth_task()], pool, windowed(4096), RolloutConfig(concurrency=2), samples=2), 20
                )
            message = str(raised.value)
            assert "harness.context_tokens=4096 is more than the context limit of every inference server" in message
            assert f"{fakes.url('a')}: 2048 tokens" in message and "set it to 3072 or less" in message
            assert sum(fakes.completions.values()) == 0 and [s.leases for s in pool.servers] == [0, 0]
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_one_server_too_small_for_the_window_keeps_its_message(fakes):
    fakes.health["a"] = current()
    fakes.limits["a"] = 1000

    async def scenario():
        pool = await ServerPool.connect([fakes.url("a")], ENDPOINT)
        try:
            with pytest.raises(
                ConfigError, match=r"context_tokens=4096 is more than the server's context limit of 1000"
            ):
                await run_rollouts([synth_task()], pool, windowed(4096), RolloutConfig())
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_rollout_waits_for_a_server_that_holds_its_window_while_one_is_out(fakes):
    """The large server is out (restarting): the rollout waits for it rather than run on the
    small one, and if it does not come back the error names the limits."""
    fakes.health["small"] = fakes.health["big"] = current()
    fakes.limits["small"], fakes.limits["big"] = 2048, 8192

    async def scenario():
        pool = await ServerPool.connect(
            [fakes.url("small"), fakes.url("big")], ENDPOINT, health_interval_s=0.1, no_server_timeout_s=0.5
        )
        small, big = pool.servers
        try:
            fakes.health["big"] = 500, {}
            await until(lambda: not big.alive)
            with pytest.raises(WhetstoneError, match=r"at least 4096 tokens .* for 0.5 s.*small/v1: 2048 tokens"):
                async with pool.lease(4096):
                    pass
            pool.no_server_timeout_s = 30
            waiting = asyncio.create_task(pool.pick(context_tokens=4096))
            await asyncio.sleep(0.2)
            assert not waiting.done() and small.leases == 0
            fakes.health["big"] = current()
            assert await asyncio.wait_for(waiting, 10) is big
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_seeded_rollouts_context_limit_is_its_servers_now(fakes):
    """Its server restarted with a smaller limit between the lease and the harness's start (the
    sandbox's setup): the harness sizes its window by the limit the server has now."""
    fakes.health["a"] = current()
    fakes.limits["a"] = 8192

    async def scenario():
        pool = await ServerPool.connect([fakes.url("a")], ENDPOINT, health_interval_s=0.1)
        try:
            async with pool.lease() as leased:
                seeded = SeededPolicy(leased, seed=3)
                assert seeded.context_limit == 8192
                await restart(fakes, leased.server, "a", 2048)
                assert seeded.context_limit == leased.context_limit == 2048
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_the_client_of_a_server_taken_out_is_closed_once_no_call_is_on_it(fakes):
    """Each take-out and rejoin makes a new client: the old one's connections are closed at a
    health round once its last call in flight has ended, not held open until the pool closes
    (a server that flaps through a long run would use up the process's file descriptors)."""
    fakes.health["a"] = current()

    async def scenario():
        pool = await ServerPool.connect([fakes.url("a")], ENDPOINT, health_interval_s=0.1)
        a = pool.servers[0]
        try:
            async with pool.lease() as policy:
                old = a.policy
                fakes.release.clear()
                call = asyncio.create_task(policy.complete([1, 2], SHORT))
                await until(lambda: a.active_calls == 1)
                pool.take_out(a)
                await until(lambda: a.alive and a.policy is not old)
                await asyncio.sleep(0.3)  # health rounds while the call is still in flight on the old client
                assert not old._client.is_closed
                fakes.release.set()
                assert (await call).ids  # answered on the old client
                await until(lambda: old._client.is_closed)
                assert (await policy.complete([1, 2], SHORT)).ids and not a.policy._client.is_closed
        finally:
            fakes.release.set()
            await pool.close()

    asyncio.run(scenario())


def test_retired_clients_a_cancelled_round_did_not_close_are_closed_with_the_pool(fakes):
    """The pool closing cancels its watcher, maybe amid a round's closes: the clients that round
    had not closed yet are closed by the pool's close all the same, also after one that fails."""
    fakes.health["a"] = current()

    class SlowToClose:
        def __init__(self, fails=False):
            self.closed, self.fails = False, fails
            self.config = SimpleNamespace(base_url="http://10.0.0.1:8000/v1")

        async def close(self):
            await asyncio.sleep(0.05)
            self.closed = True
            if self.fails:
                raise OSError("connection reset")

    async def scenario():
        pool = await ServerPool.connect([fakes.url("a")], ENDPOINT, health_interval_s=60)
        retired = [SlowToClose(fails=True), SlowToClose(), SlowToClose(fails=True), SlowToClose()]
        pool._retired += retired
        closing = asyncio.create_task(pool._close_retired())
        await asyncio.sleep(0.07)  # the first closed, the second on its way
        closing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        await pool.close()
        assert all(policy.closed for policy in retired)

    asyncio.run(scenario())


def test_a_moved_rollout_leased_for_a_window_takes_the_least_loaded_server_that_holds_it(fakes):
    """Any server whose limit holds the window will do, though smaller than the one it started on."""
    fakes.health["a"] = fakes.health["c"] = fakes.health["d"] = current()
    fakes.limits["a"], fakes.limits["c"], fakes.limits["d"] = 8192, 4096, 8192

    async def scenario():
        pool = await ServerPool.connect([fakes.url(n) for n in "acd"], ENDPOINT, health_interval_s=0.1)
        a, c, d = pool.servers
        try:
            async with pool.lease(4096) as moved:
                assert moved.server is a
                d.leases += 1  # another rollout's
                fakes.health["a"] = 500, {}
                await until(lambda: not a.alive)
                assert (await moved.complete([1] * 3000, SHORT)).ids and moved.server is c
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_with_a_registry_a_window_no_server_holds_waits_for_one_then_names_the_limits(fakes, tmp_path):
    """A server that holds it may yet be announced (one restarting leaves the registry meanwhile)."""
    fakes.health["small"] = current()
    fakes.limits["small"] = 2048
    registry = registry_of(tmp_path)
    registry.announce(ServerRecord.new(fakes.url("small"), "eu"))

    async def scenario():
        pool = await ServerPool.connect([], ENDPOINT, registry=registry, no_server_timeout_s=0.5)
        try:
            assert [s.context_limit for s in pool.servers if s.alive] == [2048]
            started = time.monotonic()
            with pytest.raises(WhetstoneError, match=r"at least 4096 tokens .* for 0.5 s: .*small/v1: 2048 tokens"):
                async with pool.lease(4096):
                    pass
            assert time.monotonic() - started >= 0.5
        finally:
            await pool.close()

    asyncio.run(scenario())
