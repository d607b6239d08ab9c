"""The task record: a superset of the SWE-bench record (see docs/architecture.md, "Task").

Everything the grader needs lives here; the parts the agent must never see (hidden tests,
reference solution) are kept out of the rollout sandbox by the code that builds it.
"""

from __future__ import annotations

import math
import shlex
from pathlib import PurePosixPath
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from whetstone.config import Config

TASK_FORMAT_VERSION = 1
Split = Literal["train", "heldout"]
"""Dataset splits: `train` tasks are trained on, `heldout` tasks only evaluate."""


FILE_MAPS = ("repo_files", "hidden_tests", "solution_files")
"""The fields that give files as {relative path: text}; all are written into one workspace."""


def _writable(text: str) -> bool:
    """Whether `text` can be written as a file's name or content: UTF-8, with the bytes of a file
    read with surrogateescape kept as they were (`sandbox.templates.write_files`)."""
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def _check_paths(files: dict[str, str], info: ValidationInfo) -> dict[str, str]:
    """Paths in the file maps must be what a workspace reads back: relative, inside the repository,
    and normalized (`a/b.py`, not `./a/b.py`, `a//b.py` or `a/b.py/`); an untouched file under
    another spelling would show up as deleted, which for a test is flagged as cheating. No path may
    be a file in one place and a directory in another (`a` and `a/b.py`), within a map or across
    them, since all of them are written into one tree."""
    what = f"task {info.data['id']!r}: {info.field_name}" if "id" in info.data else str(info.field_name)
    for name in files:
        path = PurePosixPath(name)
        if path.is_absolute() or ".." in path.parts:
            raise ValueError(f"{what}: path {name!r} must be relative and stay inside the repository")
        if not path.parts:
            raise ValueError(f"{what}: path {name!r} names no file")
        if path.as_posix() != name:
            raise ValueError(f"{what}: path {name!r} is not normalized (write {path.as_posix()!r})")
        for part, text in (("path", name), ("text", files[name])):
            if not _writable(text):
                raise ValueError(
                    f"{what}: the {part} of {name!r} holds a character no file can hold (a lone surrogate, as "
                    "JSON can escape half of an emoji): fix the task's text"
                )
    owners = {name: field for field in FILE_MAPS if field != info.field_name for name in info.data.get(field, {})}
    owners.update(dict.fromkeys(files, info.field_name))

    def named(path: str) -> str:
        return repr(path) if owners[path] == info.field_name else f"{path!r} (in {owners[path]})"

    for name, field in owners.items():
        for parent in PurePosixPath(name).parents[:-1]:
            if (clash := parent.as_posix()) in owners and info.field_name in (field, owners[clash]):
                raise ValueError(f"{what}: {named(clash)} is a file, but {named(name)} needs it to be a directory")
    return files


