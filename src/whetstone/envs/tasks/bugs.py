"""Bug injection shared by `mutate` and `repofix` (SWE-smith style).

Given a project as files, the modules bugs may go into and its test files: run the tests on the
pristine project, apply AST mutations one at a time, run the tests again, and keep a mutant only
if at least one test that passed now fails. Its FAIL_TO_PASS are those tests, its PASS_TO_PASS
every other test that passed. All runs go through `grade()` in sandboxes, so the test ids and
outcomes recorded here are exactly the ones the grader will check later.

The split of a bug is a fixed hash of the function it is in (`module.py:function`), so held-out
bugs sit in functions the train split never breaks.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import PurePosixPath

from whetstone.envs.grading.grade import grade
from whetstone.envs.grading.reward import RewardConfig
from whetstone.envs.task import Task
from whetstone.envs.tasks.mutations import Mutation, mutation_sites
from whetstone.errors import WhetstoneError
from whetstone.utils.python_source import parse_source

HELDOUT_BUCKETS = 4
HANG_FACTOR = 5.0
"""A mutant's test run may take this many times the pristine run's before it counts as hanging."""
MIN_MUTANT_LIMIT_S = 10.0
MAX_ERROR_CHARS = 200


@dataclass
class Bug:
    path: str
    mutation: Mutation
    function: str
    """`file.py:qualified.name` of the function the mutation is in (`file.py:<module>` outside any);
    no directory, so the same template function falls in the same split whatever its package name."""
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    log: str
    """The test output of the mutant, for the problem statement."""

    @property
    def split(self) -> str:
        return split_of(self.function)


def split_of(function: str) -> str:
    bucket = int(hashlib.sha256(function.encode()).hexdigest()[:8], 16) % HELDOUT_BUCKETS
    return "heldout" if bucket == 0 else "train"


def enclosing_function(source: str, line: int) -> str:
    """Qualified name of the innermost function or class around `line` ("<module>" if none)."""
    definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)

    def walk(node: ast.AST, names: list[str]) -> list[str]:
        for child in ast.iter_child_nodes(node):
            start, end = getattr(child, "lineno", None), getattr(child, "end_lineno", None)
            if start is not None and end is not None and start <= line <= end:
                return walk(child, names + [child.name] if isinstance(child, definitions) else names)
        return names

    return ".".join(walk(parse_source(source), [])) or "<module>"


def function_of(path: str, source: str, line: int) -> str:
    """`file.py:qualified.name` of the function around `line` of the module at `path` (`Bug.function`)."""
    return f"{PurePosixPath(path).name}:{enclosing_function(source, line)}"


def probe_task(files: dict[str, str], tests: list[str], test_command: str, test_time_limit_s: float) -> Task:
    """A task used only to run a project's own tests through the grader (no ids: all tests run)."""
    task = Task(
        id="probe",
        instruction="(run the project's tests)",
        repo_files=files,
        hidden_tests={path: files[path] for path in tests},
        test_time_limit_s=test_time_limit_s,
    )
    # A loaded task with a custom command must list its ids (`Task.unlisted_custom_tests`); the
    # probe lists none on purpose, so its command is set past that check.
    return task.model_copy(update={"test_command": test_command})


@dataclass
class ProjectRun:
    outcomes: dict[str, str]
    log: str
    seconds: float


def run_tests(probe: Task, changes: dict[str, str | None], reward_config: RewardConfig | None = None) -> ProjectRun:
    """Outcome per test id, the test output and the time taken, of the project plus `changes`."""
    start = time.perf_counter()
    result = grade(probe, changes, reward_config or RewardConfig())
    return ProjectRun(result.tests, result.log, time.perf_counter() - start)


