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

The reference solution is what the agent writes, so build these only from validated tasks (whose
reference passes every test, as the run_tests turn says). Held-out tasks are refused: showing
them to the model in mid-training would leak the evaluation.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from whetstone.envs import prompts
from whetstone.envs.task import Task
from whetstone.errors import WhetstoneError

Message = dict[str, Any]


def visible_test_ids(task: Task) -> list[str]:
    """The graded test ids that live in the task's visible test files."""
    visible = set(task.visible_tests)
    return [test_id for test_id in task.fail_to_pass + task.pass_to_pass if test_id.split("::")[0] in visible]


def _minimal_edit(old: str, new: str) -> tuple[str, str]:
    """The smallest (old, new) line block turning `old` into `new`, with context lines added on
    both sides until the old block occurs exactly once (the `edit` tool needs a unique match)."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    changed = [op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]
    i1, i2, j1, j2 = changed[0][1], changed[-1][2], changed[0][3], changed[-1][4]
    while True:
        before = "".join(a[i1:i2])
        if (before and old.count(before) == 1) or (i1 == 0 and i2 == len(a)):
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


def demonstration(task: Task) -> list[Message]:
    if task.split != "train":
        raise WhetstoneError(f"task {task.id}: demonstrations are made from the train split only (split={task.split!r})")
    if not task.solution_files:
        raise WhetstoneError(f"task {task.id}: no reference solution files to demonstrate")
    messages: list[Message] = [
        {"role": "system", "content": prompts.SYSTEM_PROMPT},
        {"role": "user", "content": prompts.first_user_message(task)},
    ]
    calls = _solve_calls(task)
    if task.visible_tests:
        passed = {test_id: "passed" for test_id in visible_test_ids(task)}
        calls.append(("run_tests", {}, prompts.run_tests_result(passed)))
    for number, (name, arguments, result) in enumerate(calls, 1):
        call_id = f"call_{number}"
        messages.append(prompts.tool_call(call_id, name, **arguments))
        messages.append(prompts.tool_message(call_id, result))
    messages.append(prompts.tool_call(f"call_{len(calls) + 1}", "submit"))
    return messages


def demonstrations(tasks: Iterable[Task]) -> list[list[Message]]:
    """One transcript per task (train split only; see the module docstring)."""
    return [demonstration(task) for task in tasks]
