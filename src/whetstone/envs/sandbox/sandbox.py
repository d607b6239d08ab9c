"""A sandbox: a private workspace plus a way to run limited, isolated commands in it.

Each `run` is its own bubblewrap invocation over the same workspace, like commands typed into
one terminal: files persist between runs, processes and /tmp do not (the pid namespace ends with
the command). Opening a sandbox takes a prepared copy of the task's files from the pool.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import functools
import logging
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from whetstone.config import expand_path
from whetstone.envs.sandbox.bwrap import VENV_IN_SANDBOX, Mount, bwrap_argv, check_bwrap
from whetstone.envs.sandbox.cgroups import Cgroup, CgroupRoot, find_cgroup_root, remove_stale_groups
from whetstone.envs.sandbox.config import SandboxConfig
from whetstone.envs.sandbox.disk import MAX_PATH_CHARS, DiskWatch, remove_tree, scan
from whetstone.envs.sandbox.interpreter import SandboxPython, make_sandbox_python
from whetstone.envs.sandbox.process import Limits, RunResult, kill_process_group, limit_prefix, run_process
from whetstone.envs.sandbox.templates import WorkspacePool
from whetstone.errors import WhetstoneError

log = logging.getLogger(__name__)

SHELL = "/bin/bash" if Path("/bin/bash").exists() else "/bin/sh"
CLOSE_WAIT_S = 10.0
"""How long `close` waits for the runs it stopped to return before deleting the workspace anyway."""
OWNER_LOCK = "owner.lock"
"""In each sandbox root: locked (flock) by the process that made the root for as long as it lives."""
UNLOCKED_GRACE_S = 60.0
"""A root without an `OWNER_LOCK` younger than this is left alone: its maker may be about to lock it."""


class Sandbox:
    """A workspace directory and the limits and mounts its commands run under. A context manager.

    `run` may be called from several threads at once, and `close` from any thread: it kills the
    commands still running (their `run` returns with `sandbox_closed` set) and refuses new ones."""

    def __init__(self, workspace: Path, config: SandboxConfig, runtime: _Runtime, mounts: list[Mount]):
        for path in config.ro_paths:
            if not Path(path).exists():
                raise WhetstoneError(f"sandbox.ro_paths: {path} does not exist on this machine")
        self.workspace = workspace
        """The workspace on the host (the agent's tools may read and write it directly)."""
        self.config = config
        self.workdir = str(workspace) if config.unsandboxed else config.workdir
        """The workspace's path as commands see it."""
        self._runtime = runtime
        self._home = workspace.with_name(workspace.name + "-home")  # HOME and TMPDIR when unsandboxed
        self._cgroup = (
            Cgroup(runtime.cgroup_root, config.max_processes, config.memory_mb << 20) if runtime.cgroup_root else None
        )
        try:  # the cgroup is removed if a step below fails
            python = runtime.python
            self._mounts = [Mount(path, path) for path in [*python.host_paths, *config.ro_paths]]
            self._mounts += [Mount(str(python.prefix), VENV_IN_SANDBOX), *mounts]
            self._bin_dir = str(python.bin_dir) if config.unsandboxed else f"{VENV_IN_SANDBOX}/bin"
            self._limits = Limits(
                cpu_s=config.cpu_s,
                memory_bytes=config.memory_mb << 20,
                file_bytes=config.max_file_mb << 20,
                nproc=None,  # set for each run (`_nproc_limit`) where no cgroup bounds the processes
            )
            self._disk_limit = config.disk_mb << 20
            # Everything a command can write that outlives it or sits on the host's disk counts.
            self._disk_dirs = [workspace] + [Path(m.source) for m in mounts if m.writable]
            self._tmpfs = {"/tmp": config.tmp_size_mb << 20, "/dev": 0}
            self._lock = threading.Condition()  # guards the four below; notified when a run ends
            self._closed = False
            self._runs = 0  # runs in progress, started or not
            self._procs: set[subprocess.Popen] = set()  # the processes of runs in progress
            self._stopped: set[subprocess.Popen] = set()  # those of them that `close` killed
            if config.unsandboxed:
                self._home.mkdir()
                self._disk_dirs.append(self._home)
                self._tmpfs = {}
        except BaseException:
            if self._cgroup:
                self._cgroup.close()
            raise

    def run(
        self,
        command: str | list[str],
        timeout_s: float | None = None,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
    ) -> RunResult:
        """Run a shell command line (str) or an argv (list) in the workspace, within the limits;
        `env` adds variables to the sandbox's environment for this command. A command that takes
        the sandbox over its disk budget is stopped and what it added is taken back. Raises
        `WhetstoneError` once the sandbox is closed."""
        with self._lock:
            if self._closed:
                raise WhetstoneError(f"the sandbox over {self.workspace} is closed: it runs no more commands")
            self._runs += 1
        started: list[subprocess.Popen] = []
        try:
            return self._run(command, timeout_s, stdin, env, started)
        finally:
            with self._lock:
                self._runs -= 1
                self._procs.difference_update(started)
                self._stopped.difference_update(started)
                if self._runs == 0 and self._cgroup:  # what escaped runs that ended beside others
                    self._cgroup.kill_all()
                self._lock.notify_all()

    def _run(
        self,
        command: str | list[str],
        timeout_s: float | None,
        stdin: str | None,
        env: dict[str, str] | None,
        started: list[subprocess.Popen],
    ) -> RunResult:
        argv = [SHELL, "-c", command] if isinstance(command, str) else list(command)
        if not self.config.unsandboxed:
            argv = bwrap_argv(self.workspace, self.workdir, self.config.tmp_size_mb << 20, self._mounts, argv)
        disk = self._disk_watch()
        nproc = None if self._cgroup else _nproc_limit(self.config.max_processes)
        limits = replace(self._limits, file_bytes=disk.file_limit(self._limits.file_bytes), nproc=nproc)
        argv = limit_prefix(limits, self._cgroup.procs_files if self._cgroup else []) + argv
        before = self._cgroup.counters() if self._cgroup else {}
        result = run_process(
            argv,
            env={**self._env(), **(env or {})},
            cwd=self.workspace,
            stdin=stdin,
            timeout_s=timeout_s if timeout_s is not None else self.config.wall_clock_s,
            max_output_bytes=self.config.max_output_bytes,
            kill_tree=self._kill_tree,
            watch=disk,
            on_start=lambda proc: self._started(proc, started),
            cpu_s=limits.cpu_s,
        )
        with self._lock:
            result.sandbox_closed = bool(self._stopped.intersection(started))
        if result.sandbox_closed:
            result.stderr += "\n[stopped: the sandbox was closed while the command ran]"
            return result  # its workspace is about to be deleted: nothing to measure or take back
        if self._cgroup:
            after = self._cgroup.counters()
            result.limits_hit += [name for name in after if after[name] > before[name]]
        if "disk" not in result.limits_hit and disk.ran_into():
            result.limits_hit.append("disk")
        if "disk" in result.limits_hit:
            self._take_back(disk, result)
        return result

    def _disk_watch(self) -> DiskWatch:
        """The disk budget of the next command, measured before it starts."""
        disk = DiskWatch(self._disk_dirs, self._tmpfs, self._disk_limit)
        if disk.start.too_deep:
            raise WhetstoneError(
                f"the sandbox's workspace holds folders nested past {MAX_PATH_CHARS} characters of path, "
                "which its disk budget cannot measure: remove them"
            )
        if disk.start.lost:
            raise WhetstoneError(
                "the sandbox's workspace could not be measured for its disk budget before the command: a folder "
                "in it was moved, or locked with chmod, while it was walked, by a command running beside this "
                "one in the same sandbox; run the command again once that one has ended"
            )
        if not disk.start.complete:
            raise WhetstoneError(
                f"the sandbox's workspace already uses over {self.config.disk_mb} MB, its disk budget "
                f"(sandbox.disk_mb): raise the budget for this task"
            )
        return disk

    def _take_back(self, disk: DiskWatch, result: RunResult) -> None:
        """Undo what a command over the disk budget added, and say so after its output."""
        undone = disk.undo()
        deep = f", or folders nested past {MAX_PATH_CHARS} characters of path made" if disk.too_deep else ""
        result.stderr += (
            f"\n[disk budget of {self.config.disk_mb} MB (workspace, /tmp and /dev together) reached{deep}: what the "
            f"command added was taken back ({undone.removed} files and directories deleted, "
            f"{undone.cut_back} files cut back to their earlier size)]"
        )

    def disk_left(self) -> int:
        """Bytes the workspace may still grow by before it reaches its disk budget."""
        return self._disk_limit - scan(self._disk_dirs, self._disk_limit).used

    def _env(self) -> dict[str, str]:
        home = str(self._home) if self.config.unsandboxed else "/tmp"
        return {
            "PATH": f"{self._bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": home,
            "TMPDIR": home,
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            **self.config.env,
        }

    def _started(self, proc: subprocess.Popen, started: list[subprocess.Popen]) -> None:
        """Track a run's process so that `close` can stop it; one that starts as the sandbox
        closes is stopped here."""
        started.append(proc)
        with self._lock:
            self._procs.add(proc)
            if self._closed:
                self._stopped.add(proc)
            stop = self._closed
        if stop:
            self._kill_tree(proc)

    def _kill_tree(self, proc: subprocess.Popen) -> None:
        """Stop `proc` and what it started. Sandboxed, killing bwrap's child (pid 1 of the sandbox,
        see `kill_process_group`) ends the pid namespace; the cgroup also catches escaped
        sessions, but it holds the processes of every run of the sandbox: it is emptied only when
        no other run is in progress (or the sandbox closes), so that a command ending never kills
        another thread's; else the last run to return empties it (`run`). The lock is held
        meanwhile, so no run starts a process into the group as it is emptied."""
        kill_process_group(proc)
        if self._cgroup:
            with self._lock:
                if self._closed or self._runs <= 1:
                    self._cgroup.kill_all()

    def close(self) -> None:
        """Stop anything left running and delete the workspace. Commands running in other threads
        are killed (their process groups, and the cgroup where there is one) and their runs
        awaited, so the workspace goes once nothing uses it; later runs are refused."""
        with self._lock:
            self._closed = True
            running = self._procs - self._stopped
            self._stopped |= running
        for proc in running:
            self._kill_tree(proc)
        with self._lock:
            if not self._lock.wait_for(lambda: self._runs == 0, CLOSE_WAIT_S):
                log.warning(
                    "sandbox %s: a command still runs %g s after close; deleting the workspace anyway",
                    self.workspace,
                    CLOSE_WAIT_S,
                )
        if self._cgroup:
            self._cgroup.close()
        remove_tree(self.workspace)
        remove_tree(self._home)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_sandbox(
    files: dict[str, str] | Path, config: SandboxConfig | None = None, *, mounts: list[Mount] | None = None
) -> Sandbox:
    """A sandbox over a private copy of `files` ({relative path: text} or a snapshot directory).

    A snapshot directory must not change while sandboxes use it: spare copies are made ahead of
    time. Its `.git`, if any, is not copied. `mounts` adds host paths (the grader's runner, its
    result directory). Raises `SandboxUnavailableError` when namespaces are unavailable and
    `unsandboxed` is not set.
    """
    config = config or SandboxConfig()
    if not config.unsandboxed:
        check_bwrap()
    runtime = _runtime(config)
    workspace = runtime.pool.checkout(files)
    try:
        return Sandbox(workspace, config, runtime, list(mounts or []))
    except BaseException:
        remove_tree(workspace)
        raise


@dataclass
class _Runtime:
    """What all sandboxes of one process share: the pool, the sandbox Python, the cgroup parent."""

    root: Path
    lock: int | None
    """The fd that holds `root`'s `OWNER_LOCK` (None on a file system without locks)."""
    pool: WorkspacePool
    python: SandboxPython
    cgroup_root: CgroupRoot | None

    def close(self) -> None:
        self.pool.close()
        remove_tree(self.root)
        if self.lock is not None:
            os.close(self.lock)


_runtimes: dict[tuple, _Runtime] = {}
_runtimes_lock = threading.Lock()


def _runtime(config: SandboxConfig) -> _Runtime:
    key = (config.root_dir, config.pool_size, config.max_templates, config.cgroups)
    with _runtimes_lock:
        if key not in _runtimes:
            parent = expand_path(config.root_dir) if config.root_dir else Path(tempfile.gettempdir())
            parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_roots(parent)
            root, lock = _make_root(parent)
            try:
                cgroup_root = find_cgroup_root() if config.cgroups else None
                if cgroup_root:
                    remove_stale_groups(cgroup_root)
                runtime = _Runtime(
                    root=root,
                    lock=lock,
                    pool=WorkspacePool(root, config.pool_size, config.max_templates),
                    python=make_sandbox_python(root / "python"),
                    cgroup_root=cgroup_root,
                )
            except BaseException:
                remove_tree(root)
                if lock is not None:
                    os.close(lock)
                raise
            atexit.register(runtime.close)
            _runtimes[key] = runtime
        return _runtimes[key]


NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)
"""flock's errors on a file system that has no locks (some network and FUSE file systems)."""


