"""Reading and writing task sets: a JSONL file (one task per line) or a folder per task.

Folder layout (easy to read and edit by hand):

    <root>/<task id, '/' as '__'>/task.json      every field except the three file maps
                                 /repo/...         repo_files
                                 /hidden_tests/... hidden_tests
                                 /solution/...     solution_files

A symbolic link in a task folder is read as the file it points to when that file is inside the
task folder; one pointing outside it (an untrusted task must not pull in ~/.aws/credentials, to be
exported and shown), to a folder, or nowhere makes the record bad. So does a task folder of a set
that is itself a link to a folder outside the set. A task id names its folder, so
ids that are not safe as one (`unsafe_id`) make the record bad too.

Errors name the file, the line (JSONL) and the field that is wrong. `read_records` yields a
problem per bad record instead of raising, for `whetstone tasks validate`, which reports bad
records alongside tasks that fail validation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from whetstone.config import expand_path
from whetstone.envs.task import Task
from whetstone.errors import WhetstoneError
from whetstone.utils.atomic import atomic_directory, atomic_write_text
from whetstone.utils.jsonl import read_json_lines

TASK_FILE = "task.json"
FILE_FIELDS = {"repo_files": "repo", "hidden_tests": "hidden_tests", "solution_files": "solution"}


@dataclass
class Record:
    """One entry of a task source: a task, or why it could not be read (`where` names it)."""

    where: str
    task: Task | None = None
    problem: str | None = None
    id: str | None = None
    """The id a bad record gives (when it gives a string one): `whetstone tasks show` names the
    problem of the task asked for."""


MAX_FOLDER_NAME_BYTES = 255
"""The longest file name Linux file systems take, in bytes: a task's folder name is its id."""


def unsafe_id(task_id: str) -> str | None:
    """Why `task_id` cannot be a task id, or None. An id names the task's folder (`folder_name`)
    and is printed one per line: it is not blank, holds no control character (a line break, NUL),
    no part between `/` that is empty (or blank), `.` or `..`, and fits in a folder name."""
    if not task_id.strip():
        return f"id {task_id!r} is blank (it names the task and its folder: write e.g. 'source/name')"
    if control := next((char for char in task_id if ord(char) < 32 or ord(char) == 127), None):
        return f"id {task_id!r} holds the control character {control!r}"
    if any(not part.strip() or part in (".", "..") for part in task_id.split("/")):
        return (
            f"id {task_id!r} has an empty, '.' or '..' part between '/' (it names a folder: write e.g. 'source/name')"
        )
    if len(folder_name(task_id).encode("utf-8")) > MAX_FOLDER_NAME_BYTES:
        return f"id {task_id[:40]!r}... is longer than a folder name can be ({MAX_FOLDER_NAME_BYTES} bytes)"
    return None


def validation_problem(err: ValidationError) -> str:
    """A task's validation error on one line, naming each field that is wrong."""
    parts = []
    for item in err.errors():
        field = ".".join(str(part) for part in item["loc"]) or "<record>"
        parts.append(f"field {field!r}: {item['msg']}")
    return "; ".join(parts)


def _parse(data: object, where: str) -> Record:
    if not isinstance(data, dict):
        return Record(where, problem="expected a JSON object")
    given_id = data.get("id") if isinstance(data.get("id"), str) else None
    if given_id is not None and (reason := unsafe_id(given_id)):
        return Record(where, problem=f"field 'id': {reason}", id=given_id)
    try:
        return Record(where, task=Task.model_validate(data))
    except ValidationError as err:
        return Record(where, problem=validation_problem(err), id=given_id)


def _read_jsonl(path: Path) -> Iterator[Record]:
    """A bad line (not UTF-8, not JSON, not a task) is a bad record under its own line number."""
    for line in read_json_lines(path):
        where = f"{path}:{line.number}"
        yield Record(where, problem=line.problem) if line.problem else _parse(line.value, where)


