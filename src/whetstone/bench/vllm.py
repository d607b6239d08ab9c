"""vLLM against whetstone's engine as the rollout engine, side by side in one run.

On the same model (the embedded default's tiny MoE, random weights, as `bench pipeline` makes it),
the same coin tasks and the same harness (one turn per rollout, temperature 1), each engine runs
as `whetstone run` starts it (`whetstone serve`, or vLLM through `integrations.vllm_serve` in its
own virtual environment), following the same weight store:

- rollouts/s: `tasks x samples` rollouts through the server pool (`concurrency` at once), graded;
- mismatch: the trainer's forward (`bench.consistency.mismatch`, no replay) on those rollouts
  against the logprobs the engine returned: k3 KL and max |Δ logprob|;
- publish -> serving: seconds from a version's publication (the publisher's return) to the server
  reporting it (`/health` for whetstone, vLLM's `/weight_info` as `vllm_serve` tags it), median
  over `versions` publications of small deltas.

    whetstone bench vllm --json        (needs $WHETSTONE_VLLM_PYTHON or --vllm-python)
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from whetstone.bench.options import check_at_least
from whetstone.errors import WhetstoneError

ENGINES = ("whetstone", "vllm")


def served_version(engine: str, url: str) -> int | None:
    """The weight version the server reports now (None while it reports none or is down)."""
    root = url.removesuffix("/v1")
    try:
        if engine == "vllm":
            version = str(httpx.get(root + "/weight_info", timeout=5).json().get("weight_version"))
            return int(version) if version.isdigit() else None
        return httpx.get(root + "/health", timeout=5).json().get("weight_version")
    except (httpx.HTTPError, ValueError):
        return None


def wait_for_version(engine: str, url: str, version: int, timeout_s: float) -> float:
    """Seconds until the server reports `version`."""
    started = time.perf_counter()
    while served_version(engine, url) != version:
        if time.perf_counter() - started > timeout_s:
            raise WhetstoneError(f"{engine} server did not serve weight version {version} within {timeout_s:g} s")
        time.sleep(0.01)
    return time.perf_counter() - started


def start_server(engine: str, folder: Path, model_dir: str, sync, python: str, timeout_s: float):
    """`engine`'s server following the store of `sync`, healthy; returns (process, API root)."""
    from whetstone.config import write_toml
    from whetstone.inference.config import EngineConfig, ServeConfig
    from whetstone.integrations.vllm import serve_command, whetstone_path
    from whetstone.utils.processes import RoleProcess, free_port

    port = free_port()
    log = folder / f"{engine}.log"
    health = f"http://127.0.0.1:{port}/health"
    if engine == "vllm":
        command = serve_command(
            python, model_dir, port, sync.model_dump_json(), 0, ["--max-model-len", "1024", "--enforce-eager"]
        )
        env = {"PYTHONPATH": whetstone_path(folder / "vllm-path")}
        server = RoleProcess("vllm", [], log, health_url=health, env=env, command=command)
    else:
        config = ServeConfig(model_path=model_dir, port=port, threads=1, engine=EngineConfig(max_batch=16), sync=sync)
        path = folder / "serve.toml"
        write_toml(path, config)
        server = RoleProcess("serve", ["serve", str(path)], log, health_url=health, threads=1)
    server.start()
    try:
        server.wait_healthy(timeout_s)
    except BaseException:
        server.stop()
        raise
    return server, f"http://127.0.0.1:{port}/v1"