def _make_root(parent: Path) -> tuple[Path, int | None]:
    """A new sandbox root in `parent`, and the fd that holds its `OWNER_LOCK` for as long as this
    process lives. The lock file is locked before it takes its name, so that no other process
    finds it unlocked meanwhile and takes the root for a dead one's. On a file system without
    locks the root has no lock file (None): others judge it by the pid in its name."""
    root = Path(tempfile.mkdtemp(prefix=f"whetstone-sandbox-{os.getpid()}-", dir=parent))
    making = root / f"{OWNER_LOCK}.new"
    lock = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as err:
            if err.errno not in NO_LOCKS:
                raise
            _warn_once(f"{parent} has no file locks ({err.strerror}): sandbox roots there are judged by pid")
            making.unlink()
            os.close(lock)
            return root, None
        making.rename(root / OWNER_LOCK)
    except BaseException:
        os.close(lock)
        remove_tree(root)
        raise
    return root, lock


def _remove_stale_roots(parent: Path) -> None:
    """Delete the templates and workspaces of whetstone processes that died without cleaning up.

    A root is its maker's while that holds its `OWNER_LOCK`: a lock, unlike the pid in the
    root's name, holds across PID namespaces (a /tmp or `root_dir` shared with a container beside)
    and does not outlive its process when the pid is reused. A root without a lock file is
    judged by the pid in its name, once older than `UNLOCKED_GRACE_S`."""
    for root in parent.glob("whetstone-sandbox-*-*"):
        try:
            lock = os.open(root / OWNER_LOCK, os.O_RDWR)
        except FileNotFoundError:
            owner = root.name.split("-")[2]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists() and _age(root) > UNLOCKED_GRACE_S:
                remove_tree(root)
            continue
        except OSError:  # not a folder, or another user's: not ours to judge
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its maker lives (or another process is removing it)
            continue
        else:
            remove_tree(root)  # the lock is held meanwhile, so no other process removes it too
        finally:
            os.close(lock)


def _age(path: Path) -> float:
    """Seconds since `path` last changed; 0 when it cannot be read (gone meanwhile)."""
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _nproc_limit(max_processes: int) -> int | None:
    """RLIMIT_NPROC counts every task of the user (each thread of each process), so allow what
    they already run, threads included, plus the budget: a role's thread pools alone can outnumber
    `max_processes`. Counted anew for each command (about a millisecond per hundred processes
    on the host): the user's tasks come and go while a sandbox lives (thread pools that grow,
    other sandboxes' commands), and a count taken once would leave a later command no room to fork."""
    uid = os.getuid()
    if uid == 0:
        _warn_once("no writable cgroup: the sandbox process limit is not enforced for root")
        return None
    running = sum(_tasks(p) for p in Path("/proc").iterdir() if p.name.isdigit() and _owner(p) == uid)
    return running + max_processes


def _tasks(process: Path) -> int:
    """The threads of a process (/proc/<pid>/task); 0 once it is gone."""
    try:
        return len(os.listdir(process / "task"))
    except OSError:
        return 0


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def _owner(path: Path) -> int | None:
    try:
        return path.stat().st_uid
    except OSError:
        return None
