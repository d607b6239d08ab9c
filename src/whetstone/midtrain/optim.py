"""AdamW over the fp32 master weights, with weight decay on matrices only (not norms or biases)."""

from __future__ import annotations

import torch


def build_optimizer(model: torch.nn.Module, *, lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float) -> torch.optim.AdamW:
    """Two parameter groups: matrices (decayed) and vectors/scalars (not decayed).

    Decaying norm gains and biases toward 0 only fights the model; matrices are what overfits.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
