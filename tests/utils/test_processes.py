"""Roles as child processes: started with the same interpreter, logged to a file, stopped cleanly."""

import contextlib
import http.server
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from whetstone.errors import WhetstoneError
from whetstone.utils import processes
from whetstone.utils.processes import RoleProcess, Stopping, Terminated, free_ports, sigterm_raises, stop_on_signals


def test_a_role_runs_the_whetstone_command_and_logs_to_a_file(tmp_path):
    role = RoleProcess("help", ["--help"], tmp_path / "logs" / "help.log").start()
    assert role.wait(60) == 0
    assert "Usage" in role.log_path.read_text() and role.argv[:3] == [sys.executable, "-m", "whetstone.cli"]
    role.check()  # exit 0 is fine


def test_a_failing_role_raises_with_its_log(tmp_path):
    # a path longer than a console's 80 columns: the error is written to the log unwrapped
    missing = tmp_path / f"{'long' * 20}" / ":warning:" / "[missing].toml"  # no markup, no emoji code
    role = RoleProcess("bad", ["trainer", str(missing)], tmp_path / "bad.log").start()
    assert role.wait(60) == 2
    with pytest.raises(WhetstoneError, match="bad exited with code 2") as raised:
        role.check()
    assert f"error: config file {missing} does not exist" in str(raised.value)


def test_waiting_on_health_fails_fast_when_the_role_dies(tmp_path):
    role = RoleProcess(
        "serve", ["serve", "--set", "model_path="], tmp_path / "serve.log", health_url="http://127.0.0.1:9/health"
    ).start()
    with pytest.raises(WhetstoneError, match="(?s)exited .* before it became healthy.*model_path is not set"):
        role.wait_healthy(60)


def test_stop_sends_sigterm_and_returns_the_exit_code(tmp_path):
    role = RoleProcess("sleeper", ["--help"], tmp_path / "s.log")
    role.argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    role.start()
    assert role.running
    assert role.stop(grace_s=10) == -15 and not role.running


class UnstoppableRole(RoleProcess):
    """A role whose graceful stop fails (as a Ray role's does when its actor died)."""

    def stop(self, grace_s: float = 30.0) -> int | None:
        raise RuntimeError("the actor died")


class SignalOnFailedStop(logging.Handler):
    """A Ctrl-C that comes while the failed stop is being logged."""

    def emit(self, record):
        if "failed" in record.getMessage():
            signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("signalled", [False, True], ids=["alone", "a Ctrl-C while it is logged"])
def test_a_role_that_fails_to_stop_is_killed_and_the_others_are_still_stopped(tmp_path, signalled):
    logger, handler = logging.getLogger(processes.__name__), SignalOnFailedStop()
    if signalled:
        logger.addHandler(handler)
    roles = [
        cls(name, ["--help"], tmp_path / f"{name}.log") for cls, name in [(RoleProcess, "a"), (UnstoppableRole, "b")]
    ]
    for role in roles:
        role.argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        role.start()
    try:
        with Stopping() as stopping:
            for role in reversed(roles):
                stopping.stop(role)
    finally:
        logger.removeHandler(handler)
    assert stopping.first == (signal.SIGINT if signalled else None)
    assert [role.running for role in roles] == [False, False]
    # after a signal the older role is killed too, not asked to stop
    assert [role.process.returncode for role in roles] == [
        -signal.SIGKILL if signalled else -signal.SIGTERM,
        -signal.SIGKILL,
    ]


def test_a_role_stops_when_the_process_that_started_it_is_killed(tmp_path):
    # `whetstone run` killed with SIGKILL runs no clean-up: its roles must not outlive it
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time\nfrom whetstone.utils.processes import RoleProcess\n"
                f"role = RoleProcess('sleeper', [], {str(tmp_path / 'r.log')!r})\n"
                "role.argv = [sys.executable, '-c', "
                "'from whetstone.utils.processes import stop_with_parent; stop_with_parent(); "
                "import time; time.sleep(120)']\n"
                "print(role.start().process.pid, flush=True)\ntime.sleep(120)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and alive(child):
        time.sleep(0.1)
    assert not alive(child)


