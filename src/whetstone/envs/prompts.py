"""The one system prompt, tool schema and tool-result texts shared by the agent harness and the
mid-training demonstrations, so that what the model practises is exactly what it will meet.

Kept short on purpose: the embedded default's tiny model has a small context, and an easy
demonstration (system + task + three tool calls) must fit in about 512 tokens. The system prompt
already lists the tools in one line each; a chat renderer for that model should not append the
JSON schemas as well (they are for OpenAI-compatible servers, which take them as `tools`).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from whetstone.envs.task import Task
from whetstone.tokenizer import defuse_markup


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    """An OpenAI function schema whose parameters are all required strings."""
    properties = {key: {"type": "string", "description": text} for key, text in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(params)},
        },
    }


TOOLS: list[dict[str, Any]] = [
    _tool("read_file", "Show a file.", path="file path"),
    _tool("list_dir", "List a directory.", path="directory path"),
    _tool("grep", "Find lines matching a regex.", pattern="regex", path="file or directory"),
    _tool("write_file", "Create or overwrite a file.", path="file path", content="whole new text"),
    _tool("edit", "Replace a unique string in a file.", path="file path", old="exact text", new="replacement"),
    _tool("run", "Run a shell command.", command="shell command"),
    _tool("run_tests", "Run the visible tests."),
    _tool("submit", "Finish; your work is graded."),
]
TOOL_NAMES = [tool["function"]["name"] for tool in TOOLS]


def _signature(tool: dict[str, Any]) -> str:
    """`name(param, ...)`: the names say enough, and every token of the system prompt is paid for
    in every model call of every rollout (the descriptions stay in the JSON schemas)."""
    function = tool["function"]
    return f"{function['name']}({', '.join(function['parameters']['properties'])})"


SYSTEM_PROMPT = "You are a coding agent in a repository. Use the tools, then submit.\nTools:\n" + "\n".join(
    _signature(tool) for tool in TOOLS
)


def first_user_message(task: Task) -> str:
    """The task as the agent first sees it: the instruction and the repository's top-level files,
    with every control and markup string broken (`defuse_markup`). A task's text comes from
    anywhere (an issue on GitHub, a file name), and as the harness does with a tool's output, it
    must not open a turn or fake a call or a tool response. What UTF-8 cannot encode shows as `?`:
    JSON can escape a lone surrogate (half of an emoji a scraper cut), which no tokenizer takes."""
    files = sorted({name.split("/")[0] for name in task.repo_files})
    listing = f"\nFiles: {', '.join(files)}" if files else ""
    return defuse_markup(task.instruction + listing).encode("utf-8", "replace").decode("utf-8")


# Tool-result texts. The harness's tools return these, so demonstrations can show them verbatim.


def write_result(path: str, content: str) -> str:
    return f"wrote {path} ({len(content.splitlines())} lines)"


def edit_result(path: str) -> str:
    return f"edited {path}"


def run_tests_result(tests: dict[str, str], details: str = "") -> str:
    """What run_tests shows: each test that did not pass, then counts (`3 passed, 1 failed`),
    then optional details (e.g. the first failure's error line)."""
    counts = Counter(tests.values())
    lines = [f"{outcome.upper()} {test_id}" for test_id, outcome in tests.items() if outcome != "passed"]
    order = sorted(counts, key=lambda outcome: (outcome != "passed", outcome))
    lines.append(", ".join(f"{counts[outcome]} {outcome}" for outcome in order) or "no tests ran")
    if details:
        lines.append(details)
    return "\n".join(lines)


def tool_call(call_id: str, name: str, **arguments: str) -> dict[str, Any]:
    """An assistant message making one tool call, OpenAI-shaped (arguments as a JSON string)."""
    if name not in TOOL_NAMES:
        raise ValueError(f"unknown tool {name!r}; tools are {TOOL_NAMES}")
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        ],
    }


def tool_message(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}
