"""The RL trainer on any device: the configured device, a step that builds nothing on the host
and reads its figures back once, activation checkpointing that changes nothing but memory, and,
where CUDA is present, the step and the loop on the GPU in bf16."""

from __future__ import annotations

import math

import pytest
import torch

from tests.host_work import watch_host_work
from tests.trainer.test_demos import token_demos
from tests.trainer.trainer_fixtures import put_batches, trainer_config
from whetstone.config import load_config
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.model.hf import load_hf
from whetstone.model.moe import Router
from whetstone.rl.batch import collate
from whetstone.rl.logit_scale import LogitScale
from whetstone.rl.loss import LossConfig
from whetstone.trainer.config import TrainerConfig
from whetstone.trainer.loop import run_trainer
from whetstone.trainer.setup import new_optimizer
from whetstone.trainer.step import DemoAnchor, Learner, StepSettings, train_step
from whetstone.training.checkpoint import latest_checkpoint, load_checkpoint
from whetstone.training.optim import build_optimizer
from whetstone.utils.device import resolve_device


def own_code(entries: list[str]) -> list[str]:
    """Entries of a host-work record outside the model's internals (the model is tested on its own)."""
    return [entry for entry in entries if not entry.startswith("model/")]


def learner_of(model, reference=None, logit_scale=None) -> Learner:
    optimizer = build_optimizer(model, lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    return Learner(model, optimizer, reference, logit_scale)


def test_a_step_builds_nothing_on_the_host_and_reads_its_figures_back_once(tiny_moe, batches):
    """Every path of a step: KL reference, learned logit scale, forking tokens, demonstration anchor."""
    reference = load_hf(tiny_moe).eval().requires_grad_(False)
    learner = learner_of(load_hf(tiny_moe), reference, LogitScale(0.03))
    settings = StepSettings(loss=LossConfig(kl_coef=0.1, forking_fraction=0.5), micro_batch_size=3)
    anchor = DemoAnchor(collate(token_demos()), coef=1.0)
    with watch_host_work() as work:
        metrics = train_step(learner, batches[0], settings, 1e-2, anchor=anchor)
    assert own_code(work.host_tensors) == []
    assert len(own_code(work.syncs)) == 1, work.syncs  # one read-back for the whole step
    assert metrics["tokens"] == batches[0].num_loss_tokens and math.isfinite(metrics["loss"] + metrics["demo_nll"])


def test_the_step_checks_for_trained_tokens_after_its_one_read_back(tiny_moe, batches):
    model = load_hf(tiny_moe)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    empty = batches[0].select(range(len(batches[0])))
    empty.loss_mask[:] = False
    with pytest.raises(WhetstoneError, match="has no trained tokens"):
        train_step(learner_of(model), empty, StepSettings(micro_batch_size=3), 1e-2)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


@pytest.mark.parametrize(("numerics", "replay"), [("fast", True), ("fast", False), ("invariant", True)])
def test_activation_checkpointing_changes_neither_the_step_nor_its_metrics(tiny_moe, batches, numerics, replay):
    """Same loss, metrics and weights after the step; every router runs twice (the recompute), and
    under invariant numerics the recompute uses the forward's kernels (the backward runs outside
    the forward's `ops.numerics` block)."""
    results = []
    for checkpointing in (False, True):
        model = load_hf(tiny_moe)
        model.activation_checkpointing = checkpointing
        calls = []
        for router in (m for m in model.modules() if isinstance(m, Router)):
            router.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        settings = StepSettings(micro_batch_size=3, numerics=numerics, replay=replay)
        metrics = train_step(learner_of(model), batches[1], settings, 1e-2)
        results.append((metrics, model.state_dict(), len(calls)))
    (plain, plain_weights, plain_calls), (checkpointed, weights, recomputed_calls) = results
    assert recomputed_calls == 2 * plain_calls
    assert checkpointed == plain
    assert all(torch.equal(plain_weights[name], weights[name]) for name in weights)


@pytest.mark.parametrize("device", ["cpu", "auto", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_trainer_trains_publishes_and_checkpoints_on_its_device(tmp_path, tiny_moe, batches, device):
    put_batches(tmp_path / "batches", batches[:2])
    config = trainer_config(tmp_path, tiny_moe, device=device, max_steps=2, activation_checkpointing=True)
    summary = run_trainer(config)
    assert summary["device"] == str(resolve_device(device)) and summary["step"] == summary["version"] == 2
    # the last step's checkpoint, read back on the CPU
    checkpoint = latest_checkpoint(tmp_path / "trainer" / "checkpoints")
    assert checkpoint is not None and checkpoint.name == "step_00000002"
    model = load_hf(tiny_moe)
    assert load_checkpoint(checkpoint, model, new_optimizer(config, model)).step == 2


def test_a_device_name_that_means_nothing_is_refused_by_its_field():
    with pytest.raises(
        ConfigError,
        match=r"  device: .*device must be 'auto', 'cpu', 'cuda' or 'cuda:N' \(N from 0 to 127\), got 'gpu'",
    ):
        load_config(TrainerConfig, overrides=['device="gpu"'])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_for_on_a_machine_without_it_is_a_clear_error(tmp_path, tiny_moe):
    with pytest.raises(ConfigError, match="device = 'cuda', but torch sees no CUDA device here"):
        run_trainer(trainer_config(tmp_path, tiny_moe, device="cuda"))


@pytest.mark.gpu
def test_a_bf16_step_on_cuda_is_finite_and_close_to_the_cpus(tiny_moe, batches):
    results = {}
    for device in ("cpu", "cuda"):
        model = load_hf(tiny_moe).to(device)
        learner = learner_of(model)
        settings = StepSettings(micro_batch_size=3, dtype="bfloat16")
        results[device] = train_step(learner, batches[0], settings, 1e-2)
        if device == "cuda":
            assert learner.optimizer.defaults["fused"] is True
    cpu, cuda = results["cpu"], results["cuda"]
    assert math.isfinite(cuda["loss"]) and math.isfinite(cuda["grad_norm"])
    assert cuda["loss"] == pytest.approx(cpu["loss"], abs=2e-2)
    assert cuda["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=0.1)
    assert cuda["tokens"] == cpu["tokens"]
