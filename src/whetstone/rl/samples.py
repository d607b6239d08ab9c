"""Trajectories → training samples (docs/rl.md, "Samples: the alignment contract").

A sample is one sequence of N tokens as the trainer feeds it: position t holds token t and
predicts token t+1, so every per-position list (`loss_mask`, `behavior_logprobs`, `versions`,
`routes`) has N - 1 entries, exactly the teacher-forced inputs `input_ids[:-1]` (the server's
routes cover the same tokens: every token fed through the model, the last sampled one excluded).

The harness keeps each segment's context as token ids, so each call's prompt normally extends the
previous call's prompt + completion: the segment then merges into one sequence, the last call's
tokens, and that call's routes cover all of it. A segment that is not prefix-consistent (e.g. a
harness that re-renders text) yields one sample per call instead. The trajectory's reward is
credited to every segment.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from whetstone.envs.trajectory import ModelCall, Segment, Trajectory
from whetstone.errors import WhetstoneError
from whetstone.inference.protocol import decode_routes

NOT_GENERATED = -1
"""`versions` entry of a position whose target token was not sampled (prompt, tool output)."""


@dataclass
class Sample:
    input_ids: list[int]
    """All N tokens of the sequence."""
    loss_mask: list[int]
    """Per position (N - 1): 1 where the predicted token is a completion token to train on."""
    behavior_logprobs: list[float]
    """Per position: the sampler's logprob of the predicted token (0.0 where not generated)."""
    versions: list[int]
    """Per position: weight version that sampled the predicted token, or NOT_GENERATED."""
    routes: torch.Tensor | None
    """[N - 1, moe_layers, top_k] int64 expert ids to replay; None when the server gave none."""
    reward: float
    task_id: str = ""
    group_id: str = ""
    advantage: float = 0.0
    rollout_share: float = 1.0
    """This sample's trained tokens over its rollout's (1 unless the rollout was summarized into
    several segments), or over those of its rollout's samples left once some were dropped
    (`rescale_rollout_shares`): its weight under sequence aggregation, where a rollout counts once."""

    @property
    def num_positions(self) -> int:
        return len(self.input_ids) - 1

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int | None:
        """Staleness counts from the oldest sampled token (trained on or not)."""
        generated = [v for v in self.versions if v != NOT_GENERATED]
        return min(generated) if generated else None


def trajectory_samples(trajectory: Trajectory, advantage: float = 0.0) -> list[Sample]:
    """The samples of one rollout, each carrying its reward and `advantage`.

    Samples with no token to train on (every call masked out) are left out: they would cost a
    forward pass and move nothing.
    """
    samples: list[Sample] = []
    for index, segment in enumerate(trajectory.segments):
        where = f"trajectory of task {trajectory.task_id!r}, segment {index}"
        if is_prefix_consistent(segment):
            parts = [_merge(segment.calls, where)] if segment.calls else []
        else:
            parts = [_merge([call], f"{where}, call {i}") for i, call in enumerate(segment.calls)]
        for sample in parts:
            sample.reward, sample.advantage = trajectory.reward, advantage
            sample.task_id, sample.group_id = trajectory.task_id, trajectory.group_id
            if sample.num_loss_tokens:
                samples.append(sample)
    trained = sum(sample.num_loss_tokens for sample in samples)
    for sample in samples:
        sample.rollout_share = sample.num_loss_tokens / trained
    return samples


def rescale_rollout_shares(samples: Sequence[Sample], rollout_of: Sequence[Hashable]) -> None:
    """Rescale in place the `rollout_share`s of the samples left of each rollout (`rollout_of`:
    per sample, its rollout) to sum to 1, after some of a rollout's samples were dropped (stale,
    say).

    A rollout with any sample left then still weighs once under sequence aggregation, as the
    batch's rollout count says it does, its samples left standing for it. Leaving the dropped
    samples' weight out instead would make a rollout count for less the longer it ran: its
    earliest segments are the stalest, so long, summarized rollouts would lose weight to staleness
    exactly where `sequence` aggregation is meant to weigh rollouts alike whatever their length.
    """
    totals: dict[Hashable, float] = {}
    for sample, rollout in zip(samples, rollout_of, strict=True):
        totals[rollout] = totals.get(rollout, 0.0) + sample.rollout_share
    for sample, rollout in zip(samples, rollout_of):
        sample.rollout_share /= totals[rollout]


def is_prefix_consistent(segment: Segment) -> bool:
    """Does every call's prompt start with the previous call's prompt + completion?"""
    for previous, call in zip(segment.calls, segment.calls[1:]):
        context = previous.prompt_ids + previous.completion_ids
        if call.prompt_ids[: len(context)] != context:
            return False
    return True


def _merge(calls: list[ModelCall], where: str) -> Sample:
    """One sample from prefix-consistent calls: the last call's tokens, every call's completions."""
    last = calls[-1]
    input_ids = last.prompt_ids + last.completion_ids
    positions = len(input_ids) - 1
    loss_mask, behavior, versions = [0] * positions, [0.0] * positions, [NOT_GENERATED] * positions
    for call in calls:
        if not call.prompt_ids:
            # The first completion token would sit at position 0, which nothing predicts.
            raise WhetstoneError(f"{where}: a model call has an empty prompt")
        start = len(call.prompt_ids) - 1  # the position that predicts the call's first token
        end = start + len(call.completion_ids)
        loss_mask[start:end] = call.loss_mask
        behavior[start:end] = call.logprobs
        versions[start:end] = call.versions
    return Sample(input_ids, loss_mask, behavior, versions, _routes(calls, positions, where), reward=0.0)


def _routes(calls: list[ModelCall], positions: int, where: str) -> torch.Tensor | None:
    """The last call's routes: its prefill routed every earlier token again, so they cover every
    position (the earlier calls' own routes are not needed). None from a server without capture."""
    if calls[-1].routes is None:
        return None
    try:
        routes = decode_routes(calls[-1].routes)
    except (KeyError, ValueError, TypeError) as err:
        raise WhetstoneError(f"{where}: routes are not in the server's compact form: {err!r}") from None
    if routes.dim() != 3 or routes.shape[0] != positions:
        raise WhetstoneError(
            f"{where}: routes have shape {tuple(routes.shape)}, expected [{positions}, moe_layers, top_k] "
            "(one row per token fed through the model)"
        )
    return routes
