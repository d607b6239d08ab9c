"""One optimizer step of next-token training, and the validation loss.

The loss of a step is the token-weighted mean over all of its micro-batches (the sum of their
cross-entropies divided by the step's target count), so gradient accumulation gives the gradient
of one big batch, whatever the share of ignored targets in each micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from whetstone.data import IGNORE_INDEX, Batch
from whetstone.errors import WhetstoneError
from whetstone.model import Transformer, ops
from whetstone.training.optim import clip_and_step
from whetstone.utils.device import autocast


@dataclass
class StepStats:
    loss: float
    """Mean next-token cross-entropy over the step's targets (nats/token)."""
    demo_loss: float | None
    """The same over the targets in demonstration rows only (None when the step has none)."""
    aux_loss: float
    """Mean MoE load-balancing loss over the micro-batches (unweighted)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    tokens: int
    """Input tokens processed."""


def token_losses(model: Transformer, batch: Batch, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy of every target [B, T], 0 where ignored; the model's aux loss)."""
    # The fused head: fp32 softmax, no [B, T, vocab] logits kept, ignored targets skipped.
    with autocast(dtype), ops.training_kernels():
        out = model(batch.input_ids, targets=batch.targets)
    return -out.logprobs, out.aux_loss


def train_step(
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[Batch],
    *,
    lr: float,
    dtype: str,
    grad_clip: float,
    step: int,
) -> StepStats:
    """Forward/backward every micro-batch, clip, and take one AdamW step at `lr`."""
    targets = sum(int((b.targets != IGNORE_INDEX).sum()) for b in micro_batches)
    if targets == 0:
        raise WhetstoneError(f"step {step}: the batch has no trained tokens (every target is ignored)")
    aux_weight = model.cfg.router_aux_loss_coef
    loss_total, aux_total, demo_total, demo_targets = 0.0, 0.0, 0.0, 0
    for batch in micro_batches:
        losses, aux = token_losses(model, batch, dtype)
        loss_sum = losses.sum()
        loss = loss_sum / targets + aux_weight * aux / len(micro_batches)
        loss.backward()
        loss_total += loss_sum.item()
        aux_total += aux.item()
        demo_total += losses[batch.is_demo].sum().item()
        demo_targets += int((batch.targets[batch.is_demo] != IGNORE_INDEX).sum())
    loss_mean = loss_total / targets
    if not torch.isfinite(torch.tensor(loss_mean)):
        raise WhetstoneError(
            f"step {step}: the loss is {loss_mean} (training diverged); lower optimizer.lr or resume "
            "from the last checkpoint with a different config"
        )
    grad_norm = clip_and_step(model, optimizer, lr, grad_clip)
    tokens = sum(b.input_ids.numel() for b in micro_batches)
    demo_loss = demo_total / demo_targets if demo_targets else None
    return StepStats(loss_mean, demo_loss, aux_total / len(micro_batches), grad_norm, tokens)


@torch.no_grad()
def validation_loss(model: Transformer, batches: Iterable[Batch], dtype: str) -> float:
    """Mean cross-entropy (nats/token) over every target of `batches`."""
    total, count = 0.0, 0
    for batch in batches:
        losses, _ = token_losses(model, batch, dtype)
        total += losses.sum().item()
        count += int((batch.targets != IGNORE_INDEX).sum())
    return total / max(count, 1)
