"""Grade a rollout: its changes, on the pristine repository in a fresh sandbox, against tests it never saw.

1. `workspace_changes` diffs the rollout's workspace against the task's snapshot.
2. `grade` scans the changes for hacks (`cheats.py`), then opens a fresh sandbox over the
   pristine files, applies only the changes outside tests and protected paths (never `.git`,
   never through a symbolic link), and only then adds the hidden tests.
3. The tests run under `grade_runner.py`, which reports each test and what the solution code
   did at run time to a file outside the workspace; a report the code writes is never read. A
   custom `test_command` (not pytest) writes a JUnit XML report instead, to a fresh folder
   outside the workspace named by `$WHETSTONE_JUNIT_XML` (`junit.py` maps its testcases to ids).
4. `reward.combine` turns tests, an optional judge score and effort into the reward.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import difflib
import errno
import functools
import os
import py_compile
import secrets
import shlex
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from whetstone.envs.grading.cheats import is_protected, scan_changes
from whetstone.envs.grading.judge import JudgeError, judge_score
from whetstone.envs.grading.junit import JUnitCase, JUnitError, outcomes_by_id, read_testcases
from whetstone.envs.grading.reward import Effort, RewardConfig, combine
from whetstone.envs.sandbox import Mount, RunResult, Sandbox, open_sandbox
from whetstone.envs.sandbox.disk import remove_tree
from whetstone.envs.task import Task
from whetstone.errors import WhetstoneError

# Produced by running code (or by `pip install -e`), not written by the agent: neither reported
# nor carried into grading, where the pristine setup makes them again.
GENERATED = {"__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache"}
RUNNER = Path(__file__).parent / "in_sandbox" / "grade_runner.py"
PLAIN_TESTS = Path(__file__).parent / "in_sandbox" / "plain_tests.py"
MAX_RESULT_LINE_CHARS = 100_000
"""A longer line in the results file is not the runner's (its records are one test id or flag)."""
RUNNER_DIR_IN_SANDBOX = "/opt/whetstone"
RESULTS_FILE = "results.txt"
JUNIT_VARIABLE = "WHETSTONE_JUNIT_XML"
"""The environment variable naming the file a custom test command must write its JUnit XML
report to."""
REPORT_DIR_IN_SANDBOX = f"{RUNNER_DIR_IN_SANDBOX}/report"
JUNIT_FILE = "junit.xml"
MAX_REPORT_BYTES = 64 << 20
"""A larger JUnit report is not read (the sandbox's `max_file_mb` bounds it already by default)."""
NOBODY = 65534
"""The uid and gid that own the results file when the grader runs as root."""
MAX_LOG_CHARS = 20_000
SETUP_OUTPUT_CHARS = 300
"""How much of a failed setup command's output its failure reason quotes."""


@dataclass
class GradeResult:
    """The grade of one rollout."""

    reward: float
    passed: bool
    """Solved: every required test passed (and at least one ran)."""
    tests: dict[str, str]
    """Test id -> passed | failed | error | skipped (a test that never reported is an error)."""
    breakdown: dict[str, float]
    cheat_flags: list[str]
    exclude_from_gradient: bool
    log: str
    setup_failure: str | None = None
    """Why a setup command failed (the command, its exit code or time-out); the tests did not run."""
    test_limits_hit: list[str] = field(default_factory=list)
    """Limits the test run ran into: wall_clock (the tests timed out), cpu, memory, processes, output."""
    report_problem: str | None = None
    """Why a custom test command's JUnit report gave no test results (none written, not
    readable, not JUnit XML, no testcase in it); its tests then count as errors."""


def read_tree(directory: Path) -> dict[str, bytes]:
    """Regular files under `directory` by relative path; symlinks and special files are not followed."""
    files: dict[str, bytes] = {}
    stack = [directory]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name not in GENERATED and not entry.name.endswith(".egg-info"):
                        stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    files[Path(entry.path).relative_to(directory).as_posix()] = Path(entry.path).read_bytes()
    return files


