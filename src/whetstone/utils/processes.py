"""Roles as child processes: start one with its output in a log file, wait until it is healthy,
stop it (SIGTERM, then SIGKILL after a grace period) or kill it.

    server = RoleProcess("serve-0", ["serve", "serve-0.toml"], logs / "serve-0.log",
                         health_url="http://127.0.0.1:8000/health").start()
    server.wait_healthy(timeout_s=90)
    ...
    server.stop()

A role runs as `python -m whetstone.cli ROLE ...` with this interpreter, so the child gets the
same installation and `whetstone`'s error handling (a clear message and exit code 2 on bad
input). Its output goes to a file, not a pipe: a pipe nobody reads blocks the child once full.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import httpx

from whetstone.errors import WhetstoneError
from whetstone.utils.cgroups import CpuGroup, add_to_cgroups

log = logging.getLogger(__name__)

CPUS_ENV = "WHETSTONE_CPUS"
"""Set by `RoleProcess(cpus=...)`: the cores the role (and every process it starts) may run on."""
CPU_GROUP_ENV = "WHETSTONE_CPU_GROUP"
"""Set by `RoleProcess(cpu_group=...)`: the cgroup folders (os.pathsep-separated) of the CPU group
the role and its children run in."""
GPU_MEMORY_ENV = "WHETSTONE_GPU_MEMORY"
"""Set for a role that shares a GPU (`whetstone run`'s placement): `<device>=<fraction>`, the
share of that GPU's memory its process may take (`limit_gpu_memory`)."""
CUDA_CONTEXT_BYTES = 1 << 30
"""What a role's share of a GPU keeps outside its allocator's cap (`memory_cap`): its CUDA context
(about half a GB) and what else lives outside torch's allocator, and room for the context of the
run's own process beside the roles. Shares add up to the whole GPU; the caps, so, to less."""
PARENT_ENV = "WHETSTONE_PARENT_PID"
"""Set in every role's environment: the role stops when this process ends (`stop_with_parent`)."""


def apply_role_environment() -> None:
    """At the start of a role started by `RoleProcess`: its CPU placement and quota, and its end
    with its parent."""
    group = os.environ.pop(CPU_GROUP_ENV, None)
    if group:
        add_to_cgroups(group.split(os.pathsep), os.getpid())
    cpus = os.environ.pop(CPUS_ENV, None)
    if cpus:
        # every thread started so far (imports may have started some); later threads and child
        # processes (sandboxes) inherit the mask
        mask = {int(cpu) for cpu in cpus.split(",")}
        for thread_id in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(thread_id), mask)
    limit_gpu_memory(os.environ.pop(GPU_MEMORY_ENV, ""))
    stop_with_parent()


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM under `sigterm_raises`, as SIGINT raises
    KeyboardInterrupt, and of its kind: only `finally` clauses and context managers see it, and
    asyncio passes it on wherever it lands (it keeps any other exception raised in a callback of
    its event loop, logs it and runs on: a SIGTERM would be lost)."""


class FailedElsewhere(KeyboardInterrupt):
    """Raised in the main thread, wherever it is, for a failure in another thread, which signals
    the main thread to raise it (`run.monitor.ServerSampler`); `error` is the failure. Of
    KeyboardInterrupt's kind, as Ctrl-C: asyncio passes it on from a callback of its event loop,
    and no `except Exception` of the work it cuts short takes it for its own. The `whetstone`
    command ends with its `error` as with any other WhetstoneError."""

    def __init__(self, error: WhetstoneError):
        super().__init__(str(error))
        self.error = error


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises `Terminated` in the main thread, so a process that starts roles (`whetstone
    run`) stops them cleanly in its `finally` clauses (the trainer checkpoints, CPU groups are
    removed, Ray actors closed) instead of dying at once. A second SIGTERM kills as it would
    have without this, unless it comes while the roles are being stopped (`Stopping`). Only the
    main thread can take signals: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    global _sigterm_handler

    def take(_sig, _frame) -> None:
        global _sigterm_handler
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _sigterm_handler = None
        raise Terminated("stopped by SIGTERM")

    previous = signal.signal(signal.SIGTERM, take)
    _sigterm_handler = take
    try:
        yield
    finally:
        _sigterm_handler = None
        signal.signal(signal.SIGTERM, previous)


_sigterm_handler = None
"""`sigterm_raises`' handler while it is in force (and no SIGTERM came yet)."""


