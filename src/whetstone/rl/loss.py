"""The policy-gradient loss, with off-policy correction against the sampler's logprobs.

Per trained token, with r = π_θ / π_behavior = exp(logπ_θ − logπ_behavior) and advantage A:

    surrogate = clip(r, 1 − ε_low, 1 + ε_high) · A     where PPO's min picks the clipped side
                                                       (A > 0, r > 1 + ε_high or A < 0, r < 1 − ε_low:
                                                       no gradient, counted as clipped)
              = min(r, is_cap) · A                     elsewhere: truncated importance sampling,
                                                       value and gradient scaled by min(r, cap) / r
    loss      = −Σ surrogate / N  +  β · Σ k3(π_θ, π_ref) / N  −  c_H · Σ H(π_θ) / N

H(π_θ) is the entropy of the whole next-token distribution at each trained token. A positive
c_H (`entropy_coef`) rewards exploration (verl's `entropy_coeff`); a negative one sharpens the
policy everywhere at once (entropy minimisation), where the reward's per-sample pushes do not
add up to a global sharpening quickly enough (docs/run.md).

Tokens whose r leaves [mask_low, mask_high] can be masked out entirely (IcePop-style), when
`mask_ratio` is on. `aggregation` chooses N: `token` (the trained-token count of the whole
optimizer step: a token-level mean, DAPO-style) or `sequence` (each rollout's tokens weighted
1 / its trained length, N = the step's rollouts: every rollout counts the same, GRPO-style; a
rollout summarized into several rows is spread over them by their shares of its tokens).
N is the whole step's (`step_normalizer`), so micro-batches and ranks add up to the same
gradient as one big batch.

The loss sees only logprobs, advantages and masks: it does not know how advantages were made.
Metrics compare the trainer with the sampler: k3 KL = mean(exp(Δ) − Δ − 1), Δ = logπ_θ − logπ_behavior
capped at 20 (`k3`; an estimate of KL(behavior ‖ trainer) from the sampler's tokens) and
mean / p99 / max |Δ| (not clamped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field, model_validator

from whetstone.config import Config


class LossConfig(Config):
    """The clipped, importance-corrected policy-gradient loss."""

    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    """ε_low: no gradient for negative-advantage tokens once r < 1 − ε_low."""
    clip_high: float = Field(0.2, ge=0.0)
    """ε_high: no gradient for positive-advantage tokens once r > 1 + ε_high."""
    is_cap: float = Field(2.0, ge=1.0)
    """Truncated importance sampling: each token's weight is min(r, is_cap)."""
    mask_ratio: bool = False
    """Drop tokens whose r leaves [mask_low, mask_high] from the loss entirely."""
    mask_low: float = Field(0.5, gt=0.0)
    """Lower bound of the kept ratio range when `mask_ratio` is on."""
    mask_high: float = Field(2.0, gt=0.0)
    """Upper bound of the kept ratio range when `mask_ratio` is on."""
    kl_coef: float = Field(0.0, ge=0.0)
    """β of the k3 KL penalty to a reference policy (0 = no reference model needed). With a
    learned logit scale the reference is taken at that scale, so the term restrains the weights'
    drift, not the sharpening."""
    entropy_coef: float = 0.0
    """c_H: the loss adds −c_H × the mean entropy of the trained tokens' next-token distributions.
    Positive rewards exploration; negative minimises entropy (sharpens the policy)."""
    forking_fraction: float = Field(1.0, gt=0.0, le=1.0)
    """Train only on this fraction of each micro-batch's trained tokens, those with the highest
    next-token entropy ("forking" tokens, Wang et al. 2025, "Beyond the 80/20 rule": 0.2).
    The rest are left out of the policy-gradient term and counted as `forking_dropped`. 1 = all.
    The threshold is each micro-batch's quantile (the trainer's micro-batches group rows of similar
    length), so with this on, the step depends on `micro_batch_size`."""
    aggregation: Literal["token", "sequence"] = "token"
    """`token`: mean over the step's trained tokens (long samples weigh more). `sequence`: mean
    over rollouts of each rollout's token mean, so that a long failed rollout (summarized into
    several rows or not) does not outweigh a short solved one."""

    @model_validator(mode="after")
    def _ranges(self) -> "LossConfig":
        if self.mask_low >= self.mask_high:
            raise ValueError(f"mask_low ({self.mask_low}) must be below mask_high ({self.mask_high})")
        if self.is_cap < 1.0 + self.clip_high:
            raise ValueError(f"is_cap ({self.is_cap}) must be at least 1 + clip_high ({1.0 + self.clip_high})")
        return self


