"""The `whetstone` command itself: its version, the help a pip user reads, and config arguments."""

import importlib.util
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import click
import pytest
import torch
import typer
from typer.testing import CliRunner

from whetstone.cli import app
from whetstone.config import example_override, load_config
from whetstone.config_reference import COMMANDS
from whetstone.config_reference import main as config_reference_main
from whetstone.errors import ConfigError
from whetstone.sync import Publisher, SyncConfig, WeightStore

runner = CliRunner()


def test_version_is_the_installed_packages():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"whetstone {metadata.version('whetstone')}\n"


def _help_texts(command: click.Command, path: str = "whetstone") -> dict[str, str]:
    texts = {path: command.help or "", **{f"{path} {p.name}": getattr(p, "help", None) or "" for p in command.params}}
    for name, sub in getattr(command, "commands", {}).items():
        texts |= _help_texts(sub, f"{path} {name}")
    return texts


def test_help_names_no_file_of_the_source_tree():
    """A pip install has no docs/ folder: help says what it means instead of pointing there."""
    texts = _help_texts(typer.main.get_command(app))
    assert len(texts) > 50
    assert {where: text for where, text in texts.items() if "docs/" in text} == {}


@pytest.mark.parametrize("title, module, name", COMMANDS)
def test_a_malformed_override_shows_a_real_key(title, module, name):
    cls = getattr(__import__(module, fromlist=[name]), name)
    example = example_override(cls)
    load_config(cls, None, [example])  # the example is a key the config has
    with pytest.raises(ConfigError, match=f"expected KEY=VALUE, e.g. {example}"):
        load_config(cls, None, ["steps"])


def test_tasks_and_rollback_take_the_config_positionally(tmp_path):
    synth = tmp_path / "synth.toml"
    synth.write_text("count = 2\n")
    listed = runner.invoke(app, ["tasks", "list", "synth", str(synth)])
    assert listed.exit_code == 0 and len(listed.stdout.splitlines()) == 2, listed.output

    sync = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="float32")
    publisher = Publisher(WeightStore.open(sync), sync)
    for version in range(3):
        publisher.publish({"w": torch.full((4, 4), float(version))})
    online = tmp_path / "online.toml"
    online.write_text(f'[sync]\nstore = "{sync.store}"\npublish_dtype = "float32"\n')
    result = runner.invoke(app, ["online", "rollback", "1", str(online)])
    assert result.exit_code == 0, result.output
    assert "version 1 republished as version 3" in result.stdout and WeightStore.open(sync).latest() == 3


def _whetstone(*args: str, module: str = "whetstone") -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "1000"}  # rich wraps messages at the terminal's width
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, env=env)


def test_a_config_path_that_is_a_directory_is_a_one_line_error(tmp_path):
    result = _whetstone("run", "--dry-run", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr == f"error: config file {tmp_path} is a directory, not a TOML file\n", result.stderr


def test_run_refuses_json_with_dry_run():
    result = runner.invoke(app, ["run", "--json", "--dry-run"])
    assert isinstance(result.exception, ConfigError), result.output
    assert "--dry-run prints the resolved config as TOML; --json is for a run's summary" in str(result.exception)
    assert result.stdout == ""


@pytest.mark.parametrize("name", ["inference", "sync", "gpu"])
def test_a_bench_module_run_as_a_script_is_its_bench_command(name):
    """`python -m whetstone.bench.NAME ARGS` is `whetstone bench NAME ARGS`: its options and help
    (a bench takes minutes: an option it did not read would start it)."""
    helped = _whetstone("--help", module=f"whetstone.bench.{name}")
    assert helped.returncode == 0 and f"Usage: whetstone bench {name} [OPTIONS]" in helped.stdout, helped.stderr
    refused = _whetstone("--no-such-option", module=f"whetstone.bench.{name}")
    assert refused.returncode == 2 and "No such option: --no-such-option" in refused.stderr


def test_every_bench_module_runs_as_its_bench_command():
    """Each `whetstone bench NAME`'s module ends in `run_as_module("NAME")` (run above for three
    of them): `python -m whetstone.bench.NAME` otherwise ran nothing and exited 0."""
    from whetstone.bench.cli import app as bench_app

    names = sorted(typer.main.get_command(bench_app).commands)
    assert len(names) >= 10, names
    for name in names:
        source = importlib.util.find_spec(f"whetstone.bench.{name}").origin
        assert f'run_as_module("{name}")' in Path(source).read_text(), name


def test_the_config_reference_refuses_arguments_it_does_not_take(capsys):
    assert config_reference_main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m whetstone.config_reference [task]")
    assert config_reference_main(["task"]) == 0 and capsys.readouterr().out.startswith("| key |")
    for args in (["bogus"], ["task", "bogus"]):
        assert config_reference_main(args) == 2
        shown = capsys.readouterr()
        assert shown.out == "" and shown.err.startswith("error: unexpected argument")
    result = _whetstone("bogus", module="whetstone.config_reference")
    assert result.returncode == 2 and result.stdout == "" and "usage:" in result.stderr