def keep_sigterm_raising() -> None:
    """Put `sigterm_raises`' handler back after a library replaced it (`ray.init` installs one
    that exits with code 15), if one is in force."""
    if _sigterm_handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm_handler)


def stopped_by(number: signal.Signals) -> BaseException:
    """What signal `number` raises in the main thread of a `whetstone` command: KeyboardInterrupt
    for SIGINT, `Terminated` for SIGTERM (`sigterm_raises`); `main` exits 128 + `number` on it."""
    return KeyboardInterrupt() if number == signal.SIGINT else Terminated(f"stopped by {number.name}")


class StopRequest(threading.Event):
    """Set by the first SIGTERM or SIGINT under `stop_on_signals`; `signal` says which came."""

    def __init__(self) -> None:
        super().__init__()
        self.signal: signal.Signals | None = None
        """The first signal that came, or None."""


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """A `StopRequest` set by SIGTERM / SIGINT: a loop that checks it finishes its step,
    checkpoints and stops (so a clean shutdown loses no work). A second signal acts as it would
    have without this (a setup that hangs, a step that never ends). Only the main thread can take
    signals: elsewhere the request is never set."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def take(number: int, _frame) -> None:
        if stop.is_set():
            signal.signal(number, _handler(previous[number]))
            os.kill(os.getpid(), number)
            return
        stop.signal = signal.Signals(number)
        stop.set()

    previous = {number: signal.signal(number, take) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for number, handler in previous.items():
            signal.signal(number, _handler(handler))


def _handler(previous: object) -> object:
    """A handler `signal.getsignal` returned, as `signal.signal` takes it back (None: one not set
    from Python, which leaves the default in force)."""
    return signal.SIG_DFL if previous is None else previous


class _Hurry(KeyboardInterrupt):
    """Raised by `Stopping` where it waits for a role to stop, on the first signal: a
    KeyboardInterrupt, which a library waiting in C passes on as one (ray.get)."""


class Stopping:
    """Stops roles whatever SIGINT or SIGTERM comes meanwhile, so that none is left behind:

        with Stopping() as stopping:
            for role in reversed(roles):
                stopping.stop(role)
            ...  # the rest of the clean-up (CPU groups, Ray), which no signal interrupts either
        if stopping.first is not None:
            raise stopped_by(stopping.first)  # where no exception of the caller's is on its way

    No signal leaves the block half done; the first makes the stopping quicker: the role being
    stopped and every role after it are killed instead of waited for (a second Ctrl-C means
    "now"). Only SIGKILL ends the process at once. Only the main thread takes signals: elsewhere
    roles are stopped as usual."""

    def __init__(self) -> None:
        self.received: list[signal.Signals] = []
        """The signals that came in the block, in order."""
        self._waiting = False
        self._previous: dict[signal.Signals, object] = {}

    @property
    def first(self) -> signal.Signals | None:
        """The first signal that came in the block, or None."""
        return self.received[0] if self.received else None

    def __enter__(self) -> Stopping:
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._take) for number in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, _handler(handler))
        self._previous = {}

    def _take(self, number: int, _frame) -> None:
        self.received.append(signal.Signals(number))
        if self._waiting and len(self.received) == 1:
            raise _Hurry

    def stop(self, role: RoleProcess) -> None:
        """Stop `role` (`RoleProcess.stop`: SIGTERM, then SIGKILL after its grace period), or
        kill it once a signal came. A role that fails to stop (its Ray actor died, say) is killed
        and the failure logged: the roles after it are still stopped."""
        hurried = False
        try:
            try:
                self._waiting = True  # the first signal raises only while this waits for the role
                if not self.received:
                    role.stop()
            finally:
                self._waiting = False
        except KeyboardInterrupt:  # the first signal, raised where it waited for the role
            hurried = True
        except Exception as err:
            log.warning("stopping %s failed (%s): killing it", role.name, err)
            hurried = True
        if hurried or self.received:
            try:
                role.kill()
            except Exception as err:
                log.error("could not kill %s: %s", role.name, err)


def exit_process(code: int | str | None = 0) -> NoReturn:
    """End this process with `code` (as `sys.exit` takes it). A torchrun rank (WORLD_SIZE > 1)
    ends at once, its output flushed, without the interpreter's and C++'s teardown: after a
    finished FSDP2 job over gloo that teardown sometimes aborts ("terminate called without an
    active exception", once every Python frame has returned: 2 of 25 runs of
    tests/training/ranks_job.py beside a test suite, none of 30 that end so), and torchrun and the
    rank groups would take the abort for the rank's failure. By then its work is written and its
    process group destroyed."""
    if int(os.environ.get("WORLD_SIZE") or 1) <= 1:
        sys.exit(code)
    if code is not None and not isinstance(code, int):  # a message, as sys.exit prints it
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def limit_gpu_memory(share: str) -> None:
    """Hold this process to a share of a GPU's memory, `<device>=<fraction>` (`GPU_MEMORY_ENV`;
    empty: no limit): its allocations beyond its cap (`memory_cap`) fail with an out-of-memory
    error instead of taking what the roles beside it on the GPU need."""
    if not share:
        return
    import torch

    name, _, fraction = share.rpartition("=")
    device = torch.device(name)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(memory_cap(float(fraction), total), device)


def memory_cap(share: float, total_bytes: int) -> float:
    """The fraction of a GPU of `total_bytes` that torch's allocator may take in a process given
    `share` of it: the share less `CUDA_CONTEXT_BYTES`, and at least half the share (a small GPU)."""
    return max(share - CUDA_CONTEXT_BYTES / total_bytes, share / 2)


def check_cpus(cpus: list[int], what: str) -> None:
    """Raise naming `what` if a core in `cpus` is not one this process may use."""
    usable = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - usable)
    if missing:
        raise WhetstoneError(f"{what}: cores {missing} are not available here (usable: {sorted(usable)})")


def stop_with_parent() -> None:
    """In a role started by `RoleProcess`: get SIGTERM when the starting process ends, however it
    ends (a SIGKILL of `whetstone run` runs none of its clean-up), so no role outlives its run."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):  # it ended before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


