"""Applying unified diffs (SWE-bench `patch` / `test_patch`) to a repository snapshot.

`git apply` runs on a temporary copy (no repository or history needed); the result is the set
of files the patch touched, as {path: new text, or None if deleted}. Which files those are is
read by git's own parser too (`git apply --numstat`, forwards and reversed for both sides of a
rename), never from the text of `---`/`+++` lines: a removed line that starts with `-- ` is not a
file, an empty file created or deleted has no such lines, and git quotes unusual names.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from whetstone.envs.task import Task
from whetstone.errors import WhetstoneError


def _git_apply(work: Path, data: bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "apply", *args, "-"], cwd=work, input=data, capture_output=True)


def _patch_bytes(patch: str) -> bytes:
    """The patch as git reads it: UTF-8, and its last line ended (a patch stored without its final
    newline would otherwise be a "corrupt patch")."""
    data = patch.encode("utf-8")
    return data if data.endswith(b"\n") or not data else data + b"\n"


def _git_repository(work: Path) -> None:
    """A repository of its own, so git never resolves paths against an enclosing one."""
    subprocess.run(["git", "init", "-q"], cwd=work, check=True, capture_output=True)


def _touched(work: Path, data: bytes, what: str) -> list[str]:
    """Every path the patch names as git reads it: the old and the new side of each file."""
    sides = []
    for reverse in ((), ("-R",)):  # reversed, git names a rename's old side
        result = _git_apply(work, data, *reverse, "--numstat", "-z")
        if result.returncode != 0:
            problem = result.stderr.decode("utf-8", "replace").strip()
            if "No valid patches" in problem:
                raise WhetstoneError(f"{what}: not a unified diff (no file headers)")
            raise WhetstoneError(f"{what} does not apply: {problem}")
        # one `added<TAB>deleted<TAB>path<NUL>` per file; with -z the path is not quoted. A binary
        # file's counts are `-`: its bytes are no text to return, so it is left out of the result
        entries = [entry.split(b"\t", 2) for entry in result.stdout.split(b"\0") if entry]
        sides.append([path for added, _, path in entries if added != b"-"])
    new, old = sides
    pairs = [name for pair in zip(old, new) for name in pair] if len(old) == len(new) else old + new
    try:
        return list(dict.fromkeys(name.decode("utf-8") for name in pairs))
    except UnicodeDecodeError:
        raise WhetstoneError(f"{what}: names a file whose name is not UTF-8") from None


def patched_paths(patch: str) -> list[str]:
    """Every path a unified diff touches (old and new sides, created and deleted files), as git
    apply reads them."""
    with tempfile.TemporaryDirectory(prefix="whetstone-patch-") as tmp:
        _git_repository(Path(tmp))
        return _touched(Path(tmp), _patch_bytes(patch), "patch")


def _write(directory: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))


def apply_patch(base: dict[str, str] | Path, patch: str, what: str = "patch") -> dict[str, str | None]:
    """Apply `patch` to a copy of `base` (files or a directory); return the files it changed."""
    data = _patch_bytes(patch)
    with tempfile.TemporaryDirectory(prefix="whetstone-patch-") as tmp:
        work = Path(tmp) / "repo"
        if isinstance(base, Path):
            shutil.copytree(base, work, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        else:
            work.mkdir()
            _write(work, base)
        _git_repository(work)
        paths = _touched(work, data, what)
        result = _git_apply(work, data, "--whitespace=nowarn")
        if result.returncode != 0:
            raise WhetstoneError(f"{what} does not apply: {result.stderr.decode('utf-8', 'replace').strip()}")
        changed: dict[str, str | None] = {}
        for name in paths:
            path = work / name
            if path.is_symlink():  # its text would be the file it points to, maybe one outside the repository
                raise WhetstoneError(
                    f"{what}: {name} is a symbolic link after patching; a patch may change text files only"
                )
            if not path.is_file():
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
