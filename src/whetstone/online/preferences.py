"""How a reply to a task is judged: by the gate (a held-out metric) and by simulated users (their
hidden taste). A reply is the assistant's text for the task's first user turn, as a user gets it
from /v1/chat/completions without `tools` (tool calls stay in the text, as the model wrote them).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any

from whetstone.envs.prompts import SYSTEM_PROMPT, first_user_message
from whetstone.envs.task import Task
from whetstone.online.config import PreferenceConfig
from whetstone.tokenizer import parse_assistant


def task_messages(task: Task) -> list[dict[str, Any]]:
    """The conversation a user opens for `task`: the harness's system prompt and first message."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": first_user_message(task)}]


def written_files(reply: str) -> dict[str, str]:
    """{path: content} of the reply's well-formed write_file calls (the last one per path wins)."""
    files: dict[str, str] = {}
    for call in parse_assistant(reply)[1]:
        function = call["function"]
        if function["name"] != "write_file":
            continue
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            continue
        path, content = arguments.get("path"), arguments.get("content")
        if isinstance(path, str) and isinstance(content, str):
            files[path] = content
    return files


class Preference(ABC):
    @abstractmethod
    def likes(self, task: Task, reply: str) -> bool: ...


class PassesTests(Preference):
    """The files the reply writes make the task's hidden tests pass (the real grader, in a sandbox)."""

    def likes(self, task: Task, reply: str) -> bool:
        from whetstone.envs.grading.grade import grade

        files = written_files(reply)
        return bool(files) and grade(task, files).passed


class MatchesPattern(Preference):
    """A style: the reply matches a regular expression."""

    def __init__(self, pattern: str):
        self.pattern = re.compile(pattern)

    def likes(self, task: Task, reply: str) -> bool:
        return self.pattern.search(reply) is not None


def make_preference(config: PreferenceConfig) -> Preference:
    return PassesTests() if config.kind == "passes_tests" else MatchesPattern(config.pattern)
