"""The optimizer: per-parameter learning-rate multipliers."""

import pytest
import torch

from tests.training.conftest import TINY
from whetstone.model import Transformer
from whetstone.training.optim import build_optimizer


def test_lr_multipliers_scale_the_step_of_the_parameters_they_name():
    from whetstone.errors import ConfigError
    from whetstone.training.optim import optimizer_step

    torch.manual_seed(0)
    model = Transformer(TINY)
    optimizer = build_optimizer(
        model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, lr_multipliers={"norm.weight": 10.0}
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # Adam's first step is lr * sign(g) for every value
    optimizer_step(optimizer, 1e-3)
    moved = {name: float((p.detach() - before[name]).abs().max()) for name, p in model.named_parameters()}
    assert moved["norm.weight"] == pytest.approx(1e-2, rel=1e-3)
    assert moved["layers.0.input_layernorm.weight"] == pytest.approx(1e-3, rel=1e-3)
    with pytest.raises(ConfigError, match="final_norm.weight"):
        build_optimizer(
            model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, lr_multipliers={"final_norm.weight": 2.0}
        )
