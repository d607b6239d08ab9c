"""The file tools: read, list, search, write and edit files of the sandbox's workspace.

They work on the workspace directly from the host (no process start per call), so every path
is resolved and must stay inside the workspace: `..`, absolute paths elsewhere and symlinks
that point out (say, one the agent made with `ln -s /etc/passwd`) are refused. Paths may be
given relative to the workspace or as absolute paths under its in-sandbox location
(`/workspace/...`). No race is possible: the agent's commands have all ended when a tool runs.
Only regular files are read or written, opened without blocking and without following a link:
a FIFO, socket or device the agent made (`mkfifo p`) would otherwise block the tool for ever.
"""

from __future__ import annotations

import codecs
import errno
import os
import pickle
import re
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from whetstone.envs import prompts

MAX_GREP_MATCHES = 200
GREP_TIME_LIMIT_S = 10.0
"""Longest a grep call may search, all files together."""
MAX_LISTED = 500
READ_CHUNK = 1 << 16
"""Bytes `read_file` reads and decodes at a time."""


class ToolError(Exception):
    """A tool ran but could not do what was asked (no such file, no unique match); the message goes to the model."""


def head_tail(text: str, limit: int) -> str:
    """`text` cut to about `limit` characters, keeping its head and tail (where errors and summaries are)."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - 60) // 2
    return _marked_cut(text[:keep], len(text) - 2 * keep, text[len(text) - keep :] if keep else "")


def _marked_cut(head: str, cut: int, tail: str) -> str:
    return f"{head}\n[... {cut} characters cut ...]\n{tail}"


def _head_tail_of(file: BinaryIO, limit: int) -> str:
    """`head_tail(file's text, limit)`, the text decoded from UTF-8 with U+FFFD for what is no
    UTF-8, read and decoded a chunk at a time: a file of a gigabyte (a log a command wrote, within
    the disk budget) is never held whole in the harness's process for the few kilobytes shown."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    keep = max(0, limit - 60) // 2
    head, tail, total = "", "", 0
    while True:
        chunk = file.read(READ_CHUNK)
        text = decoder.decode(chunk, final=not chunk)
        total += len(text)
        if len(head) <= limit:
            head += text[: limit + 1 - len(head)]
        if keep:
            tail = (tail + text[-keep:])[-keep:]
        if not chunk:
            break
    return head if total <= limit else _marked_cut(head[:keep], total - 2 * keep, tail)


