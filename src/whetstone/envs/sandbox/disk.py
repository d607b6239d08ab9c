"""The disk budget of a sandbox: its workspace, its /tmp and /dev together, enforced while commands run.

The workspace is a host directory (the harness and grading read it directly), so no
filesystem limit applies to it without root (a loop mount, a tmpfs or a quota per sandbox all
need privileges). Instead the budget is measured: the workspace (and any writable mount) is
walked before a command and once after it; every `POLL_S` while it runs, /tmp and /dev (tmpfs
mounts inside the sandbox) are read with one `statvfs` each through the sandbox's root
(`/proc/<pid>/root`), and the workspace is walked again when its filesystem has grown enough
to have used up the budget, and at least every `WALK_EVERY_S`. A command that goes over the
budget is killed, and what it added to the directories is taken back: files and directories
it created are deleted, files it grew are cut back to their earlier size (a file the task had
is never deleted, even when the command replaced it with a new one). RLIMIT_FSIZE, lowered to
what is left of the budget, keeps any one file from running past it between checks.

Usage is what the files occupy (`st_blocks`, so sparse files cost what they store and
preallocated ones what they hold), each inode once, and at least one block per entry: an
inode and its directory entry cost space too, and that bounds how many entries a walk visits.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 4096
"""The least an entry is charged."""
POLL_S = 0.05
"""Time between two checks while a command runs (each a few `statvfs` calls)."""
WALK_EVERY_S = 1.0
"""Longest time between two walks of the directories while a command runs."""
POLL_COST_SHARE = 0.2
"""Walks are spaced so that they take at most this share of the time (large workspaces)."""


@dataclass
class Scan:
    """What the directories hold: every entry by its path (relative to its directory), and the bytes charged."""

    entries: dict[tuple[int, str], tuple[int, int, int, int]] = field(default_factory=dict)
    """(index of the directory, relative path) -> (inode, size, blocks, mode)."""
    used: int = 0
    complete: bool = True
    """False when the walk stopped early, because the total had passed its bound."""


def scan(directories: list[Path], stop_above: int | None = None) -> Scan:
    """Walk `directories` without following symlinks; stop once more than `stop_above` bytes are counted."""
    result, hard_links = Scan(), set()
    for index, directory in enumerate(directories):
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue
        try:
            if not _walk(fd, "", index, result, hard_links, stop_above):
                result.complete = False
                return result
        finally:
            os.close(fd)
    return result


def _walk(fd: int, prefix: str, index: int, result: Scan, hard_links: set, stop_above: int | None) -> bool:
    # Kept lean: about 5 us an entry, so a repository of 5,000 files is measured in ~25 ms.
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            path = prefix + entry.name
            is_dir = stat.S_ISDIR(st.st_mode)
            result.entries[index, path] = (st.st_ino, st.st_size, st.st_blocks, st.st_mode)
            if st.st_nlink > 1 and not is_dir:  # a hard link: its inode is charged once
                if (st.st_dev, st.st_ino) in hard_links:
                    continue
                hard_links.add((st.st_dev, st.st_ino))
            result.used += max(st.st_blocks * 512, BLOCK)
            if stop_above is not None and result.used > stop_above:
                return False
            if is_dir:
                try:
                    child = _open_dir(fd, entry.name)
                except FileNotFoundError:
                    continue
                try:
                    if not _walk(child, path + "/", index, result, hard_links, stop_above):
                        return False
                finally:
                    os.close(child)
    return True


def tmpfs_used(pid: int, mounts: dict[str, int]) -> int:
    """Bytes used in the sandbox's tmpfs mounts ({path inside: size, or 0 if unbounded}), seen
    through the root of bwrap's child (pid 1 of the sandbox). 0 until that root is in place."""
    try:
        child = int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return 0
    used = 0
    for path, size in mounts.items():  # /tmp (of a known size) first: it proves the root is the sandbox's
        try:
            fs = os.statvfs(f"/proc/{child}/root{path}")
        except OSError:
            return 0
        if size and fs.f_blocks * fs.f_frsize != size:
            return 0  # not our tmpfs yet: bwrap is still building the sandbox's root
        used += (fs.f_blocks - fs.f_bfree) * fs.f_frsize
    return used


