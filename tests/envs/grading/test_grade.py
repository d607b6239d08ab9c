"""Grading: changes, fresh-sandbox test runs with per-test results, and the reward arithmetic."""

import importlib.util
import tempfile

import pytest

from whetstone.envs.grading.grade import changes_diff, compiled_runner, encode_paths, grade, workspace_changes
from whetstone.envs.grading.in_sandbox import grade_runner
from whetstone.envs.grading.reward import Effort, RewardConfig, combine, effort_penalty
from whetstone.envs.sandbox import SandboxConfig, open_sandbox
from whetstone.envs.sandbox.sandbox import _runtime
from whetstone.envs.task import Task

BUGGY = "def mean(values):\n    return sum(values) / (len(values) + 1)\n"
FIXED = "def mean(values):\n    if not values:\n        return 0.0\n    return sum(values) / len(values)\n"
VISIBLE = "from stats import mean\n\n\ndef test_single():\n    assert mean([0]) == 0\n"
HIDDEN = (
    "from stats import mean\n\n\ndef test_pair():\n    assert mean([1, 3]) == 2\n\n\n"
    "def test_triple():\n    assert mean([3, 3, 3]) == 3\n\n\n"
    "def test_empty():\n    assert mean([]) == 0.0\n\n\ndef test_still_zero():\n    assert mean([0, 0]) == 0\n"
)


def bugfix_task(**overrides) -> Task:
    fields = dict(
        id="custom/mean",
        kind="bugfix",
        instruction="mean() is wrong; fix it.",
        repo_files={"stats.py": BUGGY, "test_stats.py": VISIBLE},
        visible_tests=["test_stats.py"],
        hidden_tests={"test_stats_hidden.py": HIDDEN},
        solution_files={"stats.py": FIXED},
        fail_to_pass=["test_stats_hidden.py::test_pair", "test_stats_hidden.py::test_triple"],
        pass_to_pass=[
            "test_stats.py::test_single",
            "test_stats_hidden.py::test_still_zero",
            "test_stats_hidden.py::test_empty",
        ],
        protected_paths=["test_*.py"],
        test_time_limit_s=30,
    )
    return Task(**{**fields, **overrides})


def test_workspace_changes_sees_edits_additions_and_deletions():
    task = bugfix_task()
    with open_sandbox(task.repo_files) as sandbox:
        sandbox.run("printf 'x = 1\\n' > extra.py && rm test_stats.py && sed -i 's/+ 1//' stats.py")
        sandbox.run("python -c 'import extra' && mkdir -p .pytest_cache && ln -s /etc/passwd leak")
        changes = workspace_changes(task, sandbox.workspace)
    assert changes == {"extra.py": "x = 1\n", "stats.py": BUGGY.replace("+ 1", ""), "test_stats.py": None}


def test_reference_solution_passes_and_the_unfixed_repo_fails():
    task = bugfix_task()
    solved, unfixed = grade(task, task.solution_files), grade(task, {})
    assert solved.passed and solved.reward == 1.0 and solved.cheat_flags == []
    assert set(solved.tests.values()) == {"passed"} and len(solved.tests) == 5
    assert not unfixed.passed and unfixed.reward == 0.0 and unfixed.cheat_flags == []
    assert unfixed.tests["test_stats_hidden.py::test_pair"] == "failed"
    assert unfixed.tests["test_stats.py::test_single"] == "passed"
    assert unfixed.breakdown["passed_fraction"] == 0.6


def test_hidden_files_define_the_tests_when_no_ids_are_given():
    task = bugfix_task(fail_to_pass=[], pass_to_pass=[])
    result = grade(task, task.solution_files)
    assert result.passed and sorted(result.tests) == [
        "test_stats_hidden.py::test_empty",
        "test_stats_hidden.py::test_pair",
        "test_stats_hidden.py::test_still_zero",
        "test_stats_hidden.py::test_triple",
    ]


