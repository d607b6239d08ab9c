"""Validation runs each task in real sandboxes: the reference must pass, the starting repo must not."""

import json
import shutil

import pytest
from pydantic import ValidationError

from whetstone.envs.grading.grade import PLAIN_TESTS, RUNNER
from whetstone.envs.grading.reward import RewardConfig
from whetstone.envs.sandbox import SandboxConfig
from whetstone.envs.task import Task
from whetstone.envs.tasks import validation_cache
from whetstone.envs.tasks.io import Record, read_records, write_tasks
from whetstone.envs.tasks.registry import TasksConfig, load_valid_tasks
from whetstone.envs.tasks.synth import SynthConfig, generate
from whetstone.envs.tasks.validate import check_task, validate_records, validate_tasks
from whetstone.envs.tasks.validation_cache import GRADER_SOURCES, grader_fingerprint, task_hash

TEST_ADD = "from calc import add\n\n\ndef test_add():\n    assert add(2, 2) == 4\n"


def _bugfix(buggy: str, fixed: str) -> Task:
    return Task(
        id="custom/add",
        kind="bugfix",
        instruction="add() is wrong.",
        repo_files={"calc.py": buggy},
        hidden_tests={"test_calc.py": TEST_ADD},
        solution_files={"calc.py": fixed},
        fail_to_pass=["test_calc.py::test_add"],
    )


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
    verdicts = {task_hash(valid): None, task_hash(stale): "remembered reason"}
    cache.write_text(json.dumps({"grader": grader_fingerprint(), "verdicts": verdicts}))
    records = [
        Record("tasks.jsonl:1", task=valid),
        Record("tasks.jsonl:2", problem="not valid JSON: ..."),
        Record("tasks.jsonl:3", task=stale),
    ]
    report = validate_records(records, cache_path=cache)
    assert report.valid == [valid]
    assert report.to_json() == {
        "total": 3,
        "valid": 1,
        "invalid": [
            {"id": "tasks.jsonl:2", "reason": "not valid JSON: ..."},
            {"id": stale.id, "reason": "remembered reason"},
        ],
    }


def test_a_verdict_cached_under_another_grader_is_not_reused(tmp_path):
    """The task really runs again: its cached reason was found by a grader that differs."""
    [task] = generate(SynthConfig(count=1))
    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps({"grader": "another grader", "verdicts": {task_hash(task): "remembered reason"}}))
    report = validate_tasks([task], cache_path=cache)
    assert report.valid == [task] and report.invalid == []
    assert json.loads(cache.read_text()) == {"grader": grader_fingerprint(), "verdicts": {task_hash(task): None}}


def test_a_cache_without_a_grader_fingerprint_is_a_miss(tmp_path):
    """A cache written before verdicts carried the grader's fingerprint is not read as verdicts."""
    [task] = generate(SynthConfig(count=1))
    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps({task_hash(task): "remembered reason"}))
    assert validate_tasks([task], cache_path=cache).valid == [task]


def test_the_grader_fingerprint_follows_the_grading_code_and_limits(tmp_path):
    sources = []
    for source in (RUNNER, PLAIN_TESTS):
        sources.append(tmp_path / source.name)
        shutil.copy(source, sources[-1])
    before = grader_fingerprint(sources=tuple(sources))
    sources[0].write_text(sources[0].read_text() + "\n# a changed runner\n")
    assert grader_fingerprint(sources=tuple(sources)) != before
    assert {RUNNER, PLAIN_TESTS} <= set(GRADER_SOURCES)
    tighter = RewardConfig(sandbox=SandboxConfig(wall_clock_s=120.0, memory_mb=256))
    assert grader_fingerprint(tighter) != grader_fingerprint()
    more_spares = RewardConfig(sandbox=SandboxConfig(wall_clock_s=120.0, pool_size=8))
    assert grader_fingerprint(more_spares) == grader_fingerprint()


def test_a_failing_setup_command_is_named_with_its_exit_code_and_output():
    task = _bugfix("def add(a, b):\n    return a - b\n", "def add(a, b):\n    return a + b\n")
    broken = task.model_copy(update={"setup": ["echo 'no module named numpy' >&2; exit 3"]})
    reason = check_task(broken)
    assert reason.startswith('the setup failed: setup command failed with exit code 3: "echo ')
    assert "no module named numpy" in reason


def test_tests_that_time_out_are_named():
    hangs = "import time\n\n\ndef test_add():\n    time.sleep(600)\n"
    task = _bugfix("def add(a, b):\n    return a - b\n", "def add(a, b):\n    return a + b\n")
    slow = task.model_copy(update={"hidden_tests": {"test_calc.py": hangs}, "test_time_limit_s": 2.0})
    assert check_task(slow) == "the tests timed out after 2 s (test_time_limit_s) with the reference solution"


