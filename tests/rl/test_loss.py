"""The policy loss, checked against values worked out by hand.

Four trained tokens, ε = 0.2, truncation cap 2, and one padded (untrained) position:
  token 0: A = +1, r = 1.1  inside the clip range       → surrogate 1.1·1,  gradient weight 1.1
  token 1: A = +1, r = 1.5  above 1 + ε, clipped         → surrogate 1.2·1,  no gradient
  token 2: A = −1, r = 3    truncated to the cap 2       → surrogate 2·(−1), gradient weight 2
  token 3: A = −1, r = 0.6  below 1 − ε, clipped         → surrogate 0.8·(−1), no gradient
  loss = −(1.1 + 1.2 − 2 − 0.8) / 4 = 0.125
"""

from __future__ import annotations

import math

import pytest
import torch

from whetstone.config import load_config
from whetstone.errors import ConfigError
from whetstone.rl.loss import LossConfig, LossInputs, LossStats, k3, nan_quantiles, policy_loss, step_normalizer

RATIOS = [1.1, 1.5, 3.0, 0.6, 1.0]
ADVANTAGES = [1.0, 1.0, -1.0, -1.0, 0.0]
MASK = [1, 1, 1, 1, 0]


def inputs(entropy: torch.Tensor | None = None) -> LossInputs:
    behavior = torch.tensor([[-1.0, -2.0, -3.0, -0.5, 0.0]])
    logprobs = (behavior + torch.tensor([RATIOS]).log()).requires_grad_()
    return LossInputs(
        logprobs, behavior, torch.tensor([ADVANTAGES]), torch.tensor([MASK], dtype=torch.bool), entropy=entropy
    )


def test_clipped_truncated_loss_and_its_gradient():
    example = inputs()
    loss, stats = policy_loss(example, LossConfig())
    assert loss.item() == pytest.approx(0.125, rel=1e-6)
    loss.backward()
    # d loss / d logπ = −A · min(r, cap) / 4 where not clipped, 0 where clipped or untrained.
    assert example.logprobs.grad.tolist()[0] == pytest.approx([-1.1 / 4, 0.0, 2.0 / 4, 0.0, 0.0], rel=1e-6)
    metrics = stats.metrics()
    fractions = [metrics[name] for name in ("clip_fraction", "truncated_fraction", "mask_fraction")]
    assert metrics["tokens"] == 4 and fractions == [0.5, 0.25, 0.0]


def test_mismatch_metrics_between_trainer_and_sampler():
    _, stats = policy_loss(inputs(), LossConfig())
    deltas = [math.log(r) for r in RATIOS[:4]]
    metrics = stats.metrics()
    assert metrics["mismatch_kl_k3"] == pytest.approx(sum(r - 1 - d for r, d in zip(RATIOS, deltas)) / 4, rel=1e-5)
    assert metrics["logprob_diff_mean"] == pytest.approx(sum(abs(d) for d in deltas) / 4, rel=1e-5)
    assert metrics["logprob_diff_max"] == pytest.approx(math.log(3.0), rel=1e-5)
    assert metrics["logprob_diff_over_ln2"] == 0.25  # only r = 3 is beyond a factor of 2


def test_ratio_masking_drops_tokens_outside_the_range():
    example = inputs()
    loss, stats = policy_loss(example, LossConfig(mask_ratio=True))
    assert loss.item() == pytest.approx(-(1.1 + 1.2 - 0.8) / 4, rel=1e-6)  # token 2 (r = 3) is gone
    loss.backward()
    assert example.logprobs.grad[0, 2] == 0.0
    assert stats.metrics()["mask_fraction"] == 0.25


def test_clipped_and_truncated_count_only_the_tokens_the_mask_keeps():
    # mask_low 0.7 masks token 3 (r = 0.6, clipped) and token 2 (r = 3, truncated): only token 1
    # (r = 1.5, clipped) is a kept token the clip or the cap acts on.
    _, stats = policy_loss(inputs(), LossConfig(mask_ratio=True, mask_low=0.7, mask_high=2.0))
    metrics = stats.metrics()
    assert metrics["mask_fraction"] == 0.5
    assert metrics["clip_fraction"] == 0.25 and metrics["truncated_fraction"] == 0.0