class Workspace:
    def __init__(self, root: Path, workdir: str, max_chars: int, disk_left: Callable[[], int]):
        self.root = root.resolve()
        self.workdir = workdir
        """Where the workspace appears inside the sandbox, so `/workspace/x.py` means `x.py`."""
        self.max_chars = max_chars
        self.disk_left = disk_left
        """Bytes the workspace may still grow by (the sandbox's disk budget, which writes count against)."""

    def path(self, name: str) -> Path:
        """The host path of `name`, refused if it leaves the workspace."""
        name = name.strip() or "."
        posix = PurePosixPath(name)
        if posix.is_absolute():
            try:
                posix = posix.relative_to(self.workdir)
            except ValueError:
                raise ToolError(f"{name}: outside the repository (it is at {self.workdir})") from None
        try:
            resolved = (self.root / posix).resolve()
        except (ValueError, OSError, RuntimeError) as err:  # a NUL byte; a symlink loop (RuntimeError before 3.13)
            raise ToolError(f"{name!r}: not a usable path ({err})") from None
        if not resolved.is_relative_to(self.root):
            raise ToolError(f"{name}: outside the repository")
        return resolved

    def _shown(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix() or "."

    def _open(self, target: Path, name: str, flags: int) -> int:
        """A descriptor of `target`, refused unless it is a regular file. Opened non-blocking, so
        that opening a FIFO returns at once (or fails) instead of waiting for its other end."""
        try:
            fd = os.open(target, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except FileNotFoundError:
            raise ToolError(f"{name} does not exist") from None
        except OSError as err:
            if err.errno in (errno.ENXIO, errno.ELOOP):  # a FIFO no one reads, a socket; a symlink
                raise ToolError(f"{name} is not a regular file") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ToolError(f"{name} is not a regular file")
        return fd

    def _write(self, target: Path, name: str, text: str) -> None:
        with open(self._open(target, name, os.O_WRONLY | os.O_CREAT), "wb") as file:
            file.truncate()
            file.write(text.encode("utf-8"))

    def read_file(self, path: str) -> str:
        target = self.path(path)
        if target.is_dir():
            raise ToolError(f"{path} is a directory (use list_dir)")
        with open(self._open(target, path, os.O_RDONLY), "rb") as file:
            if b"\0" in file.read(8192):
                raise ToolError(f"{path} is a binary file ({os.fstat(file.fileno()).st_size} bytes)")
            file.seek(0)
            return _head_tail_of(file, self.max_chars)

    def list_dir(self, path: str) -> str:
        target = self.path(path)
        if not target.is_dir():
            raise ToolError(f"{path} is not a directory" if target.exists() else f"{path} does not exist")
        entries = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(target) if e.name != "__pycache__")
        if len(entries) > MAX_LISTED:
            entries = entries[:MAX_LISTED] + [f"[... {len(entries) - MAX_LISTED} more]"]
        return "\n".join(entries) or "(empty directory)"

    def grep(self, pattern: str, path: str) -> str:
        """Lines matching `pattern` (Python's `re`), searched in a process of its own
        (`grep_search`) that is killed at `GREP_TIME_LIMIT_S`."""
        try:
            re.compile(pattern)
        except re.error as err:
            raise ToolError(f"invalid regex {pattern!r}: {err}") from None
        except (OverflowError, RecursionError) as err:  # `a{9999999999}`; groups nested hundreds deep
            raise ToolError(f"regex too large or nested too deeply: {err}") from None
        target = self.path(path)
        if not target.exists():
            raise ToolError(f"{path} does not exist")
        if not target.is_dir() and not target.is_file():
            raise ToolError(f"{path} is not a regular file")
        paths = [(self._shown(file), str(file)) for file in self._files(target)]
        matches = _search(pattern, MAX_GREP_MATCHES + 1, paths)
        if len(matches) > MAX_GREP_MATCHES:
            return "\n".join(matches[:MAX_GREP_MATCHES] + [f"[... more than {MAX_GREP_MATCHES} matches]"])
        return head_tail("\n".join(matches), self.max_chars) or "no matches"

    def _files(self, target: Path) -> list[Path]:
        if target.is_file():
            return [target]
        found = []
        for directory, subdirs, files in os.walk(target):  # does not follow symlinked directories
            subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and d != "__pycache__")
            found += [Path(directory, f) for f in files if _is_regular(Path(directory, f))]
        return sorted(found)

    def write_file(self, path: str, content: str) -> str:
        target = self.path(path)
        if target.is_dir():
            raise ToolError(f"{path} is a directory")
        self._check_room(target, content)
        target.parent.mkdir(parents=True, exist_ok=True)
        self._write(target, path, content)
        return prompts.write_result(self._shown(target), content)

    def edit(self, path: str, old: str, new: str) -> str:
        target = self.path(path)
        if target.is_dir():
            raise ToolError(f"{path} cannot be edited: it is a directory")
        try:
            # newline="": the text as it is on disk, so "\r\n" endings match `old` and are written back unchanged
            with open(self._open(target, path, os.O_RDONLY), encoding="utf-8", newline="") as file:
                text = file.read()
        except UnicodeDecodeError as err:
            raise ToolError(f"{path} cannot be edited: {err}") from None
        count = text.count(old) if old else 0
        if count == 0 and old and "\r" in text:
            # the model wrote its lines with "\n" (as JSON strings mostly are). In a file whose lines
            # end in "\r\n": the same lines with those endings, `new` written with them too; where
            # they are mixed (a line appended with echo) or "\r" alone: every line as a "\n" line
            crlf = [_lf_lines(part).replace("\n", "\r\n") for part in (old, new)]
            if text.count(crlf[0]):
                (old, new), count = crlf, text.count(crlf[0])
            else:
                text, old = _lf_lines(text), _lf_lines(old)
                count = text.count(old)
        if count != 1:
            found = "old text not found" if count == 0 else f"old text occurs {count} times"
            raise ToolError(f"{path}: {'old is empty' if not old else found}; give text that occurs exactly once")
        text = text.replace(old, new, 1)
        self._check_room(target, text)
        self._write(target, path, text)
        return prompts.edit_result(self._shown(target))

    def _check_room(self, target: Path, content: str) -> None:
        """Refuse a write that would take the workspace over its disk budget."""
        growth = len(content.encode("utf-8")) - (target.stat().st_size if target.is_file() else 0)
        left = self.disk_left()
        if growth > 0 and growth > left:
            raise ToolError(
                f"{self._shown(target)}: writing {growth} more bytes would take the workspace over its disk budget "
                f"({max(left, 0)} bytes left); delete files first"
            )


def _is_regular(path: Path) -> bool:
    """Whether `path` itself (not what a symlink points to) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _lf_lines(text: str) -> str:
    """`text` with its `\r\n` and `\r` line endings as `\n`."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _search(pattern: str, limit: int, paths: list[tuple[str, str]]) -> list[str]:
    """`grep_search` run on `paths` in a process of its own, killed at `GREP_TIME_LIMIT_S`."""
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", str(Path(__file__).with_name("grep_search.py"))],
            input=pickle.dumps((pattern, limit, paths)),
            capture_output=True,
            timeout=GREP_TIME_LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        raise ToolError(
            f"the search for {pattern!r} ran past {GREP_TIME_LIMIT_S:g} s: use a simpler pattern "
            "(one that cannot backtrack without end) or search fewer files"
        ) from None
    if done.returncode != 0:  # out of memory, say: the agent's call failed, not the rollout
        last = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise ToolError(f"the search failed: {last[0]}")
    return pickle.loads(done.stdout)
