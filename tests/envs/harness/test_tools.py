"""The agent's tools over a real sandbox: what each returns, what counts as an invalid call, and
that no path leads out of the workspace."""

from __future__ import annotations

import threading
import time

import pytest

from tests.envs.harness.harness_support import synth_task
from whetstone.envs import prompts
from whetstone.envs.harness import workspace as workspace_module
from whetstone.envs.harness.tools import ToolCallError, Tools, check_call
from whetstone.envs.harness.workspace import head_tail
from whetstone.envs.sandbox import SandboxConfig, open_sandbox


@pytest.fixture
def task():
    return synth_task(repo_files={**synth_task().repo_files, "pkg/util.py": "def helper():\n    return 41  # TODO\n"})


@pytest.fixture
def tools(task):
    with open_sandbox(task.repo_files) as sandbox:
        yield Tools(sandbox, task, max_chars=2000, run_timeout_s=5.0)


@pytest.fixture
def budgeted(task):
    """Tools over a sandbox with a disk budget of 64 MB."""
    with open_sandbox(task.repo_files, SandboxConfig(disk_mb=64)) as sandbox:
        yield Tools(sandbox, task, max_chars=2000, run_timeout_s=60.0)


def test_file_tools_speak_the_demonstrations_texts(tools):
    assert tools.call("write_file", {"path": "solution.py", "content": "def solve(x):\n    return x\n"}, 10) == (
        prompts.write_result("solution.py", "def solve(x):\n    return x\n")
    )
    assert tools.call("edit", {"path": "solution.py", "old": "return x", "new": "return x + 1"}, 10) == (
        prompts.edit_result("solution.py")
    )
    assert tools.call("read_file", {"path": "solution.py"}, 10) == "def solve(x):\n    return x + 1\n"
    assert tools.call("list_dir", {"path": "."}, 10) == "pkg/\nsolution.py\ntest_solution.py"
    assert tools.call("grep", {"pattern": r"TODO|return x", "path": "."}, 10) == (
        "pkg/util.py:2:    return 41  # TODO\nsolution.py:2:    return x + 1"
    )


def test_tool_failures_are_results_not_invalid_calls(tools):
    assert tools.call("read_file", {"path": "missing.py"}, 10) == "error: missing.py does not exist"
    tools.call("write_file", {"path": "twice.py", "content": "a = 1\na = 1\n"}, 10)
    assert "occurs 2 times" in tools.call("edit", {"path": "twice.py", "old": "a = 1", "new": "b"}, 10)
    assert "not found" in tools.call("edit", {"path": "twice.py", "old": "zzz", "new": "b"}, 10)
    assert "invalid regex" in tools.call("grep", {"pattern": "(", "path": "."}, 10)


@pytest.mark.parametrize("path", ["../outside.py", "/etc/passwd", "pkg/../../x"])
def test_paths_outside_the_workspace_are_refused(tools, path):
    assert "outside the repository" in tools.call("read_file", {"path": path}, 10)
    assert "outside the repository" in tools.call("write_file", {"path": path, "content": "x"}, 10)


def test_a_symlink_planted_by_a_command_does_not_lead_out(tools):
    tools.call("run", {"command": "ln -s /etc/passwd leak && ln -s /etc etcdir"}, 10)
    assert "outside the repository" in tools.call("read_file", {"path": "leak"}, 10)
    assert "outside the repository" in tools.call("list_dir", {"path": "etcdir"}, 10)
    assert "root:" not in tools.call("grep", {"pattern": "root", "path": "."}, 10)


def test_unusable_paths_are_tool_errors_not_crashes(tools):
    tools.call("run", {"command": "ln -s loop loop"}, 10)
    assert "not a usable path" in tools.call("read_file", {"path": "loop"}, 10)
    assert "not a usable path" in tools.call("read_file", {"path": "a\0b"}, 10)
    assert tools.call("write_file", {"path": "test_solution.py/x.py", "content": ""}, 10) == (
        "error: File exists: test_solution.py/x.py"
    )


