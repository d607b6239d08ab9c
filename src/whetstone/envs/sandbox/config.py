"""Sandbox limits and options. Every default serves the embedded default run."""

from __future__ import annotations

from pydantic import Field

from whetstone.config import Config


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
