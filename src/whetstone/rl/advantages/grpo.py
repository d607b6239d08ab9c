"""GRPO: each rollout's reward minus its group's mean, optionally divided by the group's std.

Without std normalisation (Dr. GRPO, Cursor's published variant) a group's advantages stay in
reward units, so near-unanimous groups push gently; with it, every group with any variance
pushes with unit scale.
"""

from __future__ import annotations

import math

STD_EPS = 1e-6  # keeps a near-constant group from exploding; zero-variance groups are dropped earlier


def compute(rewards: list[float], normalize_std: bool = True) -> list[float]:
    mean = sum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / len(rewards))  # population std, as in GRPO
    return [c / (std + STD_EPS) for c in centered]
