"""Group advantages, and which rollouts and groups are dropped (and counted)."""

from __future__ import annotations

import pytest

from tests.rl.conftest import call, trajectory
from whetstone.config import load_config
from whetstone.errors import ConfigError
from whetstone.rl.advantages import AdvantageConfig, advantage_fn, grpo, rloo
from whetstone.rl.advantages.groups import score_groups


def test_grpo_divides_the_centred_rewards_by_the_population_std():
    # rewards 1, 0, 0, 0: mean 0.25, std sqrt(3)/4
    third = 1 / 3**0.5
    assert grpo.compute([1.0, 0.0, 0.0, 0.0]) == pytest.approx([3 * third, -third, -third, -third], rel=1e-5)


def test_grpo_without_std_normalisation_stays_in_reward_units():
    assert grpo.compute([1.0, 0.0, 0.0, 0.0], normalize_std=False) == [0.75, -0.25, -0.25, -0.25]


def test_rloo_subtracts_the_mean_of_the_others():
    assert rloo.compute([1.0, 0.0, 0.0, 0.0]) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert rloo.compute([2.0, 4.0]) == [-2.0, 2.0]


def test_the_config_picks_the_estimator():
    assert advantage_fn(AdvantageConfig(estimator="rloo"))([2.0, 4.0]) == [-2.0, 2.0]
    assert advantage_fn(AdvantageConfig(normalize_std=False))([2.0, 4.0]) == [-1.0, 1.0]
    with pytest.raises(ConfigError, match="estimator"):
        load_config(AdvantageConfig, overrides=["estimator=ppo"])


def test_groups_without_variance_and_excluded_rollouts_are_dropped_and_counted():
    rollouts = [
        trajectory(group_id="a", reward=1.0),
        trajectory(group_id="a", reward=0.0),
        trajectory(group_id="a", reward=1.0, cheat_flags=["exit_before_tests"], exclude_from_gradient=True),
        trajectory(group_id="b", reward=1.0),
        trajectory(group_id="b", reward=1.0),  # all solved: nothing to learn
        trajectory(group_id="c", reward=1.0),
        trajectory(group_id="c", status="failed", exclude_from_gradient=True),
    ]
    kept, report = score_groups(rollouts, AdvantageConfig(normalize_std=False))
    assert [(t.group_id, t.reward, a) for t, a in kept] == [("a", 1.0, 0.5), ("a", 0.0, -0.5)]
    assert report.metrics() == {
        "groups": 3,
        "kept_groups": 1,
        "rollouts": 7,
        "kept_rollouts": 2,
        "dropped_cheat_flagged": 1,
        "dropped_failed": 1,
        "dropped_no_variance": 2,
        "dropped_small_group": 1,
    }


def test_a_flagged_rollout_the_grader_kept_is_a_negative_example():
    # With RewardConfig.exclude_flagged_from_gradient off, a cheat scores 0 and stays in its group.
    rollouts = [trajectory(reward=1.0), trajectory(reward=0.0, cheat_flags=["edited_tests"])]
    kept, report = score_groups(rollouts, AdvantageConfig(normalize_std=False))
    assert [a for _, a in kept] == [0.5, -0.5] and report.dropped == {}


def test_rollouts_without_a_group_id_group_by_task():
    rollouts = [trajectory(group_id="", task_id="x", reward=r) for r in (0.0, 1.0)]
    rollouts += [trajectory(group_id="", task_id="y", reward=1.0)]
    kept, report = score_groups(rollouts, AdvantageConfig())
    assert report.kept_groups == 1 and [t.task_id for t, _ in kept] == ["x", "x"]


def test_negative_weight_scales_negative_advantages_and_zero_drops_them():
    rollouts = [trajectory(group_id="a", reward=r) for r in (1.0, 0.0, 0.0, 1.0)]
    kept, _ = score_groups(rollouts, AdvantageConfig(normalize_std=False, negative_weight=0.5))
    assert [a for _, a in kept] == [0.5, -0.25, -0.25, 0.5]
    kept, report = score_groups(rollouts, AdvantageConfig(normalize_std=False, negative_weight=0.0))
    assert [(t.reward, a) for t, a in kept] == [(1.0, 0.5), (1.0, 0.5)]
    assert report.metrics() == {
        "groups": 1,
        "kept_groups": 1,
        "rollouts": 4,
        "kept_rollouts": 2,
        "dropped_zero_advantage": 2,
    }


@pytest.mark.parametrize("rewards", [(0.3, 0.2, 0.1), (0.1, 0.2, 0.3)])
@pytest.mark.parametrize("config", [AdvantageConfig(), AdvantageConfig(negative_weight=0.0)])
def test_a_reward_at_the_groups_mean_is_dropped_whatever_the_rounding_and_order(rewards, config):
    # (0.3 + 0.2 + 0.1) / 3 is not 0.2 in floating point: 0.2's advantage came out near 1e-16
    kept, report = score_groups([trajectory(group_id="a", reward=r) for r in rewards], config)
    assert 0.2 not in [t.reward for t, _ in kept] and report.dropped["zero_advantage"] >= 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_reward_that_is_not_finite_drops_its_rollout_not_its_group(bad):
    rollouts = [trajectory(group_id="a", reward=r) for r in (bad, 1.0, 0.0)]
    kept, report = score_groups(rollouts, AdvantageConfig(normalize_std=False))
    assert [a for _, a in kept] == [0.5, -0.5] and report.dropped == {"nonfinite_reward": 1}


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_a_rollout_with_a_logprob_that_is_not_finite_is_dropped_not_its_group(bad):
    # a server whose numerics failed: one such behavior logprob would make the whole step's loss NaN
    broken = trajectory([call([1, 2], [3, 4]), call([1, 2, 3, 4, 5], [6, 7], logprobs=[-0.5, bad])], reward=1.0)
    rollouts = [broken, *(trajectory([call([1, 2], [3, 4])], reward=r) for r in (1.0, 0.0))]
    kept, report = score_groups(rollouts, AdvantageConfig(normalize_std=False))
    assert [a for _, a in kept] == [0.5, -0.5] and report.dropped == {"nonfinite_logprobs": 1}
    assert report.metrics()["dropped_nonfinite_logprobs"] == 1
