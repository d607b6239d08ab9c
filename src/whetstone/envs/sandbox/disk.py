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
Walks (`_tree`) go to any depth without recursion and with a bounded number of open folders,
since a command that keeps making a folder and going into it nests thousands deep in a second;
a path past `MAX_PATH_CHARS` counts as over the budget. A walk that lost its way back up (a
folder moved while it was below it, as package managers and builds move folders about) is walked
again; one lost again while the command runs measures nothing, and the budget is then judged by
how much the filesystems grew since the last whole walk. After the command, a walk still lost
counts as over the budget. A folder its owner made unreadable or unsearchable is opened up
for its owner (the caller, when not root, is bound by those modes): its mode is changed through
a descriptor of that very folder (`_open_up`), never by name, since a command still running
could swap the name for a symlink to a host file meanwhile. A folder locked again before the
walk could open it (a command still running that keeps running `chmod 000` on it) loses the
walk its way as a moved folder does; once the command has ended, nothing locks it again.
Opening up goes through /proc/self/fd: without /proc mounted it is an error.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from whetstone.errors import WhetstoneError

BLOCK = 4096
"""The least an entry is charged."""
POLL_S = 0.05
"""Time between two checks while a command runs (each a few `statvfs` calls)."""
WALK_EVERY_S = 1.0
"""Longest time between two walks of the directories while a command runs."""
POLL_COST_SHARE = 0.2
"""Walks are spaced so that they take at most this share of the time (large workspaces)."""
MAX_PATH_CHARS = 4096
"""Longest path (relative to its directory) the budget's inventory records, as long as a path
tools can open (PATH_MAX). Folders nested deeper count as over the budget: an inventory of such
a chain would grow with the square of its depth."""
KEEP_OPEN = 16
"""Folders a walk keeps open above the one it is in; deeper ones are opened again through `..`
on the way back up, so that a walk of any depth holds a bounded number of descriptors."""
WALK_TRIES = 3
"""Walks tried in a row while each loses its way (a command still running moves folders about)."""
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
"""What opening a folder met during a walk fails with once it was removed or replaced (ELOOP: by a symlink)."""


@dataclass
class Scan:
    """What the directories hold: every entry by its path (relative to its directory), and the bytes charged."""

    entries: dict[tuple[int, str], tuple[int, int, int, int]] = field(default_factory=dict)
    """(index of the directory, relative path) -> (inode, size, blocks, mode)."""
    used: int = 0
    complete: bool = True
    """False when the walk stopped early: the total had passed its bound, or part of the tree
    could not be counted (then charged as over the bound)."""
    too_deep: bool = False
    """A path longer than `MAX_PATH_CHARS` was met: the walk stopped there, charged past its bound."""
    lost: bool = False
    """Part of the tree went uncounted, charged past its bound: a folder was moved while the walk
    was below it, or locked again (chmod) as the walk opened it up, by a command still running."""


def scan(directories: list[Path], stop_above: int | None = None) -> Scan:
    """Walk `directories` without following symlinks; stop once more than `stop_above` bytes are
    counted, or at a path longer than `MAX_PATH_CHARS` (then charged as over `stop_above`)."""
    result, hard_links = Scan(), set()
    for index, directory in enumerate(directories):
        try:
            fd = _open_top(directory)
        except FileNotFoundError:
            continue
        except PermissionError:  # locked again as it was opened up (a command still running): uncounted
            _charge_over(result, stop_above)
            result.complete, result.lost = False, True
            return result
        try:
            if not _count(fd, index, result, hard_links, stop_above):
                result.complete = False
                return result
        finally:
            os.close(fd)
    return result


def _scan_settled(directories: list[Path], stop_above: int | None) -> Scan:
    """`scan`, walked again (up to `WALK_TRIES` walks in all) while a walk loses its way: the last walk."""
    for _ in range(WALK_TRIES - 1):
        walked = scan(directories, stop_above)
        if not walked.lost:
            return walked
    return scan(directories, stop_above)


def _charge_over(result: Scan, stop_above: int | None) -> None:
    """Charge what a walk could not count as over its bound."""
    result.used = max(result.used, stop_above + 1 if stop_above is not None else 0)


