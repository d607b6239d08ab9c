"""The learned logit scale: its (unclipped) gradient, its fold into the final norm, and its checkpointed state."""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch

from tests.trainer.trainer_fixtures import put_batches, trainer_config
from whetstone.errors import CheckpointError
from whetstone.model.hf import load_hf
from whetstone.rl.logit_scale import LogitScale
from whetstone.rl.loss import LossConfig, LossInputs, policy_loss
from whetstone.trainer.loop import run_trainer
from whetstone.trainer.step import forward_logprobs
from whetstone.training.checkpoint import latest_checkpoint, list_checkpoints
from whetstone.utils.metrics import read_metrics

NEVER_CLIPS = LossConfig(clip_low=0.999, clip_high=1e6, is_cap=2e6)  # the surrogate r · A everywhere


def loss(model, batch, config: LossConfig = NEVER_CLIPS):
    """(loss, stats) of the policy loss under `config`."""
    out = forward_logprobs(model, batch, replay=True, dtype="float32", entropy=True)
    inputs = LossInputs(out.logprobs, batch.behavior_logprobs, batch.advantages, batch.loss_mask, entropy=out.entropy)
    return policy_loss(inputs, config)


@torch.no_grad()
def loss_at_scale(model, batch, log_scale: float, config: LossConfig = NEVER_CLIPS) -> float:
    """The policy loss with every logit multiplied by e^log_scale (through the final norm's gains)."""
    original = model.norm.weight.clone()
    model.norm.weight.mul_(math.exp(log_scale))
    try:
        return loss(model, batch, config)[0].item()
    finally:
        model.norm.weight.copy_(original)


def along_scale(model, batch, config: LossConfig) -> float:
    """The loss's derivative along the logit scale, by central differences."""
    h = 1e-3  # the loss is summed in float32: a smaller step measures rounding
    return (loss_at_scale(model, batch, h, config) - loss_at_scale(model, batch, -h, config)) / (2 * h)


def test_the_gradient_is_the_derivative_of_the_unclipped_surrogate_along_the_logit_scale(tiny_moe, batches):
    model = load_hf(tiny_moe).double()
    for aggregation in ("token", "sequence"):
        config = NEVER_CLIPS.model_copy(update={"aggregation": aggregation})
        analytic = loss(model, batches[0], config)[1].scale_gradient
        assert analytic == pytest.approx(along_scale(model, batches[0], config), rel=1e-3) and analytic != 0


def test_the_clip_does_not_act_on_the_scale(tiny_moe, batches):
    """Behavior logprobs 0.5 below the trainer's: every ratio is e^0.5 = 1.65, outside the default
    clip (so positive-advantage tokens give the weights no gradient) and under the IS cap of 2."""
    model = load_hf(tiny_moe).double()
    batch = batches[0]
    with torch.no_grad():
        own = forward_logprobs(model, batch, replay=True, dtype="float32").logprobs.float()
    shifted = dataclasses.replace(batch, behavior_logprobs=torch.where(batch.loss_mask, own - 0.5, own))
    clipped_loss, stats = loss(model, shifted, LossConfig())
    assert stats.clipped > 0 and stats.truncated == 0
    assert stats.scale_gradient == pytest.approx(float(loss(model, shifted)[1].scale_gradient), rel=1e-9)
    assert stats.scale_gradient == pytest.approx(along_scale(model, shifted, NEVER_CLIPS), rel=1e-3)
    assert along_scale(model, shifted, LossConfig()) != pytest.approx(float(stats.scale_gradient), rel=0.05)


def test_a_step_scales_every_logit_and_a_negative_gradient_sharpens(tiny_moe, batches):
    model = load_hf(tiny_moe).double().eval()
    tokens = batches[0].input_ids[:2]
    with torch.no_grad():
        before = model(tokens).logits
    scale = LogitScale(lr=0.1)
    delta = scale.step(model, grad=-2.0)
    assert delta == pytest.approx(0.1)  # Adam's first step: lr × sign(gradient), uphill on the scale
    with torch.no_grad():
        after = model(tokens).logits
    torch.testing.assert_close(after, before * math.exp(delta), rtol=1e-10, atol=1e-10)
    assert scale.log_scale == pytest.approx(0.1) and scale.state()["steps"] == 1


def test_a_state_without_every_field_is_refused_by_name():
    with pytest.raises(CheckpointError, match="exp_avg_sq"):
        LogitScale(lr=0.1).load_state({"exp_avg": 0.0, "steps": 1, "log_scale": 0.0})


def test_the_trainer_logs_the_scale_and_a_replayed_restart_rebuilds_it_exactly(tmp_path, tiny_moe, batches):
    options = dict(logit_scale_lr=0.05, max_steps=5)
    put_batches(tmp_path / "straight" / "batches", batches[:5])
    run_trainer(trainer_config(tmp_path / "straight", tiny_moe, **options))
    records = read_metrics(tmp_path / "straight" / "trainer" / "metrics.jsonl")
    scales = [r["logit_scale"] for r in records]
    assert len(scales) == 5 and all(s > 0 for s in scales) and scales[-1] != 1.0
    assert all(isinstance(r["logit_scale_grad"], float) for r in records)

    # The same run, restarted from its step-3 checkpoint with versions 4 and 5 already published:
    # steps 3 and 4 are replayed from the batch store, the scale's Adam state with them.
    root = tmp_path / "restarted"
    shutil.copytree(tmp_path / "straight", root)
    for checkpoint in list_checkpoints(root / "trainer" / "checkpoints"):
        if checkpoint.name != "step_00000003":
            shutil.rmtree(checkpoint)
    (root / "trainer" / "metrics.jsonl").unlink()
    config = trainer_config(root, tiny_moe, **options)
    summary = run_trainer(config)
    replayed = read_metrics(root / "trainer" / "metrics.jsonl")
    assert summary["replayed"] == 2 and [r["step"] for r in replayed] == [3, 4]
    assert replayed[-1]["replay_matches_store"] is True
    assert [r["logit_scale"] for r in replayed] == scales[3:]

    # A checkpoint that learned a scale does not resume silently without one.
    with pytest.raises(CheckpointError, match="logit_scale_lr"):
        run_trainer(config.model_copy(update={"logit_scale_lr": 0.0}))
    assert latest_checkpoint(root / "trainer" / "checkpoints").name == "step_00000005"
