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
optimizer step: a token-level mean, DAPO-style) or `sequence` (each row's tokens weighted
1 / its trained length, N = the step's trained rows: every sample counts the same, GRPO-style).
N is the whole step's (`step_normalizer`), so micro-batches and ranks add up to the same
gradient as one big batch.

The loss sees only logprobs, advantages and masks: it does not know how advantages were made.
Metrics compare the trainer with the sampler: k3 KL = mean(exp(Δ) − Δ − 1), Δ = logπ_θ − logπ_behavior
(an estimate of KL(behavior ‖ trainer) from the sampler's tokens) and mean / p99 / max |Δ|.
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
    over samples of each sample's token mean, so that a long failed rollout does not outweigh
    a short solved one."""

    @model_validator(mode="after")
    def _ranges(self) -> "LossConfig":
        if self.mask_low >= self.mask_high:
            raise ValueError(f"mask_low ({self.mask_low}) must be below mask_high ({self.mask_high})")
        if self.is_cap < 1.0 + self.clip_high:
            raise ValueError(f"is_cap ({self.is_cap}) must be at least 1 + clip_high ({1.0 + self.clip_high})")
        return self


@dataclass
class LossStats:
    """Sums over one micro-batch; `merge` several (micro-batches, ranks) before `metrics()`."""

    tokens: int = 0
    clipped: int = 0
    masked: int = 0
    truncated: int = 0
    forking_dropped: int = 0
    """Trained tokens left out of the policy-gradient term by `forking_fraction`."""
    mismatch_k3: float = 0.0
    ref_k3: float = 0.0
    entropy: float = 0.0
    """Σ of the trained tokens' entropies (nats), when the trainer computed them."""
    scale_gradient: float = 0.0
    """d(policy-gradient term)/ds for logits scaled by e^s, without the clip (`rl.logit_scale`);
    needs the entropies."""
    abs_diff: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """|logπ_θ − logπ_behavior| of every trained token (for p99 and max)."""

    @staticmethod
    def merge(parts: list["LossStats"]) -> "LossStats":
        return LossStats(
            tokens=sum(p.tokens for p in parts),
            clipped=sum(p.clipped for p in parts),
            masked=sum(p.masked for p in parts),
            truncated=sum(p.truncated for p in parts),
            forking_dropped=sum(p.forking_dropped for p in parts),
            mismatch_k3=sum(p.mismatch_k3 for p in parts),
            ref_k3=sum(p.ref_k3 for p in parts),
            entropy=sum(p.entropy for p in parts),
            scale_gradient=sum(p.scale_gradient for p in parts),
            abs_diff=torch.cat([p.abs_diff for p in parts]) if parts else torch.zeros(0),
        )

    def metrics(self) -> dict[str, float]:
        n, diff = max(self.tokens, 1), self.abs_diff.double()
        return {
            "tokens": self.tokens,
            "clip_fraction": self.clipped / n,
            "mask_fraction": self.masked / n,
            "truncated_fraction": self.truncated / n,
            "forking_dropped_fraction": self.forking_dropped / n,
            "mismatch_kl_k3": self.mismatch_k3 / n,
            "ref_kl_k3": self.ref_k3 / n,
            "entropy": self.entropy / n,
            "logprob_diff_mean": float(diff.mean()) if diff.numel() else 0.0,
            "logprob_diff_p99": float(torch.quantile(diff, 0.99)) if diff.numel() else 0.0,
            "logprob_diff_max": float(diff.max()) if diff.numel() else 0.0,
            "logprob_diff_over_ln2": float((diff > math.log(2)).double().mean()) if diff.numel() else 0.0,
        }


def k3(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(p ‖ q) from samples of p: exp(Δ) − Δ − 1, Δ = log q − log p."""
    delta = log_q - log_p
    return torch.exp(delta) - delta - 1.0


def step_normalizer(loss_mask: torch.Tensor, aggregation: str) -> int:
    """N of the loss over these rows: trained tokens, or rows with any trained token."""
    if aggregation == "sequence":
        return int(loss_mask.bool().any(dim=-1).sum())
    return int(loss_mask.sum())


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


def policy_loss(
    inputs: LossInputs, config: LossConfig, normalizer: int | None = None
) -> tuple[torch.Tensor, LossStats]:
    """(loss, stats) for one micro-batch.

    `normalizer`: N of the whole optimizer step (default: this micro-batch's `step_normalizer`).
    """
    logprobs, loss_mask, ref_logprobs, entropy = inputs.logprobs, inputs.loss_mask, inputs.ref_logprobs, inputs.entropy
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if (config.entropy_coef != 0 or config.forking_fraction < 1) and entropy is None:
        raise ValueError("entropy_coef != 0 and forking_fraction < 1 need the entropies")
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
    if config.forking_fraction < 1 and bool(trained.any()):
        detached_entropy = entropy.detach().float()
        threshold = torch.quantile(detached_entropy[trained], 1.0 - config.forking_fraction)
        forking_dropped = trained & (detached_entropy < threshold)
        surrogate = torch.where(forking_dropped, torch.zeros_like(surrogate), surrogate)
    per_token = -surrogate
    if config.kl_coef > 0:
        per_token = per_token + config.kl_coef * k3(logprobs32, ref_logprobs.float())
    if config.entropy_coef != 0:
        per_token = per_token - config.entropy_coef * entropy.float()
    kept = trained & ~masked
    lengths = trained.sum(dim=-1, keepdim=True).clamp(min=1)  # each row's trained tokens
    denominator = max(step_normalizer(loss_mask, config.aggregation) if normalizer is None else normalizer, 1)
    loss = _aggregate(per_token, kept, lengths, config, denominator)

    with torch.no_grad():
        diff = log_ratio.detach()[trained]
        stats = LossStats(
            tokens=int(trained.sum()),
            clipped=int(clipped.sum()),
            masked=int(masked.sum()),
            truncated=int(truncated.sum()),
            forking_dropped=int(forking_dropped.sum()),
            abs_diff=diff.abs().cpu(),
            mismatch_k3=float(k3(behavior[trained], logprobs32.detach()[trained]).sum()),
        )
        if entropy is not None:
            stats.entropy = float(entropy.detach().float()[trained].sum())
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
            stats.ref_k3 = float(k3(logprobs32.detach()[trained], ref_logprobs.float()[trained]).sum())
    return loss, stats


def _scale_gradient(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    lengths: torch.Tensor,
    kept: torch.Tensor,
    config: LossConfig,
    denominator: int,
) -> float:
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
    return float(_aggregate(per_token.double(), kept, lengths, config, denominator))


def _aggregate(
    per_token: torch.Tensor, kept: torch.Tensor, lengths: torch.Tensor, config: LossConfig, denominator: int
) -> torch.Tensor:
    """Σ over the kept tokens of `per_token` (divided by its row's trained length under sequence
    aggregation), over the step's `denominator`: how the loss and the scale's gradient add up."""
    if config.aggregation == "sequence":
        per_token = per_token / lengths
    return torch.where(kept, per_token, torch.zeros_like(per_token)).sum() / denominator
