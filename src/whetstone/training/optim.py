"""AdamW over the fp32 master weights, with weight decay on matrices only (not norms or biases),
and optional per-parameter learning-rate multipliers."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

import torch

from whetstone.errors import ConfigError

if TYPE_CHECKING:
    from whetstone.training.config import OptimizerConfig


def build_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    lr_multipliers: dict[str, float] | None = None,
) -> torch.optim.AdamW:
    """Parameter groups: matrices (decayed) and vectors/scalars (not decayed), each split further
    by learning-rate multiplier.

    Decaying norm gains and biases toward 0 only fights the model; matrices are what overfits.
    `lr_multipliers` maps parameter-name patterns (fnmatch, e.g. `norm.weight`, `layers.*.mlp.*`)
    to a factor on the learning rate; the first matching pattern wins, and a pattern that matches
    no parameter is an error (a typo would otherwise silently do nothing).
    """
    lr_multipliers = lr_multipliers or {}
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    unused = [pattern for pattern in lr_multipliers if not any(fnmatchcase(name, pattern) for name, _ in named)]
    if unused:
        raise ConfigError(
            f"optimizer.lr_multipliers: {unused} match no parameter of the model "
            f"(names look like {[name for name, _ in named[:3]]})"
        )
    groups: dict[tuple[bool, float], list[torch.nn.Parameter]] = {}
    for name, p in named:
        factor = next((f for pattern, f in lr_multipliers.items() if fnmatchcase(name, pattern)), 1.0)
        groups.setdefault((p.dim() >= 2, factor), []).append(p)
    return torch.optim.AdamW(
        [
            {"params": params, "weight_decay": weight_decay if decayed else 0.0, "lr_multiplier": factor}
            for (decayed, factor), params in sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1]))
        ],
        lr=lr,
        betas=betas,
        eps=eps,
    )


def optimizer_for(model: torch.nn.Module, config: "OptimizerConfig", lr: float | None = None) -> torch.optim.AdamW:
    """`build_optimizer` with the settings of an `[optimizer]` section (`lr` overrides its peak)."""
    return build_optimizer(
        model,
        lr=config.lr if lr is None else lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        lr_multipliers=config.lr_multipliers,
    )


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float, grad_clip: float) -> float:
    """Clip the global gradient norm (0 = measure only), set `lr`, step, clear the gradients.

    Returns the gradient norm before clipping. Shared by mid-training and the RL trainer.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    # max_norm=inf measures the norm without clipping.
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_multiplier", 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)