def test_kl_to_a_reference_adds_beta_times_k3():
    # One token, A = 0, ref = logπ − ln 2: k3 = 1/2 + ln 2 − 1, d k3 / d logπ = 1 − 1/2.
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    ref = logprobs.detach() - math.log(2)
    one = LossInputs(
        logprobs, logprobs.detach(), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), ref_logprobs=ref
    )
    loss, stats = policy_loss(one, LossConfig(kl_coef=0.1))
    assert loss.item() == pytest.approx(0.1 * (math.log(2) - 0.5), rel=1e-6)
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(0.05, rel=1e-6)
    assert stats.metrics()["ref_kl_k3"] == pytest.approx(math.log(2) - 0.5, rel=1e-6)


def test_k3_is_zero_for_equal_policies_and_positive_otherwise():
    p = torch.tensor([-1.0, -2.0])
    assert k3(p, p).tolist() == [0.0, 0.0]
    assert (k3(p, p + 0.3) > 0).all() and (k3(p, p - 0.3) > 0).all()


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_with_the_step_normalizer_add_up_to_the_whole_batch(aggregation):
    torch.manual_seed(0)
    config = LossConfig(aggregation=aggregation)
    behavior = -torch.rand(4, 6) * 3
    logprobs = (behavior + torch.randn(4, 6) * 0.3).requires_grad_()
    advantages = torch.randn(4, 1).expand(4, 6)
    mask = torch.rand(4, 6) > 0.3
    whole, _ = policy_loss(LossInputs(logprobs, behavior, advantages, mask), config)
    (whole_grad,) = torch.autograd.grad(whole, logprobs)
    total, parts = 0.0, []
    for rows in (slice(0, 1), slice(1, 4)):
        part, stats = policy_loss(
            LossInputs(logprobs[rows], behavior[rows], advantages[rows], mask[rows]),
            config,
            normalizer=step_normalizer(mask, aggregation),
        )
        total, parts = total + part, parts + [stats]
    (split_grad,) = torch.autograd.grad(total, logprobs)
    assert torch.allclose(total, whole, rtol=1e-6) and torch.allclose(split_grad, whole_grad, rtol=1e-6)
    merged = LossStats.merge(parts).metrics()
    _, whole_stats = policy_loss(LossInputs(logprobs, behavior, advantages, mask), config)
    assert merged == pytest.approx(whole_stats.metrics(), rel=1e-6)


def test_sequence_aggregation_weighs_every_sample_the_same_whatever_its_length():
    # A short solved sample (A = +1, 2 tokens) and a long failed one (A = -1, 8 tokens), on-policy.
    behavior = torch.full((2, 8), -1.0)
    logprobs = behavior.clone().requires_grad_()
    advantages = torch.tensor([[1.0], [-1.0]]).expand(2, 8)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :2], mask[1, :] = True, True
    for aggregation, short_share in (("token", 2 / 10), ("sequence", 1 / 2)):
        loss, _ = policy_loss(LossInputs(logprobs, behavior, advantages, mask), LossConfig(aggregation=aggregation))
        (grad,) = torch.autograd.grad(loss, logprobs)
        short, long = grad[0].abs().sum(), grad[1].abs().sum()
        assert float(short / (short + long)) == pytest.approx(short_share)
    assert step_normalizer(mask, "token") == 10 and step_normalizer(mask, "sequence") == 2


