"""The `whetstone` command itself: its version, the help a pip user reads, and config arguments."""

from importlib import metadata

import click
import pytest
import torch
import typer
from typer.testing import CliRunner

from whetstone.cli import app
from whetstone.config import example_override, load_config
from whetstone.config_reference import COMMANDS
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
