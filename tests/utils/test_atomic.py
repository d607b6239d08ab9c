import json
import os
import resource
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from whetstone.errors import WhetstoneError
from whetstone.utils.atomic import (
    _umask,
    atomic_directory,
    atomic_path,
    atomic_write_bytes,
    atomic_write_json,
    writable_folder_problem,
    write_errors,
)


def test_atomic_write_replaces_whole_file(tmp_path):
    path = tmp_path / "a" / "x.json"
    atomic_write_json(path, {"a": 1})
    atomic_write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]


def test_failed_write_leaves_old_file(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]


def test_atomic_directory(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError
    assert (target / "a").read_text() == "1"
    with atomic_directory(target) as tmp:
        (tmp / "b").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_atomic_directory_syncs_its_files_and_folders_before_the_rename(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd)
    )
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(a))) or replace(a, b))
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("1")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b").write_text("2")
    renamed = events.index(("replace", str(tmp)))
    synced = {path for kind, path in events[:renamed] if kind == "fsync"}
    assert {str(tmp / "a"), str(tmp / "sub" / "b"), str(tmp / "sub"), str(tmp)} <= synced
    assert ("fsync", str(tmp_path)) in events[renamed:]  # the parent, after the rename
    assert (target / "sub" / "b").read_text() == "2"


