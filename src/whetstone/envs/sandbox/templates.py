"""Task snapshots written once as templates, and private workspace copies made ahead of time.

Every rollout of a task, and every grading of it, starts from the same files. They are written
to disk once (a template); each sandbox gets its own copy, and a background thread keeps
`spares` copies of recently used templates ready, so opening a sandbox is usually one rename.
Copies are real copies: hard links would let a sandbox write through into the template.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from whetstone.errors import WhetstoneError

# Never part of a rollout repository: it carries no history beyond its base commit.
IGNORED_IN_SNAPSHOTS = shutil.ignore_patterns(".git")


def write_files(directory: Path, files: dict[str, str]) -> None:
    """Write {relative path: text} under `directory` (text is UTF-8; surrogate escapes kept as bytes)."""
    for name, text in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8", errors="surrogateescape"))


def copy_tree(source: Path, destination: Path) -> None:
    """A private copy of a snapshot: regular files copied with their mode, symlinks kept as links."""
    shutil.copytree(source, destination, symlinks=True, ignore=IGNORED_IN_SNAPSHOTS, copy_function=shutil.copy)


def snapshot_key(files: dict[str, str] | Path) -> str:
    digest = hashlib.sha256()
    if isinstance(files, Path):
        digest.update(b"path\0" + str(files.resolve()).encode())
    else:
        for name in sorted(files):
            # both as written (`write_files`): a name or text read with surrogateescape is its bytes
            digest.update(
                name.encode("utf-8", "surrogateescape") + b"\0" + files[name].encode("utf-8", "surrogateescape") + b"\0"
            )
    return digest.hexdigest()[:24]


@dataclass
class _Template:
    directory: Path
    owned: bool  # written by us (deleted on eviction), or a caller's snapshot directory
    spares: list[Path] = field(default_factory=list)
    refilling: bool = False


class WorkspacePool:
    """Hands out fresh private copies of task snapshots; thread-safe."""

    def __init__(self, root: Path, spares: int, max_templates: int):
        self.root, self.spares, self.max_templates = root, spares, max_templates
        for sub in ("templates", "workspaces"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self._templates: OrderedDict[str, _Template] = OrderedDict()
        self._lock = threading.Lock()
        self._counter = 0
        self._refiller = ThreadPoolExecutor(max_workers=1, thread_name_prefix="whetstone-workspace-pool")
        self._closed = False

    def checkout(self, files: dict[str, str] | Path) -> Path:
        """A new workspace directory holding `files`; the caller deletes it when done."""
        key = snapshot_key(files)
        attempts = 3
        while True:
            with self._lock:
                template = self._template(key, files)
                spare = template.spares.pop() if template.spares else None
                self._schedule_refill(key, template)
            if spare is not None:
                return spare
            try:
                return self._copy(template)
            except OSError:  # `shutil.Error` when the template is deleted halfway through the copy
                with self._lock:  # evicted meanwhile: start over; else the snapshot itself is unreadable or gone
                    evicted = self._templates.get(key) is not template
                attempts -= 1
                if not evicted or not attempts:
                    raise

    def _template(self, key: str, files: dict[str, str] | Path) -> _Template:
        template = self._templates.get(key)
        if template is None:
            if isinstance(files, Path):
                if not files.is_dir():
                    raise WhetstoneError(f"task snapshot directory {files} does not exist")
                template = _Template(files, owned=False)
            else:
                directory = self.root / "templates" / key
                staging = directory.with_name(key + ".partial")
                for stale in (staging, directory):  # left by an eviction that could not delete them
                    shutil.rmtree(stale, ignore_errors=True)
                write_files(staging, files)
                staging.mkdir(exist_ok=True)  # an empty snapshot is still a directory
                staging.rename(directory)
                template = _Template(directory, owned=True)
            self._templates[key] = template
            while len(self._templates) > self.max_templates:
                _, evicted = self._templates.popitem(last=False)
                self._discard(evicted)
        self._templates.move_to_end(key)
        return template

    def _copy(self, template: _Template) -> Path:
        with self._lock:
            self._counter += 1
            destination = self.root / "workspaces" / f"ws-{self._counter}"
        try:
            copy_tree(template.directory, destination)
        except BaseException:
            shutil.rmtree(destination, ignore_errors=True)
            raise
        return destination

    def _schedule_refill(self, key: str, template: _Template) -> None:
        if self.spares and not template.refilling and len(template.spares) < self.spares and not self._closed:
            template.refilling = True
            self._refiller.submit(self._refill, key, template)

    def _refill(self, key: str, template: _Template) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed or self._templates.get(key) is not template or len(template.spares) >= self.spares:
                        return
                try:
                    spare = self._copy(template)
                except OSError:
                    return  # evicted while copying; the next checkout starts over
                with self._lock:
                    if self._templates.get(key) is template and not self._closed:
                        template.spares.append(spare)
                        continue
                shutil.rmtree(spare, ignore_errors=True)
                return
        finally:
            template.refilling = False

    def _discard(self, template: _Template) -> None:
        for spare in template.spares:
            shutil.rmtree(spare, ignore_errors=True)
        template.spares.clear()
        if template.owned:
            shutil.rmtree(template.directory, ignore_errors=True)

    def close(self) -> None:
        """Stop refilling and delete every template and spare (handed-out workspaces are the callers')."""
        with self._lock:
            self._closed = True
        self._refiller.shutdown(wait=True)
        with self._lock:
            for template in self._templates.values():
                self._discard(template)
            self._templates.clear()
