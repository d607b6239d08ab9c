"""`whetstone midtrain` end to end through typer: a few real steps, the printed summary, errors."""

import json
from pathlib import Path

from typer.testing import CliRunner

from whetstone.config import dump_toml
from whetstone.errors import ConfigError
from whetstone.midtrain.cli import app


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


def test_a_bad_override_is_a_config_error_naming_the_key(make_config, tmp_path):
    config = write_config(make_config, tmp_path)
    result = CliRunner().invoke(app, ["midtrain", str(config), "--set", "run.dtype=float16"])
    assert isinstance(result.exception, ConfigError)  # `whetstone` prints it and exits 2
    assert "run.dtype" in str(result.exception)
