"""The sandbox: isolation, every limit for real, workspaces, and the unsandboxed opt-in."""

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import whetstone
from tests.envs.sandbox.sandbox_support import NOBODY, as_non_root
from whetstone.envs.sandbox import SandboxConfig, SandboxUnavailableError, open_sandbox
from whetstone.envs.sandbox.bwrap import bwrap_binary
from whetstone.envs.sandbox.cgroups import Cgroup
from whetstone.envs.sandbox.disk import DiskWatch
from whetstone.envs.sandbox.process import Limits, kill_process_group, limit_prefix, run_process
from whetstone.envs.sandbox.sandbox import Sandbox, _nproc_limit, _runtime
from whetstone.errors import WhetstoneError

FILES = {"app/main.py": "print('hello from', __name__)\n", "README.md": "a repo\n"}
DISK = SandboxConfig(disk_mb=64)
# 30 files of 4 MB against a budget of 64 MB, then a wait the budget must cut short.
FILL = "for i in $(seq 30); do head -c 4000000 /dev/zero > fill$i.bin || exit 1; done; sleep 20"


def listing(directory: Path) -> list[str]:
    return sorted(path.relative_to(directory).as_posix() for path in directory.rglob("*"))


def processes_with(marker: str) -> list[int]:
    """Host processes whose command line contains `marker` (to prove nothing outlived its sandbox)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def cgroups_available() -> bool:
    return _runtime(SandboxConfig()).cgroup_root is not None


def test_runs_in_the_workspace_with_the_task_files():
    with open_sandbox(FILES) as sandbox:
        result = sandbox.run("pwd && python app/main.py && ls")
    assert result.exit_code == 0 and not result.timed_out and not result.truncated
    assert result.stdout.split("\n")[:2] == ["/workspace", "hello from __main__"]
    assert "README.md" in result.stdout


def test_argv_commands_stdin_and_exit_codes():
    with open_sandbox({}) as sandbox:
        echoed = sandbox.run(["python", "-c", "import sys; sys.stdout.write(sys.stdin.read().upper())"], stdin="abc")
        big = sandbox.run("wc -c", stdin="x" * 1_000_000)  # larger than a pipe buffer
        failed = sandbox.run("echo oops >&2; exit 3")
    assert echoed.stdout == "ABC"
    assert big.stdout.strip() == "1000000"
    assert (failed.exit_code, failed.stderr) == (3, "oops\n")


def test_extra_environment_variables_reach_one_command_only():
    with open_sandbox({}) as sandbox:
        given = sandbox.run("echo $WHETSTONE_X:$HOME", env={"WHETSTONE_X": "42"})
        later = sandbox.run("echo ${WHETSTONE_X:-unset}")
    assert given.stdout.strip() == "42:/tmp" and later.stdout.strip() == "unset"


def test_files_persist_between_runs_but_tmp_and_processes_do_not():
    with open_sandbox({}) as sandbox:
        sandbox.run("echo kept > notes.txt && echo gone > /tmp/scratch")
        assert (sandbox.workspace / "notes.txt").read_text() == "kept\n"
        second = sandbox.run("cat notes.txt; ls /tmp/scratch")
    assert second.stdout == "kept\n" and "No such file" in second.stderr


def test_no_network():
    code = "import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)"
    with open_sandbox({}) as sandbox:
        result = sandbox.run(["python", "-c", code])
        interfaces = sandbox.run("cat /proc/net/dev")
    assert result.exit_code != 0 and "Network is unreachable" in result.stderr
    assert "eth" not in interfaces.stdout  # only the loopback device exists


def test_system_read_only_and_host_files_absent():
    project_file = Path(__file__).resolve()
    with open_sandbox({}) as sandbox:
        system = sandbox.run("touch /usr/x /etc/x /x 2>&1; echo done")
        host = sandbox.run(f"cat {project_file} /root/.bashrc 2>&1; ls {Path.home()}")
    assert system.stdout.count("Read-only file system") == 3
    assert "done" in system.stdout and not Path("/usr/x").exists() and not Path("/etc/x").exists()
    assert "No such file or directory" in host.stdout
    assert "def test_system_read_only_and_host_files_absent" not in host.stdout


def test_wall_clock_kills_the_whole_tree_even_escaped_sessions():
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    command = f"setsid sleep 1{marker} & (nohup sleep 2{marker} &) ; sleep 3{marker}"
    with open_sandbox({}) as sandbox:
        result = sandbox.run(command, timeout_s=1.0)
    assert result.timed_out and "wall_clock" in result.limits_hit
    assert result.duration_s < 5
    assert processes_with(marker) == []


def test_background_processes_end_with_their_command():
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    with open_sandbox({}) as sandbox:
        result = sandbox.run(f"sleep 1{marker} & echo started")
    assert result.stdout == "started\n" and not result.timed_out and result.duration_s < 5
    assert processes_with(marker) == []


WITH_AND_WITHOUT_CGROUPS = [
    pytest.param(False, id="no-cgroups"),
    pytest.param(
        True,
        id="cgroups",
        marks=pytest.mark.skipif(not cgroups_available(), reason="no writable cgroup hierarchy on this machine"),
    ),
]


def run_in_thread(sandbox, command: str) -> tuple[threading.Thread, list]:
    """`sandbox.run(command)` in a thread (as the orchestrator's workers run them): the thread and
    a list that gets the result, or the exception."""
    outcome: list = []

    def target():
        try:
            outcome.append(sandbox.run(command, timeout_s=60))
        except Exception as err:
            outcome.append(err)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("cgroups", WITH_AND_WITHOUT_CGROUPS)
def test_close_kills_a_command_running_in_another_thread(cgroups):
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    sandbox = open_sandbox(FILES, SandboxConfig(cgroups=cgroups))
    workspace = sandbox.workspace
    thread, outcome = run_in_thread(sandbox, f"sleep 6{marker}")
    deadline = time.monotonic() + 30
    while not processes_with(marker):
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    closing = time.monotonic()  # the command sleeps for hours: returning within seconds means it was killed
    sandbox.close()
    closed_after = time.monotonic() - closing
    # by the time close returns the process is gone and its run has returned, then the workspace went
    gone, returned = processes_with(marker) == [], bool(outcome)
    thread.join(5)
    assert closed_after < 15 and gone and returned and not workspace.exists()
    assert not thread.is_alive() and time.monotonic() - closing < 20
    (result,) = outcome
    assert result.sandbox_closed and not result.timed_out and result.exit_code != 0
    assert "the sandbox was closed" in result.stderr
    with pytest.raises(WhetstoneError, match="is closed"):
        sandbox.run(f"sleep 7{marker}")
    assert processes_with(marker) == []


@pytest.mark.parametrize("cgroups", WITH_AND_WITHOUT_CGROUPS)
def test_a_command_ending_leaves_another_threads_command_running(cgroups):
    """The sandbox's cgroup holds the processes of all its runs: one run ending must not empty it
    while another thread's command still runs."""
    with open_sandbox({}, SandboxConfig(cgroups=cgroups)) as sandbox:
        thread, outcome = run_in_thread(sandbox, "touch started; while [ ! -e go ]; do sleep 0.02; done; echo done")
        deadline = time.monotonic() + 30
        while not (sandbox.workspace / "started").exists():
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.02)
        quick = sandbox.run("echo quick")
        (sandbox.workspace / "go").touch()
        thread.join(30)
    assert quick.stdout == "quick\n"
    (result,) = outcome
    assert (result.exit_code, result.stdout, result.limits_hit) == (0, "done\n", [])


