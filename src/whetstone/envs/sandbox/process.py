"""Start one limited process, feed its stdin, keep a bounded amount of its output, stop it on time.

Limits are applied by an exec wrapper rather than a `preexec_fn`: `sh` moves itself into the
sandbox's cgroup, sets the rlimits with `ulimit`, then execs the command (or bwrap). The wrapper
costs about a millisecond, keeps the fast vfork path of `subprocess`, and is safe in a
multi-threaded parent, which a Python `preexec_fn` is not.
"""

from __future__ import annotations

import functools
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from whetstone.utils.processes import descendants, kill_tree

CHUNK = 65536
EXIT_POLL_S = 0.05  # without pidfds (Linux < 5.3): how often to check whether the main process is gone
DRAIN_AFTER_KILL_S = 2.0
CPU_POLL_S = 0.1
"""Time between two looks at the CPU time of a command's processes. One that handles or ignores
SIGXCPU (Go programs ignore it) lives on for a CPU second past the soft limit, until the hard
limit's SIGKILL: a look every 0.1 s sees it unless it spends that second on more than 10 cores."""


@dataclass
class RunResult:
    """What one command did."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    truncated: bool
    limits_hit: list[str] = field(default_factory=list)
    """Limits it ran into: wall_clock, cpu, memory (OOM kill), processes, output, disk."""
    sandbox_closed: bool = False
    """Killed because its sandbox was closed (from another thread) while it ran."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int
    memory_bytes: int
    file_bytes: int
    nproc: int | None  # RLIMIT_NPROC, only when no cgroup bounds the processes


class Watch(Protocol):
    """A limit measured while the command runs (the disk budget): checked when `due`."""

    due: float
    """When the next check is due (`time.perf_counter`); `check` moves it on."""

    def check(self, pid: int) -> str | None:
        """The name of the limit the command (main process `pid`) is over, if any."""


def limit_prefix(limits: Limits, cgroup_procs: list[Path]) -> list[str]:
    """An `sh` that joins the sandbox's cgroup, sets the rlimits and execs the command: one exec."""
    steps = ['while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift']  # join the cgroup
    steps += [
        f"ulimit -S -t {limits.cpu_s}",  # SIGXCPU at the soft limit, SIGKILL a second later
        f"ulimit -H -t {limits.cpu_s + 1}",
        f"ulimit -v {limits.memory_bytes >> 10}",  # KiB
        f"ulimit -f {limits.file_bytes >> 9}",  # 512-byte blocks (POSIX sh)
        "ulimit -c 0",
    ]
    if limits.nproc is not None:
        steps.append(f"ulimit {_nproc_flag()} {limits.nproc}")
    script = " && ".join(steps) + ' && exec "$@"'
    return ["/bin/sh", "-c", script, "sh", *map(str, cgroup_procs), "--"]


@functools.cache
def _nproc_flag() -> str:
    """The process-count option of this system's `sh`: `-u` in bash, `-p` in dash."""
    probe = subprocess.run(["/bin/sh", "-c", "ulimit -u"], capture_output=True)
    return "-u" if probe.returncode == 0 else "-p"


class _Capture:
    """Keeps the first `limit` bytes of a stream and counts the rest."""

    def __init__(self, limit: int):
        self.limit, self.data, self.dropped = limit, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - room)

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        return text + (f"\n[output truncated: {self.dropped} more bytes]" if self.dropped else "")


