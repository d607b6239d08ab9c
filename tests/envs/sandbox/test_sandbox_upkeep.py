"""The sandbox's bookkeeping around its limits: the CPU limit of a command that outlives SIGXCPU,
the process budget counted for each command, whose the sandbox roots in a shared folder are,
and what a start walk that lost its way reports."""

import fcntl
import os
import subprocess
import threading
import time

import pytest

from tests.envs.sandbox.sandbox_support import NOBODY, as_non_root
from whetstone.envs.sandbox import SandboxConfig, disk, open_sandbox
from whetstone.envs.sandbox.sandbox import (
    OWNER_LOCK,
    UNLOCKED_GRACE_S,
    Sandbox,
    _make_root,
    _remove_stale_roots,
    _runtime,
)
from whetstone.errors import WhetstoneError

SPIN = "import signal, sys\nsignal.signal(signal.SIGXCPU, {handler})\nwhile True: pass\n"


def test_a_command_that_outlives_sigxcpu_is_over_the_cpu_limit():
    """SIGXCPU at the soft limit can be ignored (Go programs do) or handled: such a process
    spins on until the hard limit's SIGKILL, and is over the CPU limit all the same, whether
    it is the command or one of its children (the shell then goes on)."""
    files = {
        "ignores.py": SPIN.format(handler="signal.SIG_IGN"),
        "handles.py": SPIN.format(handler="lambda *_: print('xcpu', flush=True)"),
    }
    with open_sandbox(files, SandboxConfig(cpu_s=1)) as sandbox:
        ignored = sandbox.run(["python", "ignores.py"], timeout_s=20)
        waited = time.thread_time()
        handled = sandbox.run("python handles.py; sleep 2; echo after", timeout_s=20)
        waited = time.thread_time() - waited
    assert (ignored.exit_code, ignored.timed_out, ignored.limits_hit) == (128 + 9, False, ["cpu"])
    assert (handled.exit_code, handled.stdout, handled.limits_hit) == (0, "xcpu\nafter\n", ["cpu"])
    assert waited < 1.0  # once the limit is found, the run stops polling: the shell's 2 s asleep cost no CPU here


def test_the_process_budget_leaves_room_for_threads_the_caller_starts_after_opening(shared_tmp):
    """Without a cgroup, RLIMIT_NPROC counts every task of the user: threads the caller starts
    while a sandbox lives (a pool that grows) must not use up a later command's processes."""
    config = SandboxConfig(unsandboxed=True, cgroups=False, pool_size=0, root_dir=str(shared_tmp), max_processes=16)
    runtime = _runtime(config)
    if os.getuid() == 0:  # as if nobody had made it all
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(shared_tmp)], check=True)

    def check():
        workspace = shared_tmp / "ws"
        workspace.mkdir()
        sandbox = Sandbox(workspace, config, runtime, [])
        release = threading.Event()
        threads = [threading.Thread(target=release.wait) for _ in range(40)]
        try:
            for thread in threads:
                thread.start()
            result = sandbox.run(["/bin/sh", "-c", "/bin/true && /bin/true && echo ok"])
        finally:
            release.set()
            sandbox.close()
        assert (result.exit_code, result.stdout) == (0, "ok\n"), result.stderr[-300:]

    as_non_root(check)


def test_a_root_whose_maker_holds_its_lock_stays_whatever_its_pid(tmp_path):
    """A maker in another PID namespace (a container sharing /tmp) has a pid this one lacks."""
    live = tmp_path / "whetstone-sandbox-999999999-live"
    live.mkdir()
    lock = os.open(live / OWNER_LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _remove_stale_roots(tmp_path)
    finally:
        os.close(lock)
    assert live.is_dir()
    _remove_stale_roots(tmp_path)  # its maker is gone now
    assert not live.exists()


def test_a_root_left_unlocked_goes_even_when_its_pid_is_reused(tmp_path):
    dead = tmp_path / "whetstone-sandbox-1-dead"  # pid 1 always runs
    (dead / "pool").mkdir(parents=True)
    (dead / OWNER_LOCK).touch()
    _remove_stale_roots(tmp_path)
    assert not dead.exists()


def test_roots_without_a_lock_file_are_judged_by_pid_once_old(tmp_path):
    old, young, alive = (tmp_path / f"whetstone-sandbox-{pid}" for pid in ("999999999-old", "999999999-new", "1-on"))
    for root in (old, young, alive):
        root.mkdir()
    for root in (old, alive):
        long_ago = time.time() - UNLOCKED_GRACE_S - 10
        os.utime(root, (long_ago, long_ago))
    _remove_stale_roots(tmp_path)
    assert (old.exists(), young.exists(), alive.exists()) == (False, True, True)


def test_a_root_made_here_is_locked_from_the_start(tmp_path):
    root, lock = _make_root(tmp_path)
    try:
        assert sorted(os.listdir(root)) == [OWNER_LOCK]
        _remove_stale_roots(tmp_path)
        assert root.is_dir()
    finally:
        os.close(lock)
    _remove_stale_roots(tmp_path)
    assert not root.exists()


def test_a_start_walk_that_lost_its_way_is_not_called_over_the_budget(monkeypatch):
    """A command running beside in the same sandbox that moves or locks folders as the next
    command's start walk goes through them: that is no reason to raise the disk budget."""
    real = disk._lstat

    def relocked(fd, name):
        if name == "README.md":  # as if its folder were locked again as the walk opened it up
            raise PermissionError(13, "Permission denied", name)
        return real(fd, name)

    with open_sandbox({"README.md": "a repo\n"}, SandboxConfig(unsandboxed=True, cgroups=False)) as sandbox:
        monkeypatch.setattr(disk, "_lstat", relocked)
        with pytest.raises(WhetstoneError, match="could not be measured") as error:
            sandbox.run("true")
        monkeypatch.setattr(disk, "_lstat", real)
        assert sandbox.run("true").exit_code == 0
    assert "raise the budget" not in str(error.value)


def test_a_root_on_a_file_system_without_locks_is_made_without_one(tmp_path, monkeypatch):
    """Some network and FUSE file systems refuse flock: sandboxes there still open, their roots
    judged by pid as before."""
    import errno

    from whetstone.envs.sandbox import sandbox as sandbox_module

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(sandbox_module.fcntl, "flock", no_locks)
    root, lock = sandbox_module._make_root(tmp_path)
    assert lock is None and root.is_dir() and list(root.iterdir()) == []