@pytest.mark.skipif(not cgroups_available(), reason="no writable cgroup hierarchy on this machine")
def test_what_a_command_left_running_beside_another_run_ends_with_the_last_run(monkeypatch):
    """A run ending while another is in progress leaves the cgroup alone; what its command left
    running (an escaped session, unsandboxed) is killed once the last run returns."""
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    sandbox = open_sandbox({}, SandboxConfig(unsandboxed=True, pool_size=0))
    measuring, escaped = threading.Event(), threading.Event()
    ran_into = DiskWatch.ran_into

    def measure_slowly(watch):  # the first run, its command done, measuring a large workspace
        if threading.current_thread().name == "first":
            measuring.set()
            assert escaped.wait(30)
        return ran_into(watch)

    monkeypatch.setattr(DiskWatch, "ran_into", measure_slowly)
    first = threading.Thread(target=sandbox.run, args=("true",), name="first")
    first.start()
    try:
        assert measuring.wait(30)
        # the second run returns once its escaped process is in a session of its own
        escape = f"setsid sh -c 'touch escaped; exec sleep 6{marker}' > /dev/null 2>&1 < /dev/null &"
        second = sandbox.run(escape + " while [ ! -e escaped ]; do sleep 0.01; done; echo started")
        assert second.stdout == "started\n"
        deadline = time.monotonic() + 10
        while not processes_with(marker):
            assert time.monotonic() < deadline, "the escaped process never started"
            time.sleep(0.01)
        escaped.set()
        first.join(30)
        assert processes_with(marker) == []
    finally:
        escaped.set()
        first.join(30)
        sandbox.close()


