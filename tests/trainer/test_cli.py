"""`whetstone trainer CONFIG [--set ...]`."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tests.trainer.trainer_fixtures import put_batches, trainer_config
from whetstone.config import dump_toml
from whetstone.errors import ConfigError
from whetstone.trainer.cli import app
from whetstone.trainer.config import TrainerConfig


def test_the_command_trains_the_batches_there_and_prints_a_summary(tmp_path, tiny_moe, batches):
    put_batches(tmp_path / "batches", batches[:2])
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(trainer_config(tmp_path, tiny_moe)))
    result = CliRunner().invoke(app, ["trainer", str(config_file), "--set", "max_steps=1", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["step"] == 1 and summary["version"] == 1 and summary["resumed_from"] is None


def test_a_bad_key_is_named(tmp_path):
    result = CliRunner().invoke(app, ["trainer", "--set", "loss.is_capp=3"])
    assert isinstance(result.exception, ConfigError) and "is_capp" in str(result.exception)


def test_a_decaying_learning_rate_needs_a_run_length():
    result = CliRunner().invoke(app, ["trainer", "--set", "optimizer.min_lr_ratio=0.1"])
    assert isinstance(result.exception, ConfigError) and "max_steps" in str(result.exception)


def test_a_warmup_longer_than_the_run_is_refused():
    result = CliRunner().invoke(app, ["trainer", "--set", "optimizer.warmup_steps=10", "--set", "max_steps=5"])
    assert isinstance(result.exception, ConfigError)
    assert "optimizer.warmup_steps (10) is more than max_steps (5)" in str(result.exception)
    # a ramp over the whole run reaches the peak at its last step
    assert TrainerConfig.model_validate({"optimizer": {"warmup_steps": 5}, "max_steps": 5}).max_steps == 5


def test_a_poll_interval_that_never_ends_is_refused():
    """An infinite wait is no poll: `Event.wait(inf)` raises OverflowError mid-run."""
    for key in ("poll_interval", "sync.poll_interval"):
        result = CliRunner().invoke(app, ["trainer", "--set", f"{key}=inf"])
        assert isinstance(result.exception, ConfigError) and f"{key}: Input should be a finite number" in str(
            result.exception
        )
