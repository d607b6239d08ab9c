"""Bounded staleness: a sample is trained on only if it is at most `max_off_policy_steps` behind.

A sample's staleness is the trainer's version minus the oldest weight version among its sampled
tokens (a rollout that spans a weight update is as old as its oldest token). Older samples are
dropped and counted; the rest are corrected by the loss's importance weights.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pydantic import Field

from whetstone.config import Config
from whetstone.rl.samples import Sample


class StalenessConfig(Config):
    """How far behind the trainer a sample's weights may be."""

    max_off_policy_steps: int = Field(2, ge=0)
    """Largest trainer version − oldest token version that is still trained on (0 = on-policy only)."""


def staleness(trainer_version: int, oldest_version: int | None) -> int:
    """Steps between the trainer and the oldest token; 0 for a sample with no sampled token."""
    return 0 if oldest_version is None else trainer_version - oldest_version


@dataclass
class StalenessHistogram:
    """Counts of kept samples per staleness, and of dropped ones."""

    kept: Counter = field(default_factory=Counter)
    dropped: int = 0

    def metrics(self) -> dict[str, int]:
        out = {f"staleness_{steps}": count for steps, count in sorted(self.kept.items())}
        out["dropped_stale"] = self.dropped
        return out


def filter_stale(
    samples: list[Sample], trainer_version: int, config: StalenessConfig, histogram: StalenessHistogram | None = None
) -> list[Sample]:
    """The samples within the bound, in order; counts kept and dropped ones into `histogram`."""
    histogram = histogram if histogram is not None else StalenessHistogram()
    fresh = []
    for sample in samples:
        steps = staleness(trainer_version, sample.oldest_version)
        if steps > config.max_off_policy_steps:
            histogram.dropped += 1
        else:
            histogram.kept[steps] += 1
            fresh.append(sample)
    return fresh