def test_sequence_aggregation_weighs_a_rollout_summarized_into_segments_once():
    # A short solved rollout (A = +1, one row of 2 tokens) and a failed one summarized into three
    # rows of 4, 2 and 2 tokens (A = -1): each rollout holds half of the gradient, and its rows
    # and micro-batches add up as for unsegmented rollouts.
    from whetstone.envs.trajectory import ModelCall, Segment, Trajectory
    from whetstone.rl.batch import batch_from_bytes, batch_to_bytes, collate
    from whetstone.rl.samples import trajectory_samples

    def call(prompt: int, n: int) -> ModelCall:
        return ModelCall(
            prompt_ids=[1] * prompt, completion_ids=[2] * n, logprobs=[-1.0] * n, versions=[0] * n, loss_mask=[1] * n
        )

    solved = Trajectory(task_id="t", segments=[Segment(calls=[call(3, 2)])], reward=1.0)
    failed = Trajectory(task_id="t", segments=[Segment(calls=[call(3, n)]) for n in (4, 2, 2)], reward=0.0)
    samples = trajectory_samples(solved, 1.0) + trajectory_samples(failed, -1.0)
    assert [s.rollout_share for s in samples] == [1.0, 0.5, 0.25, 0.25]
    batch = collate(samples)
    assert torch.equal(batch_from_bytes(batch_to_bytes(batch)).rollout_shares, batch.rollout_shares)
    config = LossConfig(aggregation="sequence")
    normalizer = step_normalizer(batch.loss_mask, "sequence", batch.rollout_shares)
    assert float(normalizer) == 2.0
    logprobs = batch.behavior_logprobs.clone().requires_grad_()
    whole, _ = policy_loss(
        LossInputs(
            logprobs, batch.behavior_logprobs, batch.advantages, batch.loss_mask, rollout_shares=batch.rollout_shares
        ),
        config,
        normalizer=normalizer,
    )
    (grad,) = torch.autograd.grad(whole, logprobs)
    assert float(grad[0].abs().sum()) == pytest.approx(float(grad[1:].abs().sum()))
    total = 0.0
    for rows in ([0, 2], [1, 3]):
        part = batch.select(rows)
        loss, _ = policy_loss(
            LossInputs(
                logprobs[rows, : part.loss_mask.shape[1]],
                part.behavior_logprobs,
                part.advantages,
                part.loss_mask,
                rollout_shares=part.rollout_shares,
            ),
            config,
            normalizer=normalizer,
        )
        total = total + loss
    assert torch.allclose(total, whole)


def test_extreme_ratios_stay_finite():
    logprobs = torch.tensor([[0.0, -300.0]], requires_grad=True)  # r = e^300 and e^-300
    behavior = torch.tensor([[-300.0, 0.0]])
    extreme = LossInputs(logprobs, behavior, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool))
    loss, _ = policy_loss(extreme, LossConfig())
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()


def test_k3_of_an_extreme_token_stays_finite_in_the_metrics_the_kl_term_and_its_gradient():
    # A token the sampler gave logprob -100 and the trainer -0.01 (Δ ≈ 100: exp(Δ) is inf in float32),
    # and the reverse against the reference; one more, untrained, whose reference is far off.
    bound = math.exp(20.0) - 21.0
    logprobs = torch.tensor([[-0.01, -100.0, -0.5, -100.0]], requires_grad=True)
    behavior = torch.tensor([[-100.0, -100.0, -0.5, -0.5]])
    ref = torch.tensor([[-0.01, -0.01, -0.5 - math.log(2), -0.01]])
    mask = torch.tensor([[True, True, True, False]])
    extreme = LossInputs(logprobs, behavior, torch.zeros(1, 4), mask, ref_logprobs=ref)
    loss, stats = policy_loss(extreme, LossConfig(kl_coef=0.1))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    metrics = stats.metrics()
    assert metrics["mismatch_kl_k3"] == pytest.approx(bound / 3, rel=1e-5)
    assert metrics["ref_kl_k3"] == pytest.approx((bound + math.log(2) - 0.5) / 3, rel=1e-5)
    assert logprobs.grad[0, 1] == 0.0 and logprobs.grad[0, 3] == 0.0  # held at the bound: no gradient
    assert logprobs.grad[0, 2].item() == pytest.approx(0.1 * 0.5 / 3, rel=1e-5)  # below it, exact
    assert metrics["logprob_diff_max"] == pytest.approx(99.99, rel=1e-5)  # |Δ| itself is not clamped
    # far below the reference (Δ = -100): k3 is -Δ - 1, exactly, and pulls the token down with weight ~1
    low = torch.tensor([-100.0])
    assert k3(torch.tensor([0.0]), low).item() == pytest.approx(99.0)


