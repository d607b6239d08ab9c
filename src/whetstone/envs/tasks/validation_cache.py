"""The validation cache's keys: a task's content hash (`task_hash`, a snapshot folder's files
included) and the grader's fingerprint (`grader_fingerprint`), under which cached verdicts are
kept; and reading the cache (`load_cache`)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import threading
from importlib import metadata
from pathlib import Path

from whetstone.envs.grading.reward import RewardConfig
from whetstone.envs.sandbox.templates import IGNORED_IN_SNAPSHOTS
from whetstone.envs.task import Task
from whetstone.errors import WhetstoneError


def task_hash(task: Task, digests: SnapshotDigests | None = None) -> str:
    """The key of a task's cached verdict: its record, and for a `repo_path` task the content of
    that folder too (`folder_digest`, taken from `digests` where given), so a snapshot whose files
    changed is validated again."""
    digest = hashlib.sha256(task.model_dump_json().encode())
    if task.repo_path is not None:
        try:
            digest.update(b"\0repo_path\0" + (digests or folder_digest)(Path(task.repo_path)))
        except OSError as err:
            where = os.fsdecode(err.filename) if err.filename is not None else task.repo_path
            raise WhetstoneError(
                f"task {task.id}: repo_path {task.repo_path} cannot be read ({where}: {err.strerror or err}): "
                "the snapshot folder must exist and its files be readable"
            ) from None
    return digest.hexdigest()


class SnapshotDigests:
    """`folder_digest` of each snapshot folder (by its resolved path), taken once however many
    tasks share the folder: one validation run reads each snapshot's bytes once. Threads asking
    for a folder being hashed wait for that hash; a folder that cannot be read is tried again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._folder_locks: dict[Path, threading.Lock] = {}
        self._digests: dict[Path, bytes] = {}

    def __call__(self, folder: Path) -> bytes:
        key = folder.resolve()
        with self._lock:
            folder_lock = self._folder_locks.setdefault(key, threading.Lock())
        with folder_lock:
            if key not in self._digests:
                self._digests[key] = folder_digest(folder)
            return self._digests[key]


HASH_CHUNK_BYTES = 1 << 20
"""How much of a file `folder_digest` reads at a time."""
MODE_BITS_HASHED = stat.S_IXUSR
"""The mode bits a snapshot's hash covers, of its files only: the owner's execute bit, which
decides whether a script in the sandbox's copy runs (and is the one mode bit git records). The
group's and other's bits, read as much as write, are each checkout's umask's doing (0o644 under
one, 0o600 or 0o664 under another), and the owner's read and write bits are set in any checkout:
hashing those, or a folder's bits, would only make the same files hash differently."""


def folder_digest(folder: Path) -> bytes:
    """A hash of what a sandbox copies from a snapshot folder (everything but `.git`, as
    `copy_tree`): each entry's relative path and type, a file's bytes and executable bit
    (`MODE_BITS_HASHED`), a symbolic link's target (links are not followed). Files are read in
    chunks, one at a time. Raises OSError when the folder or something in it cannot be read."""
    digest = hashlib.sha256()
    stack = [b""]
    while stack:
        relative = stack.pop()
        where = os.path.join(os.fsencode(folder), relative) if relative else os.fsencode(folder)
        with os.scandir(where) as found:
            entries = {entry.name: entry for entry in found}
        ignored = IGNORED_IN_SNAPSHOTS(os.fsdecode(where), [os.fsdecode(name) for name in entries])
        folders = []
        for name in sorted(entries):
            if os.fsdecode(name) in ignored:
                continue
            path = os.path.join(relative, name)
            info = entries[name].stat(follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                record = b"link\0" + os.readlink(entries[name].path)
            elif stat.S_ISDIR(info.st_mode):
                record = b"folder"
                folders.append(path)
            elif stat.S_ISREG(info.st_mode):
                mode = b"%o" % (stat.S_IMODE(info.st_mode) & MODE_BITS_HASHED)
                record = b"file\0" + mode + b"\0" + _file_digest(entries[name].path)
            else:  # a pipe, socket or device: its kind, never its content
                record = b"special\0%o" % stat.S_IFMT(info.st_mode)
            digest.update(path + b"\0" + record + b"\0")
        stack += reversed(folders)  # depth first, in name order
    return digest.digest()


def _file_digest(path: bytes) -> bytes:
    """The sha256 of a regular file's bytes, read in chunks without following a link."""
    digest = hashlib.sha256()
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
        while chunk := file.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.digest()


PACKAGE = Path(__file__).parents[2]
"""The whetstone package's folder."""
GRADER_SOURCES = (
    *sorted((PACKAGE / "envs" / "grading").rglob("*.py")),
    PACKAGE / "envs" / "tasks" / "validate.py",
    PACKAGE / "envs" / "tasks" / "validation_cache.py",
    PACKAGE / "envs" / "tasks" / "patches.py",
    PACKAGE / "envs" / "task.py",
)
"""The code that decides a verdict: the grading package (the runner and plain-test collector that
run in the sandbox among it), this check, the patch applier that makes a SWE-bench reference and
the task model that reads the record. The sandbox package is left out: it enforces the limits
(which are in the fingerprint) rather than deciding outcomes, and every change to it would
otherwise re-validate every cached task set."""
SANDBOX_PLUMBING = {"pool_size", "max_templates", "root_dir"}
"""Sandbox settings that say where and how many workspace copies are kept, not what a test sees."""


def sources_digest(sources: tuple[Path, ...] = GRADER_SOURCES) -> str:
    """A hash of the files' names (relative to the whetstone package where inside it) and bytes."""
    digest = hashlib.sha256()
    for source in sources:
        name = source.relative_to(PACKAGE).as_posix() if source.is_relative_to(PACKAGE) else source.name
        data = source.read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def grader_fingerprint(reward_config: RewardConfig | None = None, sources: tuple[Path, ...] = GRADER_SOURCES) -> str:
    """What decides a task's verdict besides the task: the grading code (`sources`), the sandbox
    limits the tests run under, and the Python and pytest that run them. A cached verdict is used
    only under the fingerprint it was found under."""
    sandbox = (reward_config or RewardConfig()).sandbox.model_dump(mode="json", exclude=SANDBOX_PLUMBING)
    try:
        pytest_version = metadata.version("pytest")
    except metadata.PackageNotFoundError:
        pytest_version = None
    setting = {"sandbox": sandbox, "python": sys.version, "pytest": pytest_version}
    digest = hashlib.sha256(sources_digest(sources).encode() + json.dumps(setting, sort_keys=True).encode())
    return digest.hexdigest()


def load_cache(path: Path | None, grader: str) -> dict[str, str | None]:
    """The verdicts cached in `path` under the fingerprint `grader`; none from another grader, or
    from a cache without a fingerprint."""
    if path is None or not path.exists():
        return {}
    if path.is_dir():  # it would be found out only when written, after every task ran
        raise WhetstoneError(f"validation cache {path} is a directory, not a JSON file")
    try:
        cache = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}  # a damaged cache only costs a re-validation
    except OSError as err:
        raise WhetstoneError(f"validation cache {path} cannot be read: {err.strerror or err}") from None
    if not isinstance(cache, dict) or cache.get("grader") != grader or not isinstance(cache.get("verdicts"), dict):
        return {}
    return cache["verdicts"]
