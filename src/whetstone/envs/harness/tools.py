"""The agent's tools over a sandbox: exactly the names, arguments and result texts of
`envs/prompts.py`, which the mid-training demonstrations also use.

A call the harness cannot run (unknown tool, missing or unexpected arguments, an argument that
is not valid UTF-8, a command holding a NUL character) raises `ToolCallError` and counts as an
invalid tool call; a call that runs but fails (no such file, an edit whose text is not unique)
answers with an error text like any other result.
`submit` is handled by the agent loop: it ends the rollout.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from whetstone.envs import prompts
from whetstone.envs.grading.grade import JUNIT_VARIABLE
from whetstone.envs.grading.in_sandbox import plain_tests
from whetstone.envs.harness.workspace import ToolError, Workspace, head_tail
from whetstone.envs.sandbox import RunResult, Sandbox
from whetstone.envs.task import Task

PARAMETERS = {tool["function"]["name"]: list(tool["function"]["parameters"]["properties"]) for tool in prompts.TOOLS}
PLAIN_TESTS_SOURCE = Path(plain_tests.__file__).read_text()
"""Run with `python -c`, so no file of it sits in (or is mounted into) the rollout's sandbox."""
SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+$", re.MULTILINE)
FRAME_LINE = re.compile(r"^(\S[^:]*):\d+: in ")
"""A traceback frame of `--tb=short`: `path:line: in function`, its source lines indented below."""
FAILURE_HEADER = re.compile(r"^_{3,} .+ _{3,}$\n?", re.MULTILINE)
"""The line opening each failure's (or collection error's) traceback."""
SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (\S+)|^(SKIPPED) \[\d+\] ([^\s:]+:\d+)")


class ToolCallError(Exception):
    """A call that cannot be run as written; counts against the rollout."""


def check_call(name: str, arguments: Any) -> dict[str, str]:
    """The call's arguments, if `name` is a tool and they are exactly its (string) parameters."""
    if name not in PARAMETERS:
        raise ToolCallError(f"unknown tool {name!r}; the tools are {', '.join(PARAMETERS)}")
    if not isinstance(arguments, dict):
        raise ToolCallError(f"{name}: arguments must be an object")
    expected = PARAMETERS[name]
    missing = [key for key in expected if key not in arguments]
    unexpected = [key for key in arguments if key not in expected]
    if missing or unexpected:
        problems = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unexpected {', '.join(unexpected)}"] if unexpected else []
        )
        raise ToolCallError(f"{name}({', '.join(expected)}): {'; '.join(problems)}")
    for key, value in arguments.items():
        if not isinstance(value, str):
            raise ToolCallError(f"{name}: argument {key} must be a string, got {type(value).__name__}")
        try:  # JSON's escapes can spell a lone surrogate ("\\ud800"): no file or command can hold one
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ToolCallError(
                f"{name}: argument {key} is not valid UTF-8 text ({err.reason}, at character {err.start})"
            ) from None
    if name == "run" and "\0" in arguments["command"]:  # no command line can hold one: the OS refuses it
        position = arguments["command"].index("\0")
        raise ToolCallError(f"run: argument command holds a NUL character (at character {position}); remove it")
    return arguments


