"""`repofix`: bug-fix tasks in small multi-file repositories, solved by multi-turn tool use.

Each task is a repository generated from a template (repofix_templates.py: a package of two
modules and its tests, with random constants, names and test data) with one injected bug that
breaks at least one test (found by running the tests in sandboxes, see bugs.py). The problem
statement reads like a bug report: the behaviour a failing test documents, and what happens
instead. The agent has to find the module, read it, fix it and run the tests.
"""

from __future__ import annotations

import ast
import random

from pydantic import Field, field_validator

from whetstone.config import Config
from whetstone.envs.task import Split, Task
from whetstone.envs.tasks.bugs import Bug, bug_task, failure_line, find_bugs, function_of, split_of
from whetstone.envs.tasks.mutations import mutation_sites
from whetstone.envs.tasks.repofix_templates import TEMPLATES, Repo
from whetstone.errors import WhetstoneError

TEST_COMMAND = "python -m pytest -q -p no:cacheprovider"


class RepofixConfig(Config):
    """How many repofix tasks to make, from which templates, seed and split."""

    count: int = Field(20, ge=0)
    """Number of tasks."""
    templates: list[str] = sorted(TEMPLATES)
    """Repository templates to draw from."""
    seed: int = 0
    """Generation seed; the same config always gives the same tasks."""
    split: Split = "train"
    """Bugs in functions of this split only (a fixed hash of module and function name)."""
    tries_per_task: int = Field(8, ge=1)
    """Mutants tried per generated repository before drawing a new one."""
    workers: int = Field(2, ge=1)
    """Sandboxes run at once."""

    @field_validator("templates")
    @classmethod
    def _known(cls, templates: list[str]) -> list[str]:
        unknown = sorted(set(templates) - set(TEMPLATES))
        if unknown or not templates:
            problem = f"unknown templates {unknown}" if unknown else "no templates given"
            raise ValueError(f"{problem}; choose from {sorted(TEMPLATES)}")
        return templates


def test_docstrings(repo: Repo) -> dict[str, str]:
    """{test id: docstring} for every test function of the repository."""
    docs = {}
    for path in repo.tests:
        for node in ast.parse(repo.files[path]).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                docs[f"{path}::{node.name}"] = ast.get_docstring(node) or node.name
    return docs


def bug_report(repo: Repo, bug: Bug) -> str:
    package = repo.sources[0].split("/")[0]
    docs = test_docstrings(repo)
    expected = "; ".join(docs.get(test_id, test_id).rstrip(".") for test_id in bug.fail_to_pass[:2])
    error = failure_line(bug.log, bug.fail_to_pass[0])
    actual = f"`{error}`" if error else "it does not"
    return (
        f"Bug in the `{package}` package. Expected: {expected}. Actual: {actual}. "
        "Fix the package code; the tests in tests/ must pass."
    )


def make_task(config: RepofixConfig, index: int) -> Task:
    rng = random.Random(f"repofix/{config.seed}/{config.split}/{index}")
    for _ in range(20):
        repo = TEMPLATES[rng.choice(config.templates)](rng)
        bugs = find_bugs(
            repo.files,
            repo.sources,
            repo.tests,
            rng=rng,
            want=1,
            max_tries=config.tries_per_task,
            test_command=TEST_COMMAND,
            test_time_limit_s=30.0,
            split=config.split,
            workers=config.workers,
        )
        if bugs:
            return bug_task(
                bugs[0],
                repo.files,
                repo.tests,
                task_id=f"repofix/{config.split}/s{config.seed}-{index:05d}",
                source="repofix",
                instruction=bug_report(repo, bugs[0]),
                test_command=TEST_COMMAND,
                test_time_limit_s=30.0,
                metadata={"template": repo.template, "seed": config.seed},
            )
    raise WhetstoneError(f"repofix: no mutant broke a test in 20 repositories for task {index}")


def template_splits(name: str) -> set[str]:
    """The splits of the functions of template `name` that bugs can go into. A function's split
    is a hash of its module's file name and its own (`split_of`), which every repository the
    template draws shares (only the package folder's name varies), so one repository tells."""
    repo = TEMPLATES[name](random.Random(0))
    return {
        split_of(function_of(path, repo.files[path], mutation.line))
        for path in repo.sources
        for mutation in mutation_sites(repo.files[path])
    }


def generate(config: RepofixConfig = RepofixConfig()) -> list[Task]:
    """`config.count` tasks; each costs a few sandboxed test runs (about a second each). Templates
    none of whose functions is of `config.split` are refused first: their repositories could
    never give a bug of it."""
    if config.count and not any(config.split in template_splits(name) for name in config.templates):
        others = sorted(name for name in TEMPLATES if config.split in template_splits(name))
        raise WhetstoneError(
            f"repofix: no function of the templates {config.templates} is in the {config.split!r} split (a fixed "
            f"hash of module and function name), so no bug of that split can be injected into their "
            f"repositories; templates with such functions: {others}"
        )
    return [make_task(config, index) for index in range(config.count)]
