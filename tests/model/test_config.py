import pytest

from whetstone.config import load_config
from whetstone.errors import ConfigError
from whetstone.model import ModelConfig, Transformer


def test_default_is_a_tiny_moe_of_a_few_million_parameters():
    cfg = ModelConfig()
    assert cfg.num_experts == 8 and cfg.num_moe_layers == cfg.num_hidden_layers
    total = Transformer(cfg).num_parameters()
    assert 2_000_000 < total < 20_000_000


def test_sparse_layers_follow_qwen3_moe_rules():
    cfg = ModelConfig(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert cfg.moe_layers == [1, 5]
    assert ModelConfig(num_experts=0).moe_layers == []


def test_every_field_is_documented():
    for name, field in ModelConfig.model_fields.items():
        assert field.description, name


@pytest.mark.parametrize(
    "override, message",
    [
        ("num_key_value_heads=3", "multiple of num_key_value_heads"),
        ("num_experts_per_tok=9", "num_experts_per_tok"),
        ("mlp_only_layers=[7]", "mlp_only_layers"),
        ("head_dim=63", "head_dim"),
        ("num_key_value_heads=0", "num_key_value_heads"),
        ("num_attention_heads=0", "num_attention_heads"),
        ("hidden_size=-8", "hidden_size"),
        ("rms_norm_eps=-1", "rms_norm_eps"),
        ("rope_theta=0", "rope_theta"),
    ],
)
def test_bad_shapes_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ModelConfig, overrides=[override])
