"""The optimizer: per-parameter learning-rate multipliers."""

import pytest
import torch

from whetstone.model import ModelConfig, Transformer
from whetstone.training.optim import build_optimizer

TINY = ModelConfig(
    vocab_size=50,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    num_experts=4,
    moe_intermediate_size=8,
)


def test_lr_multipliers_scale_the_step_of_the_parameters_they_name():
    from whetstone.errors import ConfigError
    from whetstone.training.optim import clip_and_step

    torch.manual_seed(0)
    model = Transformer(TINY)
    optimizer = build_optimizer(
        model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, lr_multipliers={"norm.weight": 10.0}
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # Adam's first step is lr * sign(g) for every value
    clip_and_step(model, optimizer, 1e-3, grad_clip=0.0)
    moved = {name: float((p.detach() - before[name]).abs().max()) for name, p in model.named_parameters()}
    assert moved["norm.weight"] == pytest.approx(1e-2, rel=1e-3)
    assert moved["layers.0.input_layernorm.weight"] == pytest.approx(1e-3, rel=1e-3)
    with pytest.raises(ConfigError, match="final_norm.weight"):
        build_optimizer(
            model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, lr_multipliers={"final_norm.weight": 2.0}
        )
