"""Rated responses -> the RL trainer's batch.

Each rated response becomes a one-call trajectory (prompt ids, completion ids, behavior logprobs,
weight versions, routes, all completion tokens trained) and goes through the same
`trajectory_samples` and `collate` as asynchronous RL, so the trainer cannot tell the two apart.
Only responses sampled from the untempered distribution (temperature 1, no top-p / top-k) are
kept: the importance ratio compares the trainer's plain softmax with the behavior logprobs, which
would otherwise be of another distribution. Then the staleness bound, then advantages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from whetstone.envs.trajectory import ModelCall, Segment, Trajectory
from whetstone.errors import WhetstoneError
from whetstone.online.config import OnlineConfig
from whetstone.online.store import RatedResponse, ResponseRecord
from whetstone.rl.batch import Batch, collate
from whetstone.rl.samples import Sample, trajectory_samples
from whetstone.rl.staleness import StalenessHistogram, filter_stale

log = logging.getLogger("whetstone.online")


@dataclass
class FeedbackBatch:
    """One update's training data, or the reason there is none."""

    batch: Batch | None
    counts: dict[str, int] = field(default_factory=dict)
    """events, kept, dropped_tempered, dropped_empty, dropped_malformed, dropped_stale, staleness_<n>."""
    reward_mean: float = 0.0
    skip_reason: str = ""


def untempered(response: ResponseRecord) -> bool:
    return response.temperature == 1.0 and response.top_p == 1.0 and response.top_k <= 0


def rated_sample(item: RatedResponse, reward: float) -> list[Sample]:
    """The sample of one rated response; raises WhetstoneError if its record does not add up."""
    response = item.response
    call = ModelCall(prompt_ids=response.prompt_ids, completion_ids=response.completion_ids,
                     logprobs=response.logprobs, versions=response.versions,
                     loss_mask=[1] * len(response.completion_ids), routes=response.routes,
                     finish_reason=response.finish_reason)  # fmt: skip
    trajectory = Trajectory(task_id=f"{response.response_id}/{response.choice}", segments=[Segment(calls=[call])],
                            reward=reward)  # fmt: skip
    return trajectory_samples(trajectory)


def feedback_batch(rated: list[RatedResponse], config: OnlineConfig, version: int,
                   meta: dict[str, Any] | None = None) -> FeedbackBatch:  # fmt: skip
    """The batch of `rated` for an update of the deployed `version`."""
    counts = {"events": len(rated), "dropped_tempered": 0, "dropped_empty": 0, "dropped_malformed": 0}
    samples: list[Sample] = []
    for item in rated:
        if not untempered(item.response):
            counts["dropped_tempered"] += 1
            continue
        if not item.response.completion_ids:
            counts["dropped_empty"] += 1
            continue
        try:
            samples += rated_sample(item, config.rewards.reward(item.rating, item.score))
        except WhetstoneError as err:  # a record that does not add up (e.g. routes of another shape)
            counts["dropped_malformed"] += 1
            log.warning("feedback event %d dropped: %s", item.seq, err)
    histogram = StalenessHistogram()
    samples = filter_stale(samples, version, config.staleness, histogram)
    counts.update(histogram.metrics(), kept=len(samples))
    if not samples:
        return FeedbackBatch(None, counts, skip_reason="no usable feedback (every event was stale, tempered, empty "
                                                       "or malformed)")
    rewards = [s.reward for s in samples]
    mean = sum(rewards) / len(rewards)
    baseline = mean if config.baseline == "batch_mean" else 0.0
    for sample in samples:
        sample.advantage = sample.reward - baseline
    result = FeedbackBatch(None, counts, reward_mean=mean)
    if all(abs(s.advantage) < 1e-9 for s in samples):
        result.skip_reason = "no reward variance: every kept event has the same reward, nothing to learn"
        return result
    result.batch = collate(samples, meta=meta)
    return result