def filesystems_used(directories: list[Path]) -> int:
    """Bytes in use on the filesystems that hold `directories` (each filesystem once)."""
    devices, used = set(), 0
    for directory in directories:
        try:
            device, fs = os.stat(directory).st_dev, os.statvfs(directory)
        except OSError:
            continue
        if device not in devices:
            devices.add(device)
            used += (fs.f_blocks - fs.f_bfree) * fs.f_frsize
    return used


class DiskWatch:
    """One command's disk budget: measured before it starts (`start`), now and then while it runs
    (`check`, from `run_process`) and after it ends (`ran_into`)."""

    def __init__(self, directories: list[Path], tmpfs: dict[str, int], limit: int):
        self.directories, self.tmpfs, self.limit = directories, tmpfs, limit
        began = time.perf_counter()
        self._disk_at_walk = filesystems_used(directories)
        self.start = scan(directories, limit)
        """What the directories held before the command (`complete` is False when that is over the limit)."""
        self._walked = self.start.used
        self._schedule_walks(began)
        self.due = time.perf_counter() + POLL_S
        """When the next check is due (`time.perf_counter`)."""
        self._file_cap: int | None = None

    def file_limit(self, max_file_bytes: int) -> int:
        """RLIMIT_FSIZE for the command: `max_file_bytes`, or less when less of the budget is left."""
        left = (self.limit - self.start.used) >> 9 << 9  # RLIMIT_FSIZE is set in 512-byte blocks
        if left < max_file_bytes:
            self._file_cap = left
        return min(left, max_file_bytes)

    def check(self, pid: int) -> str | None:
        """A walk costs ~5 us an entry; most checks need none. The filesystems' own usage can only
        have grown by at least what the directories grew by since the last walk, so a walk is
        due only when that growth could have used up the budget, or `WALK_EVERY_S` after the
        last one (others freeing space at the same time could hide the growth)."""
        now = time.perf_counter()
        in_tmpfs = tmpfs_used(pid, self.tmpfs) if self.tmpfs else 0
        on_disk = filesystems_used(self.directories)
        could_be_over = in_tmpfs + self._walked + max(0, on_disk - self._disk_at_walk) > self.limit
        if (could_be_over and now >= self._walk_allowed) or now >= self._walk_due:
            self._disk_at_walk = on_disk
            self._walked = scan(self.directories, self.limit - in_tmpfs).used
            self._schedule_walks(now)
        self.due = time.perf_counter() + POLL_S
        return "disk" if in_tmpfs + self._walked > self.limit else None

    def _schedule_walks(self, began: float) -> None:
        """After a walk that began at `began`: when the next may start, and when it must."""
        done = time.perf_counter()
        self._walk_allowed = began + (done - began) / POLL_COST_SHARE
        self._walk_due = max(done + WALK_EVERY_S, self._walk_allowed)

    def ran_into(self) -> bool:
        """After the command: it left the directories over the budget, or grew a file up to the
        size cap that what was left of the budget set (a write cut short by RLIMIT_FSIZE). A file
        already that large before (kept, shrunk, moved or rewritten no larger) reached nothing."""
        after = scan(self.directories, self.limit)
        if after.used > self.limit:
            return True
        cap = self._file_cap
        if cap is None:
            return False
        before = self.start.entries
        by_inode = {(index, ino): size for (index, _), (ino, size, _, mode) in before.items() if stat.S_ISREG(mode)}
        for key, (ino, size, _, mode) in after.entries.items():
            if not stat.S_ISREG(mode) or size < cap:
                continue
            old = before.get(key)
            at_path = old[1] if old is not None and stat.S_ISREG(old[3]) else -1
            if size > max(at_path, by_inode.get((key[0], ino), -1)):
                return True
        return False

    def undo(self) -> Undone:
        """Take back what the command added to the directories (see `undo_growth`)."""
        return undo_growth(self.directories, self.start)


@dataclass
class Undone:
    removed: int = 0
    cut_back: int = 0