def find_bugs(
    files: dict[str, str],
    sources: list[str],
    tests: list[str],
    *,
    rng: random.Random,
    want: int,
    max_tries: int,
    test_command: str,
    test_time_limit_s: float = 60.0,
    split: str | None = None,
    workers: int = 2,
    reward_config: RewardConfig | None = None,
) -> list[Bug]:
    """Up to `want` mutants (of `split`, if given) that break tests, trying at most `max_tries`."""
    candidates, unparsable = [], []
    for path in sources:
        try:
            sites = mutation_sites(files[path])
        except (SyntaxError, ValueError) as err:  # Python 2, a newer Python's syntax, a fixture meant to fail
            unparsable.append(f"{path} ({getattr(err, 'msg', err)})")
            continue
        for mutation in sites:
            candidates.append((path, mutation, function_of(path, files[path], mutation.line)))
    if unparsable:
        print(f"left out {len(unparsable)} files that do not parse as Python: {listed(unparsable)}", file=sys.stderr)
    rng.shuffle(candidates)
    if split is not None:
        candidates = [c for c in candidates if split_of(c[2]) == split]
    candidates = candidates[:max_tries]
    if not candidates:  # no function of the split (a repofix template's are all in the other one)
        return []
    probe = probe_task(files, tests, test_command, test_time_limit_s)
    baseline = run_tests(probe, {}, reward_config)
    passing = [test_id for test_id, outcome in baseline.outcomes.items() if outcome == "passed"]
    if not passing:
        raise WhetstoneError(f"no test passes on the unmutated project; test output:\n{baseline.log[-2000:]}")
    if probe.pytest_args is None:
        check_listed_ids(probe, passing, reward_config)
    # A mutant that loops forever would cost every later grading the whole time limit: mutants
    # get a few times the pristine run's time, and those that use it all are dropped.
    limit = min(test_time_limit_s, max(MIN_MUTANT_LIMIT_S, HANG_FACTOR * baseline.seconds))
    mutant_probe = probe.model_copy(update={"test_time_limit_s": limit})

    def attempt(candidate: tuple[str, Mutation, str]) -> Bug | None:
        path, mutation, function = candidate
        run = run_tests(mutant_probe, {path: mutation.apply(files[path])}, reward_config)
        broken = [test_id for test_id in passing if run.outcomes.get(test_id) != "passed"]
        if not broken or run.seconds >= limit:
            return None
        return Bug(path, mutation, function, broken, [t for t in passing if t not in broken], run.log)

    bugs: list[Bug] = []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for start in range(0, len(candidates), workers):  # in small batches, to stop once we have enough
            bugs += [bug for bug in pool.map(attempt, candidates[start : start + workers]) if bug]
            if len(bugs) >= want:
                break
    return bugs[:want]


def check_listed_ids(probe: Task, passing: list[str], reward_config: RewardConfig | None = None) -> None:
    """Raise a WhetstoneError unless a custom test command, run on the project with `passing` (ids
    of its JUnit report's testcases) appended as a task's grading runs it, passes them all. The
    probe runs it with the test files appended instead: a command that takes its arguments as
    paths (pytest under another name) ran the tests there and finds no file named by an id here,
    so none of its tasks would validate."""
    run = run_tests(probe.model_copy(update={"fail_to_pass": passing}), {}, reward_config)
    refused = [test_id for test_id in passing if run.outcomes.get(test_id) != "passed"]
    if refused:
        raise WhetstoneError(
            f"the test command {probe.test_command!r} passes the project's tests when given their files, but not "
            f"when given their ids, as a task's grading runs it: {listed(refused)} did not pass. A command that "
            "is not pytest gets the ids of its JUnit report's testcases appended; make it run the tests they "
            'name, or run the whole suite and leave them unused (docs/tasks.md, "Custom test commands"). '
            f"Test output:\n{run.log[-2000:]}"
        )


_ERROR_LINE = re.compile(r"^E\s+(.+)$")
_SECTION = re.compile(r"^_{3,} (.+?) _{3,}$")


def failure_line(log: str, test_id: str) -> str | None:
    """The first `E   ...` line pytest printed in the failure section of `test_id`, if any."""
    title = ".".join(test_id.split("::")[1:])  # pytest titles a failure `Class.test_name`
    inside = False
    for line in log.splitlines():
        section = _SECTION.match(line)
        if section:
            inside = section.group(1) == title
        elif inside and (error := _ERROR_LINE.match(line)):
            text = error.group(1).strip()
            return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
    return None


def bug_task(
    bug: Bug,
    files: dict[str, str],
    tests: list[str],
    *,
    task_id: str,
    source: str,
    instruction: str,
    test_command: str,
    test_time_limit_s: float = 60.0,
    metadata: dict | None = None,
) -> Task:
    """The bug-fix task for `bug`: the mutant repository, its tests visible, pristine tests hidden."""
    return Task(
        id=task_id,
        source=source,
        split=bug.split,
        kind="bugfix",
        instruction=instruction,
        repo_files={**files, bug.path: bug.mutation.apply(files[bug.path])},
        visible_tests=tests,
        # The pristine tests go back in at grading, so editing the visible copies gains nothing.
        hidden_tests={path: files[path] for path in tests},
        solution_files={bug.path: files[bug.path]},
        fail_to_pass=bug.fail_to_pass,
        pass_to_pass=bug.pass_to_pass,
        test_command=test_command,
        test_time_limit_s=test_time_limit_s,
        protected_paths=list(tests),
        metadata={
            "mutation": bug.mutation.describe(),
            "operator": bug.mutation.operator,
            "function": bug.function,
            **(metadata or {}),
        },
    )


def listed(test_ids: list[str], limit: int = 3) -> str:
    more = f" and {len(test_ids) - limit} more" if len(test_ids) > limit else ""
    return ", ".join(test_ids[:limit]) + more
