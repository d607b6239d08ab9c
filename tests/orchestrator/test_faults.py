"""Faults with real processes: two `whetstone serve` processes following the weight store; one is
killed (SIGKILL) while it is answering, later restarted at the same address."""

import asyncio
import time

import httpx
import pytest

from tests.orchestrator.orchestrator_support import (
    ProcessServer,
    Trainer,
    coin_tasks,
    model_folder,
    orchestrator_config,
)
from whetstone.orchestrator import Orchestrator
from whetstone.rl.batch import batch_from_bytes
from whetstone.rl.batch_store import batch_key
from whetstone.store import LocalStore

pytestmark = pytest.mark.slow


async def until(condition, run: asyncio.Task, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if run.done():
            run.result()  # raises what stopped the orchestrator
            raise AssertionError("the orchestrator stopped")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def weight_version(health_url: str) -> int:
    return httpx.get(health_url).json()["weight_version"]


def test_a_killed_server_loses_no_rollout_and_rejoins_after_a_restart(tmp_path):
    model_dir = model_folder(tmp_path)
    trainer = Trainer(model_dir, tmp_path / "weights")
    trainer.publish()
    servers = [ProcessServer(model_dir, tmp_path / "weights", tmp_path).start() for _ in range(2)]
    store = LocalStore(tmp_path / "batches")
    try:
        for server in servers:
            server.wait_healthy()
        harness = {
            "tokenizer_path": model_dir,
            "max_turns": 2,
            "max_turn_tokens": 48,
            "max_tool_tokens": 128,
            "max_calls_per_turn": 2,
            "summary_tokens": 16,
            "train_cut_off_calls": True,
        }
        config = orchestrator_config(tmp_path, model_dir, [s.url for s in servers], max_batches=0, harness=harness)
        orchestrator = Orchestrator(config, coin_tasks(2))

        async def train() -> None:
            """Stands in for the trainer's publishing: version n + 1 once batch n is in the store."""
            while True:
                if store.exists(batch_key(trainer.publisher.store.latest())):
                    await asyncio.to_thread(trainer.publish)
                await asyncio.sleep(0.1)

        async def scenario() -> None:
            run = asyncio.create_task(orchestrator.run())
            publishing = asyncio.create_task(train())
            await until(lambda: orchestrator.pool is not None and store.exists(batch_key(0)), run, "batch 0")
            victim = orchestrator.pool.servers[1]
            await until(lambda: victim.active_calls > 0, run, "a call on server 1")
            servers[1].kill()  # mid-answer
            await until(lambda: victim.failures == 1, run, "the call on server 1 to fail")
            after = len(store.list("batches/"))  # batches already complete may still be put before it fails
            await until(lambda: store.exists(batch_key(after + 1)), run, "two more batches")  # with the other server
            assert victim.failures == 1 and orchestrator.pool.calls_rerun >= 1 and not victim.alive
            await until(lambda: trainer.publisher.store.latest() >= 2, run, "version 2")
            published_while_down = trainer.publisher.store.latest()

            servers[1].start()
            await until(lambda: victim.alive, run, "server 1 back in the pool")
            calls = victim.calls
            await until(lambda: victim.calls > calls, run, "rollouts on server 1")

            def caught_up():
                return weight_version(victim.health_url) >= published_while_down

            await until(caught_up, run, "server 1 to catch up through the weight store")
            for task in (run, publishing):
                task.cancel()
            await asyncio.gather(run, publishing, return_exceptions=True)

        asyncio.run(scenario())
    finally:
        for server in servers:
            server.kill()

    for key in store.list("batches/"):
        meta = batch_from_bytes(store.get(key), key).meta
        assert "dropped_failed" not in meta["groups"], meta  # no rollout was lost to the dead server
        # both rollouts of the group came back (the lost call re-ran); a sample may still be dropped
        # as stale when the test's fast publishing outran it
        assert meta["rollouts"] >= 2 and meta["samples"] + meta["staleness_histogram"]["dropped_stale"] >= 2, meta
