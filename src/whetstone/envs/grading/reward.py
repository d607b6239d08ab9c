"""The reward of one rollout: tests first, a bounded judge term, bounded penalties, zero for cheats.

    reward = max(0, tests + judge_weight * judge - effort - invalid_calls)
    tests  = 1 if solved else partial_credit * (fraction of required tests passing)

The bounds are checked when the config is built: a solved rollout with every penalty at its
maximum and no judge credit still scores above an unsolved one with full partial and judge
credit, so no amount of effort or judging can make solving a task look worse than failing it.
A cheat-flagged rollout scores 0 and, by default, is left out of the gradient.
"""

from __future__ import annotations

import math

from pydantic import Field, model_validator

from whetstone.config import Config
from whetstone.envs.grading.judge import JudgeConfig
from whetstone.envs.sandbox import SandboxConfig


class Effort(Config):
    """What a rollout spent: counted by the harness."""

    turns: int = Field(0, ge=0)
    """Model calls (assistant turns) in the rollout."""
    tokens: int = Field(0, ge=0)
    """Completion tokens generated over the rollout."""
    invalid_tool_calls: int = Field(0, ge=0)
    """Tool calls that did not parse or named an unknown tool."""


class RewardConfig(Config):
    """How grading turns test results, a judge and effort into one number."""

    partial_credit: float = Field(0.0, ge=0.0, le=0.5)
    """Most an unsolved rollout gets from its tests, times the fraction passing (0 = all or nothing)."""
    judge_weight: float = Field(0.2, ge=0.0, le=0.5)
    """Weight of the LLM judge's rubric score in [0, 1] (used when the task has a rubric and a judge is set)."""
    judge: JudgeConfig = JudgeConfig()
    """The judge endpoint (off unless `base_url` is set)."""
    effort_penalty_max: float = Field(0.1, ge=0.0)
    """Largest penalty for turns and tokens together (reached at both budgets)."""
    turn_budget: int = Field(50, gt=0)
    """Turns at which the turn half of the effort penalty is full; concave (square root) below it."""
    token_budget: int = Field(100_000, gt=0)
    """Tokens at which the token half of the effort penalty is full; concave (square root) below it."""
    invalid_call_penalty: float = Field(0.02, ge=0.0)
    """Penalty per invalid tool call."""
    invalid_call_penalty_max: float = Field(0.1, ge=0.0)
    """Largest total penalty for invalid tool calls."""
    exclude_flagged_from_gradient: bool = True
    """Mark cheat-flagged rollouts to be left out of the policy gradient (they score 0 either way)."""
    sandbox: SandboxConfig = SandboxConfig(wall_clock_s=120.0)
    """Limits of the grading sandbox (the task's `test_time_limit_s` bounds each test run)."""

    @model_validator(mode="after")
    def _solving_always_wins(self) -> RewardConfig:
        worst_solved = 1.0 - self.effort_penalty_max - self.invalid_call_penalty_max
        best_unsolved = self.partial_credit + self.judge_weight
        if worst_solved <= best_unsolved:
            raise ValueError(
                f"a solved rollout could score {worst_solved:g} and an unsolved one {best_unsolved:g}: lower "
                "effort_penalty_max + invalid_call_penalty_max or partial_credit + judge_weight"
            )
        return self


def effort_penalty(effort: Effort, config: RewardConfig) -> tuple[float, float]:
    """(turns and tokens penalty, invalid tool call penalty), both positive and bounded."""
    turns = math.sqrt(min(1.0, effort.turns / config.turn_budget))
    tokens = math.sqrt(min(1.0, effort.tokens / config.token_budget))
    invalid = min(config.invalid_call_penalty_max, config.invalid_call_penalty * effort.invalid_tool_calls)
    return config.effort_penalty_max * (turns + tokens) / 2, invalid


def combine(
    solved: bool,
    passed_fraction: float,
    judge_score: float | None,
    effort: Effort | None,
    cheat_flags: list[str],
    config: RewardConfig,
) -> tuple[float, dict[str, float], bool]:
    """(reward, breakdown, exclude_from_gradient) for one graded rollout."""
    if cheat_flags:
        zero = {"tests": 0.0, "judge": 0.0, "effort_penalty": 0.0, "invalid_call_penalty": 0.0}
        return 0.0, {**zero, "passed_fraction": passed_fraction, "cheat": 1.0}, config.exclude_flagged_from_gradient
    tests = 1.0 if solved else config.partial_credit * passed_fraction
    judge = config.judge_weight * min(1.0, max(0.0, judge_score)) if judge_score is not None else 0.0
    effort_cost, invalid_cost = effort_penalty(effort or Effort(), config)
    reward = max(0.0, tests + judge - effort_cost - invalid_cost)
    breakdown = {
        "tests": tests,
        "passed_fraction": passed_fraction,
        "judge": judge,
        "effort_penalty": -effort_cost,
        "invalid_call_penalty": -invalid_cost,
        "cheat": 0.0,
    }
    return reward, breakdown, False
