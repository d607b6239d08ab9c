"""Rated responses -> the RL trainer's batch.

Each rated response becomes a one-call trajectory (prompt ids, completion ids, behavior logprobs,
weight versions, routes, all completion tokens trained) and goes through the same
`trajectory_samples` and `collate` as asynchronous RL, so the trainer cannot tell the two apart;
each row also carries its sampling temperature, so the trainer's logprobs are of the same
tempered distribution as the behavior logprobs. Responses sampled from a truncated distribution
are dropped (`truncated`), then the staleness bound applies, then advantages.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from whetstone.envs.trajectory import ModelCall, Segment, Trajectory
from whetstone.errors import WhetstoneError
from whetstone.inference.sampling import GREEDY_BELOW, SamplingParams
from whetstone.model import ModelConfig
from whetstone.model.moe import check_route_ids
from whetstone.online.config import OnlineConfig
from whetstone.rl.batch import Batch, collate
from whetstone.rl.samples import NOT_GENERATED, Sample, rescale_rollout_shares, trajectory_samples
from whetstone.rl.staleness import StalenessHistogram, staleness
from whetstone.store.feedback import RatedResponse, ResponseRecord

log = logging.getLogger("whetstone.online")


@dataclass
class FeedbackBatch:
    """One update's training data, or the reason there is none."""

    batch: Batch | None
    counts: dict[str, int] = field(default_factory=dict)
    """events, kept, dropped_truncated, dropped_empty, dropped_malformed, dropped_stale, staleness_<n>."""
    reward_mean: float = 0.0
    skip_reason: str = ""


def truncated(response: ResponseRecord) -> bool:
    """Sampled with top-p, top-k or greedily (a temperature below `GREEDY_BELOW`, 0 among them:
    top-k 1). The behavior logprobs are
    then of softmax(logits / T) renormalised over a cut set of tokens that depends on the logits
    themselves: the trainer's full softmax is another distribution (the ratio is off by the cut
    mass), and tokens outside the cut were never sampleable, so no importance weight corrects
    for them. Temperature alone is fine: the trainer divides the logits by it."""
    return response.temperature < GREEDY_BELOW or response.top_p < 1.0 or response.top_k > 0


def rated_sample(item: RatedResponse, reward: float) -> list[Sample]:
    """The sample of one rated response; raises WhetstoneError if its record does not add up,
    sampling parameters the servers refuse among them (a NaN temperature fails the whole batch's
    collate, a temperature beyond the servers' bound is not what any reply was sampled at)."""
    response = item.response
    SamplingParams(temperature=response.temperature, top_p=response.top_p, top_k=response.top_k)
    call = ModelCall(
        prompt_ids=response.prompt_ids,
        completion_ids=response.completion_ids,
        logprobs=response.logprobs,
        versions=response.versions,
        loss_mask=[1] * len(response.completion_ids),
        routes=response.routes,
        finish_reason=response.finish_reason,
    )
    trajectory = Trajectory(
        task_id=f"{response.response_id}/{response.choice}", segments=[Segment(calls=[call])], reward=reward
    )
    return trajectory_samples(trajectory)


def check_fits(sample: Sample, model: ModelConfig) -> None:
    """Raise WhetstoneError if `sample` is not of `model`: a token id outside its vocabulary, or
    routes of other experts or another [moe_layers, top_k] (a server of another model writing to
    the same store). The trainer's forward would fail on it, and the whole update with it."""
    if min(sample.input_ids) < 0 or max(sample.input_ids) >= model.vocab_size:
        raise WhetstoneError(
            f"token ids in [{min(sample.input_ids)}, {max(sample.input_ids)}], outside the model's vocabulary "
            f"(0..{model.vocab_size - 1}): a response of another model?"
        )
    routes = sample.routes
    if routes is None or not model.num_moe_layers:
        return
    expected = [model.num_moe_layers, model.num_experts_per_tok]
    if list(routes.shape[1:]) != expected:
        raise WhetstoneError(
            f"routes of [moe_layers, top_k] {list(routes.shape[1:])}, the model's are {expected}: a response of "
            "another model?"
        )
    check_route_ids(routes, model.num_experts)


