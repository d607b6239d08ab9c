"""The Python that sandboxed commands see: this interpreter and its packages, without start-up code.

Site-packages often hold `.pth` files that run code at every interpreter start (hooks, editable
installs, certificate shims); on this machine they cost ~50 ms of a ~70 ms `python -c pass`. The
sandbox gets its own virtual environment whose only `.pth` lists the host's site-packages
directories as plain paths: the same packages import, and no start-up code runs.
"""

from __future__ import annotations

import site
import sys
import sysconfig
import venv
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SandboxPython:
    """A virtual environment for sandboxes plus the host paths its interpreter and packages live in."""

    prefix: Path
    bin_dir: Path
    host_paths: tuple[str, ...]


def host_site_packages() -> list[str]:
    """Site-packages directories of this interpreter (the venv's own, then the base ones)."""
    dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    user_site = site.getusersitepackages()
    if site.ENABLE_USER_SITE and Path(user_site).is_dir():
        dirs.append(user_site)
    return list(dict.fromkeys(d for d in dirs if Path(d).is_dir()))


def make_sandbox_python(directory: Path) -> SandboxPython:
    """Create the sandbox's virtual environment in `directory` (about 5 ms, once per process)."""
    venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(directory)
    packages = host_site_packages()
    own_site = Path(sysconfig.get_path("purelib", vars={"base": str(directory), "platbase": str(directory)}))
    (own_site / "_host_site_packages.pth").write_text("".join(f"{path}\n" for path in packages))
    host_paths = _outermost([sys.base_prefix, sys.prefix, *packages])
    return SandboxPython(prefix=directory, bin_dir=directory / "bin", host_paths=tuple(host_paths))


def _outermost(paths: list[str]) -> list[str]:
    """Drop paths already inside another one, so each tree is mounted once."""
    # Keep each path as given and resolved: symlinks must lead somewhere inside the sandbox too.
    resolved = sorted({str(Path(p).absolute()) for p in paths} | {str(Path(p).resolve()) for p in paths})
    kept: list[str] = []
    for path in resolved:
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept
