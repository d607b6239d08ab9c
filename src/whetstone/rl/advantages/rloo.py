"""RLOO: each rollout's reward minus the mean reward of the other rollouts of its group.

The baseline leaves the rollout itself out, so it is unbiased; it equals the group-mean
advantage scaled by G / (G - 1).
"""

from __future__ import annotations


def compute(rewards: list[float]) -> list[float]:
    count = len(rewards)
    if count < 2:
        raise ValueError("RLOO needs at least 2 rollouts per group")
    total = sum(rewards)
    return [r - (total - r) / (count - 1) for r in rewards]