def rollouts(engine: str, url: str, tasks, model_dir: str, samples: int, max_tokens: int, concurrency: int):
    """The tasks' rollouts on the server, and the seconds they took."""
    from whetstone.envs.grading.reward import RewardConfig
    from whetstone.envs.harness import (
        AgentHarness,
        EndpointConfig,
        HarnessConfig,
        RolloutConfig,
        ServerPool,
        run_rollouts,
    )

    harness = AgentHarness.from_config(
        HarnessConfig(
            tokenizer_path=model_dir,
            max_turns=1,
            max_turn_tokens=max_tokens,
            max_tool_tokens=128,
            max_calls_per_turn=2,
            summary_tokens=16,
            train_cut_off_calls=True,
        )
    )
    config = RolloutConfig(concurrency=concurrency, reward=RewardConfig(effort_penalty_max=0.0))

    async def run():
        pool = await ServerPool.connect([url], EndpointConfig(engine=engine, retries=0))
        try:
            pool.require_one()
            started = time.perf_counter()
            done = await run_rollouts(tasks, pool, harness, config, samples=samples, seed=0)
            return done, time.perf_counter() - started
        finally:
            await pool.close()

    return asyncio.run(run())


def mismatch(trajectories, model_dir: str, state: dict[str, torch.Tensor]) -> dict[str, float]:
    """The trainer's forward under `state` against the rollouts' logprobs."""
    from whetstone.bench.consistency import mismatch as measure
    from whetstone.model.hf import load_hf
    from whetstone.rl.batch import collate
    from whetstone.rl.samples import trajectory_samples

    ok = [t for t in trajectories if t.status == "ok" and t.calls]
    if not ok:
        raise WhetstoneError(f"no rollout finished: {[t.error for t in trajectories][:3]}")
    model = load_hf(model_dir)
    model.load_state_dict(state)
    found = measure(model, collate([s for t in ok for s in trajectory_samples(t)]), "float32", "fast")
    return {key: found[key] for key in ("k3_kl", "max_abs_logprob_diff", "bitwise_equal_fraction", "tokens")}


def run(
    tasks: int = 4,
    samples: int = 2,
    max_tokens: int = 48,
    concurrency: int = 4,
    versions: int = 3,
    vllm_python: str = "",
    start_timeout_s: float = 900.0,
) -> dict[str, Any]:
    from whetstone.bench.pipeline import coin_tasks, random_model
    from whetstone.integrations.vllm import vllm_python as find_python
    from whetstone.model.hf import load_hf
    from whetstone.sync import Publisher, SyncConfig, WeightStore

    check_at_least(
        ("tasks", tasks, 1),
        ("samples", samples, 1),
        ("max_tokens", max_tokens, 1),
        ("concurrency", concurrency, 1),
        ("versions", versions, 1),  # publish -> serving is their median
    )
    python = find_python(vllm_python)
    task_list = coin_tasks(tasks, seed=5)
    result: dict[str, Any] = {"tasks": tasks, "samples": samples, "max_tokens": max_tokens, "concurrency": concurrency}
    with tempfile.TemporaryDirectory(prefix="whetstone-bench-vllm-") as tmp:
        folder = Path(tmp)
        model_dir = str(random_model(folder, task_list))
        sync = SyncConfig(store=str(folder / "weights"), publish_dtype="keep", poll_interval=0.02)
        publisher = Publisher(WeightStore.open(sync), sync)
        state = load_hf(model_dir).state_dict()
        latest = publisher.publish(state).version
        generator = torch.Generator().manual_seed(0)
        for engine in ENGINES:
            server, url = start_server(engine, folder, model_dir, sync, python, start_timeout_s)
            try:
                wait_for_version(engine, url, latest, start_timeout_s)
                done, seconds = rollouts(engine, url, task_list, model_dir, samples, max_tokens, concurrency)
                figures: dict[str, Any] = {"rollouts_per_s": len(done) / seconds, "rollouts": len(done)}
                figures["rollouts_failed"] = sum(t.status != "ok" for t in done)
                figures.update(mismatch(done, model_dir, state))
                waits = []
                for _ in range(versions):
                    state = {k: v + 1e-3 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
                    latest = publisher.publish(state).version
                    waits.append(wait_for_version(engine, url, latest, start_timeout_s))
                figures["publish_to_serving_s"] = statistics.median(waits)
                figures["publish_to_serving_max_s"] = max(waits)
            finally:
                server.stop()
            result[engine] = figures
    return result


if __name__ == "__main__":  # `whetstone bench vllm`, options included
    from whetstone.bench.cli import run_as_module

    run_as_module("vllm")
