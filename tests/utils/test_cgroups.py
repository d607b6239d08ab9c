"""CPU groups through cgroups (utils/cgroups.py): usage, quotas, and roles started inside them."""

import os
import subprocess
import sys
import time

import pytest

from whetstone.errors import WhetstoneError
from whetstone.utils.cgroups import CpuGroup, cpu_group_parents, why_no_cpu_groups
from whetstone.utils.processes import RoleProcess

BUSY = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"


needs_groups = pytest.mark.skipif(why_no_cpu_groups() is not None, reason="no writable cgroup cpu controller here")


def busy_role(tmp_path, group: CpuGroup, seconds: float) -> RoleProcess:
    """A role that starts a busy child (which it never waits for) and is busy itself."""
    role = RoleProcess("busy", [], tmp_path / "busy.log", cpu_group=group)
    child = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {BUSY.format(seconds=seconds)!r}])"
    role.argv = [
        sys.executable,
        "-c",
        "from whetstone.utils.processes import apply_role_environment\n"
        f"apply_role_environment()\n{child}\n{BUSY.format(seconds=seconds)}",
    ]
    return role.start()


def members(group: CpuGroup) -> list[int]:
    return [int(pid) for pid in (group.paths[0] / "cgroup.procs").read_text().split()]


def wait_for_members(group: CpuGroup, count: int) -> None:
    deadline = time.monotonic() + 20
    while len(members(group)) < count and time.monotonic() < deadline:  # moved in, then spawned
        time.sleep(0.05)


def enforced_period_us(group: CpuGroup) -> int:
    folder = group.dirs["cpu"]
    if group.version == "v1":
        return int((folder / "cpu.cfs_period_us").read_text())
    return int((folder / "cpu.max").read_text().split()[1])


@needs_groups
@pytest.mark.parametrize("period_us", [100_000, 10_000])
def test_a_quota_caps_a_role_and_everything_it_starts(tmp_path, period_us):
    """The role and its child, both busy, share a quarter of a core: unthrottled they would use up
    to 2 CPU seconds per second here."""
    with CpuGroup("test", 0.25, period_us=period_us) as group:
        assert enforced_period_us(group) == period_us
        role = busy_role(tmp_path, group, seconds=3)
        wait_for_members(group, 2)
        assert role.process.pid in members(group) and len(members(group)) == 2  # the child joined on its own
        first, first_at = group.usage_seconds(), time.monotonic()
        time.sleep(1.0)
        cpu, wall = group.usage_seconds() - first, time.monotonic() - first_at
        assert 0.05 <= cpu <= 0.25 * wall + 0.1
        role.wait(60)
    assert not any(path.exists() for path in group.paths)  # removed once its last process ended


@needs_groups
def test_without_a_quota_a_group_counts_the_cpu_of_children_nobody_waits_for(tmp_path):
    # Each process reports the CPU time it used inside the group, so the check holds under any load.
    def loop(report):
        return (
            "import time\nstart = time.process_time()\nx = 0\nfor i in range(2 * 10**6): x += i\n"
            f"open({str(report)!r}, 'w').write(str(time.process_time() - start))\n"
        )

    child, parent = tmp_path / "child.cpu", tmp_path / "parent.cpu"
    with CpuGroup("count") as group:
        role = RoleProcess("loops", [], tmp_path / "loops.log", cpu_group=group)
        role.argv = [
            sys.executable,
            "-c",
            "from whetstone.utils.processes import apply_role_environment\n"
            "apply_role_environment()\nimport subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', {loop(child)!r}])\n{loop(parent)}",
        ]
        role.start().wait(60)
        deadline = time.monotonic() + 60
        while members(group) and time.monotonic() < deadline:  # the child may outlive the role
            time.sleep(0.05)
        used = group.usage_seconds()
    assert used >= float(parent.read_text()) + float(child.read_text())  # the unwaited child's too


