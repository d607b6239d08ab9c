from __future__ import annotations

import pytest
import torch

from whetstone.model import ModelConfig

# A two-layer MoE small enough for optimizer, checkpoint and step tests.
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


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the cores are shared with other engineers' tests
