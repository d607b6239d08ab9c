"""Group advantages: one small module per estimator, each `compute(rewards) -> advantages` for
one group, and `groups.score_groups` to drop what teaches nothing and attach advantages.

The trainer never sees which estimator ran: it gets one advantage per sample.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal

from pydantic import Field

from whetstone.config import Config
from whetstone.rl.advantages import grpo, rloo

AdvantageFn = Callable[[list[float]], list[float]]


class AdvantageConfig(Config):
    """How rollouts of one group become advantages, and which groups are kept."""

    estimator: Literal["grpo", "rloo"] = "grpo"
    """`grpo`: reward minus the group mean (see `normalize_std`); `rloo`: reward minus the mean of the others."""
    normalize_std: bool = True
    """GRPO only: divide by the group's reward std (false = Dr. GRPO / Cursor's variant)."""
    min_group_size: int = Field(2, ge=2)
    """Groups left with fewer usable rollouts than this (after dropping excluded ones) are dropped."""
    min_reward_spread: float = Field(0.01, ge=0.0)
    """A group whose max - min reward is at most this has no variance: dropped (it teaches nothing).
    Not 0: the effort penalty makes every rollout's reward a little different (solved ones score
    0.985-0.987 on synth), and std normalisation would blow those thousandths up into unit-scale
    advantages, pushing correct solutions down for a few extra tokens. 0.01 keeps differences
    of one invalid tool call (`RewardConfig.invalid_call_penalty` 0.02)."""
    negative_weight: float = Field(1.0, ge=0.0, le=1.0)
    """Scale of negative advantages: 1 = the estimator as is; 0 = positive-sample reinforcement
    (only rollouts better than their group's baseline are reinforced, the others are dropped
    before the trainer as `zero_advantage`). Pushing down sampled tokens spreads probability
    over the rest (entropy rises, pass@k is kept); pushing up the good ones sharpens (pass@1)."""


def advantage_fn(config: AdvantageConfig) -> AdvantageFn:
    if config.estimator == "rloo":
        return rloo.compute
    return partial(grpo.compute, normalize_std=config.normalize_std)
