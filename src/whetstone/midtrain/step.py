"""One optimizer step of next-token training, and the validation loss.

The loss of a step is the token-weighted mean over all of its micro-batches (the sum of their
cross-entropies divided by the step's target count), so gradient accumulation gives the gradient
of one big batch, whatever the share of ignored targets in each micro-batch.

Under torchrun each rank trains on its share of every micro-batch's rows (`rank_share`); the
target count is summed over the ranks on the device before the first backward, so each rank's
loss is its share of the whole step's mean and FSDP2's summed gradients are the one-process
gradient. The MoE load-balancing loss is taken over each rank's rows of each micro-batch (it is
not a sum over tokens), and averaged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch

from whetstone.data import IGNORE_INDEX, Batch
from whetstone.errors import WhetstoneError
from whetstone.model import Transformer, ops
from whetstone.training.distributed import sum_on_device, world
from whetstone.training.optim import clip_gradients, optimizer_step
from whetstone.training.readback import read_back
from whetstone.utils.device import autocast
from whetstone.utils.transfer import tensor_to_device


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


def on_device(batch: Batch, device: torch.device) -> Batch:
    """The batch with its tensors on `device` (itself when they are there already)."""
    if batch.input_ids.device == device:
        return batch
    return Batch(**{f.name: tensor_to_device(getattr(batch, f.name), device) for f in fields(batch)})


def rank_share(batch: Batch) -> Batch:
    """This rank's rows of `batch` under torchrun (rows rank, rank + world, ...); all of it on one
    rank. Every rank gets as many rows, so every rank runs the forward and FSDP2's collectives
    pair up: a training batch's size is a multiple of the ranks, and the shorter shares of a
    smaller one (the validation split's last batch) are padded with copies of its first row whose
    targets are all ignored, which add nothing to a loss or a target count."""
    rank, world_size = world()
    if world_size == 1:
        return batch
    share = {f.name: getattr(batch, f.name)[rank::world_size] for f in fields(batch)}
    missing = -(-len(batch.input_ids) // world_size) - len(share["input_ids"])
    if missing:
        padding = _ignored_rows(batch, missing)
        share = {name: torch.cat([value, padding[name]]) for name, value in share.items()}
    return Batch(**share)


def _ignored_rows(batch: Batch, count: int) -> dict[str, torch.Tensor]:
    """`count` copies of `batch`'s first row, by field, with every target ignored (not a
    demonstration row either)."""
    rows = {f.name: getattr(batch, f.name)[:1].repeat_interleave(count, dim=0) for f in fields(batch)}
    rows["targets"].fill_(IGNORE_INDEX)
    rows["is_demo"].fill_(False)
    return rows


def token_losses(model: Transformer, batch: Batch, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy of every target [B, T], 0 where ignored; the model's aux loss)."""
    # The fused head: fp32 softmax, no [B, T, vocab] logits kept, ignored targets skipped.
    with autocast(dtype, batch.input_ids.device), ops.training_kernels():
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
    """Forward/backward every micro-batch (moved to the model's device), clip, and take one AdamW
    step at `lr`. The step's figures stay on the device until one read-back before the optimizer
    step; on a GPU the host also waits once a forward, where the head reads back how many
    positions it trains."""
    device = next(model.parameters()).device
    ranks = world()[1]
    micro_batches = [on_device(rank_share(batch), device) for batch in micro_batches]
    targets = sum_on_device(sum((batch.targets != IGNORE_INDEX).sum() for batch in micro_batches))
    aux_weight = model.cfg.router_aux_loss_coef
    loss_total, aux_total, demo_total, demo_targets = (torch.zeros((), device=device) for _ in range(4))
    for batch in micro_batches:
        losses, aux = token_losses(model, batch, dtype)
        loss_sum = losses.sum()
        loss = loss_sum / targets.clamp(min=1) + aux_weight * aux / (len(micro_batches) * ranks)
        loss.backward()
        demo_rows = batch.is_demo.unsqueeze(-1)
        loss_total += loss_sum.detach()
        aux_total += aux.detach()
        demo_total += (losses.detach() * demo_rows).sum()
        demo_targets += ((batch.targets != IGNORE_INDEX) & demo_rows).sum()
    grad_norm = clip_gradients(model, grad_clip)  # the whole model's norm, on every rank
    loss_total, aux_total, demo_total, demo_targets = sum_on_device(
        torch.stack([loss_total, aux_total, demo_total, demo_targets])
    )
    figures = read_back(
        {
            "loss": loss_total,
            "aux": aux_total / ranks,
            "demo": demo_total,
            "demo_targets": demo_targets,
            "targets": targets,
            "grad_norm": grad_norm,
        }
    )
    if figures["targets"] == 0:
        optimizer.zero_grad(set_to_none=True)
        raise WhetstoneError(f"step {step}: the batch has no trained tokens (every target is ignored)")
    loss_mean = figures["loss"] / figures["targets"]
    if not (math.isfinite(loss_mean) and math.isfinite(figures["grad_norm"])):
        optimizer.zero_grad(set_to_none=True)  # a NaN norm would clip every gradient to NaN
        raise WhetstoneError(
            f"step {step}: the loss is {loss_mean} and the gradient norm {figures['grad_norm']} "
            "(training diverged); lower optimizer.lr or resume from the last checkpoint with a "
            "different config"
        )
    optimizer_step(optimizer, lr)
    tokens = sum(b.input_ids.numel() for b in micro_batches) * ranks
    demo_loss = figures["demo"] / figures["demo_targets"] if figures["demo_targets"] else None
    return StepStats(loss_mean, demo_loss, figures["aux"] / len(micro_batches), figures["grad_norm"], tokens)


@torch.no_grad()
def validation_loss(model: Transformer, batches: Iterable[Batch], dtype: str) -> float:
    """Mean cross-entropy (nats/token) over every target of `batches`, read back once (under
    torchrun: over every rank's share, the same on every rank)."""
    device = next(model.parameters()).device
    total, count = torch.zeros((), device=device), torch.zeros((), device=device)
    for batch in batches:
        batch = on_device(rank_share(batch), device)
        losses, _ = token_losses(model, batch, dtype)
        total += losses.sum()
        count += (batch.targets != IGNORE_INDEX).sum()
    total, count = sum_on_device(torch.stack([total, count]))
    figures = read_back({"total": total, "count": count})
    return figures["total"] / max(figures["count"], 1)