def test_partial_credit_is_configurable_and_below_solving():
    task = bugfix_task()
    half = grade(task, {"stats.py": BUGGY.replace("+ 1", "")}, RewardConfig(partial_credit=0.5))
    assert not half.passed and half.tests["test_stats_hidden.py::test_empty"] == "failed"
    assert half.reward == pytest.approx(0.5 * 4 / 5)


def test_a_crash_before_tests_is_an_error_not_a_pass():
    task = bugfix_task()
    result = grade(task, {"stats.py": "def mean(values) return 0\n"})
    assert set(result.tests.values()) == {"error"} and result.reward == 0.0 and result.cheat_flags == []


def test_setup_commands_run_first_and_their_failure_fails_the_grade():
    ok = bugfix_task(setup=["echo 'TOLERANCE = 0' > settings.py"])
    broken = bugfix_task(setup=["exit 7"])
    assert grade(ok, ok.solution_files).passed
    failed = grade(broken, broken.solution_files)
    assert not failed.passed and "setup command failed with exit code 7" in failed.log


# A test command that is not `python -m pytest` (so graded as a custom command) and runs pytest,
# which writes its JUnit report where the grader says.
PYTEST_BY_ANOTHER_NAME = (
    "python -c 'import sys, pytest; sys.exit(pytest.main())' -q -p no:cacheprovider --junitxml=$WHETSTONE_JUNIT_XML"
)
# A check script in any language's place: its own JUnit report, exit code 0 whatever it finds.
CHECK = """import os
from stats import mean

cases = []
for name, values, expected in [("pair", [1, 3], 2), ("empty", [], 0.0)]:
    try:
        ok = mean(values) == expected
    except Exception:
        ok = False
    cases.append(f'<testcase classname="check" name="{name}">' + ("" if ok else "<failure/>") + "</testcase>")
with open(os.environ["WHETSTONE_JUNIT_XML"], "w") as report:
    report.write("<testsuite>" + "".join(cases) + "</testsuite>")
"""


def test_a_custom_test_command_is_judged_by_its_junit_report_test_by_test():
    """pytest's own report, read back by the pytest node ids a SWE-bench record lists."""
    more = "from stats import mean\n\n\nclass TestMean:\n    def test_pair(self):\n        assert mean([2, 4]) == 3\n"
    hidden = {"test_stats_hidden.py": HIDDEN, "tests/test_more.py": more}
    f2p = ["test_stats_hidden.py::test_pair", "tests/test_more.py::TestMean::test_pair"]
    task = bugfix_task(test_command=PYTEST_BY_ANOTHER_NAME, hidden_tests=hidden, fail_to_pass=f2p)
    solved, unfixed = grade(task, task.solution_files), grade(task, {})
    assert solved.passed and set(solved.tests.values()) == {"passed"} and len(solved.tests) == 5
    assert solved.report_problem is None and solved.cheat_flags == []
    assert unfixed.tests == {
        "test_stats_hidden.py::test_pair": "failed",
        "tests/test_more.py::TestMean::test_pair": "failed",
        "test_stats.py::test_single": "passed",
        "test_stats_hidden.py::test_still_zero": "passed",
        "test_stats_hidden.py::test_empty": "passed",
    }
    unlisted = task.model_copy(update={"fail_to_pass": [], "pass_to_pass": []})
    assert grade(unlisted, {}).tests["test_stats_hidden::test_still_zero"] == "passed"  # every testcase, as C::N


def test_a_custom_commands_exit_code_decides_nothing():
    """The check script exits 0 however the checks go; an id its report lacks is an error."""
    ids = {"fail_to_pass": ["check::pair"], "pass_to_pass": ["check::empty"]}
    task = bugfix_task(test_command="python check.py", hidden_tests={"check.py": CHECK}, **ids)
    assert grade(task, task.solution_files).tests == {"check::pair": "passed", "check::empty": "passed"}
    assert grade(task, {}).tests == {"check::pair": "failed", "check::empty": "passed"}
    missing = task.model_copy(update={"pass_to_pass": ["check::empty", "check::triple"]})
    result = grade(missing, missing.solution_files)
    assert not result.passed and result.tests["check::triple"] == "error"


