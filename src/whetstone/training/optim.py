"""AdamW over the fp32 master weights, with weight decay on matrices only (not norms or biases),
and optional per-parameter learning-rate multipliers. On CUDA it is torch's fused AdamW (one
kernel for every parameter's update instead of several per parameter)."""

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
    on_cuda = bool(named) and all(p.device.type == "cuda" for _, p in named)
    return torch.optim.AdamW(
        [
            {"params": params, "weight_decay": weight_decay if decayed else 0.0, "lr_multiplier": factor}
            for (decayed, factor), params in sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1]))
        ],
        lr=lr,
        betas=betas,
        eps=eps,
        fused=True if on_cuda else None,
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


def clip_gradients(model: torch.nn.Module, grad_clip: float) -> torch.Tensor:
    """Clip the global gradient norm to `grad_clip` (0 = measure only); return the norm before
    clipping as a 0-d tensor on the gradients' device, not read back (the step reads it back with
    its other figures). Under FSDP the norm is the whole model's, not this rank's shards'."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if hasattr(norm, "full_tensor"):  # a DTensor of this rank's share: the whole norm, on every rank
        norm = norm.full_tensor()
    if grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], grad_clip, norm)
    return norm


def optimizer_step(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set `lr` (times each group's `lr_multiplier`), step, clear the gradients. Shared by
    mid-training and the RL trainer, after `clip_gradients`."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_multiplier", 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
