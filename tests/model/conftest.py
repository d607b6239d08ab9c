import pytest
import torch

from whetstone.model import ModelConfig


@pytest.fixture(autouse=True)
def _one_thread():
    # The cores are shared with other engineers' tests.
    torch.set_num_threads(1)


def tiny_config(**overrides) -> ModelConfig:
    """A 3-layer MoE small enough for fast tests; layer 0 is dense to cover mixed models."""
    fields = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_only_layers=[0],
        max_position_embeddings=64,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture
def make_config():
    """`make_config(**overrides)` -> a tiny ModelConfig."""
    return tiny_config