def test_a_file_where_the_folder_goes_is_refused_untouched(tmp_path):
    target = tmp_path / "model"
    target.write_text("mine")
    with pytest.raises(WhetstoneError, match=r"model is a file, not a folder: move it away"):
        with atomic_directory(target) as tmp:
            (tmp / "a").write_text("1")
    assert target.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_leftover_old_folder_from_a_crash_is_put_back_or_deleted(tmp_path):
    target, old = tmp_path / "ckpt", tmp_path / ".ckpt.old"
    old.mkdir()  # a crash between moving `ckpt` aside and renaming the new one into place
    (old / "a").write_text("previous")
    with pytest.raises(RuntimeError):
        with atomic_directory(target):
            raise RuntimeError("this write fails too")
    assert (target / "a").read_text() == "previous"  # the previous folder is back, not lost
    old.write_text("left by a crash after the new folder was in place (here: a file)")
    with atomic_directory(target) as tmp:
        (tmp / "b").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    # and every later write works too (a stale `.old` does not stop them)
    with atomic_directory(target) as tmp:
        (tmp / "c").write_text("newer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@contextmanager
def umask_set(umask: int) -> Iterator[None]:
    """The process's umask set to `umask`, and the one `atomic` read forgotten, for the block."""
    previous = os.umask(umask)
    _umask.cache_clear()
    try:
        yield
    finally:
        os.umask(previous)
        _umask.cache_clear()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_atomic_writes_get_the_permissions_of_a_plain_write(tmp_path, umask):
    with umask_set(umask):
        atomic_write_json(tmp_path / "new.json", {})
        with atomic_directory(tmp_path / "folder") as tmp:
            (tmp / "inside").write_text("x")
            os.close(os.open(tmp / "owner_only", os.O_CREAT | os.O_WRONLY, 0o600))  # as safetensors writes
            (tmp / "script").write_text("#!/bin/sh\n")
            (tmp / "script").chmod(0o700)
            (tmp / "sub").mkdir(mode=0o700)
        (tmp_path / "plain").write_text("x")
        (tmp_path / "plain_folder").mkdir()
    assert mode(tmp_path / "new.json") == mode(tmp_path / "plain") == 0o666 & ~umask
    assert mode(tmp_path / "folder") == mode(tmp_path / "plain_folder") == 0o777 & ~umask
    assert mode(tmp_path / "folder" / "inside") == mode(tmp_path / "folder" / "owner_only") == 0o666 & ~umask
    assert mode(tmp_path / "folder" / "script") == mode(tmp_path / "folder" / "sub") == 0o777 & ~umask
    os.chmod(tmp_path / "new.json", 0o600)  # a file's owner chose its mode: rewriting it keeps it
    atomic_write_json(tmp_path / "new.json", {"a": 1})
    assert mode(tmp_path / "new.json") == 0o600


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_umask_is_read_once_per_process(tmp_path):
    """whetstone never changes its umask after start, so the first write reads it and the later
    ones (the weight store's many chunks) do not: a change made after it goes unseen."""
    with umask_set(0o022):
        atomic_write_json(tmp_path / "first.json", {})
        os.umask(0o077)
        atomic_write_json(tmp_path / "second.json", {})
        with atomic_directory(tmp_path / "folder") as tmp:
            (tmp / "inside").write_text("x")
    assert mode(tmp_path / "first.json") == mode(tmp_path / "second.json") == 0o644
    assert mode(tmp_path / "folder") == 0o755 and mode(tmp_path / "folder" / "inside") == 0o644
    with umask_set(0o077):
        atomic_write_json(tmp_path / "private.json", {})
    assert mode(tmp_path / "private.json") == 0o600


def test_a_write_that_fails_names_the_file_and_the_cause(tmp_path):
    """A config.toml that cannot be written (here: over the file size limit, as a full disk stops
    a write part-way) is a WhetstoneError naming it and the cause, and leaves nothing behind."""
    path = tmp_path / "run" / "config.toml"
    script = (
        "import sys\n"
        "from whetstone.config import Config, write_toml\n"
        "from whetstone.errors import WhetstoneError\n"
        "class Run(Config):\n"
        "    name: str = 'x' * 1000\n"
        "try:\n"
        "    write_toml(sys.argv[1], Run())\n"
        "except WhetstoneError as err:\n"
        "    print(err)\n"
    )

    def file_size_limit() -> None:  # a write past it fails with EFBIG, not a signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))

    done = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=file_size_limit,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == f"cannot write {path}: File too large\n"
    assert list(path.parent.iterdir()) == []


def test_writable_folder_problem_names_a_file_or_a_read_only_folder_and_creates_nothing(tmp_path, monkeypatch):
    assert writable_folder_problem(tmp_path / "a" / "b") is None
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("x")
    assert writable_folder_problem(tmp_path / "file") == f"{tmp_path / 'file'} is a file, not a folder"
    assert writable_folder_problem(tmp_path / "file" / "run") == (
        f"{tmp_path / 'file' / 'run'} cannot be created: {tmp_path / 'file'} is a file, not a folder"
    )
    (tmp_path / "ro").mkdir()
    real_access = os.access
    # as root a folder's mode does not stop writes: os.access says what this process may do
    monkeypatch.setattr(os, "access", lambda p, m: Path(p).name != "ro" and real_access(p, m))
    assert writable_folder_problem(tmp_path / "ro") == f"{tmp_path / 'ro'} is not writable"
    assert writable_folder_problem(tmp_path / "ro" / "checkpoints") == (
        f"{tmp_path / 'ro' / 'checkpoints'} cannot be created: {tmp_path / 'ro'} is not writable"
    )


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_temporary_file_whose_mode_cannot_be_set_is_removed_with_its_descriptor(tmp_path, monkeypatch):
    """fchmod fails on some mounts (EPERM on a filesystem without Unix permissions): the write
    fails with that errno and the file's name, and leaves neither the temporary file nor its fd."""

    def refuse(fd: int, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchmod", refuse)
    path = tmp_path / "x.txt"
    before = _open_fds()
    with pytest.raises(OSError) as raised:
        with atomic_path(path) as tmp:
            tmp.write_text("never")
    assert list(tmp_path.iterdir()) == []
    assert _open_fds() == before
    assert raised.value.errno == 1 and raised.value.filename == str(path)
    with pytest.raises(WhetstoneError, match=r"Operation not permitted \(giving the new file mode 0o[0-7]+\)"):
        with write_errors(path):
            atomic_write_json(path, {})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["x" * 236 + ".json", "x" * 245 + ".json", "x" * 250 + ".json", "é" * 125 + ".json"])
def test_a_name_as_long_as_a_folder_allows_is_written(tmp_path, name):
    """The temporary sibling adds a dot, a random part and `.tmp` to the name: it is shortened
    (by whole characters) to fit the 255 bytes a name may have, so any valid name can be
    written, as a file or a folder."""
    atomic_write_json(tmp_path / name, {"a": 1})
    atomic_write_json(tmp_path / name, {"a": 2})
    assert json.loads((tmp_path / name).read_text()) == {"a": 2}
    for _ in range(2):  # the second replaces the first: its old copy is set aside meanwhile
        with atomic_directory(tmp_path / "d" / name) as tmp:
            (tmp / "f").write_text("1")
    assert [p.name for p in (tmp_path / "d").iterdir()] == [name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["d", name])


def test_an_exclusive_write_creates_the_file_once_with_a_plain_writes_mode(tmp_path):
    """An exclusive write links its temporary file into place: where the file exists it fails
    with FileExistsError and leaves that file as it was, and either way no temporary file."""
    path = tmp_path / ("x" * 250 + ".json")
    with umask_set(0o027):
        atomic_write_bytes(path, b"first", exclusive=True)
    assert path.read_bytes() == b"first" and mode(path) == 0o640
    path.chmod(0o600)
    with pytest.raises(FileExistsError):
        atomic_write_bytes(path, b"second", exclusive=True)
    assert path.read_bytes() == b"first" and mode(path) == 0o600
    assert list(tmp_path.iterdir()) == [path]