class Task(Config):
    """One coding task. Files are given as {relative path: text}."""

    format_version: int = TASK_FORMAT_VERSION
    """Version of this record's layout; bumped on incompatible changes."""
    id: str = Field(min_length=1)
    """Unique task id, e.g. `synth/train/s0-00017`."""
    source: str = "custom"
    """Which task source made it: synth, repofix, mutate, humaneval, swebench, custom."""
    split: Split = "train"
    """Dataset split: `train` or `heldout` (evaluation only)."""
    kind: Literal["synthesis", "bugfix"] = "synthesis"
    """`bugfix` tasks must fail their hidden tests before the fix; `synthesis` tasks start empty."""
    instruction: str = Field(min_length=1)
    """The problem statement the agent sees."""
    repo_files: dict[str, str] = {}
    """The repository snapshot the agent starts from (visible tests included)."""
    repo_path: str | None = None
    """Alternatively, a local directory holding the snapshot (large repositories)."""
    base_commit: str | None = None
    """SWE-bench provenance; the rollout repository never carries history beyond it."""
    setup: list[str] = []
    """Shell commands run in the sandbox before the agent starts (no network)."""
    visible_tests: list[str] = []
    """Paths (inside the repository: files, or directories holding files) of tests the agent may
    run with `run_tests`."""
    hidden_tests: dict[str, str] = {}
    """Test files added only at grading time, in a fresh sandbox; this or `fail_to_pass` is
    required. Never shown to the agent."""
    solution_files: dict[str, str] = {}
    """Reference solution as whole files to overwrite; this or `solution_patch` is needed to
    validate the task. Never shown to the agent."""
    solution_patch: str | None = None
    """Reference solution as a unified diff (SWE-bench `patch`), if not given as files."""
    fail_to_pass: list[str] = []
    """Test ids that must go from failing to passing (pytest node ids, or for a custom
    `test_command` ids of its JUnit report's testcases, which validation requires); if empty,
    every test in `hidden_tests` must pass."""
    pass_to_pass: list[str] = []
    """Test ids that must keep passing."""
    test_command: str = "python -m pytest -q -p no:cacheprovider"
    """Command that runs the tests; test ids are appended. A command other than pytest must write
    a JUnit XML report to the file `$WHETSTONE_JUNIT_XML` names: its testcases are the results."""
    time_limit_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    """Wall-clock limit for a whole rollout on this task, in seconds (finite)."""
    test_time_limit_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    """Wall-clock limit for one test run (and for each setup command), in seconds (finite)."""
    protected_paths: list[str] = []
    """Glob patterns the agent must not change (tests, fixtures); changes are flagged as cheating."""
    rubric: str | None = None
    """Optional grading rubric for an LLM judge."""
    difficulty: int = Field(0, ge=0)
    """Source-specific difficulty level (0 = easiest)."""
    metadata: dict[str, str | int | float | bool] = {}
    """Free-form provenance: mutation operator, original module, seed (numbers finite)."""

    _check_file_paths = field_validator(*FILE_MAPS)(lambda cls, v, info: _check_paths(v, info))

    @field_validator("id")
    @classmethod
    def _id_not_blank(cls, task_id: str) -> str:
        """An id names the task everywhere (its folder, logs, reports): spaces alone name nothing."""
        if not task_id.strip():
            raise ValueError(f"id {task_id!r} is blank: give the task an id, e.g. 'source/name'")
        return task_id

    @field_validator("metadata")
    @classmethod
    def _finite_metadata(cls, metadata: dict[str, str | int | float | bool]) -> dict[str, str | int | float | bool]:
        """JSON has no NaN or infinity (Python's reader takes them): a task holding one would be
        written out as null and could not be read back."""
        for key, value in metadata.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{key!r}: {value} is not a finite number")
        return metadata

    @property
    def pytest_args(self) -> list[str] | None:
        """The arguments of `test_command` when it runs pytest (`python -m pytest ...`,
        `pytest ...`), else None: a custom command, whose results come from its JUnit report."""
        argv = shlex.split(self.test_command)
        if len(argv) >= 3 and PurePosixPath(argv[0]).name.startswith("python") and argv[1:3] == ["-m", "pytest"]:
            return argv[3:]
        if argv and argv[0] in ("pytest", "py.test"):
            return argv[1:]
        return None

    @model_validator(mode="after")
    def _one_snapshot(self) -> "Task":
        if self.repo_files and self.repo_path:
            raise ValueError("give the repository as repo_files or repo_path, not both")
        if not self.hidden_tests and not self.fail_to_pass:
            raise ValueError("a task needs hidden_tests or fail_to_pass tests to be graded")
        if problem := self.unlisted_custom_tests():
            raise ValueError(problem)
        return self

    def unlisted_custom_tests(self) -> str | None:
        """Why a custom `test_command` without fail_to_pass ids cannot be graded (None when the
        task runs pytest or lists them): every testcase of its JUnit report would count, so a
        report that leaves the hidden tests out would pass. Checked when a task loads (so also
        where `validate_tasks` is off) and again by validation (a task copied without checks)."""
        if self.fail_to_pass:
            return None
        try:
            custom = self.pytest_args is None
        except ValueError as err:  # shlex: an unclosed quote
            return f"test_command {self.test_command!r} is not a command line: {err}"
        if custom:
            return (
                "a custom test_command needs fail_to_pass ids: without them every testcase of its JUnit report "
                "counts, so a run whose report leaves out the hidden tests' testcases passes; list the ids of "
                'the testcases that must pass (docs/tasks.md, "Custom test commands")'
            )
        return None

    @field_validator("visible_tests")
    @classmethod
    def _visible_tests_exist(cls, tests: list[str], info: ValidationInfo) -> list[str]:
        """Checked against `repo_files` here; a `repo_path` snapshot is read only at validation."""
        if info.data.get("repo_path") is None and (
            missing := missing_visible_tests(tests, info.data.get("repo_files", {}))
        ):
            raise ValueError(f"{', '.join(map(repr, missing))}: no such file in repo_files")
        return tests


def missing_visible_tests(visible_tests: list[str], files: dict[str, str]) -> list[str]:
    """The visible tests that name neither a file of the repository nor a directory holding one
    (a pytest node id, `path::test`, is checked by its path)."""

    def present(test: str) -> bool:
        path = test.split("::")[0].rstrip("/")
        return path in files or any(name.startswith(path + "/") for name in files)

    return [test for test in visible_tests if not present(test)]