def test_a_visible_test_missing_from_a_repo_path_snapshot_is_named(tmp_path):
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    task = Task(
        id="custom/add",
        kind="bugfix",
        instruction="add() is wrong.",
        repo_path=str(tmp_path),
        visible_tests=["test_calc.py"],
        hidden_tests={"test_calc.py": TEST_ADD},
        solution_files={"calc.py": "def add(a, b):\n    return a + b\n"},
        fail_to_pass=["test_calc.py::test_add"],
    )
    assert check_task(task) == f"visible_tests: 'test_calc.py': no such file in repo_path {tmp_path}"


def test_field_errors_are_refused_when_a_task_is_read(tmp_path):
    good = json.loads(_bugfix("def add(a, b):\n    return a - b\n", "x = 1\n").model_dump_json())
    bad = {
        "time_limit_s": -5,
        "test_time_limit_s": 0,
        "split": "test",
        "visible_tests": ["test_missing.py"],
        "difficulty": -1,
    }
    path = tmp_path / "tasks.jsonl"
    path.write_text(
        "".join(json.dumps({**good, "id": f"t{i}", key: value}) + "\n" for i, (key, value) in enumerate(bad.items()))
    )
    report = validate_records(read_records(path))
    assert report.valid == [] and [item["id"] for item in report.invalid] == [f"{path}:{n}" for n in range(1, 6)]
    reasons = [item["reason"] for item in report.invalid]
    assert reasons[0] == "field 'time_limit_s': Input should be greater than 0"
    assert reasons[1] == "field 'test_time_limit_s': Input should be greater than 0"
    assert reasons[2] == "field 'split': Input should be 'train' or 'heldout'"
    assert reasons[3] == "field 'visible_tests': Value error, 'test_missing.py': no such file in repo_files"
    assert reasons[4] == "field 'difficulty': Input should be greater than or equal to 0"


def test_up_front_validation_grades_as_the_runs_rollouts_are_graded(tmp_path):
    """A task whose reference needs 300 MB is valid under the default sandbox, and not under a
    run's 128 MB one: validated up front with the run's grading config, it is skipped."""
    big = "from calc import add\n\n\ndef test_add():\n    room = bytearray(300 << 20)\n    assert add(2, 2) == 4\n"
    task = _bugfix("def add(a, b):\n    return a - b\n", "def add(a, b):\n    return a + b\n")
    write_tasks([task.model_copy(update={"hidden_tests": {"test_calc.py": big}})], tmp_path / "tasks.jsonl")
    config = TasksConfig(source=str(tmp_path / "tasks.jsonl"))
    assert [t.id for t in load_valid_tasks(config)] == ["custom/add"]
    assert load_valid_tasks(config, RewardConfig(sandbox=SandboxConfig(memory_mb=128))) == []


def _snapshot_task(folder) -> Task:
    """A bugfix task whose repository is the snapshot folder `folder` (calc.py, a script, a link)."""
    (folder / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (folder / "run.sh").write_text("#!/bin/sh\n")
    (folder / "docs").mkdir()
    (folder / "docs" / "notes.txt").write_text("notes\n")
    (folder / "latest").symlink_to("calc.py")
    return Task(
        id="custom/add",
        kind="bugfix",
        instruction="add() is wrong.",
        repo_path=str(folder),
        hidden_tests={"test_calc.py": TEST_ADD},
        solution_files={"calc.py": "def add(a, b):\n    return a + b\n"},
        fail_to_pass=["test_calc.py::test_add"],
    )


def test_a_snapshot_folder_whose_files_changed_is_validated_again(tmp_path):
    """The cache hits while the folder's files stay as they were, and misses once one changes:
    the task then really runs again (and is found valid, where the cache said otherwise)."""
    folder = tmp_path / "repo"
    folder.mkdir()
    task = _snapshot_task(folder)
    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps({"grader": grader_fingerprint(), "verdicts": {task_hash(task): "remembered reason"}}))
    assert validate_tasks([task], cache_path=cache).invalid == [{"id": task.id, "reason": "remembered reason"}]
    (folder / "calc.py").write_text("def add(a, b):\n    return a * b\n")  # 2 * 2 == 4: the bug is not caught
    report = validate_tasks([task], cache_path=cache)
    reason = "the unfixed repository already passes every FAIL_TO_PASS test (the bug is not caught)"
    assert report.invalid == [{"id": task.id, "reason": reason}]
    assert json.loads(cache.read_text())["verdicts"][task_hash(task)] == reason


