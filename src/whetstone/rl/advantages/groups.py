"""Group filtering: which rollouts and groups reach the trainer, and how many were dropped why.

A rollout is dropped when it failed (server gone, sandbox error) or the grader excluded it from
the gradient (cheat-flagged, by default: see `RewardConfig.exclude_flagged_from_gradient`).
Then a group is dropped when too few rollouts are left or their rewards do not vary: every
advantage would be zero. Rollouts whose advantage is exactly zero (with `negative_weight = 0`,
every one at or below the baseline) are dropped too: they would cost a forward and backward
pass and move nothing; an advantage within rounding of zero (a reward at the group's mean) counts
as zero. A rollout whose reward, or any of whose behavior logprobs, is not finite is dropped on its
own. Rollouts group by `group_id` (by `task_id` when it is empty).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from whetstone.envs.trajectory import Trajectory
from whetstone.rl.advantages import AdvantageConfig, advantage_fn

ZERO_ADVANTAGE = 1e-9
"""An advantage within this share of the group's largest (or of 1) is zero: float rounding of the
mean leaves ~1e-16 where the reward equals it."""


@dataclass
class GroupReport:
    groups: int = 0
    kept_groups: int = 0
    rollouts: int = 0
    kept_rollouts: int = 0
    dropped: Counter = field(default_factory=Counter)
    """Dropped rollouts by reason: failed, nonfinite_reward, nonfinite_logprobs, cheat_flagged,
    excluded, small_group, no_variance, zero_advantage."""

    def metrics(self) -> dict[str, int]:
        out = {
            "groups": self.groups,
            "kept_groups": self.kept_groups,
            "rollouts": self.rollouts,
            "kept_rollouts": self.kept_rollouts,
        }
        out.update({f"dropped_{reason}": count for reason, count in sorted(self.dropped.items())})
        return out


def score_groups(
    trajectories: list[Trajectory], config: AdvantageConfig
) -> tuple[list[tuple[Trajectory, float]], GroupReport]:
    """(trajectory, advantage) for every kept rollout, in input order, and what was dropped."""
    compute = advantage_fn(config)
    groups: dict[str, list[Trajectory]] = {}
    for trajectory in trajectories:
        groups.setdefault(trajectory.group_id or trajectory.task_id, []).append(trajectory)
    report = GroupReport(groups=len(groups), rollouts=len(trajectories))
    advantages: dict[int, float] = {}
    for members in groups.values():
        reasons = [_drop_reason(t) for t in members]
        usable = [t for t, reason in zip(members, reasons) if reason is None]
        report.dropped.update(reason for reason in reasons if reason is not None)
        rewards = [t.reward for t in usable]
        if len(usable) < config.min_group_size:
            report.dropped["small_group"] += len(usable)
        elif max(rewards) - min(rewards) <= config.min_reward_spread:
            report.dropped["no_variance"] += len(usable)
        else:
            raw = compute(rewards)
            tolerance = ZERO_ADVANTAGE * max(1.0, *(abs(a) for a in raw))  # a reward at the mean, up to rounding
            raw = [0.0 if abs(a) <= tolerance else a for a in raw]
            scored = [(t, a * config.negative_weight if a < 0 else a) for t, a in zip(usable, raw)]
            useful = {id(t): a for t, a in scored if a != 0.0}
            if len(useful) < len(usable):
                report.dropped["zero_advantage"] += len(usable) - len(useful)
            report.kept_groups += 1
            report.kept_rollouts += len(useful)
            advantages.update(useful)
    kept = [(t, advantages[id(t)]) for t in trajectories if id(t) in advantages]
    return kept, report


def _drop_reason(trajectory: Trajectory) -> str | None:
    if trajectory.status != "ok":
        return "failed"
    if not math.isfinite(trajectory.reward):  # a reward function's bug: it would make the group's advantages NaN
        return "nonfinite_reward"
    if not all(math.isfinite(sum(call.logprobs)) for segment in trajectory.segments for call in segment.calls):
        # a server's numerics failed (NaN logits): one such token makes the whole batch's loss NaN.
        # A sum is NaN or infinite exactly when a term is (logprobs are far from overflowing).
        return "nonfinite_logprobs"
    if trajectory.exclude_from_gradient:
        return "cheat_flagged" if trajectory.cheat_flags else "excluded"
    return None