def test_a_command_starting_while_the_sandbox_closes_is_killed(monkeypatch):
    """A run past the closed check whose process starts only after `close` began is still stopped."""
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    sandbox = open_sandbox(FILES, SandboxConfig(cgroups=False))
    measuring, closing = threading.Event(), threading.Event()
    measure = sandbox._disk_watch

    def slow_measure():  # the run is under way but has not started its process
        measuring.set()
        assert closing.wait(30)
        return measure()

    monkeypatch.setattr(sandbox, "_disk_watch", slow_measure)
    thread, outcome = run_in_thread(sandbox, f"sleep 6{marker}")
    assert measuring.wait(30)
    closer = threading.Thread(target=sandbox.close)
    started = time.monotonic()
    closer.start()
    deadline = time.monotonic() + 5
    while not sandbox._closed:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    closing.set()
    closer.join(5)
    thread.join(5)
    assert not closer.is_alive() and not thread.is_alive() and time.monotonic() - started < 15
    (result,) = outcome
    assert result.sandbox_closed and result.duration_s < 15
    assert processes_with(marker) == [] and not sandbox.workspace.exists()


def test_killing_a_command_kills_a_child_that_left_its_process_group():
    """bwrap's child, pid 1 of the sandbox, starts a session of its own while it sets the sandbox
    up, before its `--die-with-parent` holds: bwrap killed then (the sandbox closed, the time up)
    must not leave it, and every process under it, running on."""
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    code = (
        "import os, sys\nif os.fork() == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', sys.argv[1]])\nos.wait()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, f"6{marker}"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not [pid for pid in processes_with(marker) if pid != proc.pid and os.getsid(pid) == pid]:
            assert time.monotonic() < deadline, "the child never started a session of its own"
            time.sleep(0.01)
        kill_process_group(proc)
        proc.wait(10)
        deadline = time.monotonic() + 5
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert processes_with(marker) == []
    finally:
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_close_signals_no_process_its_run_has_reaped(monkeypatch):
    """A run whose command ended, its process reaped, but that has not returned yet (it measures
    the workspace) when the sandbox closes: that process's pid, and its process group's, may be
    a new process's by then, so `close` must not signal them."""
    sandbox = open_sandbox({}, SandboxConfig(cgroups=False))
    procs, measuring, release, killed = [], threading.Event(), threading.Event(), threading.Event()
    started, kill_tree, ran_into = sandbox._started, sandbox._kill_tree, DiskWatch.ran_into
    monkeypatch.setattr(sandbox, "_started", lambda proc, runs: (procs.append(proc), started(proc, runs))[1])
    monkeypatch.setattr(sandbox, "_kill_tree", lambda proc: (kill_tree(proc), killed.set()))

    def measure_slowly(watch):
        measuring.set()
        assert release.wait(30)
        return ran_into(watch)

    monkeypatch.setattr(DiskWatch, "ran_into", measure_slowly)
    thread, outcome = run_in_thread(sandbox, "true")
    closer, signalled = threading.Thread(target=sandbox.close), []
    try:
        assert measuring.wait(30)
        (proc,) = procs
        assert proc.returncode == 0  # reaped
        kill, killpg = os.kill, os.killpg  # what is signalled from here on
        monkeypatch.setattr(os, "kill", lambda pid, signum: (signalled.append(pid), kill(pid, signum))[1])
        monkeypatch.setattr(os, "killpg", lambda pid, signum: (signalled.append(pid), killpg(pid, signum))[1])
        closer.start()
        assert killed.wait(30)
    finally:
        release.set()
        thread.join(30)
        if closer.ident is not None:
            closer.join(30)
    assert proc.pid not in signalled
    (result,) = outcome
    assert result.exit_code == 0 and not sandbox.workspace.exists()


def test_a_process_whose_start_hook_fails_is_killed():
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"

    def refuse(proc):
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        run_process(
            ["sleep", f"6{marker}"],
            env={"PATH": "/usr/bin:/bin"},
            cwd=Path("/"),
            stdin=None,
            timeout_s=20,
            max_output_bytes=1000,
            kill_tree=kill_process_group,
            on_start=refuse,
        )
    assert processes_with(marker) == []


def test_a_process_whose_pipes_cannot_be_set_up_is_killed():
    """Whatever fails once the process exists (here stdin that cannot be encoded; no descriptor
    left for the selector would do the same) kills it before the error goes on."""
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    with pytest.raises(UnicodeEncodeError):
        run_process(
            ["sleep", f"6{marker}"],
            env={"PATH": "/usr/bin:/bin"},
            cwd=Path("/"),
            stdin="\udcff",
            timeout_s=20,
            max_output_bytes=1000,
            kill_tree=kill_process_group,
        )
    assert processes_with(marker) == []


def test_cpu_limit():
    with open_sandbox({}, SandboxConfig(cpu_s=1)) as sandbox:
        result = sandbox.run(["python", "-c", "while True: pass"], timeout_s=20)
    assert not result.timed_out and "cpu" in result.limits_hit
    assert result.duration_s < 10


def test_memory_limit_per_process():
    with open_sandbox({}, SandboxConfig(memory_mb=200)) as sandbox:
        result = sandbox.run(["python", "-c", "x = bytearray(400 << 20)"])
    assert result.exit_code != 0 and "MemoryError" in result.stderr


@pytest.mark.skipif(not cgroups_available(), reason="no writable cgroup hierarchy on this machine")
def test_memory_limit_for_the_whole_tree():
    # Each process stays under the per-process limit; together they exceed the sandbox's memory.
    hog = "import time; x = bytearray(120 << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep(2)"
    command = " & ".join([f'python -c "{hog}"'] * 4) + " & wait"
    with open_sandbox({}, SandboxConfig(memory_mb=256)) as sandbox:
        result = sandbox.run(command, timeout_s=20)
    assert "memory" in result.limits_hit


def own_groups() -> set[Path]:
    """The cgroup folders this process's sandboxes have now."""
    root = _runtime(SandboxConfig()).cgroup_root
    return {group for parent in {root.pids_dir, root.memory_dir} for group in parent.glob(f"{os.getpid()}-*")}


@pytest.mark.skipif(not cgroups_available(), reason="no writable cgroup hierarchy on this machine")
def test_a_sandbox_whose_setup_fails_leaves_no_cgroup_behind(tmp_path):
    before = own_groups()
    with pytest.raises(OSError):  # pids.max takes no negative count
        Cgroup(_runtime(SandboxConfig()).cgroup_root, -1, 1 << 30)
    assert own_groups() == before
    config = SandboxConfig(unsandboxed=True)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    workspace.with_name("ws-home").mkdir()  # where the sandbox makes its HOME: a step after the cgroup fails
    with pytest.raises(FileExistsError):
        Sandbox(workspace, config, _runtime(config), [])
    assert own_groups() == before


@pytest.mark.skipif(not cgroups_available(), reason="no writable cgroup hierarchy on this machine")
def test_fork_bomb_is_contained():
    marker = f"{uuid.uuid4().int % 10**6}"
    bomb = f"bomb() {{ bomb | bomb & }}; bomb; sleep 1{marker}"
    with open_sandbox({}, SandboxConfig(max_processes=32)) as sandbox:
        result = sandbox.run(bomb, timeout_s=3)
        after = sandbox.run("echo still usable")
    assert "processes" in result.limits_hit
    assert after.stdout == "still usable\n"
    assert processes_with(marker) == []


def test_output_is_truncated_not_buffered():
    with open_sandbox({}, SandboxConfig(max_output_bytes=1000)) as sandbox:
        result = sandbox.run("head -c 5000000 /dev/zero | tr '\\0' x; echo tail >&2")
    assert result.truncated and "output" in result.limits_hit
    assert result.stdout.startswith("x" * 1000) and "4999000 more bytes" in result.stdout
    assert result.stderr == "tail\n"


def test_file_size_limit():
    with open_sandbox({}, SandboxConfig(max_file_mb=1)) as sandbox:
        sandbox.run("head -c 5000000 /dev/zero > big")
        assert (sandbox.workspace / "big").stat().st_size == 1 << 20


def test_disk_budget_stops_a_command_filling_the_workspace_and_takes_its_files_back():
    with open_sandbox(FILES, DISK) as sandbox:
        result = sandbox.run(FILL, timeout_s=60)
        left = listing(sandbox.workspace)
        after = sandbox.run("echo notes > notes.txt && cat README.md")
    assert result.exit_code == -signal.SIGKILL and "disk" in result.limits_hit and not result.timed_out
    assert "disk budget of 64 MB" in result.stderr and "files and directories deleted" in result.stderr
    assert left == ["README.md", "app", "app/main.py"]
    assert after.exit_code == 0 and after.limits_hit == [] and after.stdout == "a repo\n"


def test_disk_budget_counts_tmp_and_dev_with_the_workspace():
    # Each part is under the budget; together they are over it.
    command = "; ".join(f"head -c 24000000 /dev/zero > {path}" for path in ["/tmp/a", "/dev/shm/b", "c"]) + "; sleep 20"
    with open_sandbox({}, DISK) as sandbox:
        result = sandbox.run(command, timeout_s=60)
        left = listing(sandbox.workspace)
    assert result.exit_code == -signal.SIGKILL and "disk" in result.limits_hit
    assert left == []


def test_disk_budget_cuts_a_grown_file_back():
    with open_sandbox({"log.txt": "start\n"}, DISK) as sandbox:
        result = sandbox.run("for i in $(seq 30); do head -c 4000000 /dev/zero >> log.txt || exit 1; done")
        text = (sandbox.workspace / "log.txt").read_text()
    assert "disk" in result.limits_hit and "1 files cut back" in result.stderr
    assert text == "start\n"


def test_a_command_that_shrinks_a_file_past_the_cap_is_not_over_the_budget():
    # 1.9 MB of a 2 MB budget: RLIMIT_FSIZE is down to what is left, and big.txt stays over it.
    with open_sandbox({"big.txt": "x" * 1_900_000}, SandboxConfig(disk_mb=2)) as sandbox:
        result = sandbox.run("truncate -s 1000000 big.txt && echo hi > notes.txt")
        left = listing(sandbox.workspace)
    assert (result.exit_code, result.limits_hit) == (0, [])
    assert left == ["big.txt", "notes.txt"]


def test_work_under_the_disk_budget_is_unaffected():
    with open_sandbox(FILES, DISK) as sandbox:
        result = sandbox.run("head -c 40000000 /dev/zero > data && head -c 16000000 /dev/zero > /tmp/x && echo ok")
        size = (sandbox.workspace / "data").stat().st_size
    assert (result.exit_code, result.stdout, result.limits_hit) == (0, "ok\n", [])
    assert size == 40_000_000


def test_a_workspace_already_over_its_disk_budget_is_a_clear_error():
    with open_sandbox({"big.txt": "x" * (2 << 20)}, SandboxConfig(disk_mb=1)) as sandbox:
        with pytest.raises(WhetstoneError, match=r"already uses over 1 MB, its disk budget \(sandbox.disk_mb\)"):
            sandbox.run("true")


def test_folders_nested_past_the_longest_path_are_taken_back():
    # A command that keeps making a folder and going into it: far deeper than Python's recursion
    # limit, and than paths the disk budget records.
    nest = "import os\nfor _ in range(2500):\n    os.mkdir('d')\n    os.chdir('d')\n"
    with open_sandbox(FILES, DISK) as sandbox:
        result = sandbox.run(["python", "-c", nest], timeout_s=60)
        left = listing(sandbox.workspace)
        after = sandbox.run("mkdir -p a/b/c && echo ok")
        workspace = sandbox.workspace
    assert "disk" in result.limits_hit and "folders nested past 4096 characters of path" in result.stderr
    assert left == ["README.md", "app", "app/main.py"]
    assert (after.exit_code, after.stdout, after.limits_hit) == (0, "ok\n", [])
    assert not workspace.exists()


def test_a_caller_that_is_not_root_measures_folders_its_code_made_unsearchable(shared_tmp):
    """A caller that is not root is bound by the modes of its own folders: those the code left
    without their owner's read or search bit, the workspace itself included, are opened up, so
    that measuring the disk budget of the next command does not fail."""
    config = SandboxConfig(unsandboxed=True, cgroups=False, pool_size=0, root_dir=str(shared_tmp))
    sandbox = open_sandbox(FILES, config)
    if os.getuid() == 0:  # as if nobody had made it all
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(shared_tmp)], check=True)

    def check():
        made = sandbox.run("mkdir listed && echo x > listed/f && chmod 400 listed && chmod 000 .")
        after = sandbox.run("cat listed/f 2>&1; ls")
        assert (made.exit_code, made.limits_hit) == (0, [])
        assert after.exit_code == 0 and after.stdout.split() == ["x", "README.md", "app", "listed"]
        sandbox.close()

    as_non_root(check)
    assert not sandbox.workspace.exists()


