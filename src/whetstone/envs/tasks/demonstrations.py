"""Demonstrations for mid-training: chat transcripts of an agent solving train tasks with tools.

Each transcript is OpenAI-shaped messages (role, content, tool_calls) using the harness's own
system prompt, tool schema and tool-result texts (envs/prompts.py):

    system     SYSTEM_PROMPT
    user       the instruction and the top-level files
    assistant  write_file(solution.py, ...)      (synthesis)  or  read_file + edit  (bugfix)
    tool       wrote solution.py (4 lines)
    assistant  run_tests()
    tool       3 passed
    assistant  submit()

A recovery demonstration starts with a failed attempt and the real output of run_tests on it from
a sandbox, the text the harness would show; then the fix, run_tests and submit. The attempt is
either a *slip*, one token changed in the reference solution (`mutations.py`: an off-by-one
constant, a swapped operator), or a *misread*, the reference solution of another task with the
same input type: the instruction read wrong, the failure a small model's own first attempts
mostly show. The attempt carries `"weight": 0` (rendered, not trained on): the model learns to
read a failure and write what the instruction asks, not to make the mistake.

The reference solution is what the agent writes, so build these only from validated tasks (whose
reference passes every test, as the run_tests turn says). Held-out tasks are refused: showing
them to the model in mid-training would leak the evaluation.
"""

from __future__ import annotations

import difflib
import hashlib
import random
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from whetstone.envs import prompts
from whetstone.envs.task import Task
from whetstone.envs.tasks.mutations import mutation_sites
from whetstone.errors import WhetstoneError
from whetstone.utils.progress import progress_bar

Message = dict[str, Any]


def visible_test_ids(task: Task) -> list[str]:
    """The graded test ids that the task's visible tests run: those in a visible file or under a
    visible directory (`Task.visible_tests` names either), and those a visible pytest node id
    (`path::test`) selects: itself, its parameters, or the tests of a class."""

    def visible(test_id: str) -> bool:
        path = test_id.split("::")[0]
        for entry in task.visible_tests:
            if "::" in entry:
                if test_id == entry or test_id.startswith((entry + "::", entry + "[")):
                    return True
            elif path == entry.rstrip("/") or path.startswith(entry.rstrip("/") + "/"):
                return True
        return False

    return [test_id for test_id in task.fail_to_pass + task.pass_to_pass if visible(test_id)]


def _occurs_once(text: str, block: str) -> bool:
    """Whether `block` starts at exactly one place in `text`, overlapping places counted: the
    `edit` tool counts without overlap and replaces the first, which need not be this one."""
    first = text.find(block)
    return first >= 0 and text.find(block, first + 1) < 0


def _minimal_edit(old: str, new: str) -> tuple[str, str]:
    """The smallest (old, new) line block turning `old` into `new`, with context lines added on
    both sides until the old block occurs exactly once (the `edit` tool needs a unique match)."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    changed = [op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]
    i1, i2, j1, j2 = changed[0][1], changed[-1][2], changed[0][3], changed[-1][4]
    while True:
        before = "".join(a[i1:i2])
        if (before and _occurs_once(old, before)) or (i1 == 0 and i2 == len(a)):
            return before, "".join(b[j1:j2])
        if i1 > 0:  # lines outside the changed span are equal in both files
            i1, j1 = i1 - 1, j1 - 1
        if i2 < len(a):
            i2, j2 = i2 + 1, j2 + 1


def _solve_calls(task: Task) -> list[tuple[str, dict[str, str], str]]:
    """(tool, arguments, result) for each step of writing the reference solution."""
    calls = []
    for path, content in sorted(task.solution_files.items()):
        original = task.repo_files.get(path)
        if not original or task.kind == "synthesis":
            calls.append(("write_file", {"path": path, "content": content}, prompts.write_result(path, content)))
            continue
        if original == content:
            continue
        old, new = _minimal_edit(original, content)
        calls.append(("read_file", {"path": path}, original))
        calls.append(("edit", {"path": path, "old": old, "new": new}, prompts.edit_result(path)))
    return calls


@dataclass(frozen=True)
class FailedAttempt:
    path: str
    content: str
    """The slipped solution the agent first writes."""
    test_output: str
    """run_tests on it, exactly as the harness's tool answers."""


