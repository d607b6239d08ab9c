"""`whetstone bench fleet`: the elastic inference fleet on this machine, with real `whetstone serve`
processes, a weight store, the fleet registry and the server pool the orchestrator uses.

    scaling       rollouts/s with 1, 2, 4 servers (the same rollouts, concurrency 4 per server),
                  and the scaling efficiency rollouts_per_s(n) / (n * rollouts_per_s(1))
    join          a server started while the store is `behind` versions ahead of its model folder
                  (a keyframe and deltas): seconds from its start to its first answer, to its
                  catch-up (reporting the newest version), and to its first rollout on the
                  current weights; catch_up_s is the part spent catching up
    cluster_loss  two clusters of one server each; the whole `us` cluster is killed (SIGKILL)
                  while rollouts run: rollouts lost (failed) of all started (goal 0)

The rollouts are coin tasks (`bench.pipeline.coin_tasks`) on a random tiny model with small
budgets: real sandboxes and grading, so rollouts/s counts the whole rollout, not only decoding.
On a machine with few cores the servers share them and scaling is sublinear by construction.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from whetstone.bench.options import check_at_least
from whetstone.config import write_toml
from whetstone.envs.harness import AgentHarness, EndpointConfig, HarnessConfig, RolloutConfig, ServerPool, rollout
from whetstone.envs.task import Task
from whetstone.fleet import FleetConfig, FleetRegistry
from whetstone.inference.config import EngineConfig, ServeConfig
from whetstone.store import LocalStore
from whetstone.sync import Publisher, SyncConfig, WeightStore
from whetstone.utils.processes import RoleProcess, free_port

PER_SERVER_CONCURRENCY = 4
HARNESS = dict(max_turns=2, max_turn_tokens=16, max_tool_tokens=128, max_calls_per_turn=2, summary_tokens=16)


class Fleet:
    """The bench's world: a model folder, a weight store, and `whetstone serve` processes."""

    def __init__(self, work: Path, tasks: list[Task]):
        from whetstone.bench.pipeline import random_model

        self.work, self.tasks = work, tasks
        self.model_dir = random_model(work / "model-src", tasks)
        self.weights = work / "weights"
        self.sync = SyncConfig(store=str(self.weights), publish_dtype="keep", poll_interval=0.1)
        self.publisher = Publisher(WeightStore(LocalStore(self.weights)), self.sync)
        self.roles: list[RoleProcess] = []

    def publish(self, count: int = 1) -> int:
        """`count` more versions (the weights nudged as an optimizer step would); the newest."""
        import torch

        from whetstone.model.hf import load_hf

        state = getattr(self, "_state", None) or load_hf(self.model_dir).state_dict()
        for _ in range(count):
            if self.publisher.store.latest() is not None:
                state = {k: t + 1e-3 * torch.randn_like(t) if t.is_floating_point() else t for k, t in state.items()}
            version = self.publisher.publish(state).version
        self._state = state
        return version

    def start_server(self, cluster: str = "default") -> RoleProcess:
        port = free_port()
        config = ServeConfig(
            model_path=str(self.model_dir),
            port=port,
            threads=1,
            engine=EngineConfig(max_batch=8),
            sync=self.sync,
            fleet=FleetConfig(announce=True, cluster=cluster, heartbeat_s=0.5),
        )
        path = self.work / f"serve-{port}.toml"
        write_toml(path, config)
        role = RoleProcess(
            f"serve-{port}",
            ["serve", str(path)],
            self.work / f"serve-{port}.log",
            health_url=f"http://127.0.0.1:{port}/health",
            threads=1,
        ).start()
        role.url = f"http://127.0.0.1:{port}/v1"
        self.roles.append(role)
        return role

    def stop_all(self) -> None:
        for role in self.roles:
            role.stop(grace_s=10)
        self.roles.clear()

    async def pool(self, **options) -> ServerPool:
        registry = FleetRegistry(LocalStore(self.weights))
        return await ServerPool.connect([], EndpointConfig(retries=0, timeout_s=120), registry=registry, **options)

    async def rollouts(self, pool: ServerPool, count: int, concurrency: int) -> list:
        harness = AgentHarness.from_config(HarnessConfig(tokenizer_path=str(self.model_dir), **HARNESS))
        config = RolloutConfig(concurrency=concurrency)
        gate = asyncio.Semaphore(concurrency)

        async def one(index: int):
            async with gate, pool.lease() as policy:
                return await rollout(self.tasks[index % len(self.tasks)], policy, harness, config)

        return await asyncio.gather(*(one(i) for i in range(count)))


async def _until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


