"""Per-sandbox cgroups: the limits that bind a whole process tree, even for root.

RLIMIT_NPROC does not bind root (and counts every process of a user, not of a sandbox), and
RLIMIT_AS bounds one process, not a tree. Where a cgroup hierarchy is writable (root in a
container or VM, or a delegated subtree) each sandbox gets its own group with `pids.max` and a
memory limit; a fork bomb then stops at the limit and a memory bomb meets the OOM killer inside
the group. cgroup v1 (separate `pids` and `memory` hierarchies) and v2 (one unified tree) are
supported; when neither is writable, `find_cgroup_root` returns None and rlimits are all we have.
"""

from __future__ import annotations

import errno
import itertools
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from whetstone.utils.cgroups import own_cgroup_path

MOUNTS = Path("/sys/fs/cgroup")
_counter = itertools.count()


@dataclass(frozen=True)
class CgroupRoot:
    """Where this process may create sandbox groups: one directory per controller."""

    version: int
    pids_dir: Path
    memory_dir: Path


def _sandbox_parent(hierarchy: Path, own: str, controllers: tuple[str, ...] = ()) -> Path | None:
    """`<own group>/whetstone` in `hierarchy` (made if missing), where sandbox groups go; None
    where it cannot be made or written, or (v2) does not get every one of `controllers` from its
    parent. A folder made here and not usable is removed again: left inside this process's group,
    it would keep that group from being removed (a run's CPU group, `utils.cgroups.CpuGroup`)."""
    parent = hierarchy / own.lstrip("/") / "whetstone"
    try:
        parent.mkdir()
        made = True
    except FileExistsError:
        made = False
    except OSError:
        return None
    try:
        available = set((parent / "cgroup.controllers").read_text().split()) if controllers else set()
        if os.access(parent, os.W_OK) and set(controllers) <= available:
            return parent
    except OSError:
        pass
    if made:
        try:
            parent.rmdir()
        except OSError:  # another process's sandboxes took it meanwhile
            pass
    return None


def find_cgroup_root() -> CgroupRoot | None:
    """The writable cgroup directories for pids and memory, or None when there are none."""
    try:
        pids_own, memory_own = own_cgroup_path("pids"), own_cgroup_path("memory")
        if pids_own is not None and memory_own is not None:
            pids = _sandbox_parent(MOUNTS / "pids", pids_own)
            memory = _sandbox_parent(MOUNTS / "memory", memory_own)
            if pids and memory:
                return CgroupRoot(1, pids, memory)
        unified_own = own_cgroup_path("")
        unified = MOUNTS / "unified" if (MOUNTS / "unified").is_dir() else MOUNTS
        # v2: our group must hand pids and memory down (a delegated subtree), and ours pass them on.
        parent = _sandbox_parent(unified, unified_own, ("pids", "memory")) if unified_own is not None else None
        if parent is not None:
            (parent / "cgroup.subtree_control").write_text("+pids +memory")
            return CgroupRoot(2, parent, parent)
    except OSError:
        return None
    return None