def generated_versions(sample: Sample) -> list[int]:
    """The weight versions of a sample's sampled tokens (what its staleness is of)."""
    return [v for v in sample.versions if v != NOT_GENERATED]


def feedback_batch(
    rated: list[RatedResponse],
    config: OnlineConfig,
    version: int,
    meta: dict[str, Any] | None = None,
    behind: Callable[[list[int]], int] | None = None,
    model: ModelConfig | None = None,
) -> FeedbackBatch:
    """The batch of `rated` for an update of the deployed `version`. `behind`: how many updates
    the weights a sample was sampled with (its tokens' versions) are from the deployed version's
    (the loop's `Lineage.behind`, which sees rollbacks); by default, version numbers apart.
    `model`: the trained model's config; records that do not fit it are dropped as malformed."""
    if behind is None:

        def behind(versions: list[int]) -> int:
            return staleness(version, min(versions, default=None))

    counts = {"events": len(rated), "dropped_truncated": 0, "dropped_empty": 0, "dropped_malformed": 0}
    counts["dropped_nonfinite_logprobs"] = 0
    samples: list[Sample] = []
    temperature: dict[str, float] = {}  # per sample (task_id = response/choice)
    rollout_of: dict[int, int] = {}  # per sample (by id): the index of its event
    steps_of: dict[int, int] = {}  # per sample (by id): updates behind the deployed weights
    for number, item in enumerate(rated):
        if truncated(item.response):
            counts["dropped_truncated"] += 1
            continue
        if not item.response.completion_ids:
            counts["dropped_empty"] += 1
            continue
        if not math.isfinite(sum(item.response.logprobs)):  # a server's numerics failed (NaN logits):
            counts["dropped_nonfinite_logprobs"] += 1  # one such token would make the update's loss NaN
            continue
        try:
            new = rated_sample(item, config.rewards.reward(item.rating, item.score))
            if model is not None:
                for sample in new:
                    check_fits(sample, model)
        except (WhetstoneError, ValidationError) as err:  # a record that does not add up (e.g. routes of another shape)
            counts["dropped_malformed"] += 1
            log.warning("feedback event %d dropped: %s", item.seq, err)
            continue
        samples += new
        temperature.update((sample.task_id, item.response.temperature) for sample in new)
        rollout_of.update((id(sample), number) for sample in new)
        steps_of.update((id(sample), behind(generated_versions(sample))) for sample in new)
    histogram, fresh = StalenessHistogram(), []
    for sample in samples:  # the staleness bound (`rl.staleness`), by the weights each reply had
        if steps_of[id(sample)] > config.staleness.max_off_policy_steps:
            histogram.dropped += 1
        else:
            histogram.kept[steps_of[id(sample)]] += 1
            fresh.append(sample)
    if len(fresh) < len(samples):  # each response left weighs once (`rescale_rollout_shares`)
        rescale_rollout_shares(fresh, [rollout_of[id(sample)] for sample in fresh])
    samples = fresh
    counts.update(histogram.metrics(), kept=len(samples))
    if not samples:
        return FeedbackBatch(
            None, counts, skip_reason="no usable feedback (every event was stale, truncated, empty or malformed)"
        )
    rewards = [s.reward for s in samples]
    mean = sum(rewards) / len(rewards)
    baseline = mean if config.baseline == "batch_mean" else 0.0
    for sample in samples:
        sample.advantage = sample.reward - baseline
    result = FeedbackBatch(None, counts, reward_mean=mean)
    if all(abs(s.advantage) < 1e-9 for s in samples):
        result.skip_reason = "no reward variance: every kept event has the same reward, nothing to learn"
        return result
    result.batch = collate(samples, meta=meta, temperatures=[temperature[s.task_id] for s in samples])
    return result
