"""pass@k: the unbiased estimator equals the fraction of k-subsets of the samples holding a pass."""

from __future__ import annotations

import itertools
import math

import pytest

from whetstone.envs.eval import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_chance_that_k_of_the_samples_hold_a_pass(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            assert math.isclose(pass_at_k(n, c, k), sum(map(any, subsets)) / len(subsets), abs_tol=1e-12)


def test_pass_at_1_is_the_pass_rate_and_large_n_does_not_overflow():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10_000, 1, 5_000) == pytest.approx(0.5)
    assert pass_at_k(200, 0, 100) == 0.0 and pass_at_k(200, 150, 100) == 1.0


def test_mean_over_tasks_and_bad_arguments():
    assert mean_pass_at_k([(4, 4), (4, 0)], 1) == 0.5
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="no tasks"):
        mean_pass_at_k([], 1)