class RoleProcess:
    def __init__(
        self,
        name: str,
        args: list[str],
        log_path: str | Path,
        *,
        health_url: str | None = None,
        threads: int | None = None,
        env: dict[str, str] | None = None,
        cpus: list[int] | None = None,
        cpu_group: CpuGroup | None = None,
        command: list[str] | None = None,
        own_group: bool = False,
    ):
        """`args`: the `whetstone` command line after the program name; `command`: a whole
        command line to run instead (another program, e.g. a vLLM server). `threads`: OMP/MKL
        threads of the child (its torch intra-op pool), so roles sharing cores do not oversubscribe.
        `cpus`: the cores it may run on (None: any). `cpu_group`: the CPU group
        (`utils.cgroups.CpuGroup`: accounting, maybe a quota) it runs in with everything it starts."""
        self.name = name
        self.argv = list(command) if command is not None else [sys.executable, "-m", "whetstone.cli", *args]
        self.log_path = Path(log_path)
        self.health_url = health_url
        self.env = {"COLUMNS": "200", **os.environ, **(env or {})}  # rich wraps log lines at 80 otherwise
        if threads is not None:
            self.env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        if cpus:
            check_cpus(cpus, name)
            self.env[CPUS_ENV] = ",".join(map(str, cpus))
        if cpu_group is not None:
            self.env[CPU_GROUP_ENV] = os.pathsep.join(map(str, cpu_group.paths))
        self.own_group = own_group
        self.process: subprocess.Popen | None = None
        self._stop_deadline: float | None = None
        """When the process must have stopped since its SIGTERM (`terminate`), or None."""

    def start(self) -> RoleProcess:
        """Start the process; with a `health_url` whose port something listens on already, raise
        instead (`check_port_free`)."""
        if self.health_url is not None:
            check_port_free(self.name, self.health_url)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(self.env)
        if threading.current_thread() is threading.main_thread():  # the kernel ties it to the starting thread
            env[PARENT_ENV] = str(os.getpid())
        self._stop_deadline = None
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=self.own_group,
            )
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def check(self) -> None:
        """Raise with the end of its log if the role exited with an error."""
        code = self.returncode
        if code not in (None, 0):
            raise WhetstoneError(f"{self.name} exited with code {code}; end of {self.log_path}:\n{self.log_tail()}")

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Until `health_url` answers 200; raises if the process dies or the time runs out."""
        if self.health_url is None:
            raise WhetstoneError(f"{self.name} has no health URL to wait on")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running:
                raise WhetstoneError(
                    f"{self.name} exited (code {self.returncode}) before it became healthy; "
                    f"end of {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.health_url, timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise WhetstoneError(f"{self.name} did not become healthy at {self.health_url} within {timeout_s:g} s")

    def wait(self, timeout_s: float | None = None) -> int:
        """Its exit code, waiting at most `timeout_s` (raises subprocess.TimeoutExpired after)."""
        if self.process is None:
            raise WhetstoneError(f"{self.name} was never started")
        return self.process.wait(timeout_s)

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM (roles checkpoint and exit cleanly on it), then SIGKILL after `grace_s`, to it
        and what it started (`kill`). One that has exited already leaves nothing of its own group."""
        if not self.running:
            self._kill_group()
            return self.returncode
        deadline = self.terminate(grace_s)
        try:
            return self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return self.kill()

    def terminate(self, grace_s: float) -> float:
        """Send SIGTERM once: a process asked to stop again while it stops (a wait for it that a
        signal cut short, then the run's clean-up) is not sent a second one, which to a role
        means "now" (`stop_on_signals`: its checkpoint would be lost). Returns when the process
        must have stopped: `grace_s` after the first SIGTERM."""
        if self._stop_deadline is None:
            self.process.send_signal(signal.SIGTERM)
            self._stop_deadline = time.monotonic() + grace_s
        return self._stop_deadline

    def kill(self) -> int | None:
        """SIGKILL, as a crash would, to the process and every process it started (`kill_tree`):
        a vLLM server's engine core holds its GPU memory, sandboxes their cores, until they end."""
        if self.running:
            kill_tree(self.process.pid, group=self.own_group)
        else:
            self._kill_group()
        return None if self.process is None else self.process.wait()

    def _kill_group(self) -> None:
        """With `own_group`, SIGKILL what is left in the process group: what left the tree but not
        the group, an orphan of a child (a vLLM engine core whose API server crashed), also once
        the main process has exited. The group's id is the main process's pid, which the kernel
        gives no new process while the group has members; once the main process is reaped, a live
        process of that pid is another one, whose group is left alone."""
        if not self.own_group or self.process is None:
            return
        if self.process.poll() is not None and Path(f"/proc/{self.process.pid}").exists():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)