def test_sandboxes_over_one_template_are_private():
    with open_sandbox(FILES) as first, open_sandbox(FILES) as second:
        first.run("echo changed > README.md && rm app/main.py")
        assert (second.workspace / "README.md").read_text() == "a repo\n"
        assert (second.workspace / "app/main.py").exists()
    with open_sandbox(FILES) as third:  # the template itself was never touched
        assert (third.workspace / "README.md").read_text() == "a repo\n"


def test_snapshot_directory_without_git_history(tmp_path):
    (tmp_path / "lib.py").write_text("X = 1\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    with open_sandbox(tmp_path) as sandbox:
        result = sandbox.run("ls -A; git log 2>&1 | head -1")
    assert result.stdout.split("\n")[0] == "lib.py"
    assert ".git" not in result.stdout.split("\n")[:2]


def test_unsandboxed_mode_is_explicit_and_still_limited():
    with open_sandbox(FILES, SandboxConfig(unsandboxed=True)) as sandbox:
        where = sandbox.run("pwd")
        slow = sandbox.run("sleep 30", timeout_s=0.5)
    assert sandbox.workdir == str(sandbox.workspace) and where.stdout.strip() == str(sandbox.workspace)
    assert slow.timed_out and slow.duration_s < 5


def test_disk_budget_binds_unsandboxed_commands_and_their_home():
    with open_sandbox({}, SandboxConfig(unsandboxed=True, disk_mb=64)) as sandbox:
        result = sandbox.run(f"head -c 30000000 /dev/zero > $HOME/scratch; {FILL}", timeout_s=60)
        left = listing(sandbox.workspace) + listing(sandbox._home)
    assert result.exit_code == -signal.SIGKILL and "disk" in result.limits_hit
    assert left == []


def test_clear_error_without_user_namespaces():
    # A sandbox whose user namespaces are disabled is a real machine where bwrap cannot work.
    bwrap = bwrap_binary()
    probe = "from whetstone.envs.sandbox import open_sandbox\nopen_sandbox({})"
    # The checkout and the Python environment may themselves live under /tmp (CI clones, a
    # virtual environment made there): keep them visible over the fresh /tmp.
    source = str(Path(whetstone.__file__).resolve().parents[1])
    environment = [arg for path in {sys.prefix, sys.base_prefix} for arg in ("--ro-bind", path, path)]
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--ro-bind",
        "/",
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
        "--ro-bind",
        source,
        source,
        *environment,
        sys.executable,
        "-c",
        probe,
    ]
    env = {**os.environ, "PYTHONPATH": source}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode != 0
    assert "SandboxUnavailableError" in result.stderr and "sandbox.unsandboxed=true" in result.stderr
    assert issubclass(SandboxUnavailableError, WhetstoneError)  # so the CLI prints it cleanly


