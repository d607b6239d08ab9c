"""Temperature sweeps: pass@1 of a model at several sampling temperatures, and the paired
statistics that compare two models each at its own best temperature.

A model's pass@1 at temperature 1 says little on its own: sampling more sharply alone can be
worth many points, and RL that learns a logit scale (`rl.logit_scale`) gets exactly that. So an
evaluation may run its tasks at several temperatures (`EvalConfig.temperatures`, every one on the
same seeds), and two models are compared each at its best.

The gain of B over A at their best temperatures is paired over tasks: for task i,
d_i = p_B(i, T_B) - p_A(i, T_A), where p(i, T) is the share of task i's samples solved at
temperature T and T_A, T_B are the temperatures where A's and B's mean pass@1 is highest; the gain
is the mean of d_i and its standard error sd(d) / sqrt(n) (sample standard deviation, n tasks).
Picking each best on the same tasks it is then scored on flatters both maxima (the max of several
noisy estimates is biased up); the biases partly cancel in the difference but not exactly. The
cross-fitted gain has no such bias: the tasks are split in two halves by a hash of their id, each
half is scored at the temperatures picked on the other half, and d_i are pooled over both halves.
Its standard error leaves out the noise of the picks themselves.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from whetstone.errors import WhetstoneError

TaskScores = dict[str, Fraction | float]
"""pass@1 of each task (its solved samples / its samples), by task id: `sweep_of` gives exact
fractions, so that two temperatures that solved as many samples tie exactly (`best_temperature`)."""
Sweep = dict[float, TaskScores]
"""Each temperature's task scores."""


@dataclass(frozen=True)
class Gain:
    """A paired difference of mean pass@1 over `tasks` tasks, and its standard error (None under 2 tasks)."""

    value: float
    se: float | None
    tasks: int


def sweep_of(report: Mapping[str, Any]) -> Sweep:
    """An evaluation report's task scores at each temperature it ran (`report["temperatures"]`)."""
    return {
        float(entry["temperature"]): {
            row["task_id"]: Fraction(row["solved"], row["samples"]) for row in entry["per_task"]
        }
        for entry in report.get("temperatures", [])
    }


def mean_pass1(scores: TaskScores, tasks: Iterable[str] | None = None) -> float:
    """Mean pass@1 over `tasks` (default: every task scored)."""
    return float(_exact_mean(scores, tasks))


def _exact_mean(scores: TaskScores, tasks: Iterable[str] | None = None) -> Fraction:
    """Mean pass@1 over `tasks` without rounding (of a float score, its exact binary value): equal
    means compare equal, whatever the order and the rounding of the scores summed."""
    chosen = list(scores) if tasks is None else list(tasks)
    if not chosen:
        raise WhetstoneError("pass@1 of no tasks")
    return sum((Fraction(scores[task]) for task in chosen), Fraction(0)) / len(chosen)


def best_temperature(sweep: Sweep, temperatures: Iterable[float], tasks: Iterable[str] | None = None) -> float:
    """The temperature among `temperatures` with the highest mean pass@1 over `tasks`; of equal
    scores, the highest temperature (the least sharpening that does as well)."""
    chosen = list(tasks) if tasks is not None else None
    candidates = sorted(set(temperatures), reverse=True)
    if not candidates:
        raise WhetstoneError("no temperature to pick the best of")
    return max(candidates, key=lambda t: _exact_mean(sweep[t], chosen))  # max keeps the first of equals


def paired_gain(after: TaskScores, before: TaskScores) -> Gain:
    """Mean over tasks of after - before, with its standard error, over the tasks both scored."""
    return _gain([after[task] - before[task] for task in sorted(after.keys() & before.keys())])


def crossfit_gain(after: Sweep, before: Sweep, temperatures: Iterable[float]) -> Gain | None:
    """The gain at each model's best temperature, each half of the tasks scored at the
    temperatures picked on the other half (module docstring); None when a half is empty."""
    candidates = list(temperatures)
    tasks = sorted(set.intersection(*(set(scores) for scores in (*after.values(), *before.values()))))
    halves = ([t for t in tasks if _half(t) == 0], [t for t in tasks if _half(t) == 1])
    if not all(halves):
        return None
    differences = []
    for scored, picked_on in (halves, halves[::-1]):
        t_after = best_temperature(after, candidates, picked_on)
        t_before = best_temperature(before, candidates, picked_on)
        differences += [after[t_after][task] - before[t_before][task] for task in scored]
    return _gain(differences)


def _half(task_id: str) -> int:
    """Which half a task falls in: stable across runs and independent of the tasks' order."""
    return hashlib.sha256(task_id.encode()).digest()[0] & 1


def _gain(differences: list[float]) -> Gain:
    if not differences:
        raise WhetstoneError("no task was scored by both evaluations")
    n = len(differences)
    se = statistics.stdev(differences) / math.sqrt(n) if n > 1 else None
    return Gain(statistics.fmean(differences), se, n)


def compare_sweeps(
    before: Sweep, after: Sweep, temperatures: list[float], headline: float, logit_scale: float | None
) -> dict[str, Any]:
    """Both curves, each one's best over `temperatures`, the gain of `after` at its best over
    `before` at its best (in-sample and cross-fitted), and the gain with the logit scale removed:
    `after` holds weights whose logits are `logit_scale` times those it started from, so sampling
    it at T * scale samples the learned weights at the starting scale; compared with `before` at
    the `headline` temperature (the evaluations' own), that is the headline gain without the scale's
    share. `after` must hold `headline * logit_scale` when a scale is given."""
    scale = logit_scale or 1.0
    best_before = best_temperature(before, temperatures)
    best_after = best_temperature(after, temperatures)
    frozen_at = headline * scale
    if frozen_at not in after:
        raise WhetstoneError(
            f"the evaluation after holds no sweep point at temperature {frozen_at:g} (headline x scale)"
        )

    def point(sweep: Sweep, t: float, scaled: bool) -> dict[str, float]:
        effective = {"effective_temperature": t / scale} if scaled else {}
        return {"temperature": t, **effective, "pass1": mean_pass1(sweep[t])}

    at_best = paired_gain(after[best_after], before[best_before])
    frozen = paired_gain(after[frozen_at], before[headline])
    crossfit = crossfit_gain(after, before, temperatures)
    return {
        "headline_temperature": headline,
        "logit_scale": logit_scale,
        "temperatures": list(temperatures),
        "before": [point(before, t, scaled=False) for t in sorted(before, reverse=True)],
        "after": [point(after, t, scaled=True) for t in sorted(after, reverse=True)],
        "best_before": point(before, best_before, scaled=False),
        "best_after": point(after, best_after, scaled=True),
        "gain_over_best_temperature": asdict(at_best),
        "gain_over_best_temperature_crossfit": None if crossfit is None else asdict(crossfit),
        "scale_frozen_temperature": frozen_at,
        "gain_scale_frozen": asdict(frozen),
    }