def test_a_snapshot_folders_hash_follows_what_a_sandbox_copies(tmp_path):
    """Names, bytes, link targets and the executable bit change the hash; a folder's `.git` and
    group write permission (a umask's doing), which never reach a sandbox's test, do not."""
    folder = tmp_path / "repo"
    folder.mkdir()
    task = _snapshot_task(folder)
    seen = {task_hash(task)}

    def changes_hash(change) -> bool:
        change()
        key = task_hash(task)
        new = key not in seen
        seen.add(key)
        return new

    assert changes_hash(lambda: (folder / "docs" / "notes.txt").write_text("other notes\n"))
    assert changes_hash(lambda: (folder / "docs" / "notes.txt").rename(folder / "docs" / "notes.md"))
    assert changes_hash(lambda: (folder / "run.sh").chmod(0o755))
    assert changes_hash(lambda: ((folder / "latest").unlink(), (folder / "latest").symlink_to("run.sh")))
    assert changes_hash(lambda: (folder / "empty").mkdir())
    assert not changes_hash(lambda: (folder / "calc.py").chmod(0o664))
    assert not changes_hash(lambda: ((folder / ".git").mkdir(), (folder / ".git" / "HEAD").write_text("ref\n")))
    moved = task.model_copy(update={"repo_path": str(tmp_path / "gone")})
    assert validate_tasks([moved], cache_path=tmp_path / "cache.json").invalid == [
        {
            "id": task.id,
            "reason": f"task {task.id}: repo_path {tmp_path / 'gone'} cannot be read ({tmp_path / 'gone'}: "
            "No such file or directory): the snapshot folder must exist and its files be readable",
        }
    ]


def test_a_custom_test_command_that_writes_no_report_is_named():
    """Exit code 0 alone is no result: the task is invalid with the reason, not valid by default."""
    task = _bugfix("def add(a, b):\n    return a - b\n", "def add(a, b):\n    return a + b\n")
    silent = task.model_copy(update={"test_command": "python test_calc.py"})
    assert check_task(silent) == (
        "no test results with the reference solution: the test command exited with code 0 and wrote no "
        "JUnit XML report to $WHETSTONE_JUNIT_XML"
    )


def test_a_snapshot_hash_leaves_out_the_read_and_write_bits_a_umask_sets(tmp_path):
    """The same files checked out under umask 022 and 077 hash alike; a file made executable does not."""
    folder = tmp_path / "repo"
    folder.mkdir()
    task = _snapshot_task(folder)
    (folder / "calc.py").chmod(0o644)
    (folder / "docs").chmod(0o755)
    before = task_hash(task)
    (folder / "calc.py").chmod(0o600)
    (folder / "docs").chmod(0o700)
    assert task_hash(task) == before
    (folder / "calc.py").chmod(0o700)
    assert task_hash(task) != before


def test_a_snapshot_folder_shared_by_tasks_is_hashed_once_per_validation(tmp_path, monkeypatch):
    """Two tasks on one folder, one of them through a link to it: its bytes are read once."""
    folder = tmp_path / "repo"
    folder.mkdir()
    task = _snapshot_task(folder)
    (tmp_path / "same").symlink_to(folder)
    tasks = [
        task.model_copy(update={"id": "custom/a", "solution_files": {}}),
        task.model_copy(update={"id": "custom/b", "solution_files": {}, "repo_path": str(tmp_path / "same")}),
    ]
    hashed = []

    def counted(path):
        hashed.append(path)
        return folder_digest(path)

    folder_digest = validation_cache.folder_digest
    monkeypatch.setattr(validation_cache, "folder_digest", counted)
    reason = "no reference solution (solution_files or solution_patch)"
    report = validate_tasks(tasks, cache_path=tmp_path / "cache.json")
    assert report.invalid == [{"id": "custom/a", "reason": reason}, {"id": "custom/b", "reason": reason}]
    assert len(hashed) == 1
    validate_tasks(tasks, cache_path=tmp_path / "cache.json")  # a new validation reads the folder again
    assert len(hashed) == 2


def test_a_custom_test_command_without_fail_to_pass_ids_is_refused():
    """Every testcase of the report would count, so one that leaves out the hidden tests passes."""
    task = _bugfix("def add(a, b):\n    return a - b\n", "def add(a, b):\n    return a + b\n")
    command = (
        "python -c 'import sys, pytest; sys.exit(pytest.main())' -p no:cacheprovider --junitxml=$WHETSTONE_JUNIT_XML"
    )
    listed = task.model_copy(update={"test_command": command})  # test_calc.py::test_add
    assert check_task(listed) is None
    unlisted = listed.model_copy(update={"fail_to_pass": []})
    assert check_task(unlisted) == (
        "a custom test_command needs fail_to_pass ids: without them every testcase of its JUnit report counts, so "
        "a run whose report leaves out the hidden tests' testcases passes; list the ids of the testcases that "
        'must pass (docs/tasks.md, "Custom test commands")'
    )
    with pytest.raises(ValidationError, match="a custom test_command needs fail_to_pass ids"):
        Task.model_validate(unlisted.model_dump())  # as a task file loads: also where validation is off
    unclosed = {**unlisted.model_dump(), "test_command": "sh -c 'make test"}
    with pytest.raises(ValidationError, match='test_command "sh -c \'make test" is not a command line'):
        Task.model_validate(unclosed)
    assert Task.model_validate({**unclosed, "fail_to_pass": listed.fail_to_pass}).fail_to_pass  # ids: not read