class Cgroup:
    """One sandbox's group: created with its limits, emptied and removed by `close`."""

    def __init__(self, root: CgroupRoot, max_processes: int, memory_bytes: int):
        self.root = root
        name = f"{os.getpid()}-{next(_counter)}"
        self.dirs: list[Path] = []  # those made so far: `close` removes them if a step below fails
        try:
            for directory in dict.fromkeys([root.pids_dir / name, root.memory_dir / name]):
                directory.mkdir()
                self.dirs.append(directory)
            pids_dir, memory_dir = root.pids_dir / name, root.memory_dir / name
            (pids_dir / "pids.max").write_text(str(max_processes))
            # Memory plus swap is capped too where swap is accounted, so a bomb cannot swap instead.
            if root.version == 1:
                (memory_dir / "memory.limit_in_bytes").write_text(str(memory_bytes))
                _write_if_present(memory_dir / "memory.memsw.limit_in_bytes", str(memory_bytes))
                self._memory_events = memory_dir / "memory.oom_control"
            else:
                (memory_dir / "memory.max").write_text(str(memory_bytes))
                _write_if_present(memory_dir / "memory.swap.max", "0")
                self._memory_events = memory_dir / "memory.events"
            self._pids_events = pids_dir / "pids.events"
        except BaseException:
            self.close()
            raise

    @property
    def procs_files(self) -> list[Path]:
        """Write a pid here to put the process (and its future children) in the group."""
        return [directory / "cgroup.procs" for directory in self.dirs]

    def counters(self) -> dict[str, int]:
        """How often the group hit its process limit and how many OOM kills it saw so far."""
        return {"processes": _read_key(self._pids_events, "max"), "memory": _read_key(self._memory_events, "oom_kill")}

    def kill_all(self) -> None:
        """SIGKILL every process still in the group (escaped sessions and daemons included).

        cgroup v2 (Linux 5.14+) has the kernel kill the whole group (`cgroup.kill`), processes
        forked meanwhile included. Otherwise each pid read from the group is signalled through a
        pidfd opened before the group is read again: a pid still listed then is the process the
        pidfd holds, or that one has exited and the signal goes nowhere. A pid read once may
        belong, by the time it is signalled, to an unrelated process that took the number of one
        of the group's that exited; killed by number, that process would die with the sandbox.
        """
        kill_file = self.dirs[0] / "cgroup.kill" if self.root.version == 2 and self.dirs else None
        for _ in range(100):  # a fork bomb may add processes while we kill: repeat until empty
            pids = self._listed_pids()
            if not pids:
                return
            if kill_file is not None:
                try:
                    kill_file.write_text("1")
                except OSError:  # missing (Linux before 5.14) or refused (a threaded group)
                    kill_file = None
            if kill_file is None:
                self._kill_pids(pids)
            time.sleep(0.001)

    def _listed_pids(self) -> set[int]:
        return {int(p) for f in self.procs_files if f.exists() for p in f.read_text().split()}

    def _kill_pids(self, pids: set[int]) -> None:
        """SIGKILL those of `pids` still in the group, through pidfds where there are any."""
        pidfds: dict[int, int] = {}
        try:
            for pid in pids:
                try:
                    pidfds[pid] = os.pidfd_open(pid)
                except ProcessLookupError:  # exited since the read
                    pass
                except (AttributeError, OSError) as err:
                    if pidfds and isinstance(err, OSError) and err.errno in (errno.EMFILE, errno.ENFILE):
                        break  # out of descriptors: the rest on the next round, once these are closed
                    _kill_by_number(pid)  # no pidfds in this Python or kernel, or none to be had
            if pidfds:
                still = self._listed_pids()
                for pid, pidfd in pidfds.items():
                    if pid in still:
                        try:
                            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
        finally:
            for pidfd in pidfds.values():
                os.close(pidfd)

    def close(self) -> None:
        self.kill_all()
        for directory in self.dirs:
            try:
                directory.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # the kernel releases a group shortly after its last process is reaped
                _reaper.submit(_remove_when_released, directory)


_reaper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="whetstone-cgroup-reaper")


def _kill_by_number(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _remove_when_released(directory: Path) -> None:
    for _ in range(400):
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005)


def _write_if_present(path: Path, value: str) -> None:
    if path.exists():
        path.write_text(value)


def _read_key(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def remove_stale_groups(root: CgroupRoot) -> None:
    """Remove empty groups left by whetstone processes that died without cleaning up."""
    for parent in {root.pids_dir, root.memory_dir}:
        for directory in parent.iterdir():
            owner = directory.name.split("-")[0]
            if directory.is_dir() and owner.isdigit() and not Path(f"/proc/{owner}").exists():
                try:
                    directory.rmdir()
                except OSError:
                    pass