def test_a_host_path_below_tmp_stays_visible(tmp_path):
    # A virtual environment or data set made under /tmp is mounted over the sandbox's own /tmp.
    data = Path("/tmp") / f"whetstone-ro-{uuid.uuid4().hex}"
    data.mkdir()
    try:
        (data / "x.txt").write_text("seen\n")
        with open_sandbox(FILES, SandboxConfig(ro_paths=[str(data)])) as sandbox:
            result = sandbox.run(f"cat {data}/x.txt && echo scratch > /tmp/y && cat /tmp/y")
        assert (result.exit_code, result.stdout) == (0, "seen\nscratch\n")
    finally:
        (data / "x.txt").unlink()
        data.rmdir()


def test_without_cgroups_the_process_limit_leaves_room_for_the_callers_threads():
    """RLIMIT_NPROC counts every thread of the user: a caller with more threads than
    `max_processes` (a role's pools) must still let its sandboxes fork."""

    def check():
        release = threading.Event()
        threads = [threading.Thread(target=release.wait) for _ in range(80)]
        for thread in threads:
            thread.start()
        try:
            limits = Limits(cpu_s=60, memory_bytes=1 << 30, file_bytes=64 << 20, nproc=_nproc_limit(64))
            result = run_process(
                limit_prefix(limits, []) + ["/bin/bash", "-c", "for i in 1 2 3; do sleep 0.1 & done; wait; echo ok"],
                env={"PATH": "/usr/bin:/bin"},
                cwd=Path("/"),
                stdin=None,
                timeout_s=20,
                max_output_bytes=10_000,
                kill_tree=kill_process_group,
            )
        finally:
            release.set()
        assert (result.exit_code, result.stdout) == (0, "ok\n"), result.stderr[-300:]

    as_non_root(check)