def run_process(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    stdin: str | None,
    timeout_s: float,
    max_output_bytes: int,
    kill_tree: Callable[[subprocess.Popen], None],
    watch: Watch | None = None,
    on_start: Callable[[subprocess.Popen], None] | None = None,
    cpu_s: int | None = None,
) -> RunResult:
    """Run `argv` to completion, to its deadline or until `watch` finds it over a limit; `kill_tree`
    must stop the process and all it started. `on_start` gets the process as soon as it exists
    (so that another thread can stop it); if it raises, the process is killed. `cpu_s`: the soft
    CPU-time limit `argv` runs under; a process of it seen to reach it counts as over the CPU
    limit, whatever became of it (the exit status alone tells only of one killed by SIGXCPU)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,  # its own process group, so the whole group can be signalled
    )
    proc.reaping = threading.Lock()  # see `_reaping_lock`
    out, err = _Capture(max_output_bytes), _Capture(max_output_bytes)
    deadline, timed_out, stopped, watched_hit = start + timeout_s, False, False, None
    selector, pidfd = None, None
    cpu_due, cpu_hit = (start if cpu_s is not None else float("inf")), False
    try:  # from here on, whatever fails (no descriptor left for the selector, say) kills the process
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ, out)
        selector.register(proc.stderr, selectors.EVENT_READ, err)
        pending = (stdin or "").encode()
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)
            selector.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
        pidfd = _pidfd(proc.pid)  # readable when the main process exits: no polling needed
        if pidfd is not None:
            selector.register(pidfd, selectors.EVENT_READ, "exit")
        if on_start is not None:
            on_start(proc)
        while selector.get_map():
            now = time.perf_counter()
            main_exited = False
            if now >= deadline:
                if stopped:
                    break  # something outside our reach holds the pipes open: give up on them
                timed_out = stopped = True
                kill_tree(proc)
                deadline = now + DRAIN_AFTER_KILL_S  # output already written is still collected
                continue
            wait = deadline - now if pidfd is not None else min(deadline - now, EXIT_POLL_S)
            if watch is not None and not stopped:
                wait = min(wait, watch.due - now)
            if not stopped:
                wait = max(0.0, min(wait, cpu_due - now))
            for key, _ in selector.select(wait):
                if key.data == "exit":
                    selector.unregister(key.fileobj)
                    main_exited = True
                elif key.data == "stdin":
                    pending = _feed(selector, key.fileobj, pending)
                elif chunk := os.read(key.fileobj.fileno(), CHUNK):
                    key.data.add(chunk)
                else:
                    selector.unregister(key.fileobj)
            if watch is not None and not stopped and time.perf_counter() >= watch.due:
                watched_hit = watch.check(proc.pid)
                if watched_hit:
                    stopped = True
                    kill_tree(proc)
                    deadline = min(deadline, time.perf_counter() + DRAIN_AFTER_KILL_S)
            if not stopped and not cpu_hit and time.perf_counter() >= cpu_due:
                cpu_hit = _cpu_used_up(proc.pid, cpu_s)
                cpu_due = float("inf") if cpu_hit else time.perf_counter() + CPU_POLL_S  # found: no more polls
            if not stopped and (main_exited or (pidfd is None and _reap(proc, wait=False) is not None)):
                stopped = True  # the command is done: stragglers that keep our pipes open are stopped
                kill_tree(proc)
                deadline = min(deadline, time.perf_counter() + DRAIN_AFTER_KILL_S)
    finally:
        if selector is not None:
            selector.close()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        if pidfd is not None:
            os.close(pidfd)
        if _reap(proc, wait=False) is None:
            kill_tree(proc)
        _reap(proc, wait=True)
    exit_code = proc.returncode
    limits_hit = ["wall_clock"] if timed_out else []
    if cpu_hit or exit_code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        limits_hit.append("cpu")
    if out.dropped or err.dropped:
        limits_hit.append("output")
    if watched_hit:
        limits_hit.append(watched_hit)
    return RunResult(
        exit_code=exit_code,
        stdout=out.text(),
        stderr=err.text(),
        timed_out=timed_out,
        duration_s=time.perf_counter() - start,
        truncated=bool(out.dropped or err.dropped),
        limits_hit=limits_hit,
    )


def _cpu_used_up(pid: int, cpu_s: int) -> bool:
    """Whether a process in the tree under `pid` has used `cpu_s` seconds of CPU time (its
    threads together, as RLIMIT_CPU counts). Processes that end meanwhile are passed over."""
    ticks = cpu_s * os.sysconf("SC_CLK_TCK")
    for process in [pid, *descendants(pid)]:
        try:
            stat = Path(f"/proc/{process}/stat").read_bytes()
            fields = stat[stat.rindex(b")") + 2 :].split()  # from the state on: the name may hold spaces
            if int(fields[11]) + int(fields[12]) >= ticks:  # utime + stime
                return True
        except (OSError, ValueError):
            continue
    return False


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _feed(selector: selectors.BaseSelector, pipe, pending: bytes) -> bytes:
    """Write what the pipe takes now; close it when everything is written or the reader is gone."""
    try:
        pending = pending[os.write(pipe.fileno(), pending[:CHUNK]) :]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        pending = b""
    if not pending:
        selector.unregister(pipe)
        pipe.close()
    return pending


_reaping = threading.Lock()
"""`_reaping_lock` of a process `run_process` did not start."""


def _reaping_lock(proc: subprocess.Popen) -> threading.Lock:
    """Held while a command's main process is reaped (`_reap`) and while it is signalled
    (`kill_process_group`): it is signalled only while unreaped, since once reaped its pid, and
    so its process group's id, may be a new process's (`Sandbox.close` kills from another thread
    than the one that reaps). One per process: a kill waits up to `processes.STOP_WAIT_S`
    holding it, and other sandboxes' commands are reaped meanwhile."""
    return getattr(proc, "reaping", _reaping)


def _reap(proc: subprocess.Popen, wait: bool) -> int | None:
    """Reap `proc` if it has exited, first waiting for it to exit when `wait`: its exit status,
    or None while it runs. The wait itself does not reap (WNOWAIT) and holds no lock, so that
    another thread can still kill the process meanwhile."""
    if wait:
        try:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # reaped already
            pass
    with _reaping_lock(proc):
        return proc.wait() if wait else proc.poll()


def kill_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`, its process group and its descendants (`kill_tree`; any of them may
    already be gone).

    Descendants that left the group are killed too: bwrap's child, pid 1 of the sandbox's pid
    namespace, starts a session of its own (`--new-session`), and when bwrap is killed before
    that child's `--die-with-parent` binds it, it lives on; killed, it takes every process of
    the namespace with it. Once `proc` is reaped nothing is signalled: its pid may be another
    process's by then."""
    with _reaping_lock(proc):
        if proc.returncode is None:
            kill_tree(proc.pid, group=True)
