"""Task validation: a task is used only if its tests can tell a solution from no solution.

Each check really runs in sandboxes, through the same `grade()` that scores rollouts:

1. the reference solution passes every graded test and raises no cheat flag (a failing setup
   command, tests that time out or hit another sandbox limit are reported as such);
2. the starting repository does not: for `bugfix` tasks at least one FAIL_TO_PASS test fails
   (the injected bug is real); for `synthesis` tasks the ungraded repository fails the tests.

Tasks that fail are reported with the reason and skipped, never silently used. Results can be
cached by the task's content hash under the grader's fingerprint (validation_cache.py), so a
fixed task set is validated once, not on every run, and again once the grader changes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from whetstone.config import expand_path
from whetstone.envs.grading.grade import grade, pristine_files
from whetstone.envs.grading.reward import RewardConfig
from whetstone.envs.sandbox import SandboxUnavailableError
from whetstone.envs.task import Task, missing_visible_tests
from whetstone.envs.tasks.bugs import listed
from whetstone.envs.tasks.io import Record
from whetstone.envs.tasks.patches import apply_patch_to_task
from whetstone.envs.tasks.validation_cache import SnapshotDigests, grader_fingerprint, load_cache, task_hash
from whetstone.errors import WhetstoneError
from whetstone.utils.atomic import atomic_write_json
from whetstone.utils.progress import progress_bar


@dataclass
class ValidationReport:
    total: int = 0
    valid: list[Task] = field(default_factory=list)
    invalid: list[dict[str, str]] = field(default_factory=list)
    """[{"id": task id (or the record's location), "reason": why}]"""

    def to_json(self) -> dict:
        return {"total": self.total, "valid": len(self.valid), "invalid": self.invalid}


def _not_passed(tests: dict[str, str], wanted: list[str]) -> list[str]:
    return [test_id for test_id in wanted if tests.get(test_id) != "passed"]


def reference_changes(task: Task) -> dict[str, str | None]:
    """The reference solution as changes to the repository (a SWE-bench patch is applied here)."""
    if task.solution_files:
        return dict(task.solution_files)
    if task.solution_patch:
        return dict(apply_patch_to_task(task, task.solution_patch))
    return {}


def check_task(task: Task, reward_config: RewardConfig | None = None) -> str | None:
    """None if the task is valid, else the reason it is not."""
    config = reward_config or RewardConfig()
    if problem := task.unlisted_custom_tests():
        return problem
    changes = reference_changes(task)
    if not changes:
        return "no reference solution (solution_files or solution_patch)"
    if task.repo_path is not None and (missing := missing_visible_tests(task.visible_tests, pristine_files(task))):
        return f"visible_tests: {', '.join(map(repr, missing))}: no such file in repo_path {task.repo_path}"
    solved = grade(task, changes, config)
    if solved.setup_failure:
        return f"the setup failed: {solved.setup_failure}"
    if "wall_clock" in solved.test_limits_hit:
        return f"the tests timed out after {task.test_time_limit_s:g} s (test_time_limit_s) with the reference solution"
    if solved.test_limits_hit:
        return f"the tests ran into the sandbox's {', '.join(solved.test_limits_hit)} limit with the reference solution"
    if solved.report_problem:
        return f"no test results with the reference solution: {solved.report_problem}"
    if solved.cheat_flags:
        return f"the reference solution is flagged as cheating: {', '.join(solved.cheat_flags)}"
    graded = task.fail_to_pass + task.pass_to_pass or list(solved.tests)
    failing = _not_passed(solved.tests, graded)
    if not solved.passed or failing or not solved.tests:
        detail = (
            f"tests not passing: {listed(failing, limit=5)}"
            if failing
            else f"reward {solved.reward}, log: {solved.log[-300:]!r}"
        )
        return f"the reference solution does not pass ({detail})"
    unsolved = grade(task, {}, config)
    if task.kind == "bugfix":
        if not _not_passed(unsolved.tests, task.fail_to_pass or list(unsolved.tests)):
            return "the unfixed repository already passes every FAIL_TO_PASS test (the bug is not caught)"
    elif unsolved.passed:
        return "the starting repository already passes the tests (nothing to solve)"
    return None


def validate_records(
    records: Iterable[Record],
    workers: int = 2,
    reward_config: RewardConfig | None = None,
    cache_path: str | Path | None = None,
) -> ValidationReport:
    """Validate every record (bad records are reported as invalid), `workers` tasks at a time,
    with a progress bar on stderr."""
    cache_file = expand_path(cache_path) if cache_path is not None else None
    grader = grader_fingerprint(reward_config) if cache_file is not None else ""
    cache = load_cache(cache_file, grader)  # before the records, which a generator may take minutes to make
    records = list(records)
    report = ValidationReport(total=len(records))
    digests = SnapshotDigests()

    def check(record: Record) -> str | None:
        assert record.task is not None
        try:  # without a cache file, no snapshot's bytes are read for a key nothing keeps
            key = task_hash(record.task, digests) if cache_file is not None else record.task.model_dump_json()
        except WhetstoneError as err:  # a snapshot folder that cannot be read: nothing to cache it under
            return str(err)
        if key not in cache:
            try:
                cache[key] = check_task(record.task, reward_config)
            except SandboxUnavailableError:
                raise  # the machine, not the task: stop with the sandbox's own explanation
            except Exception as err:  # one broken task must not stop the others
                cache[key] = f"validation crashed: {type(err).__name__}: {err}"
        return cache[key]

    readable = [record for record in records if record.task is not None]
    reasons: list[str | None] = []  # in the order of `readable`
    unreadable = len(records) - len(readable)
    with progress_bar(len(records), "validate tasks", "task") as bar:
        bar.update(unreadable, invalid=unreadable)  # unreadable records need no sandbox, and are invalid
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for reason in pool.map(check, readable):
                reasons.append(reason)
                bar.update(1, invalid=unreadable + sum(r is not None for r in reasons))
    pending = iter(reasons)
    for record in records:
        if record.task is None:
            report.invalid.append({"id": record.where, "reason": record.problem or "unreadable"})
        elif (reason := next(pending)) is None:
            report.valid.append(record.task)
        else:
            report.invalid.append({"id": record.task.id, "reason": reason})
    if cache_file is not None:
        atomic_write_json(cache_file, {"grader": grader, "verdicts": cache})
    return report


def validate_tasks(tasks: Iterable[Task], **kwargs) -> ValidationReport:
    return validate_records((Record(task.id, task=task) for task in tasks), **kwargs)


def valid_tasks(tasks: Iterable[Task], **kwargs) -> list[Task]:
    """Only the tasks that validate; the others are reported on stderr, never silently dropped."""
    report = validate_tasks(tasks, **kwargs)
    for item in report.invalid:
        print(f"skipping invalid task {item['id']}: {item['reason']}", file=sys.stderr)
    return report.valid
