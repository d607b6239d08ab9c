"""`mutate`: bug-fix tasks from any local Python project with tests, SWE-smith style.

AST mutations go into the project's source (see mutations.py), the tests run in sandboxes, and
only mutants that break at least one passing test become tasks, with FAIL_TO_PASS and
PASS_TO_PASS recorded (see bugs.py). Without a project, standard-library modules are used with
CPython's own tests (`test.test_<name>`), when the interpreter ships its test package: the
pure-Python module is copied into the task repository beside its test file; CPython's tests
import it fresh by name, and the repository comes first on the path.
"""

from __future__ import annotations

import fnmatch
import importlib.machinery
import importlib.util
import random
import sys
from pathlib import Path, PurePosixPath

from pydantic import Field

from whetstone.config import Config, expand_path
from whetstone.envs.task import Split, Task
from whetstone.envs.tasks.bugs import bug_task, failure_line, find_bugs, function_of, listed, split_of
from whetstone.envs.tasks.mutations import mutation_sites
from whetstone.errors import WhetstoneError

SKIPPED_DIRS = {".git", "__pycache__", ".venv", "venv", ".tox", ".mypy_cache", ".pytest_cache", "build", "dist"}


class MutateConfig(Config):
    """Which project to mutate and how many bug-fix tasks to make from it."""

    project: str | None = None
    """A local Python project with tests; if unset, the standard-library modules in `stdlib`."""
    stdlib: list[str] = ["heapq", "bisect"]
    """Pure-Python standard-library modules mutated (with CPython's tests) when `project` is unset."""
    sources: list[str] = ["*.py"]
    """Patterns (fnmatch: `*` also matches `/`) of the files bugs may be injected into; test files
    and conftest.py are never mutated."""
    tests: list[str] = ["test_*.py", "*/test_*.py", "*_test.py", "tests/*.py"]
    """Patterns (fnmatch) of the project's test files."""
    count: int = Field(10, ge=1)
    """Tasks to make per project (or per standard-library module)."""
    max_tries: int = Field(40, ge=1)
    """Mutants to test per project before giving up on reaching `count`."""
    seed: int = 0
    """Which mutants are tried, and in which order."""
    split: Split = "train"
    """Only mutants in functions of this split (a fixed hash of file and function name)."""
    test_command: str = "python -m pytest -q -p no:cacheprovider"
    """Command that runs the project's tests; one that is not pytest must write a JUnit XML
    report to `$WHETSTONE_JUNIT_XML`."""
    test_time_limit_s: float = Field(120.0, gt=0)
    """Wall-clock limit of one test run."""
    workers: int = Field(2, ge=1)
    """Sandboxes run at once."""


def read_project(root: Path) -> dict[str, str]:
    """The project's text files, decoded from their bytes so line endings (CRLF, a lone CR) stay
    as written; binary files cannot be part of a task and are reported, not kept. A symbolic link
    is read as its file when that file is in the project; one leading out of it is refused."""
    if not root.is_dir():
        raise WhetstoneError(f"mutate: project {root} is not a directory")
    inside = root.resolve()
    files, skipped = {}, []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if not path.is_file() or any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in relative.parts):
            continue
        if path.is_symlink() and not (target := path.resolve()).is_relative_to(inside):
            raise WhetstoneError(
                f"mutate: {root}: {relative.as_posix()} is a symbolic link to {target}, outside the project: "
                "refused (its tasks would carry that file); copy the file in or remove the link"
            )
        try:
            files[relative.as_posix()] = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(relative.as_posix())
    if skipped:
        print(f"mutate: {root}: left out {len(skipped)} binary files: {listed(skipped)}", file=sys.stderr)
    return files


def _matches(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns)  # as protected_paths match


def split_project(files: dict[str, str], config: MutateConfig) -> tuple[list[str], list[str]]:
    tests = sorted(path for path in files if path.endswith(".py") and _matches(path, config.tests))
    sources = sorted(
        path
        for path in files
        if path.endswith(".py")
        and path not in tests
        and PurePosixPath(path).name != "conftest.py"
        and _matches(path, config.sources)
    )
    if not tests or not sources:
        raise WhetstoneError(
            f"mutate: found {len(sources)} source and {len(tests)} test files; need both "
            f"(patterns sources={config.sources}, tests={config.tests})"
        )
    return sources, tests


