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
    min_reward_spread: float = Field(1e-6, ge=0.0)
    """A group whose max - min reward is at most this has no variance: dropped (it teaches nothing)."""


def advantage_fn(config: AdvantageConfig) -> AdvantageFn:
    if config.estimator == "rloo":
        return rloo.compute
    return partial(grpo.compute, normalize_std=config.normalize_std)