def demonstration(task: Task, attempt: FailedAttempt | None = None) -> list[Message]:
    _check_train(task)
    if not task.solution_files:
        raise WhetstoneError(f"task {task.id}: no reference solution files to demonstrate")
    messages: list[Message] = [
        {"role": "system", "content": prompts.SYSTEM_PROMPT},
        {"role": "user", "content": prompts.first_user_message(task)},
    ]
    if attempt is not None:
        calls = [
            (
                "write_file",
                {"path": attempt.path, "content": attempt.content},
                prompts.write_result(attempt.path, attempt.content),
            ),
            ("run_tests", {}, attempt.test_output),
        ]
        slip = _transcribe(calls, first_number=1)
        slip[0]["weight"] = 0  # the wrong write_file itself is not trained on
        messages += slip
        number = len(calls) + 1
    else:
        number = 1
    calls = _solve_calls(task)
    if task.visible_tests:
        passed = {test_id: "passed" for test_id in visible_test_ids(task)}
        calls.append(("run_tests", {}, prompts.run_tests_result(passed)))
    messages += _transcribe(calls, first_number=number)
    messages.append(prompts.tool_call(f"call_{number + len(calls)}", "submit"))
    return messages


def _check_train(task: Task) -> None:
    if task.split != "train":
        raise WhetstoneError(
            f"task {task.id}: demonstrations are made from the train split only (split={task.split!r})"
        )


def _transcribe(calls: list[tuple[str, dict[str, str], str]], first_number: int) -> list[Message]:
    messages = []
    for number, (name, arguments, result) in enumerate(calls, first_number):
        call_id = f"call_{number}"
        messages.append(prompts.tool_call(call_id, name, **arguments))
        messages.append(prompts.tool_message(call_id, result))
    return messages


AttemptKind = Literal["slip", "misread"]


def failed_attempt(
    task: Task, max_chars: int, seed: int = 0, kind: AttemptKind = "slip", peers: Iterable[Task] = ()
) -> FailedAttempt | None:
    """A wrong version of the task's (one-file) reference solution that fails a visible test, with
    the real run_tests output from a sandbox; None when no candidate fails one. `kind` picks the
    candidates (module docstring): slips of the file, or the solutions of `peers` whose
    `metadata["input_type"]` is the task's."""
    from whetstone.envs.harness.tools import Tools  # the harness's own tool: the text it shows
    from whetstone.envs.sandbox import open_sandbox

    if len(task.solution_files) != 1 or not task.visible_tests or task.setup:
        return None  # one file to get wrong, tests to show it, and no setup commands to replay
    ((path, content),) = task.solution_files.items()
    if kind == "slip":
        slips = [m for m in mutation_sites(content) if m.operator != "return_none"]  # not a plausible slip
        candidates = [slip.apply(content) for slip in slips]
    else:  # a peer's own solution of this file, where it differs (the task itself never does)
        input_type = task.metadata.get("input_type")
        same_type = [p for p in peers if input_type is not None and p.metadata.get("input_type") == input_type]
        candidates = [p.solution_files[path] for p in same_type if p.solution_files.get(path, content) != content]
    random.Random(f"{seed}:{task.id}").shuffle(candidates)
    for candidate in candidates[:3]:
        files = {**task.repo_files, path: candidate}
        sandbox = open_sandbox(files)
        try:
            output = Tools(sandbox, task, max_chars, task.test_time_limit_s).run_tests(task.test_time_limit_s)
        finally:
            sandbox.close()
        if output.startswith(("FAILED", "ERROR")):
            return FailedAttempt(path, candidate, output)
    return None


def demonstrations(
    tasks: Iterable[Task],
    recovery_fraction: float = 0.0,
    max_chars: int = 2048,
    seed: int = 0,
    workers: int = 2,
    attempt: AttemptKind = "slip",
) -> list[list[Message]]:
    """One transcript per task (train split only; see the module docstring). A `recovery_fraction`
    of them, picked by a hash of the task id, open with a failed attempt of kind `attempt` (its
    tests run in sandboxes, `workers` at a time; `max_chars` bounds the test output as the harness's
    tool does; a misread takes another of `tasks`' solutions)."""
    tasks = list(tasks)
    for task in tasks:
        _check_train(task)  # before any sandbox work
    picked = [t for t in tasks if _share(f"{seed}:{t.id}") < recovery_fraction]
    attempts: dict[str, FailedAttempt | None] = {}
    if picked:
        by_type: dict[object, list[Task]] = {}  # a misread's peers: one pass, not one per picked task
        for task in tasks:
            by_type.setdefault(task.metadata.get("input_type"), []).append(task)

        def make(task: Task) -> FailedAttempt | None:
            return failed_attempt(task, max_chars, seed, attempt, by_type[task.metadata.get("input_type")])

        with ThreadPoolExecutor(workers) as pool, progress_bar(len(picked), "failed attempts", "task") as bar:
            for task, attempt_made in zip(picked, pool.map(make, picked)):
                attempts[task.id] = attempt_made
                bar.update(1)
    return [demonstration(task, attempts.get(task.id)) for task in tasks]


def _share(key: str) -> float:
    """A stable number in [0, 1) for `key`."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
