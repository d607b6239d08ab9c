"""One optimizer step of the policy over one batch.

The batch is cut into micro-batches; each runs a forward (replaying the rollout's routes for an
MoE model unless replay is off), gets the logprobs of its targets, and backpropagates its share
of `policy_loss`. The loss is normalised by the whole step's N (trained tokens or rows,
`rl.loss.step_normalizer`), so micro-batches (and, under FSDP, ranks) add up to the gradient of one big batch.

With `numerics="invariant"` (and the engine's dtype) the forward is batch-invariant: the
logprobs and routes equal the inference engine's bit for bit, so at staleness 0 every
importance ratio is exactly 1 (docs/consistency.md). Rows sampled at a temperature T other than
1 (`Batch.temperatures`) get the logprobs of logits / T, the distribution they were drawn from.

Routing disagreement is measured alongside: with replay, how often the trainer's own router
would have picked other experts (forward hooks, `rl.routing`); without replay, how often the
trainer's choice differs from the rollout's recorded routes.

The step runs where the model is (`Transformer` on any device): the batch goes there once, and
every figure (losses, counts, the gradient norm) stays on the device until one read-back at the
end of the step (`training.readback`), so on a GPU the step never waits on it before then.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from whetstone.errors import WhetstoneError
from whetstone.model import ModelConfig, Numerics, Transformer, ops
from whetstone.model.moe import check_route_ids, check_routes
from whetstone.rl.batch import IGNORED_TARGET, Batch
from whetstone.rl.logit_scale import LogitScale
from whetstone.rl.loss import LossConfig, LossInputs, LossStats, policy_loss, step_normalizer
from whetstone.rl.routing import RoutingStats, track_routing
from whetstone.trainer.distributed import reduce_step_stats
from whetstone.training.optim import clip_gradients, optimizer_step
from whetstone.utils.device import autocast

if TYPE_CHECKING:
    from whetstone.online.config import OnlineConfig
    from whetstone.trainer.config import TrainerConfig


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """Rows in order of length, `size` at a time: each micro-batch is cut to its longest row, so
    grouping similar lengths pads less (a quarter less trainer CPU on the default run's batches,
    whose rollouts range from ~150 to ~800 positions). The step's gradient is the same."""
    lengths = [row["num_positions"] for row in batch.rows] if batch.rows else [batch.input_ids.shape[1]] * len(batch)
    order = sorted(range(len(batch)), key=lambda r: (lengths[r], r))
    return [batch.select(order[i : i + size]) for i in range(0, len(batch), size)]


def check_batch_routes(batch: Batch, cfg: ModelConfig, source: str = "batch") -> None:
    """Refuse a batch whose routes do not fit an MoE model of `cfg` (another number of MoE
    layers, experts per token or experts: a batch another model sampled), naming it (`source`).
    Reads the routes where they are: call it on the host copy, before any optimizer step of the
    batch, so that a batch refused is refused whole (a dense model ignores routes)."""
    if batch.routes is None or not cfg.num_moe_layers:
        return
    expected = (*batch.input_ids.shape, cfg.num_moe_layers, cfg.num_experts_per_tok)
    try:
        check_routes(batch.routes, expected, cfg.num_experts)
    except WhetstoneError as err:
        raise WhetstoneError(
            f"{source}: {err}: the batch was sampled by another model. Train it with the model its "
            "rollouts were sampled from, or point the batch store at this model's batches"
        ) from None


