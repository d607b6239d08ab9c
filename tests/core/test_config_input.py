"""Config values that validation alone lets through: numbers that are not finite, text that is
not UTF-8, and a `sync watch` timeout that never comes."""

import pytest
from typer.testing import CliRunner

from whetstone.config import Config, dump_toml, load_config, write_toml
from whetstone.errors import ConfigError


class Weights(Config):
    coef: float = 0.0
    """A number with no bounds."""
    scales: list[float] = [1.0]
    """Numbers with no bounds."""
    by_name: dict[str, float] = {}
    """Numbers by name."""
    name: str = "x"
    """A name."""


@pytest.mark.parametrize(
    "override, key",
    [
        ("coef=nan", "coef"),
        ("coef=-inf", "coef"),
        ("coef=NaN", "coef"),  # not TOML: text, which pydantic reads as a float
        ("scales=[1.0, inf]", "scales.1"),
        ("by_name.a=nan", "by_name.a"),
    ],
)
def test_a_number_that_is_not_finite_is_refused_by_name(override, key):
    """No config number means anything as NaN or infinity (none is "no limit": 0 or None is):
    NaN in a loss coefficient or a reward makes every weight NaN, and an infinite timeout
    raises OverflowError where it is waited on."""
    with pytest.raises(ConfigError, match=rf"{key}: Input should be a finite number"):
        load_config(Weights, None, [override])


def test_the_roles_numbers_that_are_not_finite_are_refused(tmp_path):
    from whetstone.online.config import OnlineConfig
    from whetstone.trainer.config import TrainerConfig

    with pytest.raises(ConfigError, match=r"loss.entropy_coef: Input should be a finite number"):
        load_config(TrainerConfig, None, ["loss.entropy_coef=nan"])
    path = tmp_path / "online.toml"
    path.write_text('[rewards]\nthumbs_up = inf\nthumbs_down = "nan"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(OnlineConfig, path)
    assert "rewards.thumbs_up: Input should be a finite number" in str(caught.value)
    assert "rewards.thumbs_down: Input should be a finite number" in str(caught.value)
    assert load_config(TrainerConfig, None, ["loss.entropy_coef=-1e-4"]).loss.entropy_coef == -1e-4


@pytest.mark.parametrize("override", ["name=/data/caf\udce9", "by_name.caf\udce9=1"])
def test_an_override_that_is_not_utf8_text_is_refused(override, tmp_path):
    """A `--set` argument with bytes that are not UTF-8 (a Latin-1 folder name) reaches Python as
    lone surrogates, which no TOML file holds: the run's config.toml could not be written."""
    with pytest.raises(ConfigError, match=r"is not UTF-8 text"):
        load_config(Weights, None, [override])
    cfg = load_config(Weights, None, ["name=/data/café"])
    write_toml(tmp_path / "config.toml", cfg)
    assert load_config(Weights, tmp_path / "config.toml") == cfg and "café" in dump_toml(cfg)


@pytest.mark.parametrize("timeout", ["nan", "inf"])
def test_sync_watch_refuses_a_timeout_that_never_comes(timeout, tmp_path, monkeypatch):
    """`--timeout nan` never compares as reached: the watch polled forever (and `inf` is no
    timeout, which leaving the option out says)."""
    import whetstone.sync.cli as sync_cli
    from whetstone.cli import app

    polls = []

    def sleep(seconds):
        polls.append(seconds)
        if len(polls) > 3:
            raise AssertionError("still watching")

    monkeypatch.setattr(sync_cli.time, "sleep", sleep)
    result = CliRunner().invoke(app, ["sync", "watch", str(tmp_path), "--timeout", timeout, "--poll-interval", "0.01"])
    assert isinstance(result.exception, ConfigError), result.exception
    assert f"--timeout must be a finite number of seconds, got {timeout}" in str(result.exception)
    assert polls == []