def alive(pid: int) -> bool:
    """Running (not a zombie awaiting its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_role_runs_on_its_cores_and_so_does_everything_it_starts(tmp_path):
    core = sorted(os.sched_getaffinity(0))[-1]
    role = RoleProcess("pinned", [], tmp_path / "p.log", cpus=[core])
    role.argv = [
        sys.executable,
        "-c",
        "from whetstone.utils.processes import apply_role_environment; "
        "apply_role_environment(); import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
        "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])",
    ]
    assert role.start().wait(60) == 0
    assert role.log_path.read_text().split() == [f"[{core}]", f"[{core}]"]


def test_cores_that_do_not_exist_are_named(tmp_path):
    with pytest.raises(WhetstoneError, match=r"trainer: cores \[4096\] are not available here"):
        RoleProcess("trainer", [], tmp_path / "t.log", cpus=[4096])


def test_free_ports_are_distinct_bindable_and_outside_the_kernels_ephemeral_range():
    ports = free_ports(50)
    assert len(set(ports)) == 50
    low, high = processes.PICKED_PORTS[0], min(processes.PICKED_PORTS[1], processes._ephemeral_ports()[0])
    if high - low >= 1024:  # else the kernel picks them
        assert all(low <= port < high for port in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_processes_that_seeded_random_alike_pick_different_ports():
    random.seed(0)
    first = free_ports(8)
    random.seed(0)
    assert free_ports(8) != first


def test_a_taken_port_is_passed_over(monkeypatch):
    with socket.socket() as taken, socket.socket() as other:
        taken.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        port, free = taken.getsockname()[1], other.getsockname()[1]
        other.close()
        picks = iter([port, port, free])
        monkeypatch.setattr(processes, "_ephemeral_ports", lambda: (32768, 60999))
        monkeypatch.setattr(processes._PORT_CHOICE, "randrange", lambda low, high: next(picks, free))
        assert free_ports(1) == [free]


def test_where_the_range_is_too_narrow_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(processes, "_ephemeral_ports", lambda: (processes.PICKED_PORTS[0] + 10, 60999))
    monkeypatch.setattr(processes._PORT_CHOICE, "randrange", lambda low, high: pytest.fail("picked in the range"))
    assert len(set(free_ports(3))) == 3


@pytest.mark.parametrize(
    ("number", "second"),
    [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_first_signal_asks_to_stop_and_says_which_and_a_second_acts_as_without_it(number, second):
    # sent to the main thread, whose waits the signal interrupts; the handler's own re-sent signal
    # may reach another thread of the process (earlier tests leave some), so the main thread waits
    # in short sleeps, between which Python runs its handler. Outside: Python's own SIGINT handler
    # and `sigterm_raises` (as in `whetstone run`), which the second signal reaches.
    main = threading.main_thread().ident
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with sigterm_raises():
            outside = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}
            with stop_on_signals() as stop:
                assert stop.signal is None and not stop.is_set()
                signal.pthread_kill(main, number)
                assert stop.wait(5)  # a loop finishes its step and checkpoints
                assert stop.signal == number
                with pytest.raises(second):  # as without the handler: a setup that hangs can be stopped
                    signal.pthread_kill(main, number)
                    for _ in range(100):
                        time.sleep(0.05)
                assert stop.signal == number  # the first one's
            assert {n: signal.getsignal(n) for n in outside} == outside
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_sigterm_that_lands_in_an_event_loop_callback_still_stops_the_loop():
    # asyncio keeps an exception other than KeyboardInterrupt / SystemExit raised in a plain
    # callback (not a task's step): it logs it and runs on. The signal is sent from the callback,
    # so Python runs the handler there, at its next instruction.
    import asyncio

    main = threading.main_thread().ident
    landed = []

    def callback() -> None:
        signal.pthread_kill(main, signal.SIGTERM)
        landed.append(True)  # not reached: the handler raised before

    async def serve() -> None:
        asyncio.get_running_loop().call_soon(callback)
        await asyncio.sleep(2)

    with sigterm_raises(), pytest.raises(Terminated):
        asyncio.run(serve())
    assert not landed


CHECKPOINTS_ON_SIGTERM = """
import signal, sys, time
from pathlib import Path
asked = []
def take(number, frame):
    if asked:  # a second SIGTERM: "now", as `stop_on_signals` takes it
        sys.exit(1)
    asked.append(number)
signal.signal(signal.SIGTERM, take)
Path(sys.argv[1]).write_text("ready")
while not asked:
    time.sleep(0.01)
