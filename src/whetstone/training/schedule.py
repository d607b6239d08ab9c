"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

A pure function of the step, so a resumed run needs nothing but the step to be back on the curve.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Warmup rises linearly from peak/warmup to peak over `warmup_steps`; the cosine then falls from
    peak to `min_lr_ratio * peak` at `total_steps` and stays there if training runs longer.
    """
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    min_lr = peak_lr * min_lr_ratio
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (peak_lr - min_lr) * (1 + math.cos(math.pi * progress))
