"""Run an evaluation: every task `samples` times through the harness against an endpoint, at each
of its temperatures, then write (optionally) trajectories.jsonl, report.md and report.json into
`output_dir`, each atomically, report.json last: it is there only beside the files of its own run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

from whetstone.config import expand_path, hide_password, without_secrets
from whetstone.envs.eval.config import EvalConfig
from whetstone.envs.eval.report import build_report, render_markdown, temperature_point
from whetstone.envs.harness import AgentHarness, ServerPool, run_rollouts
from whetstone.envs.task import Task
from whetstone.envs.trajectory import Trajectory, save_trajectories
from whetstone.errors import WhetstoneError
from whetstone.utils.atomic import atomic_write_json, atomic_write_text, writable_folder_problem, write_errors


def load_eval_tasks(config: EvalConfig) -> list[Task]:
    from whetstone.envs.tasks import load_tasks, load_valid_tasks

    tasks = load_valid_tasks(config.tasks, config.rollout.reward) if config.validate_tasks else load_tasks(config.tasks)
    if not tasks:
        raise WhetstoneError(f"no tasks to evaluate from source {config.tasks.source!r}")
    return tasks


def evaluate(
    config: EvalConfig, tasks: list[Task], on_done: Callable[[Trajectory], None] | None = None
) -> dict[str, Any]:
    """Evaluate, write the report files, and return the report: its figures are those at the
    harness's temperature; `temperatures` gives pass@k and per-task counts at each one evaluated.
    An `output_dir` that cannot be written is an error before any rollout, not after all of them."""
    out = expand_path(config.output_dir)
    if problem := writable_folder_problem(out):
        raise WhetstoneError(f"output_dir: {problem}; set output_dir to a folder the report can be written in")
    started, clock = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.monotonic()
    swept, model = asyncio.run(_rollouts(config, tasks, on_done))
    headline = config.evaluated_temperatures[0]
    run = {
        "model": model,
        "endpoint": ", ".join(map(hide_password, config.servers or [config.endpoint.base_url])),
        "started": started,
        "samples_per_task": config.samples,
        "wall_clock_s": time.monotonic() - clock,
        "config": without_secrets(config.model_dump(mode="json")),  # a server address's password as ***
    }
    report = build_report(swept[headline], config.k, run)
    report["temperatures"] = [temperature_point(t, group, config.k) for t, group in swept.items()]
    # report.json marks a finished evaluation, so it goes last: an earlier evaluation's files are
    # removed first, and a write that fails leaves no report.json beside another run's files.
    stale = ["report.json", "report.md", *([] if config.save_trajectories else ["trajectories.jsonl"])]
    for name in stale:
        with write_errors(out / name):
            (out / name).unlink(missing_ok=True)
    if config.save_trajectories:
        with write_errors(out / "trajectories.jsonl"):
            save_trajectories(out / "trajectories.jsonl", [t for group in swept.values() for t in group])
    with write_errors(out / "report.md"):
        atomic_write_text(out / "report.md", render_markdown(report))
    with write_errors(out / "report.json"):
        atomic_write_json(out / "report.json", report)
    return report


def evaluate_with_progress(config: EvalConfig, tasks: list[Task], description: str = "eval") -> dict[str, Any]:
    """`evaluate` with a progress bar on stderr counting solved and failed rollouts."""
    from whetstone.envs.eval.report import solved
    from whetstone.utils.progress import progress_bar

    counts = {"solved": 0, "failed": 0}
    total = len(tasks) * config.samples * len(config.evaluated_temperatures)
    with progress_bar(total, description, "rollout") as bar:

        def done(trajectory: Trajectory) -> None:
            counts["solved"] += solved(trajectory)
            counts["failed"] += trajectory.status != "ok"
            bar.update(1, **counts)

        return evaluate(config, tasks, done)


async def _rollouts(
    config: EvalConfig, tasks: list[Task], on_done: Callable[[Trajectory], None] | None
) -> tuple[dict[float, list[Trajectory]], str]:
    """Each temperature's rollouts, on one connection to the servers. Every temperature draws from
    the same seeds; the trajectories of a temperature other than the headline's have the group
    id `T=<temperature>/<task id>`."""
    concurrency = config.rollout.concurrency
    harnesses = _harnesses(config)
    # Tools and grading block in worker threads: enough of them that no rollout waits for one.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(concurrency + 2, thread_name_prefix="rollout"))
    pool = await ServerPool.connect(config.servers or [config.endpoint.base_url], config.endpoint)
    headline = config.evaluated_temperatures[0]
    swept: dict[float, list[Trajectory]] = {}
    try:
        pool.require_one()
        model = pool.model
        for temperature, harness in harnesses.items():
            swept[temperature] = await run_rollouts(
                tasks,
                pool,
                harness,
                config.rollout,
                samples=config.samples,
                group_prefix="" if temperature == headline else f"T={temperature:g}/",
                on_done=on_done,
                seed=None if config.seed < 0 else config.seed,
            )
    finally:
        await pool.close()
    return swept, model


def _harnesses(config: EvalConfig) -> dict[float, AgentHarness]:
    """The agent loop at each temperature evaluated, sharing one tokenizer."""
    loaded = AgentHarness.from_config(config.harness)
    return {
        t: AgentHarness(
            config.harness.model_copy(
                update={"sampling": config.harness.sampling.model_copy(update={"temperature": t})}
            ),
            loaded.tokenizer,
        )
        for t in config.evaluated_temperatures
    }