def pristine_files(task: Task) -> dict[str, str]:
    """The task's repository snapshot as {path: text} (read from `repo_path` when given that way)."""
    if task.repo_path is None:
        return dict(task.repo_files)
    snapshot = Path(task.repo_path)
    if not snapshot.is_dir():
        raise WhetstoneError(f"task {task.id}: repo_path {snapshot} is not a directory")
    tree = read_tree(snapshot)
    tree = {path: data for path, data in tree.items() if not path.startswith(".git/")}
    return {path: data.decode("utf-8", "surrogateescape") for path, data in tree.items()}


def workspace_changes(task: Task, workspace: Path) -> dict[str, str | None]:
    """The agent's changes against the pristine snapshot: {path: new text, or None if deleted}."""
    pristine = {path: text.encode("utf-8", "surrogateescape") for path, text in pristine_files(task).items()}
    current = read_tree(workspace)
    changes: dict[str, str | None] = {p: None for p in pristine if p not in current}
    for path, data in current.items():
        if pristine.get(path) != data:
            changes[path] = data.decode("utf-8", "surrogateescape")
    return dict(sorted(changes.items()))


def _applicable(path: str, task: Task) -> bool:
    parts = PurePosixPath(path).parts
    return ".git" not in parts and not is_protected(path, task)


def _clashes(path: str, files: set[str]) -> bool:
    """Whether a file at `path` cannot stand beside `files` (one of them is a folder above it, or it
    is a folder above one of them): a change that would turn a hidden test, or a file of the
    repository the grader keeps, into a folder or back is not applied; the hidden tests win."""
    parts = PurePosixPath(path).parts
    above = {"/".join(parts[:end]) for end in range(1, len(parts))}
    return bool(above & files) or any(file.startswith(path + "/") for file in files)


