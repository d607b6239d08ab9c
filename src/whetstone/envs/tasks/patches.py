"""Applying unified diffs (SWE-bench `patch` / `test_patch`) to a repository snapshot.

`git apply` runs on a temporary copy (no repository or history needed); the result is the set
of files the patch touched, as {path: new text, or None if deleted}.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from whetstone.envs.task import Task
from whetstone.errors import WhetstoneError

_TARGET = re.compile(r"^(?:\+\+\+|---) (?:[ab]/)?(.+?)\s*$")


def patched_paths(patch: str) -> list[str]:
    """Every path a unified diff names (old and new sides), without a/ b/ prefixes or /dev/null."""
    paths = []
    for line in patch.splitlines():
        match = _TARGET.match(line)
        if match and match.group(1) != "/dev/null":
            paths.append(match.group(1).split("\t")[0])
    return list(dict.fromkeys(paths))


def _write(directory: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))


def apply_patch(base: dict[str, str] | Path, patch: str, what: str = "patch") -> dict[str, str | None]:
    """Apply `patch` to a copy of `base` (files or a directory); return the files it changed."""
    paths = patched_paths(patch)
    if not paths:
        raise WhetstoneError(f"{what}: not a unified diff (no ---/+++ file headers)")
    with tempfile.TemporaryDirectory(prefix="whetstone-patch-") as tmp:
        work = Path(tmp) / "repo"
        if isinstance(base, Path):
            shutil.copytree(base, work, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        else:
            work.mkdir()
            _write(work, base)
        # A repository of its own, so git never resolves paths against an enclosing one.
        subprocess.run(["git", "init", "-q"], cwd=work, check=True, capture_output=True)
        result = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", "-"], cwd=work, input=patch, capture_output=True, text=True
        )
        if result.returncode != 0:
            raise WhetstoneError(f"{what} does not apply: {result.stderr.strip()}")
        changed: dict[str, str | None] = {}
        for name in paths:
            path = work / name
            if not path.exists():
                changed[name] = None
                continue
            try:
                changed[name] = path.read_bytes().decode("utf-8")  # line endings kept as patched
            except UnicodeDecodeError:
                raise WhetstoneError(f"{what}: {name} is not UTF-8 text after patching") from None
        return changed


def apply_patch_to_task(task: Task, patch: str) -> dict[str, str | None]:
    base: dict[str, str] | Path = Path(task.repo_path) if task.repo_path else task.repo_files
    return apply_patch(base, patch, what=f"task {task.id}: patch")
