"""The optimizer's config, shared by every trainer (mid-training, RL, online)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from whetstone.config import Config

Beta = Annotated[float, Field(ge=0, lt=1)]
"""An AdamW moment decay rate: 1 or more would never forget, and torch refuses it."""


class OptimizerConfig(Config):
    """AdamW on fp32 master weights, linear warmup then cosine decay, gradient clipping."""

    lr: float = Field(3e-3, gt=0, allow_inf_nan=False)
    """Peak learning rate, reached at the end of warmup."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The cosine falls to `lr * min_lr_ratio` at step `total_steps` (the step after the last: `lr_at`)."""
    warmup_steps: int = Field(40, ge=0)
    """Optimizer steps of linear warmup from lr/warmup_steps to lr."""
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    """AdamW beta1, beta2 (each in [0, 1))."""
    eps: float = Field(1e-8, gt=0, allow_inf_nan=False)
    """AdamW epsilon."""
    weight_decay: float = Field(0.1, ge=0, allow_inf_nan=False)
    """Decoupled weight decay, applied to matrices only (not to norms or biases)."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value before each step; 0 turns clipping off."""
    lr_multipliers: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = {}
    """Parameter-name pattern (fnmatch, e.g. `norm.weight` for the final norm) -> factor on the
    learning rate of the parameters it matches; first match wins; a pattern matching nothing is
    refused."""