async def scaling(fleet: Fleet, sizes: list[int], rollouts_per_server: int) -> dict[str, Any]:
    """Rollouts/s with each number of servers (started fresh for each size)."""
    out: dict[str, Any] = {}
    for size in sizes:
        servers = [fleet.start_server() for _ in range(size)]
        for server in servers:
            server.wait_healthy(180)
        pool = await fleet.pool()
        try:
            await _until(lambda p=pool, n=size: sum(s.alive for s in p.servers) == n, 60, "servers joining the pool")
            await fleet.rollouts(pool, size, size)  # warm-up: one rollout per server
            started = time.perf_counter()
            done = await fleet.rollouts(pool, rollouts_per_server * size, PER_SERVER_CONCURRENCY * size)
            elapsed = time.perf_counter() - started
        finally:
            await pool.close()
            fleet.stop_all()
        out[f"rollouts_per_s_{size}"] = round(len(done) / elapsed, 3)
        out[f"failed_{size}"] = sum(t.status == "failed" for t in done)
    base = out.get("rollouts_per_s_1")
    for size in sizes:
        if base:
            out[f"scaling_efficiency_{size}"] = round(out[f"rollouts_per_s_{size}"] / (size * base), 3)
    return out


async def join(fleet: Fleet, behind: int) -> dict[str, Any]:
    """A server joining while the store is `behind` versions past its model folder's weights."""
    latest = fleet.publish(behind)
    started = time.monotonic()
    server = fleet.start_server(cluster="late")
    health = server.health_url
    answered = caught_up = None
    async with httpx.AsyncClient(timeout=5) as client:
        while caught_up is None:
            if not server.running:
                raise RuntimeError(f"the joining server died: {server.log_tail()}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                body = (await client.get(health)).json()
                answered = answered or time.monotonic()
                if body.get("weight_version") == latest:
                    caught_up = time.monotonic()
            await asyncio.sleep(0.05)
    pool = await fleet.pool(min_version=lambda: latest, health_interval_s=0.1)
    try:
        await _until(lambda: any(s.alive for s in pool.servers), 60, "the late server joining the pool")
        (trajectory,) = await fleet.rollouts(pool, 1, 1)
        first_rollout = time.monotonic()
        versions = {v for call in trajectory.calls for v in call.versions}
    finally:
        await pool.close()
        fleet.stop_all()
    return {
        "behind_versions": behind,
        "first_answer_s": round(answered - started, 2),
        "catch_up_s": round(caught_up - answered, 2),
        "start_to_current_weights_s": round(caught_up - started, 2),
        "start_to_first_rollout_s": round(first_rollout - started, 2),
        "first_rollout_versions": sorted(versions),
    }


async def cluster_loss(fleet: Fleet, rollouts: int) -> dict[str, Any]:
    """Rollouts over clusters `eu` and `us`; `us` is killed once the first rollout finished."""
    eu, us = fleet.start_server("eu"), fleet.start_server("us")
    for server in (eu, us):
        server.wait_healthy(180)
    pool = await fleet.pool(health_interval_s=0.2)
    try:
        await _until(lambda: sum(s.alive for s in pool.servers) == 2, 60, "both clusters joining the pool")
        run = asyncio.create_task(fleet.rollouts(pool, rollouts, 2 * PER_SERVER_CONCURRENCY))
        await _until(lambda: sum(pool.rollouts.values()) >= 1 or run.done(), 300, "a first rollout")
        us.kill()
        killed_at = sum(pool.rollouts.values())
        done = await run
    finally:
        await pool.close()
        fleet.stop_all()
    return {
        "rollouts": len(done),
        "finished_before_the_kill": killed_at,
        "rollouts_lost": sum(t.status == "failed" for t in done),
        "calls_rerun": pool.calls_rerun,
        "finished_by_cluster": dict(pool.rollouts),
    }


@contextlib.contextmanager
def _work_dir(output_dir: str | None) -> Iterator[Path]:
    """`output_dir`, new or empty (`fresh_output_dir`: a previous run's weight store would put the
    servers more versions behind than `behind` says), or a temporary folder, removed after."""
    if output_dir:
        from whetstone.bench.pipeline import fresh_output_dir

        yield fresh_output_dir(output_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="whetstone-fleet-") as tmp:
            yield Path(tmp)


def run(
    sizes: list[int] = (1, 2, 4),
    rollouts_per_server: int = 8,
    behind: int = 10,
    loss_rollouts: int = 16,
    tasks: int = 8,
    output_dir: str | None = None,
) -> dict[str, Any]:
    from whetstone.bench.pipeline import coin_tasks

    check_at_least(
        ("servers", min(sizes, default=0), 1),  # 0 servers time no rollout; fewer never join the pool
        ("rollouts_per_server", rollouts_per_server, 1),
        ("behind", behind, 1),  # the joining server has versions to catch up on
        ("loss_rollouts", loss_rollouts, 1),
        ("tasks", tasks, 1),
    )
    with _work_dir(output_dir) as work:
        fleet = Fleet(work, coin_tasks(tasks))
        fleet.publish()  # version 0: the model folder's weights
        try:
            result = {
                "scaling": asyncio.run(scaling(fleet, list(sizes), rollouts_per_server)),
                "join": asyncio.run(join(fleet, behind)),
                "cluster_loss": asyncio.run(cluster_loss(fleet, loss_rollouts)),
            }
        finally:
            fleet.stop_all()
    result["machine"] = {"cpus": len(os.sched_getaffinity(0))}
    return result


if __name__ == "__main__":  # `whetstone bench fleet`, options included
    from whetstone.bench.cli import run_as_module

    run_as_module("fleet")