def _count(fd: int, index: int, result: Scan, hard_links: set, stop_above: int | None) -> bool:
    # Kept lean: about 5 us an entry, so a repository of 5,000 files is measured in ~25 ms.
    lost: list[str | None] = []
    with closing(_tree(fd, lost=lost)) as tree:
        for _, path, _, st in tree:
            if lost:
                break
            if st is None:
                continue
            if path is None:
                result.too_deep = True
                _charge_over(result, stop_above)
                return False
            result.entries[index, path] = (st.st_ino, st.st_size, st.st_blocks, st.st_mode)
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):  # a hard link: its inode is charged once
                if (st.st_dev, st.st_ino) in hard_links:
                    continue
                hard_links.add((st.st_dev, st.st_ino))
            result.used += max(st.st_blocks * 512, BLOCK)
            if stop_above is not None and result.used > stop_above:
                return False
    if lost:  # what was left above a moved folder, or in one locked again, went uncounted: over the bound
        _charge_over(result, stop_above)
        result.lost = True
        return False
    return True


@dataclass
class _Level:
    """A folder a walk is in or above."""

    fd: int | None
    """Open while the walk is in it or at most `KEEP_OPEN` levels below the top; else None."""
    key: tuple[int, int]
    """(device, inode): how it is recognized when opened again through `..`."""
    path: str | None
    """Relative to the top ("" for the top); None past `MAX_PATH_CHARS`."""
    name: str
    names: Iterator[str]
    """What is left of its listing: read as the walk goes while the folder is open, in full once it is closed."""

    def close(self) -> None:
        """Close its fd, keeping the rest of its listing for when it is opened again. The listing
        is read into a list once, on the first close (which closes its own fd too): a level deeper
        than `KEEP_OPEN` is closed again at each of its subfolders, and copying the rest of a big
        folder's listing each time would make the walk quadratic."""
        if hasattr(self.names, "close"):  # still read lazily (`_listing`)
            self.names = iter(list(self.names))
        os.close(self.fd)
        self.fd = None


def _listing(fd: int, changes: bool) -> Iterator[str]:
    """The names in the folder open as `fd`. Read lazily, so that a walk that stops at its bound
    reads no more of a huge folder than it counted; read in full first when the walk `changes`
    the folder, since entries removed while a folder is read can make it skip others."""
    if changes:
        yield from os.listdir(fd)
        return
    with os.scandir(fd) as entries:
        for entry in entries:
            yield entry.name


def _tree(
    top: int, changes: bool = False, lost: list[str | None] | None = None
) -> Iterator[tuple[int, str | None, str, os.stat_result | None]]:
    """Every entry under the folder open as `top`, depth first, never through a symlink: (the fd
    of its folder, its path relative to the top or None past `MAX_PATH_CHARS`, its name, its
    lstat), and once a folder's contents are done (the fd of its parent, its path, its name, None).
    An fd is good until the next step; `changes`: the caller removes entries as it goes. Entries
    removed or replaced meanwhile are passed over. A folder moved meanwhile ends the walk of what
    was left above it, up to a folder still open, and what a folder locked again as it is opened
    up (`_open_up`, `_lstat`) holds is passed over: their paths are added to `lost`. No recursion and
    at most 2 x (`KEEP_OPEN` + 2) descriptors besides `top` (a folder and its listing): a sandboxed
    command can nest folders far deeper than Python's recursion limit or the descriptors a
    process may open."""
    levels = [_Level(top, _key(top), "", "", _listing(top, changes))]
    try:
        while True:
            level = levels[-1]
            name = next(level.names, None)
            if name is not None:
                try:
                    st = _lstat(level.fd, name)
                except FileNotFoundError:
                    continue
                except PermissionError:  # its folder was locked again as it was opened up
                    if lost is not None:
                        lost.append(level.path)
                    continue
                path = None if level.path is None else f"{level.path}/{name}" if level.path else name
                if path is not None and len(path) > MAX_PATH_CHARS:
                    path = None
                yield level.fd, path, name, st
                if not stat.S_ISDIR(st.st_mode):
                    continue
                try:
                    child = _open_dir(level.fd, name)
                except PermissionError:  # locked again as it was opened up
                    if lost is not None:
                        lost.append(path)
                    continue
                except OSError as error:
                    if error.errno in _GONE:
                        continue
                    raise
                try:
                    levels.append(_Level(child, _key(child), path, name, _listing(child, changes)))
                except BaseException:
                    os.close(child)
                    raise
                if len(levels) - 2 > KEEP_OPEN:
                    level.close()
                continue
            if len(levels) == 1:
                return
            levels.pop()
            parent = levels[-1]
            if parent.fd is None:
                parent.fd = _reopen_parent(level.fd, parent.key)
            os.close(level.fd)
            if parent.fd is None:  # moved: the rest of the folders above it that are closed is passed over
                if lost is not None:
                    lost.append(level.path)
                while levels[-1].fd is None:
                    levels.pop()
                continue
            yield parent.fd, level.path, level.name, None
    finally:
        for level in levels:
            if hasattr(level.names, "close"):  # a listing still being read holds an fd of its own
                level.names.close()
        for level in levels[1:]:
            if level.fd is not None:
                os.close(level.fd)


