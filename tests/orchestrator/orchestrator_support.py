"""Shared pieces of the orchestrator tests (no tests here): a tiny served model, a weight store
the test publishes into (standing in for the trainer's publishing, nothing else), real inference
servers following it, and synth tasks.

With random weights the model never solves a task, so every reward is 0 and every group is
dropped for lack of variance. `coin_tasks` are synth tasks with the reference solution already in
the repository plus one more required hidden test that passes with probability 1/2: rollouts are
graded for real, and half the groups of two get rewards that differ (1 against 0), so
batches fill without a trained model. The effort and invalid-call penalties are off: a random
model's replies differ in how many invalid calls they make, and with penalties two solved
rollouts would differ by a few hundredths and count as a group with variance.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from tests.envs.harness.harness_support import save_tiny_model
from whetstone.bench.pipeline import coin_tasks as bench_coin_tasks
from whetstone.envs.grading.reward import RewardConfig
from whetstone.envs.harness import EndpointConfig, HarnessConfig, RolloutConfig
from whetstone.envs.task import Task
from whetstone.envs.tasks import load_source
from whetstone.orchestrator import OrchestratorConfig
from whetstone.store import LocalStore
from whetstone.sync import Publisher, SyncConfig, WeightStore
from whetstone.utils.processes import RoleProcess, free_port

torch.set_num_threads(1)
POLL_S = 0.1


def sync_config(weights: Path, mirrors: list[Path] = ()) -> SyncConfig:
    return SyncConfig(store=str(weights), publish_dtype="keep", poll_interval=POLL_S, mirrors=[str(m) for m in mirrors])


class Trainer:
    """Publishes weight versions the way the trainer does (version n + 1 after step n)."""

    def __init__(self, model_dir: str, weights: Path, mirrors: list[Path] = ()):
        """`mirrors`: the inference clusters' weight stores every version is copied into."""
        from whetstone.model.hf import load_hf

        self.state = load_hf(model_dir).state_dict()
        self.publisher = Publisher(WeightStore(LocalStore(weights)), sync_config(weights, mirrors))

    def publish(self) -> int:
        """The next version: the weights nudged a little, as an optimizer step would."""
        if self.publisher.store.latest() is not None:
            self.state = {
                name: t + 1e-3 * torch.randn_like(t) if t.is_floating_point() else t for name, t in self.state.items()
            }
        return self.publisher.publish(self.state).version


def synth_tasks(count: int = 2) -> list[Task]:
    return load_source("synth", [f"count={count}", "seed=5"])


def coin_tasks(count: int = 2) -> list[Task]:
    return bench_coin_tasks(count, seed=5)


def orchestrator_config(tmp_path: Path, model_dir: str, servers: list[str], **changes) -> OrchestratorConfig:
    """Tiny budgets: two short turns per rollout (trained even when cut off: random weights rarely
    end a turn), groups of 2, one group per batch, two batches, no stop for groups without
    reward variance."""
    harness = HarnessConfig(
        tokenizer_path=model_dir,
        max_turns=2,
        max_turn_tokens=12,
        max_tool_tokens=128,
        max_calls_per_turn=2,
        summary_tokens=16,
        train_cut_off_calls=True,
    )
    fields = dict(
        servers=servers,
        endpoint=EndpointConfig(retries=0, timeout_s=60),
        harness=harness,
        rollout=RolloutConfig(concurrency=4, reward=RewardConfig(effort_penalty_max=0.0, invalid_call_penalty=0.0)),
        validate_tasks=False,
        group_size=2,
        groups_per_batch=1,
        batch_store=str(tmp_path / "batches"),
        weight_store=str(tmp_path / "weights"),
        poll_interval_s=POLL_S,
        health_interval_s=0.2,
        no_server_timeout_s=60,
        max_batches=2,
        # a random model's groups of 2 often score alike, and with one group a batch 20 such groups
        # in a row happen: tests of other things do not stop there (the stop has its own test)
        max_fruitless_batches=0,
    )
    return OrchestratorConfig(**{**fields, **changes})


def model_folder(tmp_path: Path) -> str:
    return save_tiny_model(tmp_path)


class ThreadServer:
    """The real inference server (engine, HTTP app, weight follower) in a thread of this process,
    on a fixed port so that it can be stopped and started again at the same address."""

    def __init__(
        self,
        model_dir: str,
        weights: Path,
        port: int | None = None,
        cluster: str | None = None,
        registry: Path | None = None,
        max_batch: int = 8,
        rollout_slots: int = 0,
    ):
        """`cluster`: announce the server in the fleet registry with this label, in `registry`
        (a store other than the `weights` it follows, e.g. the main store of a mirror) or else
        in `weights`, lending `rollout_slots` of its `max_batch` slots to rollouts (0: all)."""
        self.model_dir, self.weights, self.port, self.cluster = model_dir, weights, port or free_port(), cluster
        self.registry, self.max_batch, self.rollout_slots = registry, max_batch, rollout_slots
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._server = self._thread = None

    def start(self) -> ThreadServer:
        import uvicorn

        from whetstone.fleet import FleetConfig
        from whetstone.inference.config import EngineConfig, ServeConfig
        from whetstone.inference.launch import build_app

        config = ServeConfig(
            model_path=self.model_dir,
            port=self.port,
            threads=1,
            engine=EngineConfig(max_batch=self.max_batch),
            sync=sync_config(self.weights),
            fleet=FleetConfig(
                announce=self.cluster is not None,
                cluster=self.cluster or "default",
                heartbeat_s=0.2,
                registry=str(self.registry or ""),
                rollout_slots=self.rollout_slots,
            ),
        )
        self._server = uvicorn.Server(
            uvicorn.Config(build_app(config), host="127.0.0.1", port=self.port, log_level="warning")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
            self._server = None


@contextlib.contextmanager
def thread_servers(model_dir: str, weights: Path, count: int = 2) -> Iterator[list[ThreadServer]]:
    servers = [ThreadServer(model_dir, weights).start() for _ in range(count)]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


class ProcessServer:
    """`whetstone serve` as its own process (what `whetstone run` starts), killable with SIGKILL
    and restartable at the same address."""

    def __init__(self, model_dir: str, weights: Path, folder: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        config = folder / f"serve-{self.port}.toml"
        config.write_text(
            f'model_path = "{model_dir}"\nport = {self.port}\nthreads = 1\n[engine]\nmax_batch = 8\n'
            f'[sync]\nstore = "{weights}"\npublish_dtype = "keep"\npoll_interval = {POLL_S}\n'
        )
        self.role = RoleProcess(
            f"serve-{self.port}",
            ["serve", str(config)],
            folder / f"serve-{self.port}.log",
            health_url=f"http://127.0.0.1:{self.port}/health",
            threads=1,
        )

    def start(self) -> ProcessServer:
        self.role.start()
        return self

    def wait_healthy(self, timeout_s: float = 90) -> None:
        self.role.wait_healthy(timeout_s)

    def kill(self) -> None:
        self.role.kill()
