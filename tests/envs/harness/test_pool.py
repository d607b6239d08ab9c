"""The server pool against real inference servers (engine + HTTP app in threads of this process)."""

import asyncio
import time

import pytest

from tests.orchestrator.orchestrator_support import ThreadServer, Trainer, model_folder, thread_servers
from whetstone.envs.harness import EndpointConfig, PolicyError, Sampling, ServerPool
from whetstone.errors import WhetstoneError

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
                assert pool.stats()["servers_alive"] == 1 and pool.calls_rerun == 1 and pool.servers[0].failures == 1
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