STOP_WAIT_S = 1.0
"""How long, at most, a kill (`kill_tree`) waits for the processes it stopped to be stopped: a
SIGSTOP takes hold once a process next leaves the kernel, and one in uninterruptible sleep stays
in it until its I/O is done."""


def kill_tree(pid: int, *, group: bool = False) -> None:
    """SIGKILL to process `pid` (a child of this one, not yet waited for) and its descendants,
    however they left its session or group (a sandbox's); with `group`, also to what is left in
    the process group `pid` leads (an orphan of a child). They are stopped (SIGSTOP) first, each
    as it is found, and waited for until stopped (`STOP_WAIT_S` in all), until none is left to
    find: a stopped process is out of the kernel, with no child half made, and starts no more,
    and one killed first would leave its children to init, out of reach. Where /proc cannot be
    read, `pid` alone (and its group)."""
    deadline = time.monotonic() + STOP_WAIT_S
    found: list[int] = []
    try:
        while new := [member for member in [pid, *descendants(pid)] if member not in found]:
            for member in new:
                _signal(member, signal.SIGSTOP)
            found += new
            for member in new:
                _until_stopped(member, deadline)
    finally:  # also when interrupted: what was stopped would wait forever
        if group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for member in found:
            _signal(member, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _until_stopped(pid: int, deadline: float) -> None:
    """Wait, until `deadline` at most, for process `pid` to be stopped, a zombie or gone (its
    state in /proc). Where /proc cannot be read, not at all."""
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            return
        if stat[stat.rindex(b")") + 2 :][:1] in (b"T", b"t", b"Z", b"X"):
            return
        time.sleep(0.001)


def descendants(pid: int) -> Iterator[int]:
    """The processes below `pid` (children, theirs, ...), walked as they are read."""
    queue = child_pids(pid)
    while queue:
        child = queue.pop()
        yield child
        queue += child_pids(child)


def child_pids(pid: int) -> list[int]:
    """The children of process `pid` (of each of its threads: /proc lists them per thread); none
    once it is gone, or where /proc cannot be read."""
    children: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            children += map(int, Path(f"/proc/{pid}/task/{task}/children").read_bytes().split())
    except (OSError, ValueError):
        pass
    return children


def wait_polling(role: RoleProcess, timeout_s: float | None = None) -> int:
    """A role's exit code, polled: for roles that are not one child process of this one (a Ray
    actor's process on another node, a group of ranks); raises if it still runs after `timeout_s`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while (code := role.returncode) is None:
        if deadline is not None and time.monotonic() > deadline:
            raise WhetstoneError(f"{role.name} still runs after {timeout_s:g} s")
        time.sleep(0.2)
    return code


PICKED_PORTS = (20000, 30000)
"""Where `free_ports` picks: above Ray's worker ports (10002-19999), below Kubernetes' NodePort
range (30000-32767, which kube-proxy may redirect without holding a socket) and below the
kernel's ephemeral range (`net.ipv4.ip_local_port_range`, 32768-60999 by default)."""
_PORT_CHOICE = random.SystemRandom()
"""Picks ports from the OS's entropy: processes that seeded `random` alike still pick apart."""


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on every address right now (each bound on the wildcard
    address, which conflicts with a port in use on any of them; all held open while picking).

    A picked port is closed again before the process it is for binds it, seconds later. Picked
    in the kernel's ephemeral range (bind to port 0), it could meanwhile become the local port of
    any outgoing connection on the machine (a run makes many). So they are picked at random in
    PICKED_PORTS below that range, which only an explicit bind takes; where that range is too
    narrow, from the kernel (port 0)."""
    low = PICKED_PORTS[0]
    high = min(PICKED_PORTS[1], _ephemeral_ports()[0])
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sockets.append(sock)
            for _attempt in range(64 if high - low >= 1024 else 0):
                try:
                    sock.bind(("", _PORT_CHOICE.randrange(low, high)))
                    break
                except OSError:
                    continue
            else:
                sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


def check_port_free(name: str, url: str) -> None:
    """Raise naming role `name` if something listens already on the port of `url` (its health
    URL) at that address: it would answer the role's health checks for it, and the run would
    talk to it while the role fails to bind. A port whose last connections wait out TIME_WAIT
    passes (SO_REUSEADDR, as servers bind), and so does an address not of this machine. Only
    narrows the race with another process binding the port first; does not close it."""
    parsed = httpx.URL(url)
    if parsed.port is None:
        return
    try:  # every address of its host: `localhost` is 127.0.0.1 and ::1, and a server may hold either
        addresses = socket.getaddrinfo(parsed.host or "127.0.0.1", parsed.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):  # a name this machine cannot resolve is not one of its addresses
        return
    for family, kind, protocol, _name, address in addresses:
        try:  # an address of a family this machine lacks (::1 with IPv6 off) holds nothing
            with socket.socket(family, kind, protocol) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise WhetstoneError(
                    f"{name}: port {parsed.port} of {url} is in use already: what listens there would answer "
                    f"{name}'s health checks; stop it or choose another port"
                ) from None


@contextlib.contextmanager
def serving(args: list[str], log_path: str | Path, *, threads: int = 1, timeout_s: float = 300.0) -> Iterator[str]:
    """`whetstone serve ARGS --set port=<free port>` as a child process, healthy; yields its
    root URL (`http://127.0.0.1:<port>`) and stops it on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    role = RoleProcess(
        "serve", ["serve", *args, "--set", f"port={port}"], log_path, health_url=f"{url}/health", threads=threads
    ).start()
    try:
        role.wait_healthy(timeout_s)
        yield url
    finally:
        role.stop()
