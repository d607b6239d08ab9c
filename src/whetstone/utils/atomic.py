"""Atomic writes: a reader sees the old file or the new one, never half of one.

Write to a temporary sibling, fsync, then `os.replace` (atomic on POSIX within a filesystem), or
`os.link` for a file created only once (`exclusive`).
What they write gets the permissions a plain write gives (`mkstemp` and `mkdtemp` make 0600 and
0700): a new file 0666 and a folder 0777, less the umask; a replaced file keeps its mode. A file
holding secrets is written with `mode=PRIVATE` (0600, whatever the umask and the mode of the file
it replaces): it never holds its contents under other permissions, not even as the temporary file.
`atomic_directory` gives every file and folder in the tree it puts in place those modes, whatever
its writer used (safetensors makes its files 0600): a file made executable gets 0777 less the umask.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from whetstone.errors import WhetstoneError

PRIVATE = 0o600
"""The mode of a file holding secrets (passwords, tokens): readable by its owner only."""


def fsync_dir(directory: Path) -> None:
    """fsync a folder, so that the names created, renamed or removed in it survive a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    """fsync every file under `directory`, then every folder, deepest first and `directory`
    last: once it is renamed into place, a crash cannot leave it with missing or empty files."""
    for folder, _, files in os.walk(directory, topdown=False):
        for name in files:
            file = Path(folder) / name
            if file.is_symlink():
                continue
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(folder))


def plain_file_mode() -> int:
    """The permissions a plain write gives a new file (0o666 less the umask), where a temporary
    file renamed or linked into place would keep mkstemp's 0600."""
    return 0o666 & ~_umask()


@functools.cache
def _umask() -> int:
    """The process's umask, read once: whetstone never changes it after start, and a process
    writes many files (the weight store a chunk each). Read without changing it (os.umask sets
    it, racing other threads); a forked child inherits it with the cached value."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _plain_modes(directory: Path) -> None:
    """Give the files and folders under `directory`, and itself, the modes plain writes give."""
    umask = _umask()
    for folder, _, files in os.walk(directory):
        os.chmod(folder, 0o777 & ~umask)
        for name in files:
            file = Path(folder) / name
            if file.is_symlink():
                continue
            executable = file.stat().st_mode & 0o111
            os.chmod(file, (0o777 if executable else 0o666) & ~umask)


def writable_folder_problem(folder: str | Path) -> str | None:
    """Why files cannot be written into `folder` (made with its parents where missing), or None.

    It creates nothing: the nearest existing one of `folder` and its parents must be a folder
    this process may create entries in. For checks before a long job that writes there later.
    """
    folder = Path(folder)
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "a link to nothing" if not existing.exists() else "a file, not a folder"
        if existing == folder:
            return f"{folder} is {what}"
        return f"{folder} cannot be created: {existing} is {what}"
    if not os.access(existing, os.W_OK | os.X_OK):
        if existing == folder:
            return f"{folder} is not writable"
        return f"{folder} cannot be created: {existing} is not writable"
    return None


WRITE_ERROR_ADVICE = {
    errno.ENOSPC: "free space on its disk",
    errno.EDQUOT: "free space within the disk quota",
    errno.EROFS: "write it to a disk that is not read-only",
    errno.EACCES: "make its folder writable",
    errno.EPERM: "make its folder writable",
}
"""What to do about the write errors that have a usual remedy, by errno."""


@contextmanager
def write_errors(path: str | Path) -> Iterator[None]:
    """An OSError writing `path` (a full disk, a read-only folder) as a WhetstoneError naming the
    file and the cause, not a traceback; the cause's message, not the temporary file's name. Of
    `shutil.copytree`'s error, which gathers a (source, destination, cause) for every file that
    failed, the first file's cause (its errno read back from the text copytree keeps of it)."""
    try:
        yield
    except OSError as err:
        cause, number = err.strerror or err, err.errno
        failures = err.args[0] if isinstance(err, shutil.Error) and err.args else None
        if isinstance(failures, list) and failures and isinstance(failures[0], tuple):
            cause = str(failures[0][-1])
            if match := re.fullmatch(r"\[Errno (\d+)\] (.*?)(?:: '.*')?", cause, re.S):  # less the file's name
                number, cause = int(match.group(1)), match.group(2)
        advice = WRITE_ERROR_ADVICE.get(number)
        then = f": {advice}, then run the command again" if advice else ""
        raise WhetstoneError(f"cannot write {path}: {cause}{then}") from None