def test_code_that_exits_0_before_the_tests_ran_passes_nothing():
    task = bugfix_task(test_command=PYTEST_BY_ANOTHER_NAME)
    result = grade(task, {"stats.py": "import os\n\nos._exit(0)\n" + FIXED})  # at import: no test ran
    assert not result.passed and set(result.tests.values()) == {"error"} and result.reward == 0.0
    problem = "the test command exited with code 0 and wrote no JUnit XML report to $WHETSTONE_JUNIT_XML"
    assert result.report_problem == problem and f"[{problem}]" in result.log


@pytest.mark.parametrize(
    "command, problem",
    [
        ("true", "exited with code 0 and wrote no JUnit XML report to $WHETSTONE_JUNIT_XML"),
        ("exit 127", "exited with code 127 and wrote no JUnit XML report to $WHETSTONE_JUNIT_XML"),
        (
            "echo '3 passed' > $WHETSTONE_JUNIT_XML; true",
            "exited with code 0; its JUnit XML report cannot be used: it is not well-formed XML (syntax error, line 1)",
        ),
        (
            "echo '<testsuites/>' > $WHETSTONE_JUNIT_XML; true",
            "exited with code 0; its JUnit XML report lists no testcase",
        ),
        (
            "ln -s /workspace/report.xml $WHETSTONE_JUNIT_XML; true",
            "exited with code 0; its JUnit XML report cannot be used: it is a symbolic link, not a file",
        ),
        (
            "mkfifo $WHETSTONE_JUNIT_XML",
            "exited with code 0; its JUnit XML report cannot be used: it is not a regular file",
        ),
        (  # expat cannot read a multi-byte encoding other than UTF-8/16
            """echo '<?xml version="1.0" encoding="utf-7"?><testsuite/>' > $WHETSTONE_JUNIT_XML""",
            "exited with code 0; its JUnit XML report cannot be used: its XML declaration names an encoding the "
            "parser cannot read (multi-byte encodings are not supported): write it in UTF-8",
        ),
        (
            """echo '<?xml version="1.0" encoding="bogus"?><testsuite/>' > $WHETSTONE_JUNIT_XML""",
            "exited with code 0; its JUnit XML report cannot be used: its XML declaration names an encoding the "
            "parser cannot read (unknown encoding: bogus): write it in UTF-8",
        ),
    ],
)
def test_a_custom_command_without_a_usable_report_fails_with_the_reason(command, problem):
    task = bugfix_task(test_command=f"{command} #")
    result = grade(task, task.solution_files)
    assert not result.passed and set(result.tests.values()) == {"error"}
    assert result.reward == 0.0 and not result.exclude_from_gradient  # a failed rollout, trained on
    assert result.report_problem == f"the test command {problem}"


def test_a_report_left_before_the_test_command_ran_is_not_read():
    """Setup commands run the repository's code (`pip install -e .` runs its setup.py): what they
    leave in the report folder is gone before the test command starts."""
    fake = '<testsuite><testcase classname="test_stats_hidden" name="test_pair"/></testsuite>'
    plant = f"mkdir /opt/whetstone/report/sub && echo '{fake}' > /opt/whetstone/report/junit.xml"
    task = bugfix_task(
        test_command="true #", setup=[plant], fail_to_pass=["test_stats_hidden.py::test_pair"], pass_to_pass=[]
    )
    result = grade(task, task.solution_files)
    assert result.setup_failure is None and not result.passed
    assert result.report_problem == (
        "the test command exited with code 0 and wrote no JUnit XML report to $WHETSTONE_JUNIT_XML"
    )


def test_solution_code_naming_the_report_is_flagged():
    task = bugfix_task(test_command=PYTEST_BY_ANOTHER_NAME)
    forger = "import os\n\nREPORT = os.environ.get('WHETSTONE_JUNIT_XML')\n"
    result = grade(task, {"stats.py": forger + FIXED})
    assert result.cheat_flags == [
        "result_tampering: stats.py names WHETSTONE_JUNIT_XML, where grading reads test results"
    ]
    assert result.reward == 0.0


