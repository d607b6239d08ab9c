"""pass@k, the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models
Trained on Code"): from n samples of which c passed, the chance that at least one of k samples
drawn without replacement passes, 1 - C(n-c, k) / C(n, k). Computed as a product, which stays
exact in floating point where the binomials would overflow."""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:  # every draw of k holds a passing sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod over i of (1 - k / i)
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """pass@k averaged over tasks, from (samples, passed) per task."""
    if not counts:
        raise ValueError("pass@k of no tasks")
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
