"""Checkpoints across devices: written from any device, loaded onto any device. The files hold
CPU tensors and are loaded to the CPU, then copied into the model and optimizer wherever they
are; CUDA's fused AdamW keeps the same state as the CPU's."""

from __future__ import annotations

import pytest
import torch

from tests.training.conftest import TINY
from whetstone.model import Transformer
from whetstone.training.checkpoint import TrainState, load_checkpoint, save_checkpoint
from whetstone.training.optim import build_optimizer


def make(device: str = "cpu", seed: int = 0):
    torch.manual_seed(seed)
    model = Transformer(TINY).to(device)
    return model, build_optimizer(model, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def train(model, optimizer, steps: int, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    for _ in range(steps):
        out = model(torch.randint(0, TINY.vocab_size, (2, 8), generator=generator).to(device))
        (out.logits.float().square().mean() + out.aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad()


def moments(model, optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): name for name, p in model.named_parameters()}
    return {
        f"{names[id(p)]}.{key}": value.detach().cpu()
        for p, state in optimizer.state.items()
        for key, value in state.items()
    }


def assert_same_state(a_model, a_optimizer, b_model, b_optimizer, exact: bool = True) -> None:
    """Same weights and optimizer state (bit for bit, or to float tolerance)."""
    same = torch.equal if exact else lambda x, y: torch.allclose(x, y, rtol=1e-5, atol=1e-7)
    a, b = a_model.state_dict(), b_model.state_dict()
    assert all(same(a[name].cpu(), b[name].cpu()) for name in a)
    a, b = moments(a_model, a_optimizer), moments(b_model, b_optimizer)
    assert a.keys() == b.keys() and all(same(a[key], b[key].to(a[key].dtype)) for key in a)


def fused_twin(optimizer: torch.optim.AdamW) -> torch.optim.AdamW:
    """The same groups and settings in torch's fused AdamW (what `build_optimizer` makes on CUDA)."""
    groups = [
        {"params": g["params"], "weight_decay": g["weight_decay"], "lr_multiplier": g["lr_multiplier"]}
        for g in optimizer.param_groups
    ]
    settings = {key: optimizer.defaults[key] for key in ("lr", "betas", "eps")}
    return torch.optim.AdamW(groups, **settings, fused=True)


def test_a_fused_optimizers_checkpoint_loads_into_a_plain_one_and_back(tmp_path):
    """CUDA's fused AdamW (here torch's fused CPU kernel, the same state layout) against the CPU's."""
    model, plain = make()
    fused = fused_twin(plain)
    train(model, fused, steps=2)
    written = save_checkpoint(tmp_path / "fused", model, fused, TrainState(step=2), {}, keep=1)
    cpu_model, cpu_optimizer = make(seed=1)
    assert load_checkpoint(written, cpu_model, cpu_optimizer).step == 2
    assert_same_state(model, fused, cpu_model, cpu_optimizer)
    back = save_checkpoint(tmp_path / "plain", cpu_model, cpu_optimizer, TrainState(step=2), {}, keep=1)
    again, again_fused = make(seed=2)
    again_fused = fused_twin(again_fused)
    load_checkpoint(back, again, again_fused)
    assert_same_state(model, fused, again, again_fused)
    # each optimizer keeps its own kernel: the checkpoint's groups carry only hyperparameters over
    assert all(group["fused"] is True for group in again_fused.param_groups)
    assert all(not group["fused"] for group in cpu_optimizer.param_groups)


@pytest.mark.gpu
def test_a_checkpoint_written_on_cuda_loads_on_the_cpu_and_back(tmp_path):
    model, optimizer = make("cuda")
    assert optimizer.defaults["fused"] is True
    train(model, optimizer, steps=2)
    written = save_checkpoint(tmp_path / "cuda", model, optimizer, TrainState(step=2), {}, keep=1)
    cpu_model, cpu_optimizer = make("cpu", seed=1)
    load_checkpoint(written, cpu_model, cpu_optimizer)
    assert_same_state(model, optimizer, cpu_model, cpu_optimizer)
    back = save_checkpoint(tmp_path / "cpu", cpu_model, cpu_optimizer, TrainState(step=2), {}, keep=1)
    again, again_optimizer = make("cuda", seed=2)
    load_checkpoint(back, again, again_optimizer)
    assert_same_state(model, optimizer, again, again_optimizer)
    train(model, optimizer, steps=1, seed=3)  # and training goes on from it exactly as without the trip
    train(again, again_optimizer, steps=1, seed=3)
    assert_same_state(model, optimizer, again, again_optimizer, exact=False)  # CUDA's scatter-adds may reorder