def _unreplayed_disagreement(own: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> RoutingStats:
    """Trainer's own routes vs the rollout's, as expert sets, at the positions of `mask`."""
    differs = (own.sort(dim=-1).values != rollout.sort(dim=-1).values).any(dim=-1)  # [B, T, layers]
    differs = differs & mask.unsqueeze(-1)
    tokens = mask.sum()
    return RoutingStats(
        choices=tokens * differs.shape[-1],
        disagreed=differs.sum(),
        tokens=tokens,
        tokens_disagreed=differs.any(dim=-1).sum(),
    )


@contextmanager
def sampling_temperature(model: Transformer, temperatures: torch.Tensor | None) -> Iterator[None]:
    """Within the block, row b's logits are divided by temperatures[b]. The output head is
    linear and bias-free, so this divides the final hidden state instead: the fused logprob
    head (`whetstone.model.head`) stays as it is, and the gradient flows through the division
    (by exactly 1 for rows at temperature 1: a product by 1 changes no bit)."""
    if temperatures is None:
        yield
        return
    scale = temperatures.reciprocal().view(-1, 1, 1)
    handle = model.norm.register_forward_hook(lambda _module, _inputs, hidden: hidden * scale.to(hidden))
    try:
        yield
    finally:
        handle.remove()


@dataclass
class PolicyOutput:
    logprobs: torch.Tensor
    """[B, T] logprobs of the targets (of logits / T for rows with a temperature T)."""
    routing: RoutingStats
    """Routing disagreement at the trained positions."""
    entropy: torch.Tensor | None = None
    """[B, T] entropies of the same next-token distributions, when asked for."""


def forward_logprobs(
    model: Transformer, micro: Batch, replay: bool, dtype: str, numerics: Numerics = "fast", entropy: bool = False
) -> PolicyOutput:
    """Logprobs of the micro-batch's targets (and their distributions' entropies) at its trained
    positions (0 elsewhere), and the routing disagreement there.

    With `numerics="invariant"` and the engine's dtype, these are the engine's own logprobs
    and routes, bit for bit (docs/consistency.md), for rows at temperature 1."""
    has_routes = micro.routes is not None and model.cfg.num_moe_layers > 0
    replayed = replay and has_routes
    tracking = track_routing(model, micro.loss_mask) if replayed else nullcontext(RoutingStats())
    # Only trained positions go through the head: nothing reads a prompt's or a tool result's
    # logprobs, and the head is most of a small model's compute (its rows are chosen by target >= 0).
    targets = micro.target_ids.masked_fill(~micro.loss_mask, IGNORED_TARGET)
    device = micro.input_ids.device
    temperature = sampling_temperature(model, micro.temperatures)
    with tracking as routing, autocast(dtype, device), ops.numerics(numerics), temperature:
        out = model(
            micro.input_ids,
            routes=micro.routes if replayed else None,
            return_routes=has_routes and not replayed,
            targets=targets,
            return_entropy=entropy,
        )
    if has_routes and not replayed:
        routing = _unreplayed_disagreement(out.routes, micro.routes, micro.loss_mask)
    return PolicyOutput(out.logprobs, routing, out.entropy)


@dataclass(frozen=True)
class StepSettings:
    """How every step of a run trains: the loss and the forward's numerics (fixed for the run)."""

    loss: LossConfig = field(default_factory=LossConfig)
    """The policy-gradient loss."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this before the optimizer step; 0 = off."""
    micro_batch_size: int = 4
    """Rows per forward/backward."""
    replay: bool = True
    """Replay the rollout's routes (MoE models with routes in the batch)."""
    dtype: str = "float32"
    """Compute dtype of the forward (autocast)."""
    numerics: Numerics = "fast"
    """`invariant`: the engine's batch-invariant kernels in the forward."""

    @classmethod
    def of(cls, config: TrainerConfig | OnlineConfig) -> StepSettings:
        """The settings of a trainer's config (the RL trainer's or the online loop's: same fields)."""
        return cls(
            loss=config.loss,
            grad_clip=config.optimizer.grad_clip,
            micro_batch_size=config.micro_batch_size,
            replay=config.router_replay,
            dtype=config.dtype,
            numerics=config.numerics,
        )


@dataclass(frozen=True)
class Learner:
    """What a step moves: the policy and its optimizer, and what trains alongside them."""

    model: Transformer
    """The policy."""
    optimizer: torch.optim.Optimizer
    """The policy's optimizer."""
    reference: Transformer | None = None
    """The frozen model of the KL term (needed when `loss.kl_coef` > 0)."""
    logit_scale: LogitScale | None = None
    """The learned scale of the logits (`rl.logit_scale`): steps after the optimizer."""


@dataclass(frozen=True)
class DemoAnchor:
    """Demonstration rows whose mean next-token loss, times `coef`, joins a step's loss (`rl.demos`)."""

    rows: Batch
    """The demonstrations (assistant tokens trained)."""
    coef: float
    """Weight of their mean next-token loss; 0 = no anchor."""
    normalizer: int | None = None
    """Their trained-token count across ranks (default: these rows')."""


def _reference_logprobs(
    reference: Transformer, micro: Batch, settings: StepSettings, logit_scale: LogitScale | None
) -> torch.Tensor:
    """The reference's logprobs for the KL term, at the policy's learned logit scale: the term then
    holds the weights near the reference without pulling the scale back to 1, which would make the
    weights undo the sharpening the reward asked the scale for (rl/logit_scale.py)."""
    device = micro.input_ids.device
    factor = None if logit_scale is None else torch.full((1,), math.exp(-logit_scale.log_scale), device=device)
    with torch.no_grad(), sampling_temperature(reference, factor):  # a temperature e^-s: logits times e^s
        return forward_logprobs(reference, micro, settings.replay, settings.dtype, settings.numerics).logprobs


def _demo_loss(
    model: Transformer, anchor: DemoAnchor, settings: StepSettings, logit_scale: LogitScale | None
) -> torch.Tensor:
    """Backpropagate `anchor.coef` x the mean next-token loss of the demonstrations' assistant tokens
    (`rl.demos`); return that mean (this rank's share, on the device). It is taken at the policy's
    logits divided by the learned scale e^s, so, like the KL term's reference above, the anchor
    holds the weights to the demonstrations without pulling the sharpening back out."""
    device = _device_of(model)
    rows = anchor.rows.to(device)
    normalizer = rows.loss_mask.sum() if anchor.normalizer is None else anchor.normalizer
    if not isinstance(normalizer, torch.Tensor):  # a number of the whole step: no blocking copy to the device
        normalizer = torch.full((), normalizer, dtype=torch.float32, device=device)
    normalizer = normalizer.clamp(min=1)
    unscale = None if logit_scale is None else torch.full((1,), math.exp(logit_scale.log_scale), device=device)
    total = torch.zeros((), device=device)
    with sampling_temperature(model, unscale):  # a temperature e^s: logits divided by e^s
        for micro in micro_batches(rows, settings.micro_batch_size):
            logprobs = forward_logprobs(
                model, micro, replay=False, dtype=settings.dtype, numerics=settings.numerics
            ).logprobs
            nll = -(logprobs * micro.loss_mask).sum() / normalizer
            (anchor.coef * nll).backward()
            total += nll.detach()
    return total


def _device_of(model: torch.nn.Module) -> torch.device:
    """Where the model's weights are (the step moves its batches there)."""
    return next(model.parameters()).device


def train_step(
    learner: Learner,
    batch: Batch,
    settings: StepSettings,
    lr: float,
    *,
    normalizer: int | torch.Tensor | None = None,
    anchor: DemoAnchor | None = None,
) -> dict[str, Any]:
    """Forward/backward every micro-batch of `batch`, clip, take one optimizer step at `lr`.

    `normalizer`: N of the loss for the whole step across ranks (default: this batch's `step_normalizer`).
    `anchor`: demonstrations whose next-token loss joins the step's (`rl.demos`).
    Returns the step's metrics; raises before touching the weights if the loss is not finite.
    Its figures are read back from the device once, before the optimizer step.
    """
    model, reference, logit_scale, loss_config = learner.model, learner.reference, learner.logit_scale, settings.loss
    if loss_config.kl_coef > 0 and reference is None:
        raise WhetstoneError("loss.kl_coef > 0 needs a reference model")
    if batch.routes is not None and batch.routes.device.type == "cpu" and model.cfg.num_experts:
        # here, on the host, rather than a read-back in each forward on the device
        check_route_ids(batch.routes, model.cfg.num_experts)
    batch = batch.to(_device_of(model))
    if normalizer is None:
        normalizer = step_normalizer(batch.loss_mask, loss_config.aggregation, batch.rollout_shares)
    model.train()
    loss_total = torch.zeros((), device=batch.input_ids.device)
    loss_parts, routing_parts = [], []
    for micro in micro_batches(batch, settings.micro_batch_size):
        policy = forward_logprobs(model, micro, settings.replay, settings.dtype, settings.numerics, entropy=True)
        ref_logprobs = None
        if reference is not None and loss_config.kl_coef > 0:
            ref_logprobs = _reference_logprobs(reference, micro, settings, logit_scale)
        inputs = LossInputs(
            policy.logprobs,
            micro.behavior_logprobs,
            micro.advantages,
            micro.loss_mask,
            ref_logprobs=ref_logprobs,
            entropy=policy.entropy,
            rollout_shares=micro.rollout_shares,
        )
        loss, stats = policy_loss(inputs, loss_config, normalizer=normalizer)
        loss.backward()
        loss_total += loss.detach()
        loss_parts.append(stats)
        routing_parts.append(policy.routing)
    anchored, demo_nll = anchor is not None and anchor.coef > 0, 0.0
    if anchored:
        demo_nll = _demo_loss(model, anchor, settings, logit_scale)
        loss_total += anchor.coef * demo_nll
    grad_norm = clip_gradients(model, settings.grad_clip)
    stats, routing = LossStats.merge(loss_parts), RoutingStats.merge(routing_parts)
    # One read-back; under torchrun, the whole step's loss and stats on every rank, so all ranks
    # agree on a bad loss.
    totals = reduce_step_stats(
        {"loss": loss_total, "demo_nll": demo_nll, **stats.totals(), **routing.totals()},
        stats.abs_diff,
        whole={"grad_norm": grad_norm},
    )
    if totals["tokens"] == 0 or not (math.isfinite(totals["loss"]) and math.isfinite(totals["grad_norm"])):
        learner.optimizer.zero_grad(set_to_none=True)  # a NaN norm would clip every gradient to NaN
        index = batch.meta.get("index", "?")
        if totals["tokens"] == 0:
            raise WhetstoneError(f"batch {index} has no trained tokens (every loss_mask is 0)")
        raise WhetstoneError(
            f"batch {index}: the loss is {totals['loss']} and the gradient norm {totals['grad_norm']}; this "
            "optimizer step is not taken, and nothing of the batch is published or checkpointed (a mini-batch "
            "of it before this one may have stepped). A lower optimizer.lr or a grad_clip may help"
        )
    optimizer_step(learner.optimizer, lr)
    metrics = {
        "loss": totals["loss"],
        "grad_norm": totals["grad_norm"],
        "lr": lr,
        **stats.metrics(totals),
        **routing.metrics(totals),
    }
    if anchored:
        metrics["demo_nll"] = totals["demo_nll"]
    if logit_scale is not None:
        logit_scale.step(model, totals["scale_gradient"])
        metrics.update(logit_scale=math.exp(logit_scale.log_scale), logit_scale_grad=totals["scale_gradient"])
    return metrics