class Tools:
    """The tools of one rollout. Blocking: the agent loop runs them in a worker thread."""

    def __init__(self, sandbox: Sandbox, task: Task, max_chars: int, run_timeout_s: float):
        self.sandbox = sandbox
        self.task = task
        self.files = Workspace(sandbox.workspace, sandbox.workdir, max_chars, sandbox.disk_left)
        self.max_chars = max_chars
        self.run_timeout_s = run_timeout_s

    def call(self, name: str, arguments: dict[str, str], time_left_s: float) -> str:
        """The result text of a checked call (see `check_call`); tool failures are results too."""
        try:
            if name == "run":
                return self.run(arguments["command"], min(self.run_timeout_s, time_left_s))
            if name == "run_tests":
                return self.run_tests(min(self.task.test_time_limit_s, time_left_s))
            return getattr(self.files, name)(**arguments)
        except ToolError as err:
            return f"error: {err}"
        except OSError as err:  # e.g. writing under a path that is a file
            return f"error: {err.strerror or type(err).__name__}: {arguments.get('path', '')}"

    def run(self, command: str, timeout_s: float) -> str:
        result = self.sandbox.run(command, timeout_s=max(timeout_s, 0.1))
        return head_tail(result.stdout + result.stderr, self.max_chars) + _status(result, timeout_s)

    def run_tests(self, timeout_s: float) -> str:
        task = self.task
        if not task.visible_tests:
            return "error: this repository has no visible tests"
        pytest = task.pytest_args is not None
        result = self._plain_run(timeout_s) if pytest else None
        if result is None:  # not plain (or a custom test command): pytest or the command itself
            command = f"{task.test_command}{' -rA --tb=short' if pytest else ''} {shlex.join(task.visible_tests)}"
            # a custom command writes a JUnit report for grading; here nothing reads it
            env = None if pytest else {JUNIT_VARIABLE: "/dev/null"}
            result = self.sandbox.run(command, timeout_s=max(timeout_s, 0.1), env=env)
        output = result.stdout + result.stderr
        outcomes = _pytest_outcomes(output) if pytest else {}
        if not outcomes:  # a custom command, or pytest stopped before reporting any test
            return head_tail(output, self.max_chars) + _status(result, timeout_s)
        failed = result.exit_code != 0 or any(outcome != "passed" for outcome in outcomes.values())
        details = (
            head_tail(_failure_details(output, self.sandbox.workdir), self.max_chars) + _status(result, timeout_s)
            if failed
            else ""
        )
        return prompts.run_tests_result(outcomes, details.strip())

    def _plain_run(self, timeout_s: float) -> RunResult | None:
        """The visible tests run by `plain_tests.py` (pytest's report shape, without starting
        pytest), or None when the run is not plain and pytest must run it."""
        args = [*self.task.pytest_args, *self.task.visible_tests]
        if plain_tests.plan(args, str(self.sandbox.workspace)) is None:  # read here: no sandbox started for it
            return None
        result = self.sandbox.run(["python", "-c", PLAIN_TESTS_SOURCE, *args], timeout_s=max(timeout_s, 0.1))
        if result.exit_code == plain_tests.NOT_PLAIN and not result.timed_out:
            return None
        return result  # a time-out too: pytest would run the same code into the same limit


def _status(result: RunResult, timeout_s: float) -> str:
    if result.timed_out:
        return f"\n[timed out after {timeout_s:g} s]"
    limits = f", limits hit: {', '.join(result.limits_hit)}" if result.limits_hit else ""
    return f"\n[exit code {result.exit_code}{limits}]"


def _pytest_outcomes(output: str) -> dict[str, str]:
    """Test id -> outcome from pytest's `-rA` short summary."""
    header = SUMMARY_HEADER.search(output)
    if header is None:
        return {}
    outcomes = {}
    for line in output[header.end() :].splitlines():
        match = SUMMARY_LINE.match(line)
        if match:
            kind, test_id = (match[1], match[2]) if match[1] else (match[3], match[4])
            outcomes[test_id] = {"XFAIL": "xfailed", "XPASS": "xpassed"}.get(kind, kind.lower())
    return outcomes


def _failure_details(output: str, workdir: str) -> str:
    """The first failure's short traceback (`--tb=short`: the failing line and the assertion), or
    the output before the summary when there is none. One failure is what an agent acts on next;
    the list above it names the others, and `run` shows everything."""
    header = SUMMARY_HEADER.search(output)
    before = output[: header.start()] if header else output
    sections = FAILURE_HEADER.split(before)
    if len(sections) > 1:
        return _without_foreign_frames(sections[1], workdir).strip("\n")
    return re.sub(r"^=+ PASSES =+$\n?", "", before, flags=re.MULTILINE)


def _without_foreign_frames(traceback: str, workdir: str) -> str:
    """The traceback without frames outside the repository (pytest's importer, the standard
    library: an absolute path or `<frozen ...>` not under the workspace) and without `^^^` lines."""
    kept, keep = [], True
    for line in traceback.splitlines():
        frame = FRAME_LINE.match(line)
        if frame:
            path = frame[1]
            keep = not (
                path.startswith("<") or (path.startswith("/") and not path.startswith(workdir.rstrip("/") + "/"))
            )
        elif not line.startswith(" "):
            keep = True  # an `E ...` line or a message: always shown
        elif not line.strip(" ^~"):
            continue  # Python's position markers under a source line: tokens that say little
        if keep:
            kept.append(line)
    return "\n".join(kept)
