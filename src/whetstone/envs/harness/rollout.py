"""Rollouts: a harness on a task in a fresh sandbox, graded afterwards; many at once.

    trajectories = await run_rollouts(tasks, policy, harness, RolloutConfig(concurrency=8), samples=4)
    trajectories = await run_rollouts(tasks, pool, harness, config)   # spread over a ServerPool

One rollout opens a sandbox over the task's snapshot, runs the task's setup, lets the harness
work (cancelled if it overruns the task's `time_limit_s` by more than `OVERRUN_GRACE_S`), takes
the workspace's changes and grades them with `grade()` in a fresh sandbox: reward, breakdown,
cheat flags and timings land in the trajectory. Sandbox work runs in worker threads, so the
sandboxes, tools and HTTP calls of concurrent rollouts overlap (size the event loop's default
executor to at least `concurrency`). A rollout that breaks is recorded as `failed` with the
reason and left out of the gradient; it is never lost and never stops the others.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from whetstone.envs.grading.grade import grade, workspace_changes
from whetstone.envs.grading.reward import Effort
from whetstone.envs.harness.base import Harness
from whetstone.envs.harness.config import RolloutConfig
from whetstone.envs.harness.policy import Policy, SeededPolicy
from whetstone.envs.harness.pool import ServerPool
from whetstone.envs.harness.workspace import head_tail
from whetstone.envs.sandbox import Sandbox, open_sandbox
from whetstone.envs.task import Task
from whetstone.envs.trajectory import Trajectory
from whetstone.errors import WhetstoneError

OVERRUN_GRACE_S = 30.0
log = logging.getLogger("whetstone.rollout")


async def rollout(
    task: Task, policy: Policy, harness: Harness, config: RolloutConfig, group_id: str = ""
) -> Trajectory:
    """One graded rollout. Never raises (except on cancellation): failures are recorded."""
    started = time.monotonic()
    timings: dict[str, float] = {}
    try:
        trajectory = await _graded_rollout(task, policy, harness, config, timings)
    except Exception as err:
        trajectory = Trajectory(task_id=task.id, status="failed", error=f"{type(err).__name__}: {err}")
    trajectory.task_id, trajectory.group_id = task.id, group_id
    if trajectory.status != "ok":
        trajectory.exclude_from_gradient = True
    trajectory.timings.update(timings, total=time.monotonic() - started)
    return trajectory


async def _graded_rollout(
    task: Task, policy: Policy, harness: Harness, config: RolloutConfig, timings: dict[str, float]
) -> Trajectory:
    clock = time.monotonic()
    snapshot = Path(task.repo_path) if task.repo_path else dict(task.repo_files)
    sandbox = await _open_sandbox(snapshot, config)
    try:
        await asyncio.to_thread(_setup, sandbox, task)
        timings["setup"] = time.monotonic() - clock
        try:
            trajectory = await asyncio.wait_for(harness.run(task, policy, sandbox), task.time_limit_s + OVERRUN_GRACE_S)
        except TimeoutError:
            raise WhetstoneError(f"the harness overran the task's time limit of {task.time_limit_s:g} s") from None
        changes = await asyncio.to_thread(workspace_changes, task, sandbox.workspace)
    finally:
        await _close(sandbox)
    if trajectory.status != "ok":
        return trajectory
    clock = time.monotonic()
    effort = Effort(
        turns=trajectory.turns, tokens=trajectory.completion_tokens, invalid_tool_calls=trajectory.invalid_tool_calls
    )
    try:
        graded = await asyncio.to_thread(grade, task, changes, config.reward, effort)
    except Exception as err:  # keep what the harness sampled, with the reason
        trajectory.status, trajectory.error = "failed", f"grading failed: {type(err).__name__}: {err}"
        return trajectory
    timings["grading"] = time.monotonic() - clock
    trajectory.reward, trajectory.reward_breakdown = graded.reward, graded.breakdown
    trajectory.solved = graded.passed
    trajectory.cheat_flags, trajectory.exclude_from_gradient = graded.cheat_flags, graded.exclude_from_gradient
    return trajectory


async def _open_sandbox(snapshot: Path | dict[str, str], config: RolloutConfig) -> Sandbox:
    """`open_sandbox` in a worker thread. Cancelling the await cannot stop the thread, so a
    sandbox it opens for a rollout cancelled meanwhile is closed rather than left behind: by the
    thread if it finishes after the cancellation, else here."""
    lock = threading.Lock()
    opened: list[Sandbox] = []
    abandoned = False

    def open_unless_abandoned() -> Sandbox:
        sandbox = open_sandbox(snapshot, config.sandbox)
        with lock:
            opened.append(sandbox)
            keep = not abandoned
        if not keep:
            sandbox.close()
        return sandbox

    try:
        return await asyncio.to_thread(open_unless_abandoned)
    except asyncio.CancelledError:
        with lock:
            abandoned = True
            unclaimed = list(opened)  # opened before the cancellation, but never handed over
        for sandbox in unclaimed:
            await _close(sandbox)
        raise


async def _close(sandbox: Sandbox) -> None:
    """`sandbox.close()` in a worker thread, awaited to its end even if the rollout is cancelled
    meanwhile. A stop cancels a rollout twice (asyncio.run's shutdown cancels every task, the
    orchestrator its rollouts), and with `to_thread` the second cancellation would cancel the
    close itself while it waits for a free worker: the sandbox's processes, workspace and cgroup
    would outlive the stop."""
    closing = asyncio.get_running_loop().run_in_executor(None, sandbox.close)
    cancelled: asyncio.CancelledError | None = None
    while not closing.done():
        try:
            await asyncio.shield(closing)
        except asyncio.CancelledError as stop:
            cancelled = stop
    if cancelled is not None:
        if closing.exception() is not None:  # read here, or asyncio reports it as never retrieved
            log.warning("closing the sandbox of a stopped rollout failed: %s", closing.exception())
        raise cancelled
    closing.result()


def _setup(sandbox: Sandbox, task: Task) -> None:
    """Run the task's setup commands; the first that does not succeed is an error saying why: it
    failed, it timed out, or it was stopped because the sandbox was closed (the rollout stopped)."""
    for command in task.setup:
        result = sandbox.run(command, timeout_s=task.test_time_limit_s)
        if result.sandbox_closed:
            raise WhetstoneError(f"setup command {command!r} stopped: the sandbox was closed while it ran")
        if result.exit_code != 0 or result.timed_out:
            output = head_tail(result.stdout + result.stderr, 2000)
            why = (
                f"timed out after {task.test_time_limit_s:g} s (test_time_limit_s)"
                if result.timed_out
                else f"failed (exit code {result.exit_code})"
            )
            raise WhetstoneError(f"setup command {command!r} {why}: {output}")


async def run_rollouts(
    tasks: Sequence[Task],
    policy: Policy | ServerPool,
    harness: Harness,
    config: RolloutConfig,
    *,
    samples: int = 1,
    group_prefix: str = "",
    on_done: Callable[[Trajectory], None] | None = None,
    seed: int | None = None,
) -> list[Trajectory]:
    """Each task `samples` times, `config.concurrency` at once. Results come in input order (the
    samples of a task together, sharing the group id `group_prefix + task.id`); `on_done` sees
    each as it finishes. With a `ServerPool`, each rollout leases the least-loaded live server
    that holds the harness's context window (`Harness.context_tokens`).
    `seed`: sample j of a task samples from seeds derived from (seed, task id, j) (`SeededPolicy`),
    the same under any weights; None = unseeded (RL groups must be: their samples must differ)."""
    gate = asyncio.Semaphore(config.concurrency)

    def seeded(task: Task, sample: int, leased: Policy) -> Policy:
        return leased if seed is None else SeededPolicy(leased, rollout_seed(seed, task.id, sample))

    async def one(task: Task, sample: int) -> Trajectory:
        async with gate:
            if isinstance(policy, ServerPool):
                async with policy.lease(harness.context_tokens) as leased:
                    trajectory = await rollout(
                        task, seeded(task, sample, leased), harness, config, group_id=group_prefix + task.id
                    )
            else:
                trajectory = await rollout(
                    task, seeded(task, sample, policy), harness, config, group_id=group_prefix + task.id
                )
        if on_done is not None:
            on_done(trajectory)
        return trajectory

    return await asyncio.gather(*(one(task, sample) for task in tasks for sample in range(samples)))


def rollout_seed(seed: int, task_id: str, sample: int) -> int:
    """A seed for sample `sample` of task `task_id`, stable across runs and processes (not `hash`),
    below 2**62, so a rollout's consecutive calls (seed + k) stay within the servers' 64 bits."""
    digest = hashlib.sha256(f"{seed}/{task_id}/{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2
