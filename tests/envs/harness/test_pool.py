"""The server pool against real inference servers (engine + HTTP app in threads of this process)."""

import asyncio
import time

import pytest

from tests.orchestrator.orchestrator_support import ThreadServer, Trainer, model_folder, thread_servers
from whetstone.envs.harness import EndpointConfig, PolicyError, Sampling, ServerPool
from whetstone.errors import WhetstoneError
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


def test_a_server_stuck_on_old_weights_is_up_and_behind_while_a_stopped_one_is_down():
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers = {
        "/stale/health": {"status": "weights stale", "weight_version": 14, "latest_weight_version": 15},
        "/stopped/health": {"status": "engine stopped", "weight_version": 14},
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(answers[self.path]).encode()
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    async def scenario():
        pool = ServerPool([f"{base}/stale/v1", f"{base}/stopped/v1"], ENDPOINT)
        try:
            stale, stopped = [await pool.health(s) for s in pool.servers]
            assert stale["weight_version"] == 14 and stopped is None
        finally:
            await pool.close()

    try:
        asyncio.run(scenario())
    finally:
        server.shutdown()


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