def _check_link(path: Path, task_folder: Path) -> None:
    """Raise unless the symbolic link `path` points to a file inside `task_folder` (resolved)."""
    target = Path(os.path.realpath(path))
    if not target.is_relative_to(task_folder):
        raise WhetstoneError(
            f"{path} is a symbolic link to {target}, outside the task folder {task_folder}: refused "
            "(a task reads only its own files; copy the file in)"
        )
    if not target.exists():
        raise WhetstoneError(f"{path} is a broken symbolic link (to {os.readlink(path)}): no file there")
    if target.is_dir():
        raise WhetstoneError(f"{path} is a symbolic link to the folder {target}: only links to files are read")


def _read_tree(root: Path, task_folder: Path) -> dict[str, str]:
    """Every file under `root`, decoded from its bytes, so line endings (CRLF, a lone CR) come
    back exactly as written: a `solution_patch` over such files must still apply. A symbolic link
    is read as its target if `_check_link` allows it."""
    paths = []
    for directory, folders, names in os.walk(root, onerror=_unreadable):  # a linked folder is listed, not entered
        for name in folders + names:
            if (path := Path(directory) / name).is_symlink():
                _check_link(path, task_folder)
            if name in names and path.is_file():
                paths.append(path)
    files = {}
    for path in sorted(paths):
        try:
            files[path.relative_to(root).as_posix()] = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise WhetstoneError(f"{path}: not UTF-8 text (task files must be text)") from None
        except OSError as err:
            _unreadable(err)
    return files


def _unreadable(err: OSError) -> None:
    """A task file or folder that cannot be read is an error naming it, not a file left out."""
    raise WhetstoneError(f"{err.filename}: cannot be read: {err.strerror or err}") from None


