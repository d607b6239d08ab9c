"""Temperature sweeps: each model's best temperature, and paired gains with their standard errors,
checked on inputs worked by hand."""

from __future__ import annotations

import json
import math

import pytest

from whetstone.envs.eval.config import EvalConfig
from whetstone.envs.eval.report import temperature_point
from whetstone.envs.eval.sweep import (
    _half,
    best_temperature,
    compare_sweeps,
    crossfit_gain,
    paired_gain,
    sweep_of,
)
from whetstone.envs.trajectory import Trajectory
from whetstone.errors import ConfigError, WhetstoneError

# Four tasks in two halves (by the hash of their id): t1, t2 and t0, t8.
BEFORE = {1.0: {"t1": 1.0, "t2": 1.0, "t0": 0.0, "t8": 0.0}, 0.5: {"t1": 0.0, "t2": 0.5, "t0": 1.0, "t8": 1.0}}
AFTER = {
    1.0: {"t1": 1.0, "t2": 1.0, "t0": 1.0, "t8": 0.5},
    0.5: {"t1": 0.5, "t2": 0.5, "t0": 1.0, "t8": 1.0},
    2.0: {"t1": 0.0, "t2": 0.0, "t0": 0.5, "t8": 0.0},  # T = 1 x a learned scale of 2
}


def test_the_paired_gain_is_the_mean_per_task_difference_and_its_standard_error():
    gain = paired_gain({"a": 1.0, "b": 0.5, "c": 1.0, "d": 0.0}, {"a": 0.5, "b": 0.5, "c": 0.0, "d": 0.0})
    # differences 0.5, 0, 1, 0: mean 0.375; squared deviations 0.6875 in all, over n - 1 = 3
    assert gain.value == 0.375 and gain.tasks == 4
    assert gain.se == pytest.approx(math.sqrt(0.6875 / 3) / math.sqrt(4))
    assert paired_gain({"a": 1.0, "x": 1.0}, {"a": 0.5, "y": 0.0}).tasks == 1  # only the tasks both scored
    assert paired_gain({"a": 1.0}, {"a": 0.5}).se is None  # no spread from one task
    with pytest.raises(WhetstoneError, match="no task was scored by both evaluations"):
        paired_gain({"a": 1.0}, {"b": 1.0})


def test_the_best_temperature_is_the_highest_mean_and_of_equals_the_highest_temperature():
    assert best_temperature(BEFORE, [1.0, 0.5]) == 0.5  # 0.625 against 0.5
    assert best_temperature(BEFORE, [1.0, 0.5], ["t1", "t2"]) == 1.0  # on those tasks alone
    assert best_temperature(AFTER, [1.0, 0.5]) == 1.0  # 2.0 is not a candidate
    ties = {1.0: {"a": 0.5}, 0.5: {"a": 0.5}, 0.3: {"a": 0.4}}
    assert best_temperature(ties, [0.3, 0.5, 1.0]) == 1.0
    with pytest.raises(WhetstoneError, match="no temperature"):
        best_temperature(ties, [])


def test_temperatures_that_solved_as_many_samples_tie_exactly():
    """3 of 10 samples at both: 0/5 + 3/5 and 1/5 + 2/5 differ in floating point (0.3 against
    0.30000000000000004), and the tie must still go to the higher temperature."""

    def point(t: float, solved: dict[str, int]) -> dict:
        return {"temperature": t, "per_task": [{"task_id": k, "samples": 5, "solved": c} for k, c in solved.items()]}

    sweep = sweep_of({"temperatures": [point(1.0, {"a": 0, "b": 3}), point(0.5, {"a": 1, "b": 2})]})
    assert best_temperature(sweep, [0.5, 1.0]) == 1.0
    compared = compare_sweeps(sweep, sweep, [1.0, 0.5], headline=1.0, logit_scale=None)
    assert compared["best_before"] == {"temperature": 1.0, "pass1": 0.3}
    assert compared["best_after"] == {"temperature": 1.0, "effective_temperature": 1.0, "pass1": 0.3}
    assert compared["gain_over_best_temperature"] == {"value": 0.0, "se": 0.0, "tasks": 2}
    json.dumps(compared)  # the summary holds it: plain numbers only