def _key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _reopen_parent(fd: int, key: tuple[int, int]) -> int | None:
    """The folder above the one open as `fd`, if it is still the one whose (device, inode) is
    `key`; one made unreadable meanwhile is opened up once recognized."""
    try:
        try:
            parent = os.open("..", os.O_PATH | os.O_DIRECTORY, dir_fd=fd)
        except PermissionError:  # a folder its owner may not search: opened up, as by `_lstat`
            os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | 0o700)
            parent = os.open("..", os.O_PATH | os.O_DIRECTORY, dir_fd=fd)
    except OSError:
        return None
    try:
        return _open_up(parent) if _key(parent) == key else None
    except OSError:
        return None
    finally:
        os.close(parent)


def _lstat(fd: int, name: str) -> os.stat_result:
    """`name`'s lstat in the folder open as `fd`. A folder its owner made unsearchable (`chmod 400`:
    listed, but nothing in it can be looked at) is opened up for its owner first, as `_open_dir` does."""
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except PermissionError:
        os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | 0o700)
        return os.stat(name, dir_fd=fd, follow_symlinks=False)


def _open_top(directory: Path) -> int:
    """The fd of a directory a walk starts from; one its owner locked (`chmod 000` on the
    workspace itself) is opened up for its owner first. Its path is looked up once: the folder
    found is the one opened up, whatever is renamed meanwhile."""
    pinned = os.open(directory, os.O_PATH | os.O_DIRECTORY)
    try:
        return _open_up(pinned)
    finally:
        os.close(pinned)


def _open_up(pinned: int) -> int:
    """The folder `pinned` (an O_PATH fd) opened for reading; one its owner made unreadable or
    unsearchable is made rwx for its owner first. Both act on the inode `pinned` holds, never on
    a name a running command could have swapped for a symlink meanwhile. PermissionError when a
    command still running locked it again in between."""
    try:
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=pinned)
    except PermissionError:
        os.chmod(_by_fd(pinned), stat.S_IMODE(os.fstat(pinned).st_mode) | 0o700)
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=pinned)


def _by_fd(fd: int) -> str:
    """A path that acts on the inode open as `fd` (for calls that take no fd: chmod of an O_PATH
    fd, opening it anew). Without /proc mounted it is missing, and taking that for an entry
    removed meanwhile would let what a locked folder holds escape the budget: an error instead."""
    if not os.path.isdir("/proc/self/fd"):
        raise WhetstoneError(
            "/proc is not mounted on this host: the sandbox's disk budget needs /proc/self/fd to open up "
            "folders and files the sandboxed code locked; mount proc at /proc"
        )
    return f"/proc/self/fd/{fd}"


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
        self.start = _scan_settled(directories, limit)
        """What the directories held before the command (`complete` is False when that is over the limit)."""
        self._walked = self.start.used
        self._schedule_walks(began)
        self.due = time.perf_counter() + POLL_S
        """When the next check is due (`time.perf_counter`)."""
        self._file_cap: int | None = None
        self._lost = False
        """Whether the last walk while the command runs lost its way (`check`)."""
        self.too_deep = self.start.too_deep
        """Whether a walk met a path longer than `MAX_PATH_CHARS` (charged as over the budget)."""

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
        last one (others freeing space at the same time could hide the growth). Walks that keep
        losing their way measure nothing: that growth since the last whole walk is then the
        measure, so a command moving folders about is stopped only once it could be over."""
        now = time.perf_counter()
        in_tmpfs = tmpfs_used(pid, self.tmpfs) if self.tmpfs else 0
        on_disk = filesystems_used(self.directories)
        could_be_over = in_tmpfs + self._walked + max(0, on_disk - self._disk_at_walk) > self.limit
        if (could_be_over and now >= self._walk_allowed) or now >= self._walk_due:
            walked = _scan_settled(self.directories, self.limit - in_tmpfs)
            self.too_deep = self.too_deep or walked.too_deep
            self._lost = walked.lost
            if not walked.lost:
                self._walked, self._disk_at_walk = walked.used, on_disk
            self._schedule_walks(now)
        self.due = time.perf_counter() + POLL_S
        over = could_be_over if self._lost else in_tmpfs + self._walked > self.limit
        return "disk" if over else None

    def _schedule_walks(self, began: float) -> None:
        """After a walk that began at `began`: when the next may start, and when it must."""
        done = time.perf_counter()
        self._walk_allowed = began + (done - began) / POLL_COST_SHARE
        self._walk_due = max(done + WALK_EVERY_S, self._walk_allowed)

    def ran_into(self) -> bool:
        """After the command: it left the directories over the budget, or grew a file up to the
        size cap that what was left of the budget set (a write cut short by RLIMIT_FSIZE). A file
        already that large before (kept, shrunk, moved or rewritten no larger) reached nothing."""
        after = _scan_settled(self.directories, self.limit)
        self.too_deep = self.too_deep or after.too_deep
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
            fd = _open_top(directory)
        except FileNotFoundError:
            continue
        try:
            _undo(fd, index, before, undone)
        finally:
            os.close(fd)
    return undone


def _undo(top: int, index: int, before: Scan, undone: Undone) -> None:
    with closing(_tree(top, changes=True)) as tree:
        for fd, path, name, st in tree:
            old = before.entries.get((index, path)) if path is not None else None
            if st is None:  # a folder, its contents done
                if old is None or not stat.S_ISDIR(old[3]):
                    _remove(fd, name, os.rmdir)
                    undone.removed += 1
            elif stat.S_ISDIR(st.st_mode):
                continue
            elif old is not None and stat.S_ISREG(old[3]):  # the task's file, or what replaced it
                grew = st.st_size > old[1] or st.st_blocks > old[2]
                if grew and stat.S_ISREG(st.st_mode) and _cut_back(fd, name, old[1]):
                    undone.cut_back += 1
            elif old is None or old[0] != st.st_ino or stat.S_IFMT(old[3]) != stat.S_IFMT(st.st_mode):
                _remove(fd, name, os.unlink)
                undone.removed += 1


def _open_dir(fd: int, name: str) -> int:
    """A subdirectory's fd, never through a symlink. One the owner made unreadable (mode 000)
    is opened up for its owner first (`_open_up`): content the walk cannot see would escape the budget."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
    except PermissionError:
        pass
    pinned = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
    try:
        return _open_up(pinned)
    finally:
        os.close(pinned)


