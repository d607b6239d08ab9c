"""`whetstone tasks validate|list|show|export`, driven like a user would."""

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from whetstone.envs.cli import app
from whetstone.envs.tasks.io import read_tasks
from whetstone.envs.tasks.synth import SynthConfig, generate
from whetstone.errors import WhetstoneError

runner = CliRunner()


def test_validate_json_reports_valid_and_invalid(tmp_path):
    good, _ = generate(SynthConfig(count=2))
    path = tmp_path / "tasks.jsonl"
    path.write_text(good.model_dump_json() + "\n" + '{"id": "broken"}\n')
    result = runner.invoke(app, ["validate", str(path), "--json"])
    assert result.exit_code == 1, result.output  # an invalid task fails the command
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


def test_show_finds_a_good_task_among_bad_records_and_warns_of_them(tmp_path):
    good, other = generate(SynthConfig(count=2))
    path = tmp_path / "tasks.jsonl"
    path.write_text(
        good.model_dump_json()
        + "\n{not json\n"
        + '{"id": "bad/1", "instruction": "x"}\n'
        + other.model_dump_json()
        + "\n"
    )
    shown = runner.invoke(app, ["show", str(path), other.id])
    assert shown.exit_code == 0, shown.output
    assert f"id: {other.id}" in shown.stdout
    assert f"2 records cannot be read (first: {path}:2: not valid JSON" in shown.stderr
    bad = runner.invoke(app, ["show", str(path), "bad/1"])  # its own record is bad: that problem is the error
    assert isinstance(bad.exception, WhetstoneError)
    assert f"task 'bad/1' ({path}:3) cannot be read: field '<record>'" in str(bad.exception)
    listed = runner.invoke(app, ["list", str(path)])  # a list missing tasks would pass for the whole set
    assert isinstance(listed.exception, WhetstoneError) and f"{path}:2: not valid JSON" in str(listed.exception)


def test_export_writes_what_list_shows(tmp_path):
    result = runner.invoke(app, ["export", "synth", str(tmp_path / "out"), "-s", "count=4", "-s", "split=heldout"])
    assert result.exit_code == 0, result.output
    assert read_tasks(tmp_path / "out") == generate(SynthConfig(count=4, split="heldout"))
    result = runner.invoke(app, ["export", "synth", str(tmp_path / "t.jsonl"), "-s", "count=2"])
    assert len(read_tasks(tmp_path / "t.jsonl")) == 2


def test_validate_exits_nonzero_naming_the_invalid_task_and_zero_when_all_are_valid(tmp_path):
    good, other = generate(SynthConfig(count=2))
    wrong = other.model_copy(update={"solution_files": {"solution.py": "def solve(x):\n    return x\n"}})
    path = tmp_path / "tasks.jsonl"
    path.write_text(good.model_dump_json() + "\n" + wrong.model_dump_json() + "\n")
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 1, result.output
    assert "1 of 2 tasks valid" in result.stdout
    assert f"invalid {wrong.id}: the reference solution does not pass (tests not passing: " in result.stdout
    path.write_text(good.model_dump_json() + "\n")
    assert runner.invoke(app, ["validate", str(path)]).exit_code == 0


def test_a_missing_file_and_an_unknown_name_are_told_apart(tmp_path):
    missing = runner.invoke(app, ["list", str(tmp_path / "tasks.jsnol")])
    assert missing.exit_code != 0 and str(missing.exception) == f"no such file: {tmp_path / 'tasks.jsnol'}"
    bare = runner.invoke(app, ["list", "synth5.jsonl"])
    assert str(bare.exception) == "no such file: synth5.jsonl"
    unknown = runner.invoke(app, ["list", "synht"])
    assert "unknown task source 'synht'" in str(unknown.exception)
    assert "synth, repofix, mutate, humaneval, swebench" in str(unknown.exception)


