"""Linux cgroups shared by the roles: where this process sits in a hierarchy, and CPU groups:
processes whose CPU time is counted together (sandboxes included, which per-process accounting
misses: they are not reaped by the role that starts them) and, optionally, capped by a quota.

A quota of 0.25 cores lets the group's processes together run 25 ms in every 100 ms period,
however many cores they spread over. On one machine this stands in for sizing hardware per role
(trainer GPUs against inference GPUs): the pipeline benchmark gives the trainer and the rollout
side the shares of the machine their work needs (bench/pipeline.py).

    with CpuGroup("trainer", cores=0.5) as group:     # new cgroups under this process's own
        RoleProcess(..., cpu_group=group)             # the role moves itself in at its start
                                                      # (`add_to_cgroups`), and its children follow
        group.usage_seconds()                         # CPU time of everything in it so far

cgroup v1 (the `cpu` hierarchy for the quota, `cpuacct` for the usage) and v2 (`cpu.max`,
`cpu.stat`; the cpu controller must be enabled for this process's cgroup's children). Where
neither is writable, an error says what is missing; nothing falls back silently to no quota.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from pathlib import Path

from whetstone.errors import WhetstoneError

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
"""The enforcement period (the kernel's default): a group may run `cores` x this in each period."""


def own_cgroup_path(controller: str) -> str | None:
    """This process's group in the hierarchy holding `controller` ("" selects cgroup v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (controller == "" and controllers == ""):
            return path
    return None


def _v1_mount(root: Path, controller: str, probe: str) -> Path | None:
    """The v1 hierarchy holding `controller` (mounted alone or co-mounted with its partner)."""
    names = [controller, "cpu,cpuacct", "cpuacct,cpu"]
    return next((root / name for name in names if (root / name / probe).exists()), None)


def cpu_group_parents(root: Path = CGROUP_ROOT) -> tuple[str, dict[str, Path]]:
    """("v1" or "v2", {"cpu": folder for quotas, "cpuacct": folder for usage}): this process's
    own groups, under which new CPU groups are made."""
    try:
        v1, v2 = own_cgroup_path("cpu"), own_cgroup_path("")
        acct = own_cgroup_path("cpuacct")
    except OSError as error:
        raise WhetstoneError(f"CPU groups need Linux cgroups: cannot read /proc/self/cgroup ({error})") from None
    if v1 is not None and acct is not None:
        cpu_mount, acct_mount = _v1_mount(root, "cpu", "cpu.cfs_quota_us"), _v1_mount(root, "cpuacct", "cpuacct.usage")
        if cpu_mount is None or acct_mount is None:
            raise WhetstoneError(
                f"CPU groups: this process is in v1 cpu/cpuacct cgroups but no hierarchy with "
                f"cpu.cfs_quota_us and cpuacct.usage is mounted under {root}"
            )
        return "v1", {"cpu": cpu_mount / v1.lstrip("/"), "cpuacct": acct_mount / acct.lstrip("/")}
    if v2 is not None:
        own = root / v2.lstrip("/")
        return "v2", {"cpu": own, "cpuacct": own}
    raise WhetstoneError("CPU groups: /proc/self/cgroup names neither v1 cpu/cpuacct cgroups nor a v2 cgroup")


class CpuGroup:
    """New cgroups (children of this process's own) counting the CPU time of the processes put in
    them, and capping it at `cores` CPUs in all when `cores` > 0, enforced every `period_us` (or
    the shortest period whose quota is the kernel's least, 1 ms, for a smaller share)."""

    def __init__(self, name: str, cores: float = 0.0, root: Path = CGROUP_ROOT, period_us: int = PERIOD_US):
        if cores < 0:
            raise WhetstoneError(f"CPU group {name}: cores must be >= 0 (0 = no quota), got {cores}")
        if not 1000 <= period_us <= 1_000_000:
            raise WhetstoneError(
                f"CPU group {name}: period_us must be in 1000..1000000 (the kernel's range), got {period_us}"
            )
        self.name, self.cores, self.period_us = name, cores, period_us
        self.version, parents = cpu_group_parents(root)
        remove_stale_groups(list(parents.values()))
        leaf = f"whetstone-{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.dirs = {kind: parent / leaf for kind, parent in parents.items()}
        self.paths = list(dict.fromkeys(self.dirs.values()))  # v2: one folder does both
        try:
            for path in self.paths:
                path.mkdir()
        except OSError as error:
            self.remove()
            raise WhetstoneError(
                f"CPU group {name}: cannot create a cgroup in {path.parent} ({error}); CPU groups "
                f"need a writable cgroup cpu controller (root, or a delegated cgroup)"
            ) from None
        if cores > 0:
            # The kernel's least quota is 1 ms: a smaller share gets a longer period, not more CPU.
            self.period_us = min(1_000_000, max(period_us, math.ceil(1000 / cores)))
            self._set_quota(max(1000, round(cores * self.period_us)))

    def _set_quota(self, quota_us: int) -> None:
        try:
            if self.version == "v1":
                (self.dirs["cpu"] / "cpu.cfs_period_us").write_text(str(self.period_us))
                (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota_us))
            else:
                (self.dirs["cpu"] / "cpu.max").write_text(f"{quota_us} {self.period_us}")
        except OSError as error:
            self.remove()
            hint = " (is the cpu controller in the parent's cgroup.subtree_control?)" if self.version == "v2" else ""
            raise WhetstoneError(
                f"CPU group {self.name}: cannot set its quota in {self.dirs['cpu']} ({error}){hint}"
            ) from None

    def __enter__(self) -> CpuGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def usage_seconds(self) -> float:
        """CPU seconds used by every process that has been in the group, since it was made."""
        if self.version == "v1":
            return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
        for line in (self.dirs["cpuacct"] / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
        raise WhetstoneError(f"CPU group {self.name}: no usage_usec in {self.dirs['cpuacct'] / 'cpu.stat'}")

    def remove(self, timeout_s: float = 5.0) -> None:
        """Delete the group, and the empty groups made inside it (a sandbox's parent group), once
        its processes are gone (exited processes leave it a moment late)."""
        deadline = time.monotonic() + timeout_s
        for path in self.paths:
            while path.exists():
                _remove_empty_children(path)
                try:
                    path.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise WhetstoneError(f"CPU group {self.name}: {path} {_what_holds(path)}") from None
                    time.sleep(0.05)


def _children(group: Path) -> list[Path]:
    try:
        return [child for child in group.iterdir() if child.is_dir()]
    except OSError:  # removed meanwhile
        return []


def _remove_empty_children(group: Path) -> None:
    """Remove the groups under `group` that hold no processes, the deepest first."""
    for child in _children(group):
        _remove_empty_children(child)
        try:
            child.rmdir()
        except OSError:  # it holds processes
            pass


def _what_holds(group: Path) -> str:
    """Why `group` cannot be removed, for the error: its processes, or the groups under it."""
    try:
        pids = (group / "cgroup.procs").read_text().split()
    except OSError:
        pids = []
    if pids:
        return f"still holds processes (pids {', '.join(pids[:8])}{', ...' if len(pids) > 8 else ''})"
    children = _children(group)
    if children:
        return f"still holds the groups {', '.join(child.name for child in children[:8])}, with processes in them"
    return "could not be removed"


def remove_stale_groups(parents: list[Path]) -> None:
    """Remove the empty CPU groups (`whetstone-<name>-<pid>-<id>`) in `parents` whose process is
    gone: one ended by a signal (`whetstone run` on SIGTERM or SIGKILL) removes none of its own."""
    for parent in dict.fromkeys(parents):
        try:
            groups = list(parent.glob("whetstone-*-*-*"))
        except OSError:
            continue
        for group in groups:
            pid = group.name.rsplit("-", 2)[1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                _remove_empty_children(group)
                try:
                    group.rmdir()
                except OSError:  # still holds processes (an orphaned sandbox), or not ours to remove
                    pass


def add_to_cgroups(paths: list[str] | list[Path], pid: int) -> None:
    """Move `pid` into each cgroup folder of `paths` (`cgroup.procs` moves the whole process)."""
    for path in paths:
        try:
            (Path(path) / "cgroup.procs").write_text(str(pid))
        except OSError as error:
            raise WhetstoneError(f"cannot move process {pid} into the cgroup {path}: {error}") from None


def why_no_cpu_groups() -> str | None:
    """Why this process cannot make CPU groups with quotas here, or None if it can."""
    try:
        CpuGroup("probe", 1.0).remove()
    except WhetstoneError as err:
        return str(err)
    return None
