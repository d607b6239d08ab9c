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


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float, grad_clip: float) -> float:
    """Clip the global gradient norm (0 = measure only), set `lr`, step, clear the gradients.

    Returns the gradient norm before clipping. Shared by mid-training and the RL trainer.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    # max_norm=inf measures the norm without clipping.
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)