def _remove(fd: int, name: str, remove) -> None:
    """`remove` (unlink or rmdir) `name` in directory `fd`, making the directory writable if need
    be; one already gone (removed by a process still running) is left gone."""
    try:
        try:
            remove(name, dir_fd=fd)
        except PermissionError:
            os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | 0o700)
            remove(name, dir_fd=fd)
    except FileNotFoundError:
        pass


def _cut_back(fd: int, name: str, size: int) -> bool:
    """Truncate `name` to `size` bytes if it is a regular file, and say whether it could. A file
    made read-only is made writable for its owner just long enough to open it, then gets its mode
    back. The file is pinned first (O_PATH, never through a symlink) and its mode changed and it
    opened through that fd: a running command swapping the name for a symlink to a host file
    meanwhile changes nothing outside, and a FIFO put in its place is not opened."""
    try:
        pinned = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=fd)
    except OSError as error:
        if error.errno in _GONE:
            return False
        raise
    try:
        st = os.fstat(pinned)
        if not stat.S_ISREG(st.st_mode):
            return False
        inode = _by_fd(pinned)  # opening or changing this acts on the pinned inode
        try:
            file = os.open(inode, os.O_WRONLY)
        except PermissionError:
            mode = stat.S_IMODE(st.st_mode)
            try:
                os.chmod(inode, mode | stat.S_IWUSR)
                try:
                    file = os.open(inode, os.O_WRONLY)
                finally:
                    os.chmod(inode, mode)
            except PermissionError:  # not its owner's to change: left as it is
                return False
    finally:
        os.close(pinned)
    try:
        os.ftruncate(file, size)
    finally:
        os.close(file)
    return True


def remove_tree(path: Path) -> None:
    """Delete the folder `path` and everything under it, as far as this process may, never
    through a symlink and at any depth. Sandboxed code can take its owner's rights away (`chmod
    500` or `000` on a folder: its files are the caller's), which stops a plain `shutil.rmtree` of
    a caller that is not root: such folders are opened up for their owner (`_remove`,
    `_open_dir`). Python 3.11's `shutil.rmtree` also recurses, and a command nests folders
    deeper than that allows in a second. What still cannot be removed is left, as `ignore_errors`
    would leave it."""
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        try:
            top = _open_dir(parent, path.name)
        except OSError:
            return
        try:
            with closing(_tree(top, changes=True)) as tree:
                for fd, _, name, st in tree:
                    if st is None or not stat.S_ISDIR(st.st_mode):
                        _remove_if_possible(fd, name, os.rmdir if st is None else os.unlink)
        except OSError:
            pass
        finally:
            os.close(top)
        _remove_if_possible(parent, path.name, os.rmdir)
    finally:
        os.close(parent)


def _remove_if_possible(fd: int, name: str, remove) -> None:
    """`_remove`, leaving what cannot be removed."""
    try:
        _remove(fd, name, remove)
    except OSError:
        pass