# Patches the runner that plain tests run under (no pytest) so that every test is a no-op.
SKIP_PLAIN_TESTS = (
    "import sys\n\n"
    "_runner = sys.modules.get('plain_tests')\n"
    "if _runner is not None:\n"
    "    _runner.Trusted.callable = lambda self, test_id, function: (lambda: None)\n\n"
)


def test_patching_the_plain_test_runner_is_flagged():
    task = bugfix_task()
    result = grade(task, {"stats.py": SKIP_PLAIN_TESTS + BUGGY})
    assert [flag.split(":")[0] for flag in result.cheat_flags] == ["runner_patching"], result.cheat_flags
    assert "plain_tests.Trusted.callable" in result.cheat_flags[0] and result.reward == 0.0


def test_snapshot_directory_tasks(tmp_path):
    for name, text in bugfix_task().repo_files.items():
        (tmp_path / name).write_text(text)
    task = bugfix_task(repo_files={}, repo_path=str(tmp_path))
    with open_sandbox(tmp_path) as sandbox:
        (sandbox.workspace / "stats.py").write_text(FIXED)
        changes = workspace_changes(task, sandbox.workspace)
    assert changes == {"stats.py": FIXED}
    assert grade(task, changes).passed


def test_diff_for_people_and_judges():
    diff = changes_diff({"a.py": "x = 1\n", "b.py": "y\n"}, {"a.py": "x = 2\n", "b.py": None, "c.py": "z\n"})
    assert "-x = 1\n+x = 2\n" in diff and "+++ /dev/null" in diff and "--- /dev/null\n+++ b/c.py" in diff


def test_effort_penalty_is_bounded_and_concave():
    config = RewardConfig(turn_budget=40, token_budget=100_000)
    assert effort_penalty(Effort(), config) == (0.0, 0.0)
    quarter = effort_penalty(Effort(turns=10, tokens=25_000), config)
    full = effort_penalty(Effort(turns=10**6, tokens=10**9), config)
    assert quarter[0] == pytest.approx(config.effort_penalty_max / 2)  # sqrt(1/4) of the budget costs half
    assert full[0] == pytest.approx(config.effort_penalty_max)
    assert effort_penalty(Effort(invalid_tool_calls=1000), config)[1] == config.invalid_call_penalty_max


def test_solving_always_beats_failing():
    config = RewardConfig(partial_credit=0.3)
    worst_solved, *_ = combine(True, 1.0, 0.0, Effort(turns=10**6, tokens=10**9, invalid_tool_calls=10**6), [], config)
    best_failed, *_ = combine(False, 0.99, 1.0, Effort(), [], config)
    assert worst_solved > best_failed
    with pytest.raises(ValueError, match="solved rollout could score"):
        RewardConfig(partial_credit=0.5, judge_weight=0.5)


def test_flagged_rollouts_score_zero_and_leave_the_gradient():
    reward, breakdown, exclude = combine(True, 1.0, 1.0, None, ["conftest: conftest.py"], RewardConfig())
    assert (reward, breakdown["cheat"], exclude) == (0.0, 1.0, True)
    kept = combine(True, 1.0, None, None, ["x: y"], RewardConfig(exclude_flagged_from_gradient=False))
    assert kept[0] == 0.0 and kept[2] is False


def test_a_change_that_would_turn_a_hidden_test_or_a_kept_file_into_a_folder_is_not_applied():
    task = bugfix_task()
    changes = {**task.solution_files, "test_stats_hidden.py/notes.txt": "x", "test_stats.py/x.txt": "y"}
    result = grade(task, {**changes, "test_stats.py": None})  # the visible test's deletion is not applied
    assert result.passed and result.setup_failure is None