def test_bad_configs_name_the_field():
    with pytest.raises(ConfigError, match="mask_low"):
        load_config(LossConfig, overrides=["mask_low=3.0"])
    with pytest.raises(ConfigError, match="is_cap"):
        load_config(LossConfig, overrides=["is_cap=1.1"])
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(LossInputs(*[torch.zeros(1, 1)] * 3, torch.ones(1, 1)), LossConfig(kl_coef=0.1))


def test_entropy_term_adds_its_coefficient_times_the_mean_entropy_and_is_logged():
    behavior = torch.full((2, 3), -1.0)
    advantages = torch.tensor([[1.0], [-1.0]]).expand(2, 3)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    entropy = torch.tensor([[0.5, 1.5, 9.0], [1.0, 2.0, 3.0]], requires_grad=True)
    plain, _ = policy_loss(LossInputs(behavior.clone(), behavior, advantages, mask), LossConfig())
    for coef in (0.1, -0.3):
        with_entropy = LossInputs(behavior.clone(), behavior, advantages, mask, entropy=entropy)
        loss, stats = policy_loss(with_entropy, LossConfig(entropy_coef=coef))
        assert loss.item() == pytest.approx(plain.item() - coef * 8.0 / 5)  # untrained 9.0 left out
        (grad,) = torch.autograd.grad(loss, entropy)
        assert grad[0, 2] == 0 and float(grad[1, 0]) == pytest.approx(-coef / 5)
        assert stats.metrics()["entropy"] == pytest.approx(8.0 / 5)
    with pytest.raises(ValueError, match="entropies"):
        policy_loss(LossInputs(behavior, behavior, advantages, mask), LossConfig(entropy_coef=-0.1))


def test_forking_fraction_keeps_the_policy_gradient_on_the_highest_entropy_tokens_only():
    example = inputs(entropy=torch.tensor([[0.1, 3.0, 2.0, 0.2, 9.0]]))  # the padded position's 9 must not count
    loss, stats = policy_loss(example, LossConfig(forking_fraction=0.5))
    loss.backward()
    # Tokens 1 and 2 are the upper half of the trained tokens' entropies: token 1 is clipped
    # (value only), token 2 keeps its weight 2; tokens 0 and 3 leave the surrogate, the normaliser stays 4.
    assert example.logprobs.grad.tolist()[0] == pytest.approx([0.0, 0.0, 2.0 / 4, 0.0, 0.0], rel=1e-6)
    assert loss.item() == pytest.approx(-(1.2 - 2.0) / 4, rel=1e-6)
    assert stats.metrics()["forking_dropped_fraction"] == 0.5
    with pytest.raises(ValueError, match="forking_fraction"):
        policy_loss(inputs(), LossConfig(forking_fraction=0.5))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_nan_quantiles_are_torchs_for_any_size(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1001, generator=generator, dtype=dtype)
    x[torch.randperm(1001, generator=generator)[:300]] = math.nan
    quantiles = (0.0, 0.25, 0.5, 0.99, 1.0)
    expected = torch.nanquantile(x, torch.tensor(quantiles, dtype=dtype))
    torch.testing.assert_close(
        nan_quantiles(x, quantiles), expected, rtol=0, atol=0 if dtype == torch.float64 else 1e-6
    )
    assert nan_quantiles(torch.full((5,), math.nan, dtype=dtype), (0.5,)).isnan().all()
    assert nan_quantiles(torch.tensor([], dtype=dtype), (0.5,)).isnan().all()
    # torch's refuses more than 2^24 values, which a step's positions over several ranks can hold
    big = torch.zeros(2**24 + 1)
    big[-1], big[0] = 1.0, math.nan
    assert nan_quantiles(big, (0.5, 1.0)).tolist() == [0.0, 1.0]
