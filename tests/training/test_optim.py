"""The optimizer: per-parameter learning-rate multipliers, settings refused."""

import pytest
import torch

from tests.training.conftest import TINY
from whetstone.config import load_config
from whetstone.errors import ConfigError
from whetstone.model import Transformer
from whetstone.trainer.config import TrainerConfig
from whetstone.training.optim import build_optimizer


def test_lr_multipliers_scale_the_step_of_the_parameters_they_name():
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


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("optimizer.betas=[0.9, 1.0]", r"optimizer.betas.1: Input should be less than 1"),
        ("optimizer.betas=[-0.1, 0.95]", r"optimizer.betas.0: Input should be greater than or equal to 0"),
        ("optimizer.lr=inf", r"optimizer.lr: Input should be a finite number"),
        ("optimizer.weight_decay=inf", r"optimizer.weight_decay: Input should be a finite number"),
        ('optimizer.lr_multipliers={"norm.weight"=inf}', r"optimizer.lr_multipliers.norm.weight: .* finite number"),
    ],
)
def test_settings_adamw_refuses_or_turns_into_nan_weights_are_refused_as_the_config_loads(override, error):
    """Left to the optimizer, betas of 1 are torch's raw error and an infinite lr NaN weights, published."""
    with pytest.raises(ConfigError, match=error):
        load_config(TrainerConfig, None, [override])
