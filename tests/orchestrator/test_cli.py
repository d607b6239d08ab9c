"""`whetstone orchestrator CONFIG` end to end: a TOML config, a task file, real servers."""

import json

import pytest
from typer.testing import CliRunner

from tests.orchestrator.orchestrator_support import Trainer, coin_tasks, model_folder, thread_servers
from tests.utils.tracking_support import assert_tracked
from whetstone.envs.tasks.io import write_tasks
from whetstone.errors import WhetstoneError
from whetstone.orchestrator.cli import app
from whetstone.store import LocalStore
from whetstone.tokenizer import Tokenizer


@pytest.mark.slow  # ~10-15 s: rollouts graded in sandboxes
def test_orchestrator_command_puts_batches_and_metrics(tmp_path, monkeypatch):
    model_dir = model_folder(tmp_path)
    Trainer(model_dir, tmp_path / "weights").publish()
    write_tasks(coin_tasks(1), tmp_path / "tasks.jsonl")
    with thread_servers(model_dir, tmp_path / "weights") as servers:
        config = tmp_path / "orchestrator.toml"
        config.write_text(f"""
servers = {json.dumps([s.url for s in servers])}
group_size = 2
groups_per_batch = 1
max_batches = 1
validate_tasks = false
batch_store = "{tmp_path / "batches"}"
weight_store = "{tmp_path / "weights"}"
metrics_path = "{tmp_path / "metrics.jsonl"}"
poll_interval_s = 0.1
[tasks]
source = "{tmp_path / "tasks.jsonl"}"
[rollout]
concurrency = 4
[harness]
tokenizer_path = "{model_dir}"
max_turns = 2
max_turn_tokens = 12
max_tool_tokens = 128
max_calls_per_turn = 2
summary_tokens = 16
train_cut_off_calls = true
""")
        loads = []  # the harness's tokenizer: checked before the stores are created, and used
        real_load = Tokenizer.load.__func__
        monkeypatch.setattr(
            Tokenizer, "load", classmethod(lambda cls, path: loads.append(path) or real_load(cls, path))
        )
        result = CliRunner().invoke(app, ["orchestrator", str(config)])
    assert result.exit_code == 0, result.output
    assert "put batches 0..0" in result.output
    assert len(loads) == 1, loads
    assert LocalStore(tmp_path / "batches").list("batches/") == ["batches/0000000000.batch"]
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert record["index"] == 0 and record["samples"] == 2 and record["servers_alive"] == 2
    # two groups run at once (concurrency 4, groups of 2): both may be kept before the batch is put
    assert record["groups.kept_groups"] in (1, 2) and "staleness_0" in record
    assert_tracked(tmp_path / "tensorboard" / "orchestrator", [record], step_key="index")


@pytest.mark.parametrize(
    "overrides, named",
    [
        ([], "harness.tokenizer_path is not set"),
        (["--set", "harness.tokenizer_path=no-model"], "no-model/tokenizer.json does not exist"),
    ],
)
def test_a_missing_tokenizer_is_named_before_any_folder_is_created(tmp_path, monkeypatch, overrides, named):
    monkeypatch.chdir(tmp_path)  # the default stores are runs/default/{batches,weights}
    result = CliRunner().invoke(app, ["orchestrator", *overrides])
    assert isinstance(result.exception, WhetstoneError) and named in str(result.exception), result.exception
    assert list(tmp_path.iterdir()) == []
