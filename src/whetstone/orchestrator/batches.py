"""Batches for the trainer: what goes in a batch, and its meta.

Batch n goes into the batch store (`rl.batch_store`); the trainer's optimizer step n consumes it
under weight version n. Its meta carries what the trainer logs: the drop counts of the groups scored since
the previous batch, their mean reward, and the staleness histogram of what is in it (overall,
and per inference cluster: `cluster_staleness`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from whetstone.envs.trajectory import Trajectory
from whetstone.rl.batch import Batch, collate
from whetstone.rl.samples import Sample, rescale_rollout_shares
from whetstone.rl.staleness import StalenessConfig, StalenessHistogram, filter_stale, staleness

log = logging.getLogger("whetstone.orchestrator")


@dataclass
class Group:
    """The samples of one kept group, and how many rollouts made them."""

    samples: list[Sample]
    rollouts: int
    clusters: list[str] = field(default_factory=list)
    """Per sample: the cluster label of the server that finished its rollout (empty: unknown)."""
    rollout_of: list[int] = field(default_factory=list)
    """Per sample: which of the group's rollouts made it (empty: unknown)."""

    def keep(self, fresh: list[Sample]) -> None:
        """Keep only `fresh`, a subsequence of the samples (their clusters with them), count the
        rollouts that still have a sample, and rescale each one's `rollout_share`s to sum to 1
        over the samples it has left (`rescale_rollout_shares`: a rollout weighs once, as it is
        counted). Without `rollout_of` the shares stay as they are."""
        kept = {id(sample) for sample in fresh}
        if self.clusters:
            self.clusters = [c for s, c in zip(self.samples, self.clusters) if id(s) in kept]
        if self.rollout_of:
            self.rollout_of = [r for s, r in zip(self.samples, self.rollout_of) if id(s) in kept]
            self.rollouts = len(set(self.rollout_of))
            if len(fresh) < len(self.samples):
                rescale_rollout_shares(fresh, self.rollout_of)
        self.samples = fresh


@dataclass
class Window:
    """What happened since the last batch was put: the counts that go in the next one's meta."""

    groups: Counter = field(default_factory=Counter)
    rewards: list[float] = field(default_factory=list)
    dropped_stale: int = 0

    def add(self, trajectories: list[Trajectory], report_metrics: dict[str, int]) -> None:
        """Count a scored group: its report's counts, and the reward of each rollout that ran and
        has a finite one (a NaN or infinite reward is dropped as `nonfinite_reward` and would make
        the batch's `reward_mean` NaN)."""
        self.groups.update(report_metrics)
        self.rewards += [t.reward for t in trajectories if t.status == "ok" and math.isfinite(t.reward)]


def drop_stale(groups: list[Group], index: int, config: StalenessConfig, window: Window) -> list[Group]:
    """The groups with their samples still fresh enough for batch `index`; the others counted in `window`."""
    fresh = []
    for group in groups:
        histogram = StalenessHistogram()
        group.keep(filter_stale(group.samples, index, config, histogram))
        window.dropped_stale += histogram.dropped
        if group.samples:
            fresh.append(group)
    return fresh


def build_batch(
    index: int,
    groups: list[Group],
    window: Window,
    config: StalenessConfig,
    weight_version: int | None,
    temperature: float = 1.0,
) -> Batch:
    """`temperature`: the rollouts' sampling temperature; other than 1 it goes with every row, so
    the trainer's logprobs are those of the distribution the tokens were drawn from."""
    samples = [sample for group in groups for sample in group.samples]
    unrouted = sum(sample.routes is None for sample in samples)
    if 0 < unrouted < len(samples):  # replay needs routes for every row
        log.warning(
            "batch %d: %d of its %d samples came without routes (servers that return none, e.g. vLLM "
            "without whetstone's worker extension, beside ones that do): it is trained without router replay",
            index,
            unrouted,
            len(samples),
        )
        samples = [dataclasses.replace(sample, routes=None) for sample in samples]
    histogram = StalenessHistogram(dropped=window.dropped_stale)
    filter_stale(samples, index, config, histogram)  # all fresh by now: this counts them per staleness
    meta = {
        "index": index,
        "trainer_step": index,
        "weight_version": weight_version,
        "created": time.time(),
        "staleness_histogram": histogram.metrics(),
        "groups": dict(window.groups),
        "reward_mean": sum(window.rewards) / len(window.rewards) if window.rewards else None,
        "samples": len(samples),
        "rollouts": sum(group.rollouts for group in groups),
        "cluster_staleness": cluster_staleness(groups, index),
    }
    batch = collate(samples, meta=meta, temperatures=None if temperature == 1.0 else [temperature] * len(samples))
    batch.meta["loss_tokens"] = batch.num_loss_tokens
    return batch


def cluster_staleness(groups: list[Group], index: int) -> dict[str, float]:
    """Per cluster, how stale the samples it produced for batch `index` are: the mean and the
    largest staleness (`rl.staleness`), and how many samples (`cluster_<label>_...`)."""
    by_cluster: dict[str, list[int]] = {}
    for group in groups:
        for sample, cluster in zip(group.samples, group.clusters):
            by_cluster.setdefault(cluster, []).append(staleness(index, sample.oldest_version))
    out: dict[str, float] = {}
    for cluster, steps in sorted(by_cluster.items()):
        out[f"cluster_{cluster}_samples"] = len(steps)
        out[f"cluster_{cluster}_staleness_mean"] = sum(steps) / len(steps)
        out[f"cluster_{cluster}_staleness_max"] = max(steps)
    return out


def flat_metrics(meta: dict) -> dict:
    """A batch's meta as one flat metrics record (`groups.<count>`, `staleness_<k>`)."""
    out = {}
    for key, value in meta.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}" if key == "groups" else k: v for k, v in value.items()})
        else:
            out[key] = value
    return out