Count = int | float | torch.Tensor
"""A sum in `LossStats`: a 0-d tensor on the step's device until read back, then a number."""


@dataclass
class LossStats:
    """Sums over one micro-batch; `merge` several (micro-batches, ranks) before `metrics()`.

    The sums stay 0-d tensors on the step's device, so a step reads all of them back at once
    (`totals()` with `whetstone.training.readback`) instead of waiting on the device for each."""

    tokens: Count = 0
    clipped: Count = 0
    """Tokens in the loss (trained, not masked) whose ratio the clip stopped."""
    masked: Count = 0
    truncated: Count = 0
    """Tokens in the loss (trained, not masked) whose importance weight was capped at `is_cap`."""
    forking_dropped: Count = 0
    """Trained tokens left out of the policy-gradient term by `forking_fraction`."""
    mismatch_k3: Count = 0.0
    ref_k3: Count = 0.0
    entropy: Count = 0.0
    """Σ of the trained tokens' entropies (nats), when the trainer computed them."""
    scale_gradient: Count = 0.0
    """d(policy-gradient term)/ds for logits scaled by e^s, without the clip (`rl.logit_scale`);
    needs the entropies."""
    abs_diff: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """|logπ_θ − logπ_behavior| of every position, NaN where not trained (for p99 and max)."""

    SUMS = (
        "tokens",
        "clipped",
        "masked",
        "truncated",
        "forking_dropped",
        "mismatch_k3",
        "ref_k3",
        "entropy",
        "scale_gradient",
    )

    @staticmethod
    def merge(parts: list["LossStats"]) -> "LossStats":
        return LossStats(
            **{name: sum(getattr(p, name) for p in parts) for name in LossStats.SUMS},
            abs_diff=torch.cat([p.abs_diff for p in parts]) if parts else torch.zeros(0),
        )

    def totals(self) -> dict[str, Count]:
        """The sums, and the |Δ| summary (`diff_mean`, `diff_p99`, `diff_max`, `diff_over_ln2`)
        computed where the |Δ| are, all still unread; `metrics` takes them read back."""
        return {**{name: getattr(self, name) for name in self.SUMS}, **diff_summary(self.abs_diff)}

    def metrics(self, totals: dict[str, float] | None = None) -> dict[str, float]:
        """The step's metrics from `totals()` read back (read back here when not given)."""
        if totals is None:
            from whetstone.training.readback import read_back

            totals = read_back(self.totals())
        n = max(totals["tokens"], 1)
        return {
            "tokens": int(totals["tokens"]),
            "clip_fraction": totals["clipped"] / n,
            "mask_fraction": totals["masked"] / n,
            "truncated_fraction": totals["truncated"] / n,
            "forking_dropped_fraction": totals["forking_dropped"] / n,
            "mismatch_kl_k3": totals["mismatch_k3"] / n,
            "ref_kl_k3": totals["ref_k3"] / n,
            "entropy": totals["entropy"] / n,
            "logprob_diff_mean": totals["diff_mean"],
            "logprob_diff_p99": totals["diff_p99"],
            "logprob_diff_max": totals["diff_max"],
            "logprob_diff_over_ln2": totals["diff_over_ln2"] / n,
        }


DIFF_SUMMARY = ("diff_mean", "diff_p99", "diff_max", "diff_over_ln2")
"""The keys of `diff_summary`."""


def diff_summary(abs_diff: torch.Tensor) -> dict[str, Count]:
    """Mean, p99 and max of the trained positions' |Δ| (NaN elsewhere), and how many exceed ln 2,
    as unread tensors where the |Δ| are (0 for no trained position)."""
    diff = abs_diff.double()
    if not diff.numel():
        return dict.fromkeys(DIFF_SUMMARY, 0.0)
    p99, largest = nan_quantiles(diff.flatten(), (0.99, 1.0)).nan_to_num(0.0).unbind()
    over = (diff > math.log(2)).sum()
    return dict(zip(DIFF_SUMMARY, (diff.nanmean().nan_to_num(0.0), p99, largest, over)))


