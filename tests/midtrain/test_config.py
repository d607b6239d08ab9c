"""The config: the embedded default's model sizes survive partial overrides, and bad values are named."""

from pathlib import Path

import pytest

from whetstone.config import load_config
from whetstone.errors import ConfigError
from whetstone.midtrain.config import MidtrainConfig
from whetstone.model import ModelConfig

REPO = Path(__file__).resolve().parents[2]


def test_a_partial_model_section_changes_only_what_it_names():
    default = MidtrainConfig().model
    wider = load_config(MidtrainConfig, None, ["model.hidden_size=256"]).model
    assert wider.hidden_size == 256
    assert (wider.num_hidden_layers, wider.tie_word_embeddings) == (default.num_hidden_layers, False)


def test_a_plain_model_config_is_taken_as_is():
    config = MidtrainConfig(model=ModelConfig(hidden_size=64))
    assert config.model.hidden_size == 64
    assert config.model.num_hidden_layers == ModelConfig().num_hidden_layers


def test_bad_values_name_the_key():
    with pytest.raises(ConfigError, match=r"run\.dtype"):
        load_config(MidtrainConfig, None, ["run.dtype=float16"])
    with pytest.raises(ConfigError, match=r"warmup_steps \(10\) must be below run.steps \(10\)"):
        load_config(MidtrainConfig, None, ["run.steps=10", "optimizer.warmup_steps=10"])
    with pytest.raises(ConfigError, match=r"run\.batch_size"):
        load_config(MidtrainConfig, None, ["run.batch_size=0"])
    with pytest.raises(ConfigError, match=r"run\.seed"):  # the data order's seed: when the config loads
        load_config(MidtrainConfig, None, ["run.seed=-1"])
    for name in (".", "..", "a/b", ""):  # the output folder itself, its parent, a folder deeper
        with pytest.raises(ConfigError, match=r"run\.name: must be one folder's name"):
            load_config(MidtrainConfig, None, [f'run.name="{name}"'])
    assert load_config(MidtrainConfig, None, ['run.name=".hidden-1.2"']).run.name == ".hidden-1.2"


def test_the_reference_file_is_the_embedded_default():
    assert load_config(MidtrainConfig, REPO / "configs" / "midtrain-default.toml") == MidtrainConfig()