def call_within(tools, name, arguments, seconds=5.0):
    """The call's result, or None if it is still blocked after `seconds` (left behind in a daemon thread)."""
    results = []
    thread = threading.Thread(target=lambda: results.append(tools.call(name, arguments, 10)), daemon=True)
    thread.start()
    thread.join(seconds)
    return results[0] if results else None


def test_a_fifo_made_by_a_command_is_refused_not_waited_on(tools, task):
    tools.call("run", {"command": "mkfifo pipe pkg/pipe"}, 10)
    assert call_within(tools, "read_file", {"path": "pipe"}) == "error: pipe is not a regular file"
    assert call_within(tools, "write_file", {"path": "pipe", "content": "x"}) == "error: pipe is not a regular file"
    assert call_within(tools, "edit", {"path": "pipe", "old": "a", "new": "b"}) == "error: pipe is not a regular file"
    assert call_within(tools, "grep", {"pattern": "x", "path": "pipe"}) == "error: pipe is not a regular file"
    assert call_within(tools, "grep", {"pattern": "TODO", "path": "."}) == "pkg/util.py:2:    return 41  # TODO"


def test_absolute_paths_inside_the_sandbox_workdir_are_the_workspace(tools):
    assert tools.call("read_file", {"path": "/workspace/pkg/util.py"}, 10).startswith("def helper")


def test_run_reports_output_exit_code_and_timeouts(tools):
    assert tools.call("run", {"command": "echo out; echo err >&2; exit 3"}, 10) == "out\nerr\n\n[exit code 3]"
    assert tools.call("run", {"command": "sleep 5"}, 0.5).endswith("[timed out after 0.5 s]")


def test_long_output_keeps_head_and_tail(tools):
    result = tools.call("run", {"command": "seq 1 100000"}, 10)
    assert result.startswith("1\n2\n") and "100000\n\n[exit code 0]" in result and "characters cut" in result
    assert len(result) < 2100


def test_run_tests_reports_each_failing_test_then_counts(tools):
    tools.call("write_file", {"path": "solution.py", "content": "def solve(x):\n    return None\n"}, 10)
    result = tools.call("run_tests", {}, 30)
    lines = result.splitlines()
    assert lines[:4] == [
        "FAILED test_solution.py::test_1",
        "FAILED test_solution.py::test_2",
        "FAILED test_solution.py::test_3",
        "3 failed",
    ]
    assert "assert None ==" in result and "[exit code 1]" in result
    # Only the first failure's short traceback: its test line and assertion, not the others'.
    assert lines[4] == "test_solution.py:5: in test_1" and "in test_2" not in result


def test_run_tests_shows_a_syntax_error_without_pytest_internals(tools):
    tools.call("write_file", {"path": "solution.py", "content": "def solve(x):\n    return x +\n"}, 10)
    result = tools.call("run_tests", {}, 30)
    assert result.startswith("ERROR test_solution.py\n1 error\ntest_solution.py:1: in <module>")
    assert "SyntaxError: invalid syntax" in result and "_pytest" not in result and "<frozen" not in result


def test_run_tests_when_passing_is_exactly_the_demonstration_text(tools, task):
    path, content = next(iter(task.solution_files.items()))
    tools.call("write_file", {"path": path, "content": content}, 10)
    passed = {f"test_solution.py::test_{i}": "passed" for i in (1, 2, 3)}
    assert tools.call("run_tests", {}, 30) == prompts.run_tests_result(passed) == "3 passed"


def test_run_tests_runs_a_custom_command_that_writes_a_junit_report(task):
    """A custom test command may write its report to `$WHETSTONE_JUNIT_XML` for grading; the
    agent's run of it has the variable too (nothing reads that report), and sees its output."""
    command = 'sh -c \'echo "tests ran" > "$WHETSTONE_JUNIT_XML" && echo 3 checks passed\' --'
    custom = task.model_copy(update={"test_command": command})
    with open_sandbox(custom.repo_files) as sandbox:
        result = Tools(sandbox, custom, max_chars=2000, run_timeout_s=5.0).call("run_tests", {}, 30)
    assert result == "3 checks passed\n\n[exit code 0]"