def nan_quantiles(x: torch.Tensor, quantiles: tuple[float, ...]) -> torch.Tensor:
    """`torch.nanquantile(x, quantiles)` of a 1-d `x` (linear interpolation; NaN where all of x
    is NaN), on x's device without reading anything back, and for any size: torch's refuses
    more than 2^24 values, which a step's positions over several ranks can hold."""
    if not x.numel():
        return x.new_full((len(quantiles),), math.nan)
    ordered = x.sort().values  # the NaNs last
    last = ((~x.isnan()).sum() - 1).clamp(min=0).double()  # index of the largest value
    position = torch.stack([last * q for q in quantiles])
    low, high = position.floor().long(), position.ceil().long()
    below, above = ordered[low], ordered[high]
    return torch.lerp(below, above, (position - low).to(x.dtype))


K3_LOG_RATIO_LIMIT = 20.0
"""Δ above which `k3` holds Δ at this bound (verl clamps Δ at ±20 too, and its k3 at ±10)."""


def k3(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(p ‖ q) from samples of p: exp(Δ) − Δ − 1, Δ = log q − log p.

    Δ is held at `K3_LOG_RATIO_LIMIT` from above before the exp: a token p gave almost no
    probability and q did not (Δ ≈ 100) would otherwise make exp(Δ) overflow float32 to inf, the
    step's loss and mismatch metric inf, and, at a position the mask leaves out, its gradient NaN
    (0 × inf); below the bound its gradient, 1 − exp(Δ), still reaches ~5e8. Beyond it a token
    counts as at it (exp(20) − 21 ≈ 4.9e8) and adds no gradient. Below, nothing is clamped: k3
    grows like −Δ and its gradient stays within 1."""
    delta = (log_q - log_p).clamp(max=K3_LOG_RATIO_LIMIT)
    return torch.exp(delta) - delta - 1.0


def step_normalizer(
    loss_mask: torch.Tensor, aggregation: str, rollout_shares: torch.Tensor | None = None
) -> torch.Tensor:
    """N of the loss over these rows: trained tokens, or the rollouts the rows with any trained
    token make up (each row its share of its rollout: `Batch.rollout_shares`, None for 1). A 0-d
    tensor on the mask's device: the step divides by it without reading it back."""
    if aggregation == "sequence":
        rows = loss_mask.bool().any(dim=-1)
        return rows.sum() if rollout_shares is None else torch.where(rows, rollout_shares, 0.0).sum()
    return loss_mask.sum()


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's per-token tensors, all [B, T]; `logprobs` (and `entropy`) carry the gradient."""

    logprobs: torch.Tensor
    """The policy's logprobs of the sampled tokens."""
    behavior_logprobs: torch.Tensor
    """The sampler's logprobs of the same tokens (the importance ratio's denominator)."""
    advantages: torch.Tensor
    """Each token's advantage (its sample's)."""
    loss_mask: torch.Tensor
    """Which tokens are trained."""
    ref_logprobs: torch.Tensor | None = None
    """The reference's logprobs, for the KL term (needed when `kl_coef` > 0)."""
    entropy: torch.Tensor | None = None
    """The policy's next-token entropies (needed when `entropy_coef` ≠ 0 or `forking_fraction` < 1)."""
    rollout_shares: torch.Tensor | None = None
    """[B] each row's share of its rollout's trained tokens (None: whole rollouts), for `sequence`."""


def policy_loss(
    inputs: LossInputs, config: LossConfig, normalizer: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, LossStats]:
    """(loss, stats) for one micro-batch.

    `normalizer`: N of the whole optimizer step (default: this micro-batch's `step_normalizer`).
    """
    logprobs, loss_mask, ref_logprobs, entropy = inputs.logprobs, inputs.loss_mask, inputs.ref_logprobs, inputs.entropy
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if (config.entropy_coef != 0 or config.forking_fraction < 1) and entropy is None:
        raise ValueError("entropy_coef != 0 or forking_fraction < 1 needs the entropies")
    trained = loss_mask.bool()
    logprobs32, behavior = logprobs.float(), inputs.behavior_logprobs.float()
    advantages = inputs.advantages.float()
    log_ratio = logprobs32 - behavior
    detached = torch.exp(log_ratio.detach())
    clipped = trained & torch.where(advantages >= 0, detached > 1 + config.clip_high, detached < 1 - config.clip_low)
    masked = torch.zeros_like(trained)
    if config.mask_ratio:
        masked = trained & ((detached < config.mask_low) | (detached > config.mask_high))
    truncated = trained & ~clipped & (detached > config.is_cap)

    # Values come from the detached ratio and the gradient from logπ_θ alone, so an overflowing
    # exp(Δ) on an extreme token can neither produce inf nor leak NaN into the backward pass.
    weight = torch.where(clipped, torch.zeros_like(detached), torch.clamp(detached, max=config.is_cap))
    value = torch.where(clipped, torch.clamp(detached, 1 - config.clip_low, 1 + config.clip_high), weight)
    surrogate = (value + weight * (logprobs32 - logprobs32.detach())) * advantages
    forking_dropped = torch.zeros_like(trained)
    if config.forking_fraction < 1:  # no trained token: the threshold is NaN and drops nothing
        detached_entropy = entropy.detach().float()
        trained_entropy = torch.where(trained, detached_entropy, torch.full_like(detached_entropy, math.nan))
        threshold = nan_quantiles(trained_entropy.flatten(), (1.0 - config.forking_fraction,))[0]
        forking_dropped = trained & (detached_entropy < threshold)
        surrogate = torch.where(forking_dropped, torch.zeros_like(surrogate), surrogate)
    per_token = -surrogate
    if config.kl_coef > 0:
        per_token = per_token + config.kl_coef * k3(logprobs32, ref_logprobs.float())
    if config.entropy_coef != 0:
        per_token = per_token - config.entropy_coef * entropy.float()
    kept = trained & ~masked
    lengths = trained.sum(dim=-1, keepdim=True).clamp(min=1)  # each row's trained tokens
    if inputs.rollout_shares is not None:  # its rollout's, under sequence aggregation
        lengths = lengths / inputs.rollout_shares.view(-1, 1).to(lengths.device)
    if normalizer is None:
        normalizer = step_normalizer(loss_mask, config.aggregation, inputs.rollout_shares)
    # no trained token: the sum is 0 (and a step of parts of rollouts may weigh less than 1)
    denominator = normalizer.clamp(min=1e-9) if isinstance(normalizer, torch.Tensor) else max(normalizer, 1e-9)
    loss = _aggregate(per_token, kept, lengths, config, denominator)

    with torch.no_grad():
        zero = torch.zeros_like(logprobs32)
        stats = LossStats(
            tokens=trained.sum(),
            clipped=(clipped & kept).sum(),  # of the tokens in the loss: a masked one is neither
            masked=masked.sum(),
            truncated=(truncated & kept).sum(),
            forking_dropped=forking_dropped.sum(),
            abs_diff=torch.where(trained, log_ratio.detach().abs(), math.nan).flatten(),
            mismatch_k3=torch.where(trained, k3(behavior, logprobs32.detach()), zero).sum(),
        )
        if entropy is not None:
            stats.entropy = torch.where(trained, entropy.detach().float(), zero).sum()
            stats.scale_gradient = _scale_gradient(
                logprobs32.detach(),
                entropy.detach().float(),
                detached,
                advantages,
                lengths,
                kept & ~forking_dropped,
                config,
                denominator,
            )
        if ref_logprobs is not None:
            stats.ref_k3 = torch.where(trained, k3(logprobs32.detach(), ref_logprobs.float()), zero).sum()
    return loss, stats


def _scale_gradient(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    lengths: torch.Tensor,
    kept: torch.Tensor,
    config: LossConfig,
    denominator: int | torch.Tensor,
) -> torch.Tensor:
    """The policy-gradient term's derivative along the logits' log-scale s, at the current s.

    With logits v scaled by e^s, d logπ(a)/ds = v_a − E_π[v] = logπ(a) + H(π): no backward needed.
    Weighted like the surrogate's gradient (truncated importance weight × advantage, same
    aggregation), but never clipped: the clip is a trust region for the weights, and on the scale
    it pulls back. After a step that sharpened, confident tokens leave [1 − ε, 1 + ε] first, so
    what is left unclipped are the tokens that want the scale lower, and the next optimizer steps
    on the same batch pull it back. The scale's own step size (Adam at a fixed lr) is
    its trust region.
    """
    per_token = -torch.clamp(ratio, max=config.is_cap) * advantages * (logprobs + entropy)
    return _aggregate(per_token.double(), kept, lengths, config, denominator)


def _aggregate(
    per_token: torch.Tensor,
    kept: torch.Tensor,
    lengths: torch.Tensor,
    config: LossConfig,
    denominator: int | torch.Tensor,
) -> torch.Tensor:
    """Σ over the kept tokens of `per_token` (divided by its row's trained length under sequence
    aggregation), over the step's `denominator`: how the loss and the scale's gradient add up."""
    if config.aggregation == "sequence":
        per_token = per_token / lengths
    return torch.where(kept, per_token, torch.zeros_like(per_token)).sum() / denominator