def _apply(workspace: Path, changes: dict[str, str | None]) -> dict[str, str]:
    """Writes `changes` (None deletes) into `workspace` without following a symbolic link, and
    returns the changes it refused, each with the link in its way. A file that is a link is
    removed and written as a plain file, as the agent's workspace showed it (`read_tree` sees a
    link replaced by a file as a new file; a write through the link shows as a change to the
    file it points to). A change under a folder that is a link is refused: written through it,
    it would land on the file the link points to (a test, a protected file, a host file)."""
    refused: dict[str, str] = {}
    # deletions first: a folder the agent replaced with a file (or a file with a folder) is gone
    # before the new one is written
    for name, text in sorted(changes.items(), key=lambda change: change[1] is not None):
        path = PurePosixPath(name)
        if path.is_absolute() or ".." in path.parts or not name:
            raise WhetstoneError(f"change to {name!r}: paths must be relative and stay inside the repository")
        link = _link_above(workspace, path)
        if link is not None:
            refused[name] = link
            continue
        target = workspace / path
        if text is None or target.is_symlink():
            target.unlink(missing_ok=True)
        if text is not None:
            if target.is_dir():  # a folder whose files the changes deleted, now a file
                _remove_folder_for_file(target, name)
            target.parent.mkdir(parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            with open(os.open(target, flags, 0o666), "wb") as file:
                file.write(text.encode("utf-8", "surrogateescape"))
    return refused


def _remove_folder_for_file(folder: Path, name: str) -> None:
    """Removes `folder`, where the agent's workspace has a file: with it go what `read_tree` does
    not see in it (links, caches such as `__pycache__`). A file it sees there is one the changes
    kept, which a change that writes a file in the folder's place must have deleted."""
    if read_tree(folder):
        raise WhetstoneError(f"change to {name!r}: a file where the repository has a folder still holding files")
    shutil.rmtree(folder)


def _link_above(workspace: Path, path: PurePosixPath) -> str | None:
    """The first folder on the way to `path` in `workspace` that is a symbolic link, or None.
    Nothing runs in the grading sandbox while changes are applied, so no link appears after it."""
    for end in range(1, len(path.parts)):
        folder = PurePosixPath(*path.parts[:end])
        if (workspace / folder).is_symlink():
            return folder.as_posix()
    return None


def grade(
    task: Task, changes: dict[str, str | None], config: RewardConfig | None = None, effort: Effort | None = None
) -> GradeResult:
    """Run the hidden tests on the pristine repository plus `changes`, detect cheating, and score."""
    config = config or RewardConfig()
    pristine = pristine_files(task)
    flags = scan_changes(task, pristine, changes)
    applied = {path: text for path, text in changes.items() if _applicable(path, task)}
    kept = {path for path in pristine if path not in applied} | set(task.hidden_tests)
    applied = {path: text for path, text in applied.items() if text is None or not _clashes(path, kept)}
    required = task.fail_to_pass + task.pass_to_pass
    report_problem = None
    with _results_folder() as results_dir, _report_folder() as report_dir:
        compiled = compiled_runner()
        runner = Mount(str(compiled / "grade_runner.pyc"), f"{RUNNER_DIR_IN_SANDBOX}/grade_runner.pyc")
        plain_tests = Mount(str(compiled / "plain_tests.pyc"), f"{RUNNER_DIR_IN_SANDBOX}/plain_tests.pyc")
        results = Mount(results_dir, f"{RUNNER_DIR_IN_SANDBOX}/results", writable=True)
        report = Mount(report_dir, REPORT_DIR_IN_SANDBOX, writable=True)
        mounts = [runner, plain_tests, results] if task.pytest_args is not None else [report]
        snapshot = Path(task.repo_path) if task.repo_path else dict(task.repo_files)
        with open_sandbox(snapshot, config.sandbox, mounts=mounts) as sandbox:
            refused = _apply(sandbox.workspace, applied)
            flags += [
                f"symlink: {path} lies under {link}, a symbolic link (not applied)" for path, link in refused.items()
            ]
            if refused_tests := _apply(sandbox.workspace, dict(task.hidden_tests)):
                path, link = next(iter(refused_tests.items()))
                raise WhetstoneError(
                    f"task {task.id}: hidden test {path} lies under {link}, a symbolic link in the repository, and "
                    "grading writes nothing through a link: make the link a folder or put the test elsewhere"
                )
            log, setup_failure = _run_setup(sandbox, task)
            limits_hit: list[str] = []
            if setup_failure is None:
                if task.pytest_args is None:
                    outcomes, run, report_problem = _run_command(sandbox, task, required, report)
                else:
                    test_code = _test_code(task, pristine, applied)
                    outcomes, runtime_flags, run = _run_tests(sandbox, task, required, test_code, runner, results)
                    flags += runtime_flags
                log += _run_log(run) + (f"[{report_problem}]\n" if report_problem else "")
                limits_hit = run.limits_hit
            else:
                outcomes = {}
    if not required and task.pytest_args is None:
        # every test the report lists: mutate's probe of a project's tests (validation refuses a
        # task like this, whose report could leave out the hidden tests)
        required = list(outcomes) or list(task.hidden_tests)
    elif not required:  # no FAIL_TO_PASS list: every test in the hidden files must pass
        in_hidden_files = [t for t in outcomes if "::" in t and t.split("::")[0] in task.hidden_tests]
        required = in_hidden_files or list(task.hidden_tests)
    tests = {test_id: outcomes.get(test_id, "error") for test_id in required}
    passed_count = sum(outcome == "passed" for outcome in tests.values())
    solved = bool(tests) and passed_count == len(tests)
    judge, judge_log = _judge(task, pristine, applied, tests, config) if not flags else (None, "")
    reward, breakdown, exclude = combine(solved, passed_count / max(1, len(tests)), judge, effort, flags, config)
    log = (log + judge_log)[-MAX_LOG_CHARS:]
    return GradeResult(reward, solved, tests, breakdown, flags, exclude, log, setup_failure, limits_hit, report_problem)


def _run_setup(sandbox: Sandbox, task: Task) -> tuple[str, str | None]:
    """The setup commands' log, and why one failed (None if all succeeded)."""
    log = ""
    for command in task.setup:
        result = sandbox.run(command, timeout_s=task.test_time_limit_s)
        log += f"$ {command}\n{_run_log(result)}"
        if result.timed_out:
            failure = f"setup command timed out after {task.test_time_limit_s:g} s (test_time_limit_s)"
        elif result.exit_code != 0:
            failure = f"setup command failed with exit code {result.exit_code}"
        else:
            continue
        output = (result.stdout + result.stderr).strip()
        tail = f"; output ends: {output[-SETUP_OUTPUT_CHARS:]!r}" if output else ""
        return log + failure + "\n", f"{failure}: {command!r}{tail}"
    return log, None


def _test_code(task: Task, pristine: dict[str, str], applied: dict[str, str | None]) -> list[str]:
    """Files whose code may read hidden tests: those tests, and test files of the repository that
    the agent left alone (a `test_*.py` the agent wrote or edited is solution code like any other)."""
    unchanged = [path for path in pristine if path not in applied and path.endswith(".py")]
    tests = [path for path in unchanged if is_protected(path, task) or _looks_like_test(path)]
    return sorted({*task.hidden_tests, *tests})


def _looks_like_test(path: str) -> bool:
    name = PurePosixPath(path).name
    return name == "conftest.py" or name.startswith("test_") or name.endswith("_test.py")


def _run_tests(
    sandbox: Sandbox, task: Task, required: list[str], test_code: list[str], runner: Mount, results: Mount
) -> tuple[dict[str, str], list[str], RunResult]:
    """(outcome per test id, runtime cheat flags, the run) for one pytest run under the runner."""
    targets = required or sorted(task.hidden_tests)
    pytest_args = task.pytest_args
    assert pytest_args is not None, "a custom test command runs in _run_command"
    token = secrets.token_hex(16)
    env = {
        "WHETSTONE_RESULTS": f"{_seen_from(sandbox, results)}/{RESULTS_FILE}",
        "WHETSTONE_GUARDED": encode_paths(sorted(task.hidden_tests)),
        "WHETSTONE_TEST_CODE": encode_paths(test_code),
        # Only plugins named on the command line (`-p module`) load: nothing the workspace could
        # register through package metadata, and no second of hypothesis start-up per grade.
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    argv = [
        "python",
        _seen_from(sandbox, runner),
        *pytest_args,
        "-p",
        "no:cacheprovider",
        f"--rootdir={sandbox.workdir}",
        *targets,
    ]
    run = sandbox.run(argv, timeout_s=task.test_time_limit_s, stdin=token + "\n", env=env)
    text = _take_results(Path(results.source) / RESULTS_FILE)
    outcomes, flags, finished = _read_results(text or "", token)
    exited = not run.limits_hit and 0 <= run.exit_code < 128  # an exit asked for: no limit or signal to blame
    if text is None:
        flags.append("result_tampering: the results file was removed or replaced while the tests ran")
    elif finished is None and exited:
        flags.append(f"early_exit: the test process exited (code {run.exit_code}) before pytest finished")
    elif finished is not None and exited and run.exit_code != finished:
        flags.append(f"early_exit: the test process exited with code {run.exit_code}, pytest with {finished}")
    return outcomes, flags, run


def _run_command(
    sandbox: Sandbox, task: Task, required: list[str], report: Mount
) -> tuple[dict[str, str], RunResult, str | None]:
    """(outcome per test id, the run, why its report gave none) for a custom test command: it
    runs with the test ids appended and `$WHETSTONE_JUNIT_XML` naming a file in the empty
    `report` folder, and its JUnit XML report there is matched to the ids (`junit.py`). Its exit
    code decides nothing: a command that ran no test, or code that exited 0 before the tests
    did, has no report, or one that lacks the tests (each an error), unless the report is made
    from the run's printed output (go-junit-report), which that code can print."""
    targets = required or sorted(task.hidden_tests)
    _empty(Path(report.source))  # of anything the setup commands, which run the repository's code, left there
    env = {JUNIT_VARIABLE: f"{_seen_from(sandbox, report)}/{JUNIT_FILE}"}
    run = sandbox.run(f"{task.test_command} {shlex.join(targets)}", timeout_s=task.test_time_limit_s, env=env)
    how = "timed out" if run.timed_out else f"exited with code {run.exit_code}"
    try:
        testcases = _read_report(Path(report.source) / JUNIT_FILE)
    except FileNotFoundError:
        return {}, run, f"the test command {how} and wrote no JUnit XML report to ${JUNIT_VARIABLE}"
    except (OSError, JUnitError) as err:
        return {}, run, f"the test command {how}; its JUnit XML report cannot be used: {err}"
    if not testcases:
        return {}, run, f"the test command {how}; its JUnit XML report lists no testcase"
    return outcomes_by_id(testcases, required), run, None


def _read_report(path: Path) -> list[JUnitCase]:
    """The testcases of the JUnit report at `path`, read without following a symbolic link and
    only from a regular file (graded code may have put a link, pipe or folder in its place)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise JUnitError("it is a symbolic link, not a file") from None
        raise
    with open(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise JUnitError("it is not a regular file")
        if info.st_size > MAX_REPORT_BYTES:
            raise JUnitError(f"it holds {info.st_size} bytes, more than the {MAX_REPORT_BYTES} read")
        return read_testcases(file)


def _empty(folder: Path) -> None:
    """Removes everything in `folder` (made writable and searchable for its owner first)."""
    os.chmod(folder, 0o700)
    with os.scandir(folder) as entries:
        for entry in list(entries):
            if entry.is_dir(follow_symlinks=False):
                remove_tree(Path(entry.path))
            else:
                os.unlink(entry.path)


@contextlib.contextmanager
def _report_folder() -> Iterator[str]:
    """An empty folder for a custom test command's JUnit report, removed afterwards however the
    command left it (folders in it made unreadable included)."""
    folder = tempfile.mkdtemp(prefix="whetstone-report-")
    try:
        yield folder
    finally:
        remove_tree(Path(folder))


def encode_paths(paths: list[str]) -> str:
    """A path list for the runner's environment: one hex-encoded path per line (any path, even one
    with a newline, and read without a parser module in the sandbox)."""
    return "\n".join(path.encode("utf-8", "surrogateescape").hex() for path in paths)


@functools.cache
def compiled_runner() -> Path:
    """A directory with grade_runner.pyc and plain_tests.pyc, compiled once per process: run from
    their sources, both were compiled again in every grading sandbox (~5 ms of its CPU)."""
    directory = Path(tempfile.mkdtemp(prefix="whetstone-runner-"))
    atexit.register(shutil.rmtree, directory, True)
    for source in (RUNNER, PLAIN_TESTS):
        py_compile.compile(str(source), cfile=str(directory / f"{source.stem}.pyc"), doraise=True)
    return directory


@contextlib.contextmanager
def _results_folder() -> Iterator[str]:
    """A folder holding an empty results file that commands in the sandbox can append to but not
    read, list, remove or chmod: owned by `nobody`, the folder search-only and the file
    write-only (the sandbox's root has no capabilities to override that). So the runner's token
    cannot be read back from its records. Where the grader cannot give a file away (not root, or
    root in a user namespace that maps no `nobody`, or without CAP_CHOWN), the file is its own
    and only write-only, which an owner may change: the runner's audit hook then catches graded
    code doing so."""
    with tempfile.TemporaryDirectory(prefix="whetstone-grade-") as folder:
        path = Path(folder) / RESULTS_FILE
        path.touch()
        if not _give_to_nobody(path, folder):
            path.chmod(0o200)
        try:
            yield folder
        finally:
            os.chmod(folder, 0o700)  # to be removed


def _give_to_nobody(path: Path, folder: str) -> bool:
    """Gives the results file and its folder to `nobody`, the file write-only and the folder
    search-only; False, with both left as they were, where the grader cannot give files away."""
    if os.geteuid() != 0:
        return False
    try:
        os.chown(path, NOBODY, NOBODY)
        os.chown(folder, NOBODY, NOBODY)
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.EINVAL):
            raise
        path.unlink()  # in a folder still the grader's own: a fresh file of its own in its place
        path.touch()
        return False
    path.chmod(0o222)
    os.chmod(folder, 0o111)
    return True


def _take_results(path: Path) -> str | None:
    """The results file's text, made readable to the grader now the run is over; None where it is
    gone or is not the regular file the runner wrote to (a symlink, folder or pipe in its place, or
    its mode changed so the grader cannot write it), which only graded code does. A symlink is not
    followed: it could make the grader chmod and read a file of its own elsewhere."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        os.fchmod(fd, 0o600)
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as file:
            return file.read().decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _seen_from(sandbox: Sandbox, mount: Mount) -> str:
    """Where a mounted path appears to commands (unsandboxed, nothing is mounted: the host path)."""
    return mount.source if sandbox.config.unsandboxed else mount.target


def _read_results(text: str, token: str) -> tuple[dict[str, str], list[str], int | None]:
    outcomes: dict[str, str] = {}
    flags: list[str] = []
    finished = None
    for line in text.splitlines():
        try:
            record = ast.literal_eval(line) if len(line) <= MAX_RESULT_LINE_CHARS else None
            valid = isinstance(record, dict) and record.get("token") == token
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            valid = False
        if not valid:
            flags.append(f"result_tampering: a line in the results file was not written by the runner: {line[:120]!r}")
        elif finished is not None:
            flags.append(f"result_tampering: a record after the runner finished: {line[:120]!r}")
        elif "test" in record:
            outcomes[record["test"]] = record["outcome"]
        elif "flag" in record:
            flags.append(record["flag"])
        elif "finished" in record:
            finished = record["finished"]
    return outcomes, list(dict.fromkeys(flags)), finished


def _run_log(run: RunResult) -> str:
    limits = f" (limits hit: {', '.join(run.limits_hit)})" if run.limits_hit else ""
    return f"{run.stdout}{run.stderr}[exit code {run.exit_code}{limits}, {run.duration_s:.2f} s]\n"


def changes_diff(pristine: dict[str, str], changes: dict[str, str | None]) -> str:
    """A unified diff of `changes` against `pristine` (for the judge and for people)."""
    chunks = []
    for path, new in changes.items():
        old = pristine.get(path)
        chunks += difflib.unified_diff(
            (old or "").splitlines(keepends=True),
            (new or "").splitlines(keepends=True),
            fromfile=f"a/{path}" if old is not None else "/dev/null",
            tofile=f"b/{path}" if new is not None else "/dev/null",
        )
    return "".join(chunks)


def _judge(
    task: Task, pristine: dict[str, str], applied: dict[str, str | None], tests: dict[str, str], config: RewardConfig
) -> tuple[float | None, str]:
    if not (task.rubric and config.judge.base_url and config.judge_weight > 0):
        return None, ""
    summary = "\n".join(f"{test_id}: {outcome}" for test_id, outcome in tests.items())
    try:
        diff = changes_diff(pristine, applied)
        score, answer = judge_score(task.instruction, task.rubric, diff, summary, config.judge)
    except JudgeError as err:
        return None, f"\n[judge] not scored: {err}\n"
    return score, f"\n[judge] score {score:.2f}\n{answer}\n"