def test_a_folder_the_agent_turned_into_a_file_and_a_file_into_a_folder_are_graded_as_made():
    files = {"stats.py": BUGGY, "test_stats.py": VISIBLE, "notes/a.txt": "a", "notes/deep/b.txt": "b", "todo": "t"}
    task = bugfix_task(repo_files=files)
    gone = {"notes/a.txt": None, "notes/deep/b.txt": None, "todo": None}
    result = grade(task, {**task.solution_files, **gone, "notes": "now a file", "todo/list.txt": "now a folder"})
    assert result.passed and result.setup_failure is None and result.cheat_flags == []


def test_a_folder_turned_into_a_file_goes_with_the_caches_and_links_grading_does_not_see(tmp_path):
    for name, text in {"stats.py": BUGGY, "test_stats.py": VISIBLE, "notes/a.txt": "a"}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "notes" / "__pycache__").mkdir()
    (tmp_path / "notes" / "__pycache__" / "a.pyc").write_bytes(b"\0")
    (tmp_path / "notes" / "link").symlink_to("a.txt")
    task = bugfix_task(repo_files={}, repo_path=str(tmp_path))
    result = grade(task, {**task.solution_files, "notes/a.txt": None, "notes": "now a file"})
    assert result.passed and result.setup_failure is None and result.cheat_flags == []


def test_grading_leaves_nothing_behind(tmp_path, monkeypatch):
    # The folders that live as long as the process (the compiled runner, the sandboxes' root) are
    # made first, in the usual temporary folder; what then appears in tmp_path is one grade's.
    compiled_runner()
    _runtime(RewardConfig().sandbox)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the grader keeps its results
    task = bugfix_task()
    grade(task, task.solution_files)
    assert list(tmp_path.iterdir()) == []


def test_grading_also_works_unsandboxed_for_trusted_code():
    task = bugfix_task()
    config = RewardConfig(sandbox=SandboxConfig(unsandboxed=True))
    assert grade(task, task.solution_files, config).reward == 1.0
    assert not grade(task, {}, config).passed


def test_the_runner_runs_as_bytecode_compiled_once_per_process():
    directory = compiled_runner()
    assert compiled_runner() is directory  # once per process
    for name in ("grade_runner.pyc", "plain_tests.pyc"):
        assert (directory / name).read_bytes()[:4] == importlib.util.MAGIC_NUMBER  # this interpreter's
    assert sorted(p.name for p in directory.iterdir()) == ["grade_runner.pyc", "plain_tests.pyc"]  # no source


LEAN_TEST = (  # getattr: a test file that names `modules` is left to pytest, which imports them all
    "import sys\n\n\ndef test_runner_loaded_no_parser_or_collections():\n"
    "    assert not {'ast', 'importlib.util', 'collections', 'json', 're'} & set(getattr(sys, 'modules'))\n"
)


@pytest.mark.parametrize("sandboxed", [True, False])
def test_the_grading_process_imports_no_module_it_does_not_need(sandboxed):
    # Each of these costs 2-8 ms of CPU in every grading sandbox (docs/sandbox.md). The hidden test
    # runs in the runner's process, so it sees what the runner and plain_tests imported.
    task = bugfix_task(hidden_tests={"test_lean.py": LEAN_TEST}, fail_to_pass=[], pass_to_pass=[])
    config = RewardConfig(sandbox=SandboxConfig(unsandboxed=not sandboxed))
    result = grade(task, task.solution_files, config)
    assert result.tests == {"test_lean.py::test_runner_loaded_no_parser_or_collections": "passed"}


def test_path_lists_reach_the_runner_intact(monkeypatch):
    paths = ["test_a.py", "dir with space/test b.py", "new\nline.py", "caf\u00e9.py", "bad\udcff.py"]
    monkeypatch.setenv("WHETSTONE_GUARDED", encode_paths(paths))
    assert grade_runner._paths("WHETSTONE_GUARDED") == paths
    assert "WHETSTONE_GUARDED" not in __import__("os").environ  # removed before graded code runs