NAME_MAX = 255
"""The most bytes a file name may have (Linux, on ext4, xfs, btrfs and tmpfs alike)."""


def _shortened(name: str, size: int) -> str:
    """`name` less as many characters at its end as it takes to fit in `size` bytes."""
    while len(os.fsencode(name)) > size:
        name = name[:-1]
    return name


def _temporary_prefix(name: str) -> str:
    """`.<name>.`, the start of the name of the temporary sibling that becomes `name`: `name`
    shortened so that the whole, with mkstemp's 8 random characters and `.tmp`, is a name the
    folder accepts (a name of 242 bytes or more would not fit whole)."""
    return f".{_shortened(name, NAME_MAX - len('..') - 8 - len('.tmp'))}."


def _set_aside_name(name: str) -> str:
    """`.<name>.old`, where `atomic_directory` moves the folder it replaces. A name too long for
    that gets a shortened one ending in a hash of the whole name: the same name every time (the
    next call finds what a crash left), and not that of another long name with the same start."""
    if len(os.fsencode(f".{name}.old")) <= NAME_MAX:
        return f".{name}.old"
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    return f".{_shortened(name, NAME_MAX - len('..') - len(digest) - len('.old'))}.{digest}.old"


@contextmanager
def atomic_path(path: str | Path, mode: int | None = None, exclusive: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it replaces `path`, on error it is removed.

    For writers that insist on a file name (safetensors, torch.save). `mode`: the file's
    permissions (`PRIVATE` for secrets); None gives those of a plain write. `exclusive`: the
    file is hard-linked to `path` instead, which fails with FileExistsError where `path` exists
    (a link, unlike a rename, never takes the place of another name): of writers racing to create
    `path`, exactly one does. The temporary file is a dot-name, and is gone once the block ends.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:  # a plain write keeps the mode of the file it overwrites
        mode = path.stat().st_mode & 0o777 if path.is_file() and not exclusive else plain_file_mode()
    fd, tmp_name = -1, None  # until the block ends, whatever fails: the fd is closed, the file removed
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=_temporary_prefix(path.name), suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, mode)
        except OSError as err:
            raise OSError(err.errno, f"{err.strerror} (giving the new file mode {mode:#o})", str(path)) from None
        opened, fd = fd, -1
        os.close(opened)
        tmp = Path(tmp_name)
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        if exclusive:
            os.link(tmp, path)
        else:
            os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp_name is not None:
            Path(tmp_name).unlink(missing_ok=True)


def atomic_write_bytes(path: str | Path, data: bytes, mode: int | None = None, exclusive: bool = False) -> None:
    """Write `data` to `path` atomically (`atomic_path`: `mode`, `exclusive`)."""
    with atomic_path(path, mode, exclusive) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode(), mode)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory that replaces `path` as a whole once the block succeeds.

    Its files and folders are fsynced before the rename (as `atomic_path` fsyncs its file), and
    the parent after it. An existing `path` is moved aside to `.<name>.old` first and deleted only
    after the new one is in place, so a crash leaves either the old directory or the new one,
    plus at worst a `.<name>.old`: the next call puts that back when `path` is missing (a crash
    between the two renames) and deletes it otherwise. A `path` that is a file is refused before
    anything is written: it is not a directory to replace, and it is not deleted.
    """
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():
        raise WhetstoneError(f"{path} is a file, not a folder: move it away to have the folder written there")
    old = path.with_name(_set_aside_name(path.name))
    if os.path.lexists(old):
        if not os.path.lexists(path) and old.is_dir() and not old.is_symlink():
            os.replace(old, path)  # the previous directory, set aside by a write that crashed
        else:
            _remove(old)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temporary_prefix(path.name), suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        _plain_modes(tmp)
        _fsync_tree(tmp)
        if os.path.lexists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        if os.path.lexists(old):
            _remove(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _remove(path: Path) -> None:
    """Delete a file, link or directory tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