def undo_growth(directories: list[Path], before: Scan) -> Undone:
    """Delete what was created since `before` and cut files that grew back to their earlier size.

    What was there is judged by path: a path that held a regular file is never deleted, since
    that file is the task's (an edit that wrote a new file in its place, as `sed -i` and atomic
    writes do, stays; grown, it is cut back), and a folder that was there stays, its contents
    judged one by one. Other entries whose inode or type changed are new."""
    undone = Undone()
    for index, directory in enumerate(directories):
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue
        try:
            _undo(fd, "", index, before, undone)
        finally:
            os.close(fd)
    return undone


def _undo(fd: int, prefix: str, index: int, before: Scan, undone: Undone) -> None:
    with os.scandir(fd) as listing:
        entries = list(listing)
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        old = before.entries.get((index, prefix + entry.name))
        if stat.S_ISDIR(st.st_mode):
            child = _open_dir(fd, entry.name)
            try:
                _undo(child, prefix + entry.name + "/", index, before, undone)
            finally:
                os.close(child)
            if old is None or not stat.S_ISDIR(old[3]):
                _remove(fd, entry.name, os.rmdir)
                undone.removed += 1
        elif old is not None and stat.S_ISREG(old[3]):  # the task's file, or what replaced it
            grew = st.st_size > old[1] or st.st_blocks > old[2]
            if grew and stat.S_ISREG(st.st_mode) and _cut_back(fd, entry.name, old[1]):
                undone.cut_back += 1
        elif old is None or old[0] != st.st_ino or stat.S_IFMT(old[3]) != stat.S_IFMT(st.st_mode):
            _remove(fd, entry.name, os.unlink)
            undone.removed += 1


def _open_dir(fd: int, name: str) -> int:
    """A subdirectory's fd, never through a symlink. One the owner made unreadable (mode 000)
    is opened up for its owner first: content the walk cannot see would escape the budget."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        return os.open(name, flags, dir_fd=fd)
    except PermissionError:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
        os.chmod(name, stat.S_IMODE(mode) | 0o700, dir_fd=fd)
        return os.open(name, flags, dir_fd=fd)


def _remove(fd: int, name: str, remove) -> None:
    """`remove` (unlink or rmdir) `name` in directory `fd`, making the directory writable if need be."""
    try:
        remove(name, dir_fd=fd)
    except PermissionError:
        os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | 0o700)
        remove(name, dir_fd=fd)


def _cut_back(fd: int, name: str, size: int) -> bool:
    """Truncate `name` to `size` bytes, and say whether it could. A file made read-only is made
    writable for its owner just long enough to open it, then gets its mode back."""
    flags = os.O_WRONLY | os.O_NOFOLLOW
    try:
        file = os.open(name, flags, dir_fd=fd)
    except PermissionError:
        mode = stat.S_IMODE(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
        try:
            os.chmod(name, mode | stat.S_IWUSR, dir_fd=fd)
            try:
                file = os.open(name, flags, dir_fd=fd)
            finally:
                os.chmod(name, mode, dir_fd=fd)
        except PermissionError:  # not its owner's to change: left as it is
            return False
    try:
        os.ftruncate(file, size)
    finally:
        os.close(file)
    return True


def remove_tree(path: Path) -> None:
    """Delete `path` and everything under it, as far as this process may. Sandboxed code can
    take its owner's rights away (`chmod 500` or `000` on a folder: its files are the caller's),
    which stops a plain `shutil.rmtree` of a caller that is not root: such folders are opened up
    for their owner (`_remove`, `_open_dir`) and the removal tried again. What still cannot be
    removed is left, as `ignore_errors` would leave it."""
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=_remove_anyway)
    else:
        shutil.rmtree(path, onerror=lambda function, failed, info: _remove_anyway(function, failed, info[1]))


def _remove_anyway(function, path: str, error: BaseException) -> None:
    """`shutil.rmtree`'s error handler for `remove_tree`: `function` failed on `path`."""
    if not isinstance(error, PermissionError):
        return
    parent, name = os.path.split(path)
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        if function in (os.unlink, os.rmdir):  # a folder without write permission
            _remove(fd, name, function)
        elif function is os.open:  # a folder its owner may not read: opened up, then emptied and removed
            os.close(_open_dir(fd, name))
            remove_tree(Path(path))
    except OSError:
        pass
    finally:
        os.close(fd)