def _read_folder(folder: Path, task_set: Path | None = None) -> Record:
    """The task of `folder`; one of the set `task_set` may be a symbolic link only to a folder
    inside the set (else the whole folder it points to, anywhere, would be read as the task's)."""
    where = str(folder / TASK_FILE)
    task_folder = Path(os.path.realpath(folder))
    if task_set is not None and folder.is_symlink() and not task_folder.is_relative_to(os.path.realpath(task_set)):
        return Record(
            where,
            problem=f"{folder} is a symbolic link to {task_folder}, outside the task set {task_set}: refused "
            "(a task reads only its own files; copy the folder in)",
        )
    try:
        for path in [folder / TASK_FILE, *(folder / subdir for subdir in FILE_FIELDS.values())]:
            if path.is_symlink():
                _check_link(path, task_folder)
    except WhetstoneError as err:
        return Record(where, problem=str(err))
    try:
        data = json.loads((folder / TASK_FILE).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        return Record(where, problem=f"not UTF-8 text: {err}")
    except json.JSONDecodeError as err:
        return Record(where, problem=f"not valid JSON: {err}")
    if isinstance(data, dict):
        for field, subdir in FILE_FIELDS.items():
            if (folder / subdir).is_dir():
                if field in data:
                    return Record(where, problem=f"field {field!r} given both in {TASK_FILE} and as {subdir}/")
                try:
                    data[field] = _read_tree(folder / subdir, task_folder)
                except WhetstoneError as err:
                    return Record(where, problem=str(err))
    return _parse(data, where)


def read_records(path: str | Path) -> Iterator[Record]:
    """Every record of a JSONL file or task folder, good or bad, in order; duplicate ids are bad.
    `~` and `$NAME` in `path` are expanded (`expand_path`)."""
    path = expand_path(path)
    if not path.exists():
        raise WhetstoneError(f"no such file: {path}")
    if path.is_dir():
        if (path / TASK_FILE).is_file():
            records: Iterable[Record] = [_read_folder(path)]
        else:
            folders = sorted(p.parent for p in path.glob(f"*/{TASK_FILE}"))
            if not folders:
                raise WhetstoneError(f"{path}: no task folders (expected */{TASK_FILE}) and not a task folder itself")
            records = (_read_folder(folder, path) for folder in folders)
    else:
        records = _read_jsonl(path)
    first_seen: dict[str, str] = {}
    for record in records:
        if record.task is not None:
            if record.task.id in first_seen:
                record = Record(
                    record.where,
                    problem=f"duplicate task id {record.task.id!r} (first at {first_seen[record.task.id]})",
                    id=record.task.id,
                )
            else:
                first_seen[record.task.id] = record.where
        yield record


def read_tasks(path: str | Path) -> list[Task]:
    """All tasks of a source; the first bad record raises a WhetstoneError naming it."""
    tasks = []
    for record in read_records(path):
        if record.task is None:
            raise WhetstoneError(f"{record.where}: {record.problem}")
        tasks.append(record.task)
    return tasks


def folder_name(task_id: str) -> str:
    return task_id.replace("/", "__")


def write_tasks(tasks: Iterable[Task], path: str | Path, layout: str | None = None) -> None:
    """Write atomically as JSONL or as a folder per task (see `output_layout` for which); `~` and
    `$NAME` in `path` are expanded."""
    path = expand_path(path)
    if output_layout(path, layout) == "jsonl":
        atomic_write_text(path, "".join(task.model_dump_json() + "\n" for task in tasks))
    else:
        with atomic_directory(path) as tmp:
            for task in tasks:
                _write_folder(task, tmp / folder_name(task.id))


def output_layout(path: Path, layout: str | None = None) -> str:
    """The layout a task set is written to `path` in, once the path is known to take it. Without
    `layout`, the path decides: `*.jsonl` is a JSONL file, a directory or a name without a suffix a
    folder per task; any other suffix (`tasks.txt`, `tasks.json`) is refused rather than guessed.
    A folder set replaces the whole directory, so an existing one must hold task folders only."""
    path = expand_path(path)
    layout = layout or _layout_of(path)
    if layout == "jsonl":
        if path.is_dir():
            raise WhetstoneError(f"{path} is a directory: a JSONL task set is a file")
    elif layout == "folders":
        _check_replaceable(path)
    else:
        raise WhetstoneError(f"unknown task layout {layout!r}: use 'jsonl' or 'folders'")
    return layout


def _layout_of(path: Path) -> str:
    """`jsonl` for `*.jsonl`, `folders` for a directory or a name without a suffix."""
    if path.suffix == ".jsonl":
        return "jsonl"
    if path.is_dir() or not path.suffix:
        return "folders"
    raise WhetstoneError(
        f"{path}: tasks are written to a .jsonl file or to a directory (a folder per task), "
        f"not to a {path.suffix} file; name the output OUT.jsonl or DIR, or choose the layout "
        f"(--layout jsonl|folders)"
    )


def _check_replaceable(path: Path) -> None:
    if path.is_file():
        raise WhetstoneError(f"{path} is a file: a folder-per-task set is a directory")
    if path.is_dir():
        strays = [child.name for child in path.iterdir() if not (child / TASK_FILE).is_file()]
        if strays:
            raise WhetstoneError(
                f"{path} holds {', '.join(sorted(strays)[:3])}, not task folders: writing a task "
                f"set replaces the whole directory, so give a new or task-only directory"
            )


def _write_folder(task: Task, folder: Path) -> None:
    if reason := unsafe_id(task.id):
        raise WhetstoneError(f"task {task.id!r}: {reason}")
    if folder.exists():
        raise WhetstoneError(f"two tasks map to the folder {folder.name} (ids differ only in '/' vs '__')")
    data = task.model_dump(mode="json", exclude=set(FILE_FIELDS))
    folder.mkdir(parents=True)
    (folder / TASK_FILE).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    for field, subdir in FILE_FIELDS.items():
        for name, text in getattr(task, field).items():
            target = folder / subdir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text.encode("utf-8"))
