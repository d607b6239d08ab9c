"""`whetstone midtrain` end to end through typer, and the embedded default written out."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from whetstone.config import dump_toml, load_config
from whetstone.errors import ConfigError
from whetstone.midtrain.cli import app
from whetstone.midtrain.config import MidtrainConfig
from whetstone.config import load_config as load

REPO = Path(__file__).resolve().parents[2]


def write_config(make_config, tmp_path, *overrides) -> Path:
    path = tmp_path / "midtrain.toml"
    path.write_text(dump_toml(make_config(*overrides)))
    return path


def test_a_few_steps_print_the_loss_next_to_the_unigram_entropy(make_config, tmp_path):
    config = write_config(make_config, tmp_path, "run.steps=4", "run.eval_interval=2")
    result = CliRunner().invoke(app, ["midtrain", str(config), "--set", "run.name=cli"])
    assert result.exit_code == 0, result.output
    assert "validation loss" in result.output and "unigram entropy of the corpus" in result.output
    assert (tmp_path / "runs" / "cli" / "model" / "config.json").exists()


def test_json_summary_and_stop_message(make_config, tmp_path):
    config = write_config(make_config, tmp_path, "run.steps=4", "run.eval_interval=2")
    result = CliRunner().invoke(app, ["midtrain", str(config), "--json"])
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["step"] == 4 and summary["finished"]
    stopped = CliRunner().invoke(app, ["midtrain", str(config), "-s", "run.name=short", "-s", "run.max_wall_time=1e-9"])
    assert "run the same command again to continue" in stopped.output


def test_a_bad_override_names_the_key(make_config, tmp_path):
    config = write_config(make_config, tmp_path)
    result = CliRunner().invoke(app, ["midtrain", str(config), "--set", "run.dtype=float16"])
    assert isinstance(result.exception, ConfigError)
    assert "run.dtype" in str(result.exception)
    with pytest.raises(ConfigError, match="warmup_steps"):
        load_config(MidtrainConfig, None, ["run.steps=10", "optimizer.warmup_steps=10"])


def test_the_reference_file_is_the_embedded_default():
    written = load(MidtrainConfig, REPO / "configs" / "midtrain-default.toml")
    assert written == MidtrainConfig()
