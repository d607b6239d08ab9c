"""The trajectory record: what one rollout of the harness produced (docs/architecture.md, "Contracts").

A rollout is a list of segments; a new segment starts when the harness restarts its context
from a summary. A segment is a list of model calls, each holding exactly what the inference
server returned (token ids, behavior logprobs, routes, weight versions), never re-tokenized
text, so the trainer sees what was sampled. The final reward is credited to every segment.

Records are JSON: Python floats round-trip exactly, so behavior logprobs survive bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from whetstone.errors import WhetstoneError
from whetstone.utils.atomic import atomic_write_text
from whetstone.utils.jsonl import read_json_lines

TRAJECTORY_FORMAT_VERSION = 1


class Record(BaseModel):
    # A dropped rollout's -inf or NaN logprob is written as -Infinity / NaN, which Python's JSON
    # reads back, not as null, which no float field takes.
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class ModelCall(Record):
    """One request to the inference server and its answer, in tokens."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    """Behavior logprob of each completion token, as the server sampled it."""
    versions: list[int]
    """Weight version that produced each completion token."""
    loss_mask: list[int]
    """Per completion token: 1 to train on it, 0 to leave it out (e.g. a cut-off call)."""
    routes: dict[str, Any] | None = None
    """Routed expert ids of every token fed through the model (prompt, then completion), in the
    server's compact form {shape, dtype, data (base64)}; decode with
    `whetstone.inference.protocol.decode_routes`."""
    routes_missing: str | None = None
    """Why `routes` is None although they were asked for (e.g. vLLM's CPU build cannot return
    them): the trainer then routes these tokens with its own router instead of replaying."""
    is_summary: bool = False
    """This call wrote a summary of the work so far (the context restarts after it)."""
    finish_reason: str = "stop"

    @classmethod
    def from_sequence(cls, seq) -> "ModelCall":
        """The call an in-process engine's finished `inference.sequence.Sequence` stands for:
        every completion token trained on, routes (if the model has them) in the server's form."""
        from whetstone.inference.protocol import encode_routes

        return cls(
            prompt_ids=seq.prompt_ids,
            completion_ids=seq.output_ids,
            logprobs=seq.logprobs,
            versions=seq.versions,
            loss_mask=[1] * len(seq.output_ids),
            routes=None if seq.routes is None else encode_routes(seq.routes),
        )

    @model_validator(mode="after")
    def _aligned(self) -> "ModelCall":
        n = len(self.completion_ids)
        for name in ("logprobs", "versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} completion tokens")
        return self


class Segment(Record):
    """The calls made between two context restarts."""

    calls: list[ModelCall] = []
    summary: str | None = None
    """The summary this segment ended with, carried into the next segment's context."""


class Trajectory(Record):
    """One rollout of one task: segments, reward and what the grader found."""

    format_version: int = TRAJECTORY_FORMAT_VERSION
    task_id: str
    group_id: str = ""
    """Rollouts of the same task in one RL step share a group id (for group advantages)."""
    segments: list[Segment] = []
    reward: float = 0.0
    solved: bool = False
    """The grader found the task solved: every hidden / FAIL_TO_PASS / PASS_TO_PASS test passed."""
    reward_breakdown: dict[str, float] = {}
    cheat_flags: list[str] = []
    exclude_from_gradient: bool = False
    turns: int = 0
    invalid_tool_calls: int = 0
    stop_reason: str = ""
    """Why the agent loop ended: submitted, max_turns, max_total_tokens, wall_clock,
    context_full, failed."""
    status: str = "ok"
    """`ok`, or `failed` when the rollout itself broke (server gone, sandbox error)."""
    error: str | None = None
    """Why a failed rollout failed."""
    timings: dict[str, float] = {}
    """Seconds spent per phase: generation, tools, grading, total."""

    @property
    def calls(self) -> list[ModelCall]:
        return [call for segment in self.segments for call in segment.calls]

    @property
    def completion_tokens(self) -> int:
        return sum(len(call.completion_ids) for call in self.calls)

    @property
    def oldest_version(self) -> int | None:
        """Staleness is counted from the oldest token's weight version."""
        versions = [v for call in self.calls for v in call.versions]
        return min(versions) if versions else None


def save_trajectories(path: str | Path, trajectories: list[Trajectory]) -> None:
    """Write trajectories as JSONL, atomically."""
    atomic_write_text(path, "".join(t.model_dump_json() + "\n" for t in trajectories))


def load_trajectories(path: str | Path) -> list[Trajectory]:
    path = Path(path)
    out = []
    try:
        for line in read_json_lines(path):
            where = f"{path}:{line.number}"
            if line.problem:
                raise WhetstoneError(f"{where}: not a valid trajectory record: {line.problem}")
            try:
                out.append(Trajectory.model_validate(line.value))
            except ValueError as err:
                raise WhetstoneError(f"{where}: not a valid trajectory record: {err}") from None
    except FileNotFoundError:
        raise WhetstoneError(f"trajectory file {path} does not exist") from None
    return out
