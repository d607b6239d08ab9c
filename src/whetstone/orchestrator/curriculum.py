"""The curriculum: tasks the policy last solved always or never rest for a few passes.

A group whose rollouts are all solved or all failed has no reward variance, so it is dropped and
its rollouts are spent for nothing. Once the task stream comes back to a task, its last group's
solve rate says whether another group is likely to be worth it: a task solved by fewer than
`min_solve_rate` or more than `max_solve_rate` of its last group's rollouts is skipped for the
next `rest_passes` passes over the task set, then tried again (the policy has moved on since). A
run shorter than one pass over its tasks never meets a task twice, so the curriculum changes
nothing there. The orchestrator saves the record with every batch it puts (`state()`), and a
restarted one goes on with it (`load()`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, model_validator

from whetstone.config import Config


class CurriculumConfig(Config):
    """Which tasks get another group, by the solve rate of their last one."""

    min_solve_rate: float = Field(0.1, ge=0.0, le=1.0)
    """A task whose last group solved a smaller share of its rollouts rests (hopeless for now);
    0 = never rest a task for failing."""
    max_solve_rate: float = Field(0.9, ge=0.0, le=1.0)
    """A task whose last group solved a larger share rests (learned already); 1 = never rest a
    task for being solved."""
    rest_passes: int = Field(2, ge=0)
    """Passes over the task set a resting task sits out; 0 = no curriculum."""

    @model_validator(mode="after")
    def _band(self) -> "CurriculumConfig":
        if self.min_solve_rate > self.max_solve_rate:
            raise ValueError(f"min_solve_rate ({self.min_solve_rate}) exceeds max_solve_rate ({self.max_solve_rate})")
        return self


@dataclass(frozen=True)
class LastGroup:
    solve_rate: float
    pass_number: int
    """The pass over the task set the group was started in."""


class Curriculum:
    """Each task's last group, and whether the task sits out a pass."""

    def __init__(self, config: CurriculumConfig):
        self.config = config
        self._last: dict[str, LastGroup] = {}
        self.rested = 0
        """Times a task was skipped for resting."""

    def record(self, task_id: str, solved: int, rollouts: int, pass_number: int) -> None:
        """A group of the task finished: `solved` of its `rollouts` (those that ran: none = no
        record) were solved."""
        if rollouts:
            self._last[task_id] = LastGroup(solved / rollouts, pass_number)

    def rests(self, task_id: str, pass_number: int) -> bool:
        """Whether the task sits out this pass (counted in `rested` when it does)."""
        last = self._last.get(task_id)
        config = self.config
        if last is None or pass_number - last.pass_number > config.rest_passes:
            return False
        if config.min_solve_rate <= last.solve_rate <= config.max_solve_rate:
            return False
        self.rested += 1
        return True

    def state(self) -> dict:
        """The record as JSON-ready data: each task's last group (solve rate, pass) and `rested`."""
        return {"last": {task: [g.solve_rate, g.pass_number] for task, g in self._last.items()}, "rested": self.rested}

    def load(self, state: dict) -> None:
        """Go on from `state()`'s record (all of it, or, if it does not parse, none of it)."""
        last = {task: LastGroup(float(rate), int(number)) for task, (rate, number) in state["last"].items()}
        self._last, self.rested = last, int(state["rested"])