def test_the_config_file_is_a_positional_argument(tmp_path):
    config = tmp_path / "synth.toml"
    config.write_text('count = 2\nsplit = "heldout"\n')
    result = runner.invoke(app, ["list", "synth", str(config), "--json"])
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["id"] for line in result.stdout.splitlines()] == [
        "synth/heldout/s0-00000",
        "synth/heldout/s0-00001",
    ]
    shown = runner.invoke(app, ["show", "synth", "synth/heldout/s0-00001", str(config)])
    assert shown.exit_code == 0 and "split: heldout" in shown.stdout
    exported = runner.invoke(app, ["export", "synth", str(tmp_path / "out.jsonl"), str(config), "-s", "count=3"])
    assert exported.exit_code == 0 and len(read_tasks(tmp_path / "out.jsonl")) == 3


def test_export_refuses_a_path_it_would_have_to_guess_about(tmp_path):
    result = runner.invoke(app, ["export", "synth", str(tmp_path / "synth5.txt"), "-s", "count=2"])
    assert result.exit_code != 0 and not (tmp_path / "synth5.txt").exists()
    assert "not to a .txt file" in str(result.exception) and "OUT.jsonl" in str(result.exception)
    chosen = runner.invoke(app, ["export", "synth", str(tmp_path / "synth5.txt"), "-s", "count=2", "--layout", "jsonl"])
    assert chosen.exit_code == 0 and len(read_tasks(tmp_path / "synth5.txt")) == 2


def test_export_does_not_replace_a_directory_of_other_files(tmp_path):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.md").write_text("mine")
    result = runner.invoke(app, ["export", "synth", str(tmp_path / "project"), "-s", "count=2"])
    assert result.exit_code != 0 and "notes.md, not task folders" in str(result.exception)
    assert (tmp_path / "project" / "notes.md").read_text() == "mine"
    runner.invoke(app, ["export", "synth", str(tmp_path / "tasks"), "-s", "count=2"])
    again = runner.invoke(app, ["export", "synth", str(tmp_path / "tasks"), "-s", "count=3"])  # a task set is replaced
    assert again.exit_code == 0 and len(read_tasks(tmp_path / "tasks")) == 3


def test_a_cache_that_is_a_directory_is_refused_before_validating(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"id": "broken"}\n')
    result = runner.invoke(app, ["validate", str(path), "--cache", str(tmp_path)])
    assert isinstance(result.exception, WhetstoneError), result.exception
    assert str(result.exception) == f"validation cache {tmp_path} is a directory, not a JSON file"
    assert "validate tasks" not in result.stderr  # refused before any task ran


def test_the_progress_bar_counts_unreadable_records_as_invalid(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"id": "a"}\nnot json\n')
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 1 and "0 of 2 tasks valid" in result.stdout, result.output
    assert result.stderr.splitlines()[-1].endswith("invalid=2"), result.stderr


def test_a_source_holding_no_tasks_fails_validation(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("")
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 1 and f"{path} holds no tasks" in result.stderr, result.output
    assert "0 of 0" not in result.stdout
    as_json = runner.invoke(app, ["validate", str(path), "--json"])
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["total"] == 0


def test_generator_configs_that_name_nothing_are_clear_errors():
    """Refused before any sandbox runs, naming the field and the choices, not a raw traceback."""
    empty = runner.invoke(app, ["list", "repofix", "-s", "templates=[]"])
    assert isinstance(empty.exception, WhetstoneError), empty.exception
    assert "templates: no templates given; choose from ['life', 'shop', 'textkit']" in str(empty.exception)
    unknown = runner.invoke(app, ["list", "repofix", "-s", 'templates=["shop", "nope"]', "-s", "count=0"])
    assert "templates: unknown templates ['nope']" in str(unknown.exception)
    dotted = runner.invoke(app, ["list", "mutate", "-s", 'stdlib=["nosuch.mod"]'])
    assert isinstance(dotted.exception, WhetstoneError), dotted.exception
    assert "'nosuch.mod' is not a single-file pure-Python standard-library module" in str(dotted.exception)


def test_a_module_without_a_cpython_test_file_is_told_apart_from_a_missing_test_package():
    if importlib.util.find_spec("test") is None:
        pytest.skip("this interpreter ships without CPython's test package")
    result = runner.invoke(app, ["list", "mutate", "-s", 'stdlib=["_pydecimal"]'])
    assert isinstance(result.exception, WhetstoneError), result.exception
    assert "CPython has no test file test/test__pydecimal.py for '_pydecimal'" in str(result.exception)
