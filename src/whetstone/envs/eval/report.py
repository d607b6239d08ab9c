"""The evaluation report: pass@k, rewards, cheat flags, effort and failures, as JSON and Markdown.

A rollout counts as solved when it ran (`status == "ok"`), raised no cheat flag and every
required test passed: the grader's `tests` term is 1.0 exactly then (an unsolved rollout gets
at most `partial_credit` <= 0.5). A failed rollout counts as a sample that did not solve its
task, so infrastructure trouble lowers the scores rather than hiding; the failures are listed.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import Any

from whetstone.envs.eval.passk import mean_pass_at_k, pass_at_k
from whetstone.envs.trajectory import Trajectory

MAX_LISTED_FAILURES = 50
NOT_MEASURED = "not measured (no rollout ran)"
"""What report.md shows for a figure of the rollouts that ran when none did."""


def solved(trajectory: Trajectory) -> bool:
    return trajectory.status == "ok" and not trajectory.cheat_flags and trajectory.solved


def _spread(values: list[float]) -> dict[str, float | None]:
    """Mean, median and maximum of `values`; each None when there are none (every rollout failed):
    not measured, which a 0 would hide behind a figure no model reaches."""
    if not values:
        return {"mean": None, "p50": None, "max": None}
    return {"mean": statistics.fmean(values), "p50": statistics.median(values), "max": max(values)}


def _means(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({key for d in dicts for key in d})
    return {key: statistics.fmean(d.get(key, 0.0) for d in dicts) for key in keys}


def _by_task(trajectories: list[Trajectory]) -> dict[str, list[Trajectory]]:
    by_task: dict[str, list[Trajectory]] = {}
    for trajectory in trajectories:
        by_task.setdefault(trajectory.task_id, []).append(trajectory)
    return by_task


def _counts(by_task: dict[str, list[Trajectory]]) -> dict[str, tuple[int, int]]:
    """(samples, solved) of each task."""
    return {task_id: (len(group), sum(map(solved, group))) for task_id, group in by_task.items()}


def temperature_point(temperature: float, trajectories: list[Trajectory], ks: list[int]) -> dict[str, Any]:
    """The rollouts at one sampling temperature of a sweep: pass@k, and each task's solved samples
    (what the paired statistics of envs/eval/sweep.py read)."""
    counts = _counts(_by_task(trajectories))
    return {
        "temperature": temperature,
        "pass_at_k": {str(k): mean_pass_at_k(list(counts.values()), k) for k in ks} if counts else {},
        "rollouts": len(trajectories),
        "failed_rollouts": sum(t.status != "ok" for t in trajectories),
        "per_task": [{"task_id": task_id, "samples": n, "solved": c} for task_id, (n, c) in counts.items()],
    }


def build_report(trajectories: list[Trajectory], ks: list[int], run: dict[str, Any]) -> dict[str, Any]:
    """The report of one evaluation; `run` describes it (endpoint, model, config, wall clock)."""
    by_task = _by_task(trajectories)
    counts = _counts(by_task)
    ran = [t for t in trajectories if t.status == "ok"]
    # Rollouts flagged, by kind: one rollout may hold several flags of a kind (two conftest.py files).
    flags = Counter(kind for t in trajectories for kind in {flag.split(":")[0] for flag in t.cheat_flags})
    per_task = [
        {
            "task_id": task_id,
            "samples": n,
            "solved": c,
            "pass_at_k": {str(k): pass_at_k(n, c, k) for k in ks},
            "mean_reward": statistics.fmean(t.reward for t in by_task[task_id]),
        }
        for task_id, (n, c) in counts.items()
    ]
    failures = [{"task_id": t.task_id, "error": t.error} for t in trajectories if t.status != "ok"]
    return {
        **run,
        "tasks": len(by_task),
        "rollouts": len(trajectories),
        "solved_rollouts": sum(c for _, c in counts.values()),
        "pass_at_k": {str(k): mean_pass_at_k(list(counts.values()), k) for k in ks} if counts else {},
        "reward": {**_spread([t.reward for t in trajectories]), "breakdown": _means([t.reward_breakdown for t in ran])},
        "cheat_flags": dict(sorted(flags.items())),
        "flagged_rollouts": sum(1 for t in trajectories if t.cheat_flags),
        "turns": _spread([t.turns for t in ran]),
        "completion_tokens": _spread([t.completion_tokens for t in ran]),
        "segments": _spread([len(t.segments) for t in ran]),
        "invalid_tool_calls": _spread([t.invalid_tool_calls for t in ran]),
        "timings_s": _means([t.timings for t in trajectories]),
        "failed_rollouts": len(trajectories) - len(ran),
        "failures": failures[:MAX_LISTED_FAILURES],
        "per_task": per_task,
    }


def _number(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# Evaluation of `{report.get('model', '?')}`", ""]
    lines += [
        f"{report['tasks']} tasks, {report['rollouts']} rollouts ({report['solved_rollouts']} solved, "
        f"{report['failed_rollouts']} failed) in {report.get('wall_clock_s', 0):.1f} s against "
        f"{report.get('endpoint', '?')}.",
        "",
    ]
    lines += ["| metric | value |", "|---|---|"]
    lines += [f"| pass@{k} | {value:.3f} |" for k, value in report["pass_at_k"].items()]
    sweep = report.get("temperatures", [])
    for name in ("reward", "turns", "completion_tokens", "segments", "invalid_tool_calls"):
        spread = report[name]
        shown = " / ".join(_number(spread[key]) for key in ("mean", "p50", "max"))
        shown = NOT_MEASURED if spread["mean"] is None else shown
        lines.append(f"| {name} (mean / p50 / max) | {shown} |")
    lines.append(f"| cheat-flagged rollouts | {report['flagged_rollouts']} |")
    if len(sweep) > 1:
        ks = list(report["pass_at_k"])
        lines += ["", "## By sampling temperature (same tasks, same seeds)", ""]
        lines += [
            "| temperature | " + " | ".join(f"pass@{k}" for k in ks) + " | failed |",
            "|---|" + "---|" * (len(ks) + 1),
        ]
        for point in sweep:
            cells = " | ".join(f"{point['pass_at_k'][k]:.3f}" for k in ks)
            lines.append(f"| {point['temperature']:g} | {cells} | {point['failed_rollouts']} |")
    lines += ["", "## Reward breakdown (mean over rollouts that ran)", "", "| term | mean |", "|---|---|"]
    lines += [f"| {key} | {value:.4f} |" for key, value in report["reward"]["breakdown"].items()]
    if report["cheat_flags"]:
        lines += ["", "## Cheat flags", "", "| kind | rollouts |", "|---|---|"]
        lines += [f"| {kind} | {count} |" for kind, count in report["cheat_flags"].items()]
    lines += ["", "## Time per rollout (mean seconds)", "", "| phase | s |", "|---|---|"]
    lines += [f"| {key} | {value:.2f} |" for key, value in report["timings_s"].items()]
    if report["failures"]:
        lines += ["", "## Failed rollouts", ""]
        lines += [f"- {_code(f['task_id'])}: {_one_line(f['error'])}" for f in report["failures"]]
    ks = list(report["pass_at_k"])
    lines += [
        "",
        "## Per task",
        "",
        "| task | solved | mean reward | " + " | ".join(f"pass@{k}" for k in ks) + " |",
        "|---|---|---|" + "---|" * len(ks),
    ]
    for row in report["per_task"]:
        cells = " | ".join(f"{row['pass_at_k'][k]:.3f}" for k in ks)
        task = _code(row["task_id"]).replace("|", "\\|")
        lines.append(f"| {task} | {row['solved']}/{row['samples']} | {row['mean_reward']:.3f} | {cells} |")
    return "\n".join(lines) + "\n"


def _code(text: str) -> str:
    """`text` as inline code in Markdown, whatever backticks it holds (a fence one longer than its
    longest run of them)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _one_line(text: str) -> str:
    """`text` on one line (a list item of report.md): its line breaks as spaces."""
    return " ".join(str(text).split())
