"""A learned global sharpness of the policy: Adam on one scalar, the log-scale s of the logits.

RL at this scale mostly sharpens (docs/run.md): sampling the default run's mid-trained base at
temperature 0.4 scores 13 points more held-out pass@1 than at 1, while per-token
policy-gradient pushes add up to that global sharpening only slowly, because on a failed
rollout most pushed tokens are ordinary ones. The output head is linear and bias-free, so
scaling the final norm's gains by e^s scales every logit by e^s. `LogitScale` takes its own
Adam step on s and folds e^s into the gains: no new tensor, so checkpoints, published weights
and Hugging Face exports stay a plain model.
Whether it sharpens or flattens is the reward's call, step by step: its gradient is the
policy-gradient term's derivative along s (`LossStats.scale_gradient`, from the logprobs and
entropies the loss already has), unclipped, since PPO's clip would pull the scale back to the
rollouts' own after each step. Its state (moments, total) lives in the trainer's checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from whetstone.errors import CheckpointError


@dataclass
class LogitScale:
    """Adam (no weight decay) on the log-scale of the logits, through `model.norm.weight`."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    exp_avg: float = 0.0
    exp_avg_sq: float = 0.0
    steps: int = 0
    log_scale: float = 0.0
    """Σ of the steps taken: the logits are e^log_scale times what they were at the start."""

    def step(self, model: torch.nn.Module, grad: float) -> float:
        """One Adam step on s for gradient `grad` (at the constant `lr`: the optimizer's warmup
        and decay do not apply), folded into the gains; returns the step."""
        self.steps += 1
        self.exp_avg = self.beta1 * self.exp_avg + (1 - self.beta1) * grad
        self.exp_avg_sq = self.beta2 * self.exp_avg_sq + (1 - self.beta2) * grad * grad
        corrected = self.exp_avg / (1 - self.beta1**self.steps)
        scale = math.sqrt(self.exp_avg_sq / (1 - self.beta2**self.steps)) + self.eps
        delta = -self.lr * corrected / scale
        with torch.no_grad():
            model.norm.weight.mul_(math.exp(delta))
        self.log_scale += delta
        return delta

    def unfold(self, model: torch.nn.Module) -> None:
        """Take the scale out of `model`'s gains (a copy of the policy): the model as it was at
        s = 0, up to rounding."""
        with torch.no_grad():
            model.norm.weight.div_(math.exp(self.log_scale))

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON floats round-trip exactly)."""
        return {key: getattr(self, key) for key in STATE_KEYS}

    def load_state(self, state: dict[str, Any]) -> None:
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise CheckpointError(f"the checkpoint's logit-scale state lacks {missing}")
        for key in STATE_KEYS:
            setattr(self, key, state[key])


STATE_KEYS = ("exp_avg", "exp_avg_sq", "steps", "log_scale")