def _spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """The module's spec, or None where there is none: `find_spec` raises, not returns None, for a
    dotted name whose package is missing and for an empty or relative name."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def stdlib_project(name: str) -> dict[str, str]:
    """A standard-library module and CPython's test file for it, as a two-file project."""
    module = _spec(name)
    if module is None or not (module.origin or "").endswith(".py") or module.submodule_search_locations:
        raise WhetstoneError(f"mutate: {name!r} is not a single-file pure-Python standard-library module")
    test = _spec(f"test.test_{name}")
    if test is None or not (test.origin or "").endswith(".py") or test.submodule_search_locations:
        if _spec("test") is None:
            raise WhetstoneError(
                f"mutate: CPython's test file test/test_{name}.py is not installed here (the "
                "interpreter ships without its `test` package); set mutate.project to a local project"
            )
        raise WhetstoneError(
            f"mutate: CPython has no test file test/test_{name}.py for {name!r}; name another module in "
            "mutate.stdlib or set mutate.project to a local project"
        )
    return {f"{name}.py": Path(module.origin).read_text(), f"test_{name}.py": Path(test.origin).read_text()}


def instruction(failing: list[str], log: str) -> str:
    """An issue in the words a test run gives: which tests fail, and one of their errors (the
    log keeps only its end, so the first failing test's section may be gone)."""
    errors = ((test_id, failure_line(log, test_id)) for test_id in failing)
    shown = next(((test_id, error) for test_id, error in errors if error), None)
    symptom = f" ({shown[0].split('::')[-1]}: `{shown[1]}`)" if shown else ""
    return (
        f"These tests fail: {listed(failing)}{symptom}. Find the bug in the source code and fix it; "
        "do not change the tests."
    )


def check_split(files: dict[str, str], sources: list[str], name: str, config: MutateConfig) -> None:
    """Raise a WhetstoneError unless a function of `config.split` in `sources` holds a mutation
    site: without one no bug of that split can be injected into the project, and it would give
    no task, whatever `count` and `max_tries`. Files that do not parse hold none."""
    for path in sources:
        try:
            sites = mutation_sites(files[path])
        except (SyntaxError, ValueError):
            continue
        if any(split_of(function_of(path, files[path], mutation.line)) == config.split for mutation in sites):
            return
    raise WhetstoneError(
        f"mutate: {name}: no function of its source files ({listed(sources)}) that a bug can go into is in the "
        f"{config.split!r} split (a fixed hash of file and function name), so it gives no task of that split; "
        "widen mutate.sources, or mutate another project or module"
    )


def mutate_project(files: dict[str, str], name: str, config: MutateConfig) -> list[Task]:
    """Up to `config.count` bug-fix tasks of `config.split` from the project `files` (named
    `name`); a WhetstoneError if the project has no function of that split to inject bugs into."""
    sources, tests = split_project(files, config)
    check_split(files, sources, name, config)
    rng = random.Random(f"mutate/{config.seed}/{name}")
    bugs = find_bugs(
        files,
        sources,
        tests,
        rng=rng,
        want=config.count,
        max_tries=config.max_tries,
        test_command=config.test_command,
        test_time_limit_s=config.test_time_limit_s,
        split=config.split,
        workers=config.workers,
    )
    return [
        bug_task(
            bug,
            files,
            tests,
            task_id=f"mutate/{name}/{config.split}/s{config.seed}-{n:04d}",
            source="mutate",
            instruction=instruction(bug.fail_to_pass, bug.log),
            test_command=config.test_command,
            test_time_limit_s=config.test_time_limit_s,
            metadata={"project": name},
        )
        for n, bug in enumerate(bugs)
    ]


def generate(config: MutateConfig = MutateConfig()) -> list[Task]:
    if config.project:
        root = expand_path(config.project)
        return mutate_project(read_project(root), root.resolve().name, config)
    return [task for name in config.stdlib for task in mutate_project(stdlib_project(name), name, config)]
