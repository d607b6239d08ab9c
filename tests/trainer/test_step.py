"""One optimizer step over a batch sampled by the real engine from a real tiny MoE."""

from __future__ import annotations

import math

import pytest
import torch

from whetstone.errors import WhetstoneError
from whetstone.model.hf import load_hf
from whetstone.online.config import OnlineConfig
from whetstone.rl.logit_scale import LogitScale
from whetstone.rl.loss import LossConfig
from whetstone.trainer.config import TrainerConfig
from whetstone.trainer.step import Learner, StepSettings, forward_logprobs, train_step
from whetstone.training.optim import build_optimizer


def model_and_optimizer(folder):
    model = load_hf(folder)
    return model, build_optimizer(model, lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def step(model, optimizer, batch, lr=1e-2, reference=None, logit_scale=None, **settings):
    settings = {"grad_clip": 1.0, "micro_batch_size": 3} | settings
    return train_step(Learner(model, optimizer, reference, logit_scale), batch, StepSettings(**settings), lr)


@torch.no_grad()
def logprobs(model, batch):
    return forward_logprobs(model, batch, replay=True, dtype="float32").logprobs


def test_with_replay_the_trainer_reproduces_the_sampler_and_moves_toward_the_reward(tiny_moe, batches):
    model, optimizer = model_and_optimizer(tiny_moe)
    batch = batches[0]
    before = logprobs(model, batch)
    first = step(model, optimizer, batch)
    # Same weights, same routes: the trainer sees exactly what the engine sampled with.
    assert first["logprob_diff_max"] < 1e-5 and first["mismatch_kl_k3"] < 1e-9
    assert first["routing_disagreement"] == 0.0 and first["tokens"] == batch.num_loss_tokens

    after = logprobs(model, batch)
    change = ((after - before) * batch.loss_mask).sum(dim=1)
    advantages = batch.advantages[:, 0]
    assert (change[advantages > 0] > 0).all() and (change[advantages < 0] < 0).all()

    second = step(model, optimizer, batch)
    assert second["loss"] < first["loss"]  # the surrogate improves on the batch it was trained on
    assert second["mismatch_kl_k3"] > 0 and second["clip_fraction"] > 0  # now off-policy: measured, clipped


def test_only_trained_positions_go_through_the_head(tiny_moe, batches):
    model, batch = load_hf(tiny_moe), batches[0]
    assert (~batch.loss_mask & (batch.target_ids >= 0)).any()  # prompt positions with targets
    ours = logprobs(model, batch)
    with torch.no_grad():  # the model's own logprobs of every target, prompt included
        full = model(batch.input_ids, routes=batch.routes, targets=batch.target_ids).logprobs
    assert (ours[~batch.loss_mask] == 0).all() and (full[~batch.loss_mask & (batch.target_ids >= 0)] != 0).all()
    torch.testing.assert_close(ours[batch.loss_mask], full[batch.loss_mask], rtol=0, atol=1e-6)


def test_micro_batch_size_does_not_change_the_step(tiny_moe, batches):
    # Plain SGD, so the weights show the gradient itself (Adam's first step is ~lr * sign(g),
    # which would blow float noise on near-zero gradients up to lr).
    one_by_one, all_at_once = load_hf(tiny_moe), load_hf(tiny_moe)
    a = step(one_by_one, torch.optim.SGD(one_by_one.parameters()), batches[1], lr=1.0, micro_batch_size=1)
    b = step(
        all_at_once, torch.optim.SGD(all_at_once.parameters()), batches[1], lr=1.0, micro_batch_size=len(batches[1])
    )
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for (name, x), y in zip(one_by_one.state_dict().items(), all_at_once.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


def test_replay_keeps_the_rollouts_experts_when_the_trainers_router_drifted(tiny_moe, batches):
    """A router that drifted since the rollout picks other experts; replay routes through the
    rollout's experts anyway, so the trainer's logprobs stay closer to the sampler's."""
    results = {}
    for replay in (True, False):
        model, optimizer = model_and_optimizer(tiny_moe)
        torch.manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("router.weight"):
                    param.add_(torch.randn_like(param))
        results[replay] = step(model, optimizer, batches[2], lr=0.0, replay=replay)
    assert results[True]["routing_disagreement"] > 0.1  # its own top-k differs from the replayed one
    assert results[False]["routing_disagreement"] > 0.1  # its own routes differ from the rollout's
    assert results[True]["mismatch_kl_k3"] < results[False]["mismatch_kl_k3"]


def test_kl_to_the_reference_is_zero_at_the_start_and_grows(tiny_moe, batches):
    model, optimizer = model_and_optimizer(tiny_moe)
    reference = load_hf(tiny_moe).requires_grad_(False)
    config = LossConfig(kl_coef=0.1)
    first = step(model, optimizer, batches[3], loss=config, reference=reference)
    second = step(model, optimizer, batches[3], loss=config, reference=reference)
    assert first["ref_kl_k3"] == 0.0 and second["ref_kl_k3"] > 0
    with pytest.raises(WhetstoneError, match="reference"):
        step(model, optimizer, batches[3], loss=config)


def test_with_a_learned_logit_scale_the_kl_reference_is_taken_at_that_scale(tiny_moe, batches):
    # A policy that differs from the reference only by the learned scale has drifted nowhere: its
    # KL must be ~0, or the KL term would make the weights undo the sharpening.
    config = LossConfig(kl_coef=0.1)
    reference = load_hf(tiny_moe).requires_grad_(False)
    kl = {}
    for learned in (True, False):
        model, optimizer = model_and_optimizer(tiny_moe)
        with torch.no_grad():
            model.norm.weight.mul_(math.exp(0.3))  # what LogitScale's steps to log-scale 0.3 did
        scale = LogitScale(lr=0.0, log_scale=0.3) if learned else None
        kl[learned] = step(model, optimizer, batches[3], lr=0.0, loss=config, reference=reference, logit_scale=scale)[
            "ref_kl_k3"
        ]
    assert kl[True] < 1e-9 and kl[False] > 1e-4  # a random tiny model: near-uniform logits, a small KL


def test_a_gradient_that_is_not_finite_is_refused_and_leaves_the_weights(tiny_moe, batches):
    # a finite loss whose gradient overflowed: clipping by a NaN norm would make every weight NaN
    model, optimizer = model_and_optimizer(tiny_moe)
    model.norm.weight.register_hook(lambda grad: grad * float("nan"))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        WhetstoneError, match=r"the loss is -?[0-9.e-]+ and the gradient norm nan; this optimizer step is not taken"
    ):
        step(model, optimizer, batches[0])
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_a_batch_without_trained_tokens_is_refused_and_leaves_the_weights(tiny_moe, batches):
    model, optimizer = model_and_optimizer(tiny_moe)
    batch = batches[0].select(range(len(batches[0])))
    batch.loss_mask = torch.zeros_like(batch.loss_mask)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WhetstoneError, match="no trained tokens"):
        step(model, optimizer, batch)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_a_negative_entropy_coefficient_sharpens_the_policy_and_every_step_logs_entropy(tiny_moe, batches):
    runs = {}
    for coef in (0.0, -1.0):
        model, optimizer = model_and_optimizer(tiny_moe)
        runs[coef] = [
            step(model, optimizer, batches[0], lr=3e-2, loss=LossConfig(entropy_coef=coef))["entropy"] for _ in range(4)
        ]
    assert runs[0.0][0] == pytest.approx(runs[-1.0][0]) and runs[0.0][0] > 0  # same weights at the first step
    assert runs[-1.0][-1] < runs[0.0][-1] - 0.05, runs


