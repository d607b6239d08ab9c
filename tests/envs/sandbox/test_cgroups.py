"""Where sandboxes make their cgroups (envs/sandbox/cgroups.py `find_cgroup_root`), on a cgroup
tree laid out in a temporary folder: what it takes, and what it leaves when it cannot use it."""

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from whetstone.envs.sandbox import cgroups
from whetstone.utils.cgroups import own_cgroup_path


@pytest.fixture
def v2_tree(tmp_path, monkeypatch):
    """A cgroup v2 mount in tmp_path, this process in its group /run/roles (no v1 hierarchies)."""
    own = tmp_path / "run" / "roles"
    own.mkdir(parents=True)
    monkeypatch.setattr(cgroups, "MOUNTS", tmp_path)
    monkeypatch.setattr(cgroups, "own_cgroup_path", lambda controller: "/run/roles" if controller == "" else None)
    return own


def test_a_v2_group_that_passes_on_no_pids_or_memory_is_left_as_it_was(v2_tree):
    """The kernel fills a new group's cgroup.controllers from its parent's subtree_control; a
    group whose processes keep it from passing pids and memory on (a run's CPU group) gets none.
    The probe folder goes again: left there, it kept the run's CPU group from being removed."""
    assert cgroups.find_cgroup_root() is None
    assert list(v2_tree.iterdir()) == []


def test_a_v2_parent_that_was_there_before_is_not_removed(v2_tree):
    """Another process's sandboxes may use it."""
    (v2_tree / "whetstone").mkdir()
    (v2_tree / "whetstone" / "cgroup.controllers").write_text("cpu io\n")
    assert cgroups.find_cgroup_root() is None
    assert (v2_tree / "whetstone").is_dir()


def test_a_v2_parent_with_pids_and_memory_is_where_sandbox_groups_go(v2_tree):
    (v2_tree / "whetstone").mkdir()
    (v2_tree / "whetstone" / "cgroup.controllers").write_text("cpu io memory pids\n")
    root = cgroups.find_cgroup_root()
    assert root == cgroups.CgroupRoot(2, v2_tree / "whetstone", v2_tree / "whetstone")
    assert (v2_tree / "whetstone" / "cgroup.subtree_control").read_text() == "+pids +memory"


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def _join(group_dirs: list[Path], proc: subprocess.Popen) -> None:
    for directory in group_dirs:
        (directory / "cgroup.procs").write_text(str(proc.pid))


@pytest.fixture
def real_group() -> Iterator[cgroups.Cgroup]:
    """A sandbox group in this machine's writable cgroup hierarchy (root, or a delegated tree)."""
    root = cgroups.find_cgroup_root()
    if root is None:
        pytest.skip("no writable cgroup hierarchy on this machine")
    group = cgroups.Cgroup(root, 16, 64 << 20)
    yield group
    group.close()


@pytest.fixture
def no_cgroup_kill(monkeypatch) -> None:
    """`cgroup.kill` refused (as before Linux 5.14): `kill_all` signals the pids it reads, on a v2
    hierarchy too."""
    write_text = Path.write_text

    def refusing(path: Path, *args, **kwargs):
        if path.name == "cgroup.kill":
            raise PermissionError(1, "Operation not permitted", str(path))
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", refusing)


def test_kill_all_kills_no_process_that_took_the_pid_of_one_that_exited(real_group, monkeypatch, no_cgroup_kill):
    """A pid read from cgroup.procs may be that of a process that exits before the kill, its
    number then taken by a process outside the group: that one lives. Here the read lists an
    outsider's pid once, as it would have listed the member that held it before."""
    member, outsider = _sleeper(), _sleeper()
    try:
        _join(real_group.dirs, member)
        read_text, stale = Path.read_text, [outsider.pid]

        def read_procs_once_stale(path: Path, *args, **kwargs) -> str:
            text = read_text(path, *args, **kwargs)
            if path.name == "cgroup.procs" and stale:
                text = f"{stale.pop()}\n{text}"
            return text

        monkeypatch.setattr(Path, "read_text", read_procs_once_stale)
        real_group.kill_all()
        assert member.wait(timeout=5) == -signal.SIGKILL
        assert outsider.poll() is None
    finally:
        for proc in (member, outsider):
            proc.kill()
            proc.wait()


def test_kill_all_without_pidfds_kills_by_pid(real_group, monkeypatch, no_cgroup_kill):
    """Where the kernel or Python has no pidfds, the pids read are killed by number."""
    monkeypatch.delattr(os, "pidfd_open", raising=False)
    member = _sleeper()
    try:
        _join(real_group.dirs, member)
        real_group.kill_all()
        assert member.wait(timeout=5) == -signal.SIGKILL
    finally:
        member.kill()
        member.wait()


@pytest.fixture
def v2_group() -> Iterator[Path]:
    """A group of its own in this machine's cgroup v2 tree, where it has one that is writable."""
    unified = cgroups.MOUNTS / "unified" if (cgroups.MOUNTS / "unified").is_dir() else cgroups.MOUNTS
    own = own_cgroup_path("")
    if own is None or not (unified / "cgroup.controllers").exists():
        pytest.skip("no cgroup v2 tree on this machine")
    group = unified / own.lstrip("/") / f"whetstone-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as err:
        pytest.skip(f"cannot make a cgroup v2 group here: {err}")
    try:
        if not (group / "cgroup.kill").exists():
            pytest.skip("no cgroup.kill (Linux before 5.14)")
        yield group
    finally:
        for _ in range(400):  # the kernel releases a group shortly after its last process is reaped
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.005)


def test_kill_all_on_cgroup_v2_lets_the_kernel_kill_the_whole_group(v2_group, monkeypatch):
    """`cgroup.kill` kills every process of the group at once, those it forks meanwhile included,
    and no pid is read and signalled apart."""
    group = object.__new__(cgroups.Cgroup)  # a v2 group without the pids and memory controllers
    group.root, group.dirs = cgroups.CgroupRoot(2, v2_group.parent, v2_group.parent), [v2_group]

    def refuse(*args) -> None:
        raise AssertionError("a pid was signalled apart")

    monkeypatch.setattr(os, "kill", refuse)
    monkeypatch.setattr(signal, "pidfd_send_signal", refuse)
    members = [_sleeper(), _sleeper()]
    try:
        for member in members:
            _join(group.dirs, member)
        group.kill_all()
        assert [member.wait(timeout=5) for member in members] == [-signal.SIGKILL] * 2
        assert (v2_group / "cgroup.procs").read_text() == ""
    finally:
        monkeypatch.undo()
        for member in members:
            member.kill()
            member.wait()
