"""`whetstone tasks validate|list|show|export`, driven like a user would."""

import json

from typer.testing import CliRunner

from whetstone.envs.cli import app
from whetstone.envs.tasks.io import read_tasks
from whetstone.envs.tasks.synth import SynthConfig, generate

runner = CliRunner()


def test_validate_json_reports_valid_and_invalid(tmp_path):
    good, _ = generate(SynthConfig(count=2))
    path = tmp_path / "tasks.jsonl"
    path.write_text(good.model_dump_json() + "\n" + '{"id": "broken"}\n')
    result = runner.invoke(app, ["validate", str(path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # stdout holds the JSON alone; the progress bar is on stderr
    assert report["total"] == 2 and report["valid"] == 1
    [invalid] = report["invalid"]
    assert invalid["id"] == f"{path}:2" and "field 'instruction': Field required" in invalid["reason"]


def test_list_and_show(tmp_path):
    result = runner.invoke(app, ["list", "synth", "--set", "count=3", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["id"] for row in rows] == ["synth/train/s0-00000", "synth/train/s0-00001", "synth/train/s0-00002"]

    shown = runner.invoke(app, ["show", "synth", "synth/train/s0-00001", "-s", "count=3"])
    assert "=== repo_files: test_solution.py ===" in shown.stdout and "solution_files" not in shown.stdout
    revealed = runner.invoke(app, ["show", "synth", "synth/train/s0-00001", "-s", "count=3", "--reveal"])
    assert "=== hidden_tests: test_hidden.py ===" in revealed.stdout and "def solve(x):" in revealed.stdout


def test_show_unknown_task_is_a_clear_error():
    result = runner.invoke(app, ["show", "synth", "synth/train/nope", "-s", "count=2"])
    assert result.exit_code != 0 and "no task 'synth/train/nope'" in str(result.exception)


def test_export_writes_what_list_shows(tmp_path):
    result = runner.invoke(app, ["export", "synth", str(tmp_path / "out"), "-s", "count=4", "-s", "split=heldout"])
    assert result.exit_code == 0, result.output
    assert read_tasks(tmp_path / "out") == generate(SynthConfig(count=4, split="heldout"))
    result = runner.invoke(app, ["export", "synth", str(tmp_path / "t.jsonl"), "-s", "count=2"])
    assert len(read_tasks(tmp_path / "t.jsonl")) == 2
