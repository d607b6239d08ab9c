"""Sandbox limits and options. Every default serves the embedded default run."""

from __future__ import annotations

from pathlib import PurePosixPath

from pydantic import Field, field_validator

from whetstone.config import Config
from whetstone.envs.sandbox.bwrap import SANDBOX_OWN_DIRS, SYSTEM_DIRS


class SandboxConfig(Config):
    """How a sandbox isolates and limits the commands it runs."""

    wall_clock_s: float = Field(30.0, gt=0)
    """Default wall-clock limit of one `run` (seconds); the whole process tree is killed after it."""
    cpu_s: int = Field(60, gt=0)
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU, then SIGKILL one second later."""
    memory_mb: int = Field(1024, gt=0)
    """Memory: address space per process (RLIMIT_AS) and, where cgroups are writable, the whole sandbox."""
    max_processes: int = Field(64, gt=0)
    """Processes and threads alive at once in the sandbox (cgroup pids.max, else RLIMIT_NPROC)."""
    max_output_bytes: int = Field(1_000_000, gt=0)
    """Bytes kept of each of stdout and stderr; the rest is read and dropped (`truncated` is set)."""
    max_file_mb: int = Field(64, gt=0)
    """Largest file a process may write (RLIMIT_FSIZE)."""
    tmp_size_mb: int = Field(64, gt=0)
    """Size of the private /tmp (a tmpfs, fresh for every `run`)."""
    disk_mb: int = Field(1024, gt=0)
    """Disk budget of the workspace (task files included), /tmp and /dev together: a command over it is stopped."""
    workdir: str = "/workspace"
    """Where the workspace appears inside the sandbox (commands start there)."""
    env: dict[str, str] = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    """Extra environment variables for commands. The default skips pytest's entry-point plugins
    (hypothesis alone adds ~1 s to every pytest start); a task that needs one names it with `-p`."""
    ro_paths: list[str] = []
    """Extra host paths made visible read-only at the same place (toolchains, data sets)."""
    cgroups: bool = True
    """Use cgroups for the process and memory limits where they are writable (falls back to rlimits)."""
    unsandboxed: bool = False
    """Run commands directly on the host, without namespaces: for trusted code only (explicit opt-in)."""
    pool_size: int = Field(2, ge=0)
    """Spare workspace copies kept ready per task snapshot, refilled in the background."""
    max_templates: int = Field(64, gt=0)
    """Task snapshots kept prepared at once (least recently used are dropped)."""
    root_dir: str | None = None
    """Directory for templates and workspaces (default: a fresh directory under the system temp dir)."""

    @field_validator("workdir")
    @classmethod
    def _workdir_of_its_own(cls, workdir: str) -> str:
        """The workspace is mounted at `workdir` over what the sandbox already shows there: at `/`,
        at a system directory or one of the sandbox's own mounts, or above one, it hides what
        commands need (`/bin/bash`, the Python environment) or what the disk budget measures
        (the tmpfs at /tmp); the harness maps paths under it, so it is absolute and normalized."""
        path = PurePosixPath(workdir)
        if not path.is_absolute() or path.as_posix() != workdir or ".." in path.parts:
            raise ValueError(f"workdir {workdir!r}: write an absolute, normalized path such as '/workspace'")
        hidden = [d for d in (*SYSTEM_DIRS, *SANDBOX_OWN_DIRS) if PurePosixPath(d).is_relative_to(path)]
        inside = [d for d in SANDBOX_OWN_DIRS if d != "/tmp" and path.is_relative_to(d)]
        if hidden or inside:
            what = f"would hide {hidden[0]}" if hidden else f"lies in the sandbox's own {inside[0]}"
            raise ValueError(f"workdir {workdir!r} {what}: choose a folder of its own, such as '/workspace'")
        return workdir
