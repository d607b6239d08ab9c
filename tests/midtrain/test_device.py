"""Mid-training on any device: the configured device, a step and a validation pass that build
nothing on the host and read back once, activation checkpointing that changes nothing but
memory, and, where CUDA is present, a bf16 step on the GPU close to the CPU's."""

from __future__ import annotations

import math

import pytest
import torch

from tests.host_work import watch_host_work
from tests.midtrain.test_step import batch, model_and_optimizer, step
from whetstone.errors import ConfigError
from whetstone.midtrain.loop import train
from whetstone.midtrain.step import validation_loss
from whetstone.model.moe import Router
from whetstone.training.optim import build_optimizer
from whetstone.utils.device import resolve_device


def own_code(entries: list[str]) -> list[str]:
    """Entries of a host-work record outside the model's internals (the model is tested on its own)."""
    return [entry for entry in entries if not entry.startswith("model/")]


def test_a_step_and_a_validation_pass_read_back_once_and_build_nothing_on_the_host():
    torch.manual_seed(0)
    rows = torch.randint(0, 50, (4, 9))
    model, optimizer = model_and_optimizer()
    micro_batches = [batch(rows[:2], demo_rows=1), batch(rows[2:], ignore_from=4)]  # two micro-batches
    with watch_host_work() as work:
        stats = step(model, optimizer, micro_batches, grad_clip=1.0)
    assert own_code(work.host_tensors) == []
    assert len(own_code(work.syncs)) == 1, work.syncs
    assert math.isfinite(stats.loss) and stats.demo_loss is not None
    with watch_host_work() as work:
        validation_loss(model, micro_batches, "float32")
    assert own_code(work.host_tensors) == [] and len(own_code(work.syncs)) == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_checkpointing_gives_the_same_loss_gradients_and_weights(dtype):
    """bf16 on the CPU pads expert groups under `ops.training_kernels`: the recompute, which runs
    in the backward pass outside that block, must see it too."""
    torch.manual_seed(1)
    rows = torch.randint(0, 50, (4, 9))
    results = []
    for checkpointing in (False, True):
        model, optimizer = model_and_optimizer()
        model.activation_checkpointing = checkpointing
        calls = []
        for router in (m for m in model.modules() if isinstance(m, Router)):
            router.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        stats = step(model, optimizer, [batch(rows)], dtype=dtype, grad_clip=1.0)
        results.append((stats, model.state_dict(), len(calls)))
    (plain, plain_weights, plain_calls), (checkpointed, weights, recomputed_calls) = results
    assert recomputed_calls == 2 * plain_calls  # every block ran again in the backward pass
    assert checkpointed == plain  # loss, aux loss, gradient norm, demo loss, tokens
    assert all(torch.equal(plain_weights[name], weights[name]) for name in weights)


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_the_run_trains_on_its_device(make_config, device):
    summary = train(make_config(f'run.device="{device}"', "run.steps=3", "run.activation_checkpointing=true"))
    assert summary["device"] == str(resolve_device(device)) and summary["step"] == 3


def test_a_device_name_that_means_nothing_is_refused_by_its_field(make_config):
    with pytest.raises(ConfigError, match=r"run.device: .*device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        make_config('run.device="gpu0"')


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_for_on_a_machine_without_it_is_a_clear_error(make_config):
    with pytest.raises(ConfigError, match="device = 'cuda', but torch sees no CUDA device here"):
        train(make_config('run.device="cuda"'))


@pytest.mark.gpu
def test_a_bf16_step_on_cuda_is_finite_and_close_to_the_cpus():
    torch.manual_seed(2)
    rows = torch.randint(0, 50, (4, 9))
    results = {}
    for device in ("cpu", "cuda"):
        model, _ = model_and_optimizer()
        model.to(device)
        optimizer = build_optimizer(model, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # fused on CUDA
        results[device] = step(model, optimizer, [batch(rows)], dtype="bfloat16", grad_clip=1.0)
    cpu, cuda = results["cpu"], results["cuda"]
    assert math.isfinite(cuda.loss) and math.isfinite(cuda.grad_norm)
    assert cuda.loss == pytest.approx(cpu.loss, rel=2e-2) and cuda.grad_norm == pytest.approx(cpu.grad_norm, rel=0.1)


@pytest.mark.gpu
def test_a_run_on_cuda_resolves_auto_to_bf16(make_config):
    summary = train(make_config('run.device="cuda"', "run.dtype=auto", "run.steps=3"))
    assert summary["device"].startswith("cuda") and summary["dtype"] == "bfloat16"
