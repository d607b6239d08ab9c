"""`swebench`: SWE-bench-format JSONL over local repositories (no network).

Each record names a repository and a base commit; the repository must already be cloned under
`repos_dir` (as `owner__name`, `owner/name` or `name`). The task's snapshot is the tree at the
base commit, exported without history (`git archive`), so the rollout cannot read the fix from
git. `test_patch` is applied to make the hidden tests, `patch` to make the reference solution.

Symbolic links stay links in a snapshot folder (`snapshot_dir`) when they lead to a place inside
the repository. One that leads out of it is refused: grading writes a rollout's changes into a
copy of the snapshot on the host, outside any sandbox, and a write to a path that is such a link
would land where it points. Inline snapshots hold text files only, so a link there is refused
with the advice to use `snapshot_dir`.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path, PurePosixPath

from pydantic import Field, ValidationError

from whetstone.config import Config, expand_path
from whetstone.envs.task import Split, Task
from whetstone.envs.tasks.io import unsafe_id, validation_problem
from whetstone.envs.tasks.patches import apply_patch, patched_paths
from whetstone.errors import WhetstoneError
from whetstone.utils.atomic import atomic_directory, atomic_write_text
from whetstone.utils.jsonl import read_json_lines

REQUIRED = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "patch",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)


class SwebenchConfig(Config):
    """Which SWE-bench-format file to read and where its repositories are."""

    path: str = "swebench.jsonl"
    """The SWE-bench-format JSONL file."""
    repos_dir: str = "repos"
    """Directory holding a git clone of each repository (`owner__name`, `owner/name` or `name`)."""
    snapshot_dir: str | None = None
    """If set, snapshots are written here and tasks point at them (`repo_path`), for large or
    binary-holding repositories; otherwise the files are put inline in the task (text only)."""
    test_command: str = "python -m pytest -q -p no:cacheprovider"
    """Command that runs a repository's tests; FAIL_TO_PASS / PASS_TO_PASS ids are appended. One
    that is not pytest must write a JUnit XML report to `$WHETSTONE_JUNIT_XML`."""
    split: Split = "heldout"
    """Split recorded on the tasks."""
    limit: int | None = Field(None, ge=1)
    """Use only the first `limit` records."""


def _test_ids(value: object, where: str, field: str) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise WhetstoneError(f"{where}: field {field!r} is not a JSON list of test ids") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise WhetstoneError(f"{where}: field {field!r} must be a list of test ids (or a JSON string of one)")
    return value


def find_repo(repos_dir: Path, repo: str) -> Path:
    for candidate in (repos_dir / repo.replace("/", "__"), repos_dir / repo, repos_dir / repo.split("/")[-1]):
        if (candidate / ".git").exists():
            return candidate
    raise WhetstoneError(f"repository {repo!r} is not cloned under {repos_dir} (as owner__name, owner/name or name)")


def resolve_commit(repo_dir: Path, commit: str, where: str) -> str:
    """The full id of `commit` (a branch or tag moves; the id names one tree for good)."""
    result = subprocess.run(
        ["git", "-C", str(repo_dir), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise WhetstoneError(f"{where}: no commit {commit!r} in {repo_dir}: fetch it there, or correct base_commit")
    return result.stdout.strip()


def snapshot(repo_dir: Path, commit: str) -> tarfile.TarFile:
    """The tree at `commit`, without history, as an in-memory tar archive."""
    result = subprocess.run(["git", "-C", str(repo_dir), "archive", "--format=tar", commit], capture_output=True)
    if result.returncode != 0:
        raise WhetstoneError(f"{repo_dir}: cannot export commit {commit}: {result.stderr.decode().strip()}")
    return tarfile.open(fileobj=io.BytesIO(result.stdout))


def inline_files(archive: tarfile.TarFile, where: str) -> dict[str, str]:
    files = {}
    for member in archive.getmembers():
        if member.issym() or member.islnk():
            raise WhetstoneError(
                f"{where}: {member.name} is a link to {member.linkname}; inline snapshots hold text files only: "
                "set snapshot_dir to keep snapshots on disk, where links stay links"
            )
        if not member.isfile():
            continue
        data = archive.extractfile(member).read()  # type: ignore[union-attr]
        try:
            files[member.name] = data.decode("utf-8")
        except UnicodeDecodeError:
            raise WhetstoneError(
                f"{where}: {member.name} is binary; set snapshot_dir to keep snapshots on disk"
            ) from None
    return files


def _link_out(where: str, name: str, target: str) -> WhetstoneError:
    return WhetstoneError(
        f"{where}: the symbolic link {name} -> {target} leads out of the repository; grading writes changes "
        "into a copy of the snapshot outside the sandbox, where a write to it would land outside: leave the "
        "record out, or take the link out of its base commit"
    )


def links_out_of(root: Path) -> list[tuple[str, str]]:
    """(path, target) of each symbolic link under `root` that leads outside it, followed through
    every link on the way, as the files finally lie (a link checked alone can pass and still lead
    out through another one: `a -> d/l/..` with `d/l -> ..`)."""
    top = os.path.realpath(root)
    out = []
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                continue
            real = os.path.realpath(path)
            if real != top and not real.startswith(top + os.sep):
                out.append((Path(path).relative_to(root).as_posix(), os.readlink(path)))
    return sorted(out)


def commit_record(target: Path) -> Path:
    """The file beside a snapshot folder naming the commit it holds (kept out of the folder, which
    is the repository the agent sees)."""
    return target.with_name(f".{target.name}.commit")


def write_snapshot(repo_dir: Path, commit: str, target: Path, where: str) -> None:
    """Make `target` hold the tree at `commit` (a full commit id). An existing snapshot is used when
    its recorded commit is `commit`, refused when it is another (a run may be grading from it); one
    with no record, cut short or from a whetstone that did not record commits, is written again.
    The record is removed before the folder is replaced and written after, so a record names the
    commit its folder holds."""
    record = commit_record(target)
    if target.is_dir() and record.is_file():
        held = record.read_text(encoding="utf-8").strip()
        if held == commit:
            return
        raise WhetstoneError(
            f"{where}: snapshot {target} holds commit {held}, but the record's base_commit is {commit}: remove "
            "that folder to have it written again, or set another snapshot_dir"
        )
    record.unlink(missing_ok=True)
    archive = snapshot(repo_dir, commit)
    with atomic_directory(target) as tmp:  # written whole or not at all
        try:
            archive.extractall(tmp, filter="data")
        except tarfile.FilterError as err:  # a link to an absolute path or up out of the tree
            if err.tarinfo.issym() or err.tarinfo.islnk():
                raise _link_out(where, err.tarinfo.name, err.tarinfo.linkname) from None
            raise WhetstoneError(f"{where}: the snapshot cannot be written safely: {err}") from None
        if escaping := links_out_of(tmp):
            raise _link_out(where, *escaping[0])
    atomic_write_text(record, commit + "\n")


def _check_record(record: dict, where: str) -> None:
    """Raise unless the record has every field, as text (the test id lists may also be lists),
    an `instance_id` that can name a task and its snapshot folder, a `repo` that stays inside
    `repos_dir` and a `base_commit` that git cannot take for an option (`--output=FILE`)."""
    missing = [field for field in REQUIRED if field not in record]
    if missing:
        raise WhetstoneError(f"{where}: missing fields {missing}")
    lists = ("FAIL_TO_PASS", "PASS_TO_PASS")
    not_text = [field for field in REQUIRED if field not in lists and not isinstance(record[field], str)]
    if not_text:
        raise WhetstoneError(f"{where}: fields {not_text} must be strings")
    if reason := unsafe_id(f"swebench/{record['instance_id']}"):
        raise WhetstoneError(f"{where}: field 'instance_id': {reason}")
    repo = PurePosixPath(record["repo"])
    if repo.is_absolute() or not repo.parts or ".." in repo.parts:
        raise WhetstoneError(f"{where}: field 'repo' {record['repo']!r} must name a repository as owner/name")
    if record["base_commit"].startswith("-") or not record["base_commit"].strip():
        raise WhetstoneError(f"{where}: field 'base_commit' {record['base_commit']!r} is not a commit")


def to_task(record: dict, where: str, config: SwebenchConfig) -> Task:
    _check_record(record, where)
    name = record["instance_id"]
    repo_dir = find_repo(expand_path(config.repos_dir), record["repo"])
    commit = resolve_commit(repo_dir, record["base_commit"], where)
    if config.snapshot_dir:
        target = expand_path(config.snapshot_dir) / name
        write_snapshot(repo_dir, commit, target, where)
        base: dict[str, str] | Path = target
        repo = {"repo_path": str(target.resolve())}
    else:
        base = inline_files(snapshot(repo_dir, commit), where)
        repo = {"repo_files": base}
    hidden = apply_patch(base, record["test_patch"], what=f"{where}: test_patch")
    deleted = [path for path, text in hidden.items() if text is None]
    if deleted:
        raise WhetstoneError(f"{where}: test_patch deletes {deleted}; hidden tests can only add or replace files")
    solution = apply_patch(base, record["patch"], what=f"{where}: patch")
    fail_to_pass = _test_ids(record["FAIL_TO_PASS"], where, "FAIL_TO_PASS")
    pass_to_pass = _test_ids(record["PASS_TO_PASS"], where, "PASS_TO_PASS")
    try:
        return Task(
            id=f"swebench/{name}",
            source="swebench",
            split=config.split,
            kind="bugfix",
            instruction=record["problem_statement"],
            **repo,
            base_commit=record["base_commit"],
            hidden_tests={path: text for path, text in hidden.items() if text is not None},
            # Deletions cannot be written as files: such a solution stays a patch, applied when graded.
            solution_files={} if None in solution.values() else {p: t for p, t in solution.items() if t is not None},
            solution_patch=record["patch"],
            fail_to_pass=fail_to_pass,
            pass_to_pass=pass_to_pass,
            test_command=config.test_command,
            protected_paths=patched_paths(record["test_patch"]),
            metadata={"repo": record["repo"], "instance_id": name},
        )
    except ValidationError as err:  # an empty problem statement, a test path that escapes the repository
        raise WhetstoneError(f"{where}: the record makes no valid task: {validation_problem(err)}") from None


def generate(config: SwebenchConfig = SwebenchConfig()) -> list[Task]:
    path = expand_path(config.path)
    if not path.is_file():
        raise WhetstoneError(f"SWE-bench file {path} does not exist")
    tasks = []
    for line in read_json_lines(path):
        where = f"{path}:{line.number}"
        if line.problem:
            raise WhetstoneError(f"{where}: {line.problem}")
        record = line.value
        if not isinstance(record, dict):
            raise WhetstoneError(f"{where}: expected a JSON object")
        tasks.append(to_task(record, where, config))
        if config.limit is not None and len(tasks) >= config.limit:
            break
    return tasks