def test_run_tests_reports_a_collection_error(tools):
    result = tools.call("run_tests", {}, 30)  # solution.py does not exist yet
    assert result.startswith("ERROR test_solution.py\n1 error") and "ModuleNotFoundError" in result


@pytest.mark.parametrize(
    "name,arguments,message",
    [
        ("fly", {}, "unknown tool 'fly'"),
        ("read_file", {}, "read_file(path): missing path"),
        ("run_tests", {"verbose": "yes"}, "unexpected verbose"),
        ("write_file", {"path": "a.py", "content": 3}, "argument content must be a string"),
        ("run", ["ls"], "arguments must be an object"),
        ("run", {"command": "echo \udc00\ud800"}, "argument command is not valid UTF-8 text (surrogates not allowed"),
        ("write_file", {"path": "x.py", "content": "\ud800"}, "argument content is not valid UTF-8 text"),
        ("run", {"command": "echo a\0b"}, "argument command holds a NUL character (at character 6)"),
    ],
)
def test_calls_that_cannot_run_are_invalid(name, arguments, message):
    with pytest.raises(ToolCallError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_call(name, arguments)


def test_odd_regexes_are_tool_errors_not_crashes(tools):
    """Patterns `re` refuses with something other than `re.error` still answer the model."""
    assert tools.call("grep", {"pattern": "a{4294967296}", "path": "."}, 10).startswith("error: regex too large")
    nested = "(" * 1000 + "x" + ")" * 1000
    assert tools.call("grep", {"pattern": nested, "path": "."}, 10).startswith("error: regex too large")


def test_a_pattern_that_backtracks_without_end_stops_at_the_time_limit(tools, monkeypatch):
    monkeypatch.setattr(workspace_module, "GREP_TIME_LIMIT_S", 1.0)
    tools.call("write_file", {"path": "long.txt", "content": "a" * 60 + "!\n"}, 10)  # ~1e12 steps for `re`
    started = time.monotonic()
    answer = tools.call("grep", {"pattern": "(a|aa)+$", "path": "long.txt"}, 10)
    assert answer.startswith("error: the search for '(a|aa)+$' ran past 1 s: use a simpler pattern")
    assert time.monotonic() - started < 30
    assert tools.call("grep", {"pattern": "(a|aa)+!$", "path": "long.txt"}, 10) == f"long.txt:1:{'a' * 60}!"


def test_grep_reads_braces_as_re_does(tools):
    """`{e}` is text to `re` (an f-string's field), not a quantifier or anything else."""
    tools.call("write_file", {"path": "fmt.py", "content": 'msg = f"{e}"\nother = f"hello"\n'}, 10)
    assert tools.call("grep", {"pattern": 'f"{e}"', "path": "fmt.py"}, 10) == 'fmt.py:1:msg = f"{e}"'


def test_edit_keeps_crlf_line_endings_and_matches_them(tools):
    workspace = tools.sandbox.workspace
    tools.call("write_file", {"path": "dos.py", "content": "a = 1\r\nb = 2\r\n"}, 10)
    assert tools.call("edit", {"path": "dos.py", "old": "b = 2", "new": "b = 3"}, 10) == prompts.edit_result("dos.py")
    assert (workspace / "dos.py").read_bytes() == b"a = 1\r\nb = 3\r\n"  # the other line's ending untouched
    assert tools.call("edit", {"path": "dos.py", "old": "1\r\nb", "new": "1\r\nc"}, 10) == prompts.edit_result("dos.py")
    assert (workspace / "dos.py").read_bytes() == b"a = 1\r\nc = 3\r\n"
    # lines written with "\n", as a model's JSON mostly has them, match the file's "\r\n" lines
    edited = tools.call("edit", {"path": "dos.py", "old": "a = 1\nc = 3", "new": "a = 0\nc = 4\nd = 5"}, 10)
    assert edited == prompts.edit_result("dos.py")
    assert (workspace / "dos.py").read_bytes() == b"a = 0\r\nc = 4\r\nd = 5\r\n"
    # mixed endings (a line appended with echo) and old-Mac ones: matched as "\n" lines, written so
    tools.call("write_file", {"path": "mixed.py", "content": "a\r\nb\r\nc\nd\n"}, 10)
    assert tools.call("edit", {"path": "mixed.py", "old": "b\nc\n", "new": "B\nC\n"}, 10) == prompts.edit_result(
        "mixed.py"
    )
    assert (workspace / "mixed.py").read_bytes() == b"a\nB\nC\nd\n"
    tools.call("write_file", {"path": "mac.py", "content": "a\rb\rc\r"}, 10)
    assert tools.call("edit", {"path": "mac.py", "old": "a\nb\n", "new": "X\nY\n"}, 10) == prompts.edit_result("mac.py")
    assert (workspace / "mac.py").read_bytes() == b"X\nY\nc\n"


def test_run_calls_share_the_workspace_disk_budget(budgeted):
    workspace = budgeted.sandbox.workspace
    first = budgeted.call("run", {"command": "head -c 40000000 /dev/zero > a.bin"}, 60)
    second = budgeted.call("run", {"command": "head -c 40000000 /dev/zero > b.bin"}, 60)
    assert first.endswith("[exit code 0]")
    assert second.endswith("limits hit: disk]") and "disk budget of 64 MB" in second  # the total counts
    assert (workspace / "a.bin").stat().st_size == 40_000_000 and not (workspace / "b.bin").exists()


def test_file_tools_refuse_writes_over_the_disk_budget(budgeted):
    workspace = budgeted.sandbox.workspace
    budgeted.call("run", {"command": "head -c 60000000 /dev/zero > a.bin"}, 60)
    refused = budgeted.call("write_file", {"path": "big.py", "content": "x" * 8_000_000}, 10)
    budgeted.call("write_file", {"path": "small.py", "content": "X = 1\n"}, 10)
    grown = budgeted.call("edit", {"path": "small.py", "old": "X = 1", "new": "X = '" + "x" * 8_000_000 + "'"}, 10)
    assert refused.startswith("error: big.py: writing 8000000 more bytes") and "disk budget" in refused
    assert grown.startswith("error: small.py: writing") and "disk budget" in grown
    assert not (workspace / "big.py").exists() and (workspace / "small.py").read_text() == "X = 1\n"


def test_head_tail():
    assert head_tail("short", 100) == "short"
    cut = head_tail("a" * 500 + "b" * 500, 200)
    assert cut.startswith("a" * 70) and cut.endswith("b" * 70) and "860 characters cut" in cut


def test_grep_numbers_lines_as_grep_and_sed_do_and_names_binary_files(tools):
    """Lines end at a line feed only: a form feed (a page break in old sources) or a U+2028 in a
    string literal starts no line. A binary file's matches are named, not printed as text."""
    workspace = tools.sandbox.workspace
    (workspace / "paged.py").write_text("x = 1\n\x0c\ndef f():\n    return 'a\u2028b'  # TODO\nTODO = 2\r\n")
    (workspace / "lib.so").write_bytes(b"\x7fELF\x00\x01\x1b[31m TODO\n")
    assert tools.call("grep", {"pattern": "TODO( = 2)?$", "path": "."}, 10) == (
        "lib.so: binary file matches\npaged.py:4:    return 'a\u2028b'  # TODO\npaged.py:5:TODO = 2\n"
        "pkg/util.py:2:    return 41  # TODO"
    )


def test_read_file_of_a_huge_file_holds_only_what_it_shows(tools):
    """A log of hundreds of megabytes (within the disk budget) is read without holding it whole
    in the harness's process, and shows exactly what the whole text cut by `head_tail` shows."""
    import tracemalloc

    text = "".join(f"line {i} \u00e9\n" for i in range(400_000))  # 5 MB
    (tools.sandbox.workspace / "big.log").write_text(text)
    tracemalloc.start()
    try:
        shown = tools.call("read_file", {"path": "big.log"}, 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert shown == head_tail(text, tools.max_chars)
    assert peak < 1_000_000  # the text alone is 5 MB
    (tools.sandbox.workspace / "small.txt").write_text("a\u00e9b\n")
    assert tools.call("read_file", {"path": "small.txt"}, 10) == "a\u00e9b\n"