def test_the_crossfitted_gain_scores_each_half_at_the_temperatures_picked_on_the_other():
    assert [_half(t) for t in ("t1", "t2", "t0", "t8")] == [0, 0, 1, 1]
    gain = crossfit_gain(AFTER, BEFORE, [1.0, 0.5])
    # t1, t2 at the other half's picks (after 0.5, before 0.5): 0.5, 0; t0, t8 at theirs (1.0, 1.0): 1, 0.5
    assert gain.value == 0.5 and gain.tasks == 4
    assert gain.se == pytest.approx(math.sqrt(0.5 / 3) / 2)
    in_sample = paired_gain(AFTER[1.0], BEFORE[0.5])  # each at its own best over all four tasks
    assert in_sample.value == 0.25 and in_sample.se == pytest.approx(math.sqrt(1.25 / 3) / 2)
    one_half = {t: {"t1": s["t1"], "t2": s["t2"]} for t, s in BEFORE.items()}
    assert crossfit_gain(one_half, one_half, [1.0, 0.5]) is None


def test_comparing_sweeps_gives_both_curves_the_bests_and_the_gain_with_the_scale_removed():
    compared = compare_sweeps(BEFORE, AFTER, [1.0, 0.5], headline=1.0, logit_scale=2.0)
    assert compared["before"] == [{"temperature": 1.0, "pass1": 0.5}, {"temperature": 0.5, "pass1": 0.625}]
    assert compared["after"][0] == {"temperature": 2.0, "effective_temperature": 1.0, "pass1": 0.125}
    assert compared["best_before"] == {"temperature": 0.5, "pass1": 0.625}
    assert compared["best_after"] == {"temperature": 1.0, "effective_temperature": 0.5, "pass1": 0.875}
    assert compared["gain_over_best_temperature"]["value"] == 0.25
    assert compared["gain_over_best_temperature_crossfit"]["value"] == 0.5
    # the trained weights at the base's scale (sampled at 1 x 2) against the base at 1: -1, -1, 0.5, 0
    assert compared["scale_frozen_temperature"] == 2.0 and compared["gain_scale_frozen"]["value"] == -0.375
    unscaled = compare_sweeps(BEFORE, AFTER, [1.0, 0.5], headline=1.0, logit_scale=None)
    assert unscaled["gain_scale_frozen"]["value"] == 0.375  # no scale: the headline gain itself (0, 0, 1, 0.5)
    with pytest.raises(WhetstoneError, match="no sweep point at temperature 3 "):
        compare_sweeps(BEFORE, AFTER, [1.0, 0.5], headline=1.0, logit_scale=3.0)


def test_a_reports_sweep_is_read_back_as_task_scores():
    def trajectory(task: str, solved: bool) -> Trajectory:
        return Trajectory(task_id=task, solved=solved)

    points = [
        temperature_point(1.0, [trajectory("a", True), trajectory("a", False), trajectory("b", False)], [1]),
        temperature_point(0.5, [trajectory("a", True), trajectory("a", True), trajectory("b", True)], [1]),
    ]
    assert points[0]["pass_at_k"] == {"1": 0.25} and points[0]["rollouts"] == 3
    assert sweep_of({"temperatures": points}) == {1.0: {"a": 0.5, "b": 0.0}, 0.5: {"a": 1.0, "b": 1.0}}
    assert sweep_of({}) == {}


def test_the_evaluated_temperatures_start_with_the_harnesss_and_bad_ones_are_named():
    config = EvalConfig.model_validate(
        {"temperatures": [0.5, 1.0, 0.5, 0.2], "harness": {"sampling": {"temperature": 1.0}}}
    )
    assert config.evaluated_temperatures == [1.0, 0.5, 0.2]
    assert EvalConfig().evaluated_temperatures == [1.0]
    with pytest.raises((ConfigError, ValueError), match="temperatures"):
        EvalConfig.model_validate({"temperatures": [0.5, -0.1]})
