"""Validation runs each task in real sandboxes: the reference must pass, the starting repo must not."""

import json

from whetstone.envs.task import Task
from whetstone.envs.tasks.io import Record
from whetstone.envs.tasks.synth import SynthConfig, generate
from whetstone.envs.tasks.validate import check_task, task_hash, validate_records

TEST_ADD = "from calc import add\n\n\ndef test_add():\n    assert add(2, 2) == 4\n"


def _bugfix(buggy: str, fixed: str) -> Task:
    return Task(id="custom/add", kind="bugfix", instruction="add() is wrong.", repo_files={"calc.py": buggy},
                hidden_tests={"test_calc.py": TEST_ADD}, solution_files={"calc.py": fixed},
                fail_to_pass=["test_calc.py::test_add"])


def test_a_generated_task_is_valid():
    assert check_task(generate(SynthConfig(count=1))[0]) is None


def test_a_wrong_reference_solution_is_invalid():
    task = generate(SynthConfig(count=1))[0]
    wrong = task.model_copy(update={"solution_files": {"solution.py": "def solve(x):\n    return x\n"}})
    reason = check_task(wrong)
    assert reason.startswith("the reference solution does not pass (tests not passing: ")
    assert "test_hidden.py::test_" in reason


def test_a_bug_no_test_catches_is_invalid():
    # `a + b` vs `b + a`: the "bug" changes nothing the test can see
    reason = check_task(_bugfix("def add(a, b):\n    return b + a\n", "def add(a, b):\n    return a + b\n"))
    assert reason == "the unfixed repository already passes every FAIL_TO_PASS test (the bug is not caught)"


def test_a_synthesis_task_solved_from_the_start_is_invalid():
    task = generate(SynthConfig(count=1))[0]
    solved = task.model_copy(update={"repo_files": {**task.repo_files, **task.solution_files}})
    assert check_task(solved) == "the starting repository already passes the tests (nothing to solve)"


def test_a_cheating_reference_is_invalid():
    cheat = "import sys\n\ndef add(a, b):\n    sys.exit(0)\n"
    reason = check_task(_bugfix("def add(a, b):\n    return a - b\n", cheat))
    assert reason.startswith("the reference solution is flagged as cheating: ")


def test_report_lists_bad_records_and_remembers_results(tmp_path):
    """Cached results are reused by task content: nothing here needs a sandbox."""
    valid, stale = generate(SynthConfig(count=2))
    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps({task_hash(valid): None, task_hash(stale): "remembered reason"}))
    records = [Record("tasks.jsonl:1", task=valid), Record("tasks.jsonl:2", problem="not valid JSON: ..."),
               Record("tasks.jsonl:3", task=stale)]
    report = validate_records(records, cache_path=cache)
    assert report.valid == [valid]
    assert report.to_json() == {
        "total": 3,
        "valid": 1,
        "invalid": [{"id": "tasks.jsonl:2", "reason": "not valid JSON: ..."},
                    {"id": stale.id, "reason": "remembered reason"}],
    }