time.sleep(2.0)  # the checkpoint
Path(sys.argv[1]).write_text("checkpointed")
"""


def test_a_role_asked_to_stop_again_while_it_stops_is_not_signalled_twice(tmp_path):
    # The first wait is cut short, as a signal in the main thread cuts it; the second stop waits
    # out the first one's grace instead of sending the SIGTERM that would end the role at once.
    marker = tmp_path / "marker"
    role = RoleProcess("trainer", [], tmp_path / "t.log")
    role.argv = [sys.executable, "-c", CHECKPOINTS_ON_SIGTERM, str(marker)]
    role.start()
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    main = threading.main_thread().ident
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            role.stop(grace_s=30)
    finally:
        signal.signal(signal.SIGINT, before)
    assert role.running  # still checkpointing
    assert role.stop(grace_s=30) == 0
    assert marker.read_text() == "checkpointed"


def test_a_role_killed_after_its_grace_takes_the_processes_it_started_with_it(tmp_path):
    # a vLLM server's engine core, an orchestrator's sandboxes (in sessions of their own): left
    # running, they would hold their GPU memory and cores after the run
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "sleep = [sys.executable, '-c', 'import time; time.sleep(60)']\n"
        "children = [subprocess.Popen(sleep), subprocess.Popen(sleep, start_new_session=True)]\n"
        "print(*(child.pid for child in children), flush=True)\n"
        "time.sleep(60)\n"
    )
    role = RoleProcess("server", [], tmp_path / "s.log", command=[sys.executable, "-c", script]).start()
    children: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while not children and time.monotonic() < deadline:
            children = [int(pid) for pid in role.log_path.read_text().split()]
            time.sleep(0.05)
        assert len(children) == 2
        assert role.stop(grace_s=0.5) == -signal.SIGKILL
        deadline = time.monotonic() + 5
        while any(map(alive, children)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(alive, children))
    finally:
        role.kill()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("end", ["stop", "kill"])
def test_a_role_of_its_own_group_that_exited_leaves_no_orphan_of_its_group(tmp_path, end):
    # the main process crashed and left a child of its group to init (a vLLM engine core whose
    # API server died): stopping or killing the role ends it too
    script = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "sys.exit(3)\n"
    )
    role = RoleProcess("server", [], tmp_path / "s.log", command=[sys.executable, "-c", script], own_group=True)
    role.start()
    orphan = None
    try:
        assert role.wait(30) == 3
        orphan = int(role.log_path.read_text().split()[0])
        assert alive(orphan)
        assert (role.stop(grace_s=0.5) if end == "stop" else role.kill()) == 3
        deadline = time.monotonic() + 5
        while alive(orphan) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(orphan)
    finally:
        if orphan is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(orphan, signal.SIGKILL)


class Healthy(http.server.BaseHTTPRequestHandler):
    """Whatever already listens on a port: it answers every health check."""

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_port_taken_on_any_address_of_the_health_urls_host_is_found(monkeypatch):
    # `localhost` names 127.0.0.1 and ::1 (where /etc/hosts says so): a server holding the port on
    # ::1 alone answers `localhost` health checks too
    held = socket.socket(socket.AF_INET6)
    try:
        held.bind(("::1", 0))
    except OSError:
        held.close()
        pytest.skip("this machine has no IPv6 loopback address")
    with held:
        held.listen()
        port = held.getsockname()[1]
        resolved = [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
        ]
        monkeypatch.setattr(socket, "getaddrinfo", lambda host, *args, **kwargs: resolved)
        with pytest.raises(WhetstoneError, match=rf"serve-0: port {port} of http://localhost:{port}/health is in use"):
            processes.check_port_free("serve-0", f"http://localhost:{port}/health")
    processes.check_port_free("serve-0", f"http://localhost:{port}/health")  # released
    monkeypatch.undo()
    processes.check_port_free("serve-0", "http://no-such-host.invalid:8000/health")  # not this machine's


def test_a_server_whose_port_is_taken_is_not_started_to_be_answered_for_by_another(tmp_path):
    with http.server.HTTPServer(("127.0.0.1", 0), Healthy) as other:
        threading.Thread(target=other.serve_forever, daemon=True).start()
        port = other.server_address[1]
        role = RoleProcess(
            "serve-0",
            [],
            tmp_path / "serve-0.log",
            health_url=f"http://127.0.0.1:{port}/health",
            command=[sys.executable, "-c", "import time; time.sleep(2); raise SystemExit('port in use')"],
        )
        try:
            with pytest.raises(WhetstoneError, match=rf"serve-0: port {port} .* is in use already"):
                role.start()
            assert role.process is None
        finally:
            role.kill()
            other.shutdown()