def test_a_caller_that_is_not_root_deletes_a_workspace_its_code_locked(shared_tmp):
    """Root removes anything; any other caller must give itself back the rights the sandboxed
    code took from its own files (chmod 500 and 000 on folders), or the workspace stays on disk."""
    config = SandboxConfig(unsandboxed=True, cgroups=False, pool_size=0, root_dir=str(shared_tmp))
    sandbox = open_sandbox(FILES, config)
    if os.getuid() == 0:  # as if nobody had made it all
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(shared_tmp)], check=True)
    workspace = sandbox.workspace

    def check():
        (workspace / "locked").mkdir()
        (workspace / "locked" / "f").write_text("x")
        (workspace / "locked").chmod(0o500)
        (workspace / "hidden" / "deeper").mkdir(parents=True)
        (workspace / "hidden" / "deeper" / "g").write_text("y")
        (workspace / "hidden" / "deeper").chmod(0o000)
        (workspace / "hidden").chmod(0o000)
        (workspace / "app").chmod(0o500)
        sandbox.close()

    as_non_root(check)
    assert not workspace.exists()


def test_a_kill_in_progress_holds_up_no_other_command_s_reaping_or_kill():
    """A kill holds its own process's lock while the process stops (up to a second): another
    command is reaped and killed meanwhile."""
    import whetstone.envs.sandbox.process as process

    held, other = (subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2))
    for proc in (held, other):
        proc.reaping = threading.Lock()
    outcome: list = []
    try:
        with process._reaping_lock(held):  # as `kill_process_group(held)` waiting for `held` to stop
            killer = threading.Thread(
                target=lambda: (kill_process_group(other), outcome.append(process._reap(other, True)))
            )
            killer.start()
            killer.join(10)
            assert outcome == [-signal.SIGKILL]
    finally:
        held.kill()
        held.wait()