@pytest.mark.parametrize("config_type", [TrainerConfig, OnlineConfig])
def test_the_step_settings_of_a_config_are_its_own(config_type):
    unrounded = {"sync": {"publish_dtype": "float32"}} if "sync" in config_type.model_fields else {}
    config = config_type(
        **unrounded,
        loss={"clip_high": 0.3},
        optimizer={"grad_clip": 0.5},
        micro_batch_size=7,
        router_replay=False,
        dtype="bfloat16",
        numerics="invariant",
    )
    settings = StepSettings.of(config)
    assert settings == StepSettings(
        loss=LossConfig(clip_high=0.3),
        grad_clip=0.5,
        micro_batch_size=7,
        replay=False,
        dtype="bfloat16",
        numerics="invariant",
    )


@pytest.mark.parametrize("config_type", [TrainerConfig, OnlineConfig])
def test_invariant_numerics_refuse_rounded_published_weights(config_type):
    with pytest.raises(ValueError, match="sync.publish_dtype = 'float32'"):
        config_type(numerics="invariant")
    assert config_type(numerics="invariant", sync={"publish_dtype": "float32"}).numerics == "invariant"
    assert config_type(numerics="invariant", sync={"publish_dtype": "keep"}).numerics == "invariant"
    # autocast publishing rounds only what a bf16 forward rounds itself
    autocast = {"publish_dtype": "autocast"}
    assert config_type(numerics="invariant", dtype="bfloat16", sync=autocast).sync.publish_dtype == "autocast"
    with pytest.raises(ValueError, match=r"'autocast' rounds them: .* \(or 'autocast', with dtype = 'bfloat16'\)"):
        config_type(numerics="invariant", dtype="float32", sync=autocast)
