"""Reading and writing task sets: a JSONL file (one task per line) or a folder per task.

Folder layout (easy to read and edit by hand):

    <root>/<task id, '/' as '__'>/task.json      every field except the three file maps
                                 /repo/...         repo_files
                                 /hidden_tests/... hidden_tests
                                 /solution/...     solution_files

Errors name the file, the line (JSONL) and the field that is wrong. `read_records` yields a
problem per bad record instead of raising, for `whetstone tasks validate`, which reports bad
records alongside tasks that fail validation.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from whetstone.envs.task import Task
from whetstone.errors import WhetstoneError
from whetstone.utils.atomic import atomic_directory, atomic_write_text

TASK_FILE = "task.json"
FILE_FIELDS = {"repo_files": "repo", "hidden_tests": "hidden_tests", "solution_files": "solution"}


@dataclass
class Record:
    """One entry of a task source: a task, or why it could not be read (`where` names it)."""

    where: str
    task: Task | None = None
    problem: str | None = None


def _problem(err: ValidationError) -> str:
    parts = []
    for item in err.errors():
        field = ".".join(str(part) for part in item["loc"]) or "<record>"
        parts.append(f"field {field!r}: {item['msg']}")
    return "; ".join(parts)


def _parse(data: object, where: str) -> Record:
    if not isinstance(data, dict):
        return Record(where, problem="expected a JSON object")
    try:
        return Record(where, task=Task.model_validate(data))
    except ValidationError as err:
        return Record(where, problem=_problem(err))


def _read_jsonl(path: Path) -> Iterator[Record]:
    """Lines end at a line feed only (a JSON string holds no raw line break); each is decoded on
    its own, so a line that is not UTF-8 is a bad record under its own line number."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                data = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                yield Record(where, problem=f"not UTF-8 text: {err}")
                continue
            except json.JSONDecodeError as err:
                yield Record(where, problem=f"not valid JSON: {err}")
                continue
            yield _parse(data, where)


def _read_tree(root: Path) -> dict[str, str]:
    """Every file under `root`, decoded from its bytes, so line endings (CRLF, a lone CR) come
    back exactly as written: a `solution_patch` over such files must still apply."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        try:
            files[path.relative_to(root).as_posix()] = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise WhetstoneError(f"{path}: not UTF-8 text (task files must be text)") from None
    return files


def _read_folder(folder: Path) -> Record:
    where = str(folder / TASK_FILE)
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
                    data[field] = _read_tree(folder / subdir)
                except WhetstoneError as err:
                    return Record(where, problem=str(err))
    return _parse(data, where)


def read_records(path: str | Path) -> Iterator[Record]:
    """Every record of a JSONL file or task folder, good or bad, in order; duplicate ids are bad."""
    path = Path(path)
    if not path.exists():
        raise WhetstoneError(f"no such file: {path}")
    if path.is_dir():
        folders = [path] if (path / TASK_FILE).is_file() else sorted(p.parent for p in path.glob(f"*/{TASK_FILE}"))
        if not folders:
            raise WhetstoneError(f"{path}: no task folders (expected */{TASK_FILE}) and not a task folder itself")
        records: Iterable[Record] = (_read_folder(folder) for folder in folders)
    else:
        records = _read_jsonl(path)
    first_seen: dict[str, str] = {}
    for record in records:
        if record.task is not None:
            if record.task.id in first_seen:
                record = Record(
                    record.where,
                    problem=f"duplicate task id {record.task.id!r} (first at {first_seen[record.task.id]})",
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
    """Write atomically as JSONL or as a folder per task (see `output_layout` for which)."""
    path = Path(path)
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
