"""Bounded staleness: trainer version − oldest token version ≤ max_off_policy_steps."""

from __future__ import annotations

import pytest

from tests.rl.conftest import call, trajectory
from whetstone.config import load_config
from whetstone.errors import ConfigError
from whetstone.rl.samples import trajectory_samples
from whetstone.rl.staleness import StalenessConfig, StalenessHistogram, filter_stale, staleness


def sample_with_versions(*versions):
    return trajectory_samples(trajectory([call([1], list(range(2, 2 + len(versions))), versions=list(versions))]))[0]


def test_staleness_counts_from_the_oldest_token():
    # A rollout that spanned weight updates 3 → 5 is as old as version 3.
    assert staleness(6, sample_with_versions(3, 4, 5).oldest_version) == 3
    assert staleness(6, None) == 0


def test_samples_beyond_the_bound_are_dropped_and_counted():
    samples = [sample_with_versions(v, 9) for v in (9, 8, 7, 6, 8)]
    histogram = StalenessHistogram()
    fresh = filter_stale(samples, trainer_version=9, config=StalenessConfig(), histogram=histogram)
    assert [s.oldest_version for s in fresh] == [9, 8, 7, 8]
    assert histogram.metrics() == {"staleness_0": 1, "staleness_1": 2, "staleness_2": 1, "dropped_stale": 1}
    # The histogram accumulates over calls.
    filter_stale(samples[:1], trainer_version=12, config=StalenessConfig(max_off_policy_steps=0), histogram=histogram)
    assert histogram.dropped == 2


def test_the_bound_must_not_be_negative():
    with pytest.raises(ConfigError, match="max_off_policy_steps"):
        load_config(StalenessConfig, overrides=["max_off_policy_steps=-1"])