@needs_groups
def test_sandboxes_of_a_grouped_process_are_counted():
    """The reason for groups: a sandbox's CPU never reaches its starter's rusage."""
    import subprocess

    code = (
        "from whetstone.utils.cgroups import add_to_cgroups; import os, sys; "
        "add_to_cgroups(sys.argv[1:], os.getpid()); "
        "from whetstone.envs.sandbox import SandboxConfig, open_sandbox\n"
        "with open_sandbox({'a.py': 'x = 0\\nfor i in range(3 * 10**6): x += i\\n'}, SandboxConfig()) as box:\n"
        "    assert box.run(['python', 'a.py']).exit_code == 0"
    )
    with CpuGroup("sandboxes") as group:
        subprocess.run([sys.executable, "-c", code, *map(str, group.paths)], check=True, timeout=120)
        inside = group.usage_seconds()
    started = time.process_time()
    x = 0
    for i in range(3 * 10**6):
        x += i
    loop = time.process_time() - started
    assert inside >= loop  # the sandboxed loop, plus the starter's own imports


@needs_groups
def test_a_share_below_the_least_quota_gets_a_longer_period_not_more_cpu():
    """The kernel's least quota is 1 ms: 0.05 cores in 10 ms periods would be 0.5 ms."""
    with CpuGroup("small", 0.05, period_us=10_000) as group:
        assert enforced_period_us(group) == group.period_us == 20_000
        folder = group.dirs["cpu"]
        quota = (
            int((folder / "cpu.cfs_quota_us").read_text())
            if group.version == "v1"
            else int((folder / "cpu.max").read_text().split()[0])
        )
        assert quota == 1000


def test_a_negative_quota_is_refused():
    with pytest.raises(WhetstoneError, match=r"cores must be >= 0 \(0 = no quota\), got -1"):
        CpuGroup("trainer", -1)
    with pytest.raises(WhetstoneError, match=r"period_us must be in 1000..1000000 \(the kernel's range\), got 500"):
        CpuGroup("trainer", 0.5, period_us=500)


def test_without_cpu_hierarchies_the_error_says_what_is_missing(tmp_path):
    with open("/proc/self/cgroup") as own:
        v1 = any("cpu" in line.split(":")[1].split(",") for line in own)
    match = "no hierarchy with cpu.cfs_quota_us and cpuacct.usage" if v1 else "cannot create a cgroup"
    with pytest.raises(WhetstoneError, match=match):
        CpuGroup("trainer", 0.5, root=tmp_path)
    if v1:
        with pytest.raises(WhetstoneError, match="mounted under"):
            cpu_group_parents(tmp_path)


@needs_groups
def test_groups_of_a_process_that_died_are_removed_when_the_next_is_made():
    """A run ended by a signal removes none of its groups; the next CPU group made does."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    _, parents = cpu_group_parents()
    folders = list(dict.fromkeys(parents.values()))
    stale = [folder / f"whetstone-trainer-{ended.pid}-0a1b2c" for folder in folders]
    alive = [folder / f"whetstone-trainer-{os.getpid()}-0a1b2c" for folder in folders]
    for path in stale + alive:
        path.mkdir(exist_ok=True)
    (stale[0] / "whetstone").mkdir()  # an empty group made inside it (a sandbox's parent) goes too
    try:
        with CpuGroup("rollout"):
            assert not any(path.exists() for path in stale)
            assert all(path.exists() for path in alive)
    finally:
        for path in stale + alive:
            if path.exists():
                path.rmdir()


@needs_groups
def test_empty_groups_made_inside_a_group_go_with_it_and_a_held_one_is_named(tmp_path):
    """A sandbox's parent group made inside a role's group (cgroup v2 puts both in one tree) kept
    the group from being removed, reported as "still holds processes"."""
    group = CpuGroup("nested")
    (group.paths[0] / "whetstone" / "deeper").mkdir(parents=True)
    group.remove(timeout_s=1)
    assert not any(path.exists() for path in group.paths)

    group = CpuGroup("held")
    held = group.paths[0] / "sandbox"
    held.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (held / "cgroup.procs").write_text(str(sleeper.pid))
        with pytest.raises(WhetstoneError, match="still holds the groups sandbox, with processes in them"):
            group.remove(timeout_s=0.2)
        assert held.is_dir()  # not emptied by force
    finally:
        sleeper.kill()
        sleeper.wait()
    group.remove()
    assert not any(path.exists() for path in group.paths)
