"""`whetstone tasks validate|list|show|export`: look at, check and save task sets.

SOURCE is a source name (synth, repofix, mutate, humaneval, swebench; configured by an optional
CONFIG file, the last argument, and `--set key=value`) or a JSONL file / task folder. Mount as `tasks`:
`app.add_typer(whetstone.envs.cli.app, name="tasks")`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(
    no_args_is_help=True, pretty_exceptions_enable=False, help="Coding tasks: validate, list, show, export."
)

SOURCE = typer.Argument(..., help="synth | repofix | mutate | humaneval | swebench, or a JSONL file / task folder.")
OVERRIDES = typer.Option([], "--set", "-s", help="Override a field of the source's config: KEY=VALUE, e.g. count=20.")
CONFIG = typer.Argument(
    None, help="TOML file of the generator's config fields (count, split, seed, ...); generated sources only."
)


@app.command()
def validate(
    source: str = SOURCE,
    overrides: list[str] = OVERRIDES,
    config: Path | None = CONFIG,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: total, valid, invalid [{id, reason}]."),
    workers: int = typer.Option(2, min=1, help="Tasks validated at once (each in its own sandboxes)."),
    cache: Path | None = typer.Option(None, help="JSON file remembering results by task content hash."),
) -> None:
    """Run every task's reference solution (must pass) and its starting repository (must fail) in sandboxes.
    Exits 1 if any task is invalid (each is listed with the reason) or there is none, 2 on bad input."""
    from whetstone.envs.tasks.registry import source_records
    from whetstone.envs.tasks.validate import validate_records

    report = validate_records(source_records(source, overrides, config), workers=workers, cache_path=cache)
    if as_json:
        typer.echo(json.dumps(report.to_json()))
    elif report.total:
        typer.echo(f"{len(report.valid)} of {report.total} tasks valid")
        for item in report.invalid:
            typer.echo(f"  invalid {item['id']}: {item['reason']}")
    if not report.total:  # nothing a run could train or evaluate on (`run` refuses it too)
        typer.echo(f"{source} holds no tasks", err=True)
    if report.invalid or not report.total:
        raise typer.Exit(1)


@app.command("list")
def list_tasks(
    source: str = SOURCE,
    overrides: list[str] = OVERRIDES,
    config: Path | None = CONFIG,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per task (no files)."),
) -> None:
    """One line per task: id, split, kind, difficulty and the start of the instruction. A record that
    cannot be read stops it, named: a list missing tasks would pass for the whole set (`validate`
    reports every bad record)."""
    from whetstone.envs.tasks.registry import load_source

    for task in load_source(source, overrides, config):
        if as_json:
            summary = task.model_dump(include={"id", "source", "split", "kind", "difficulty", "instruction"})
            typer.echo(json.dumps(summary))
        else:
            instruction = task.instruction.replace("\n", " ")
            typer.echo(f"{task.id}\t{task.split}\t{task.kind}\t{task.difficulty}\t{instruction[:80]}")


@app.command()
def show(
    source: str = SOURCE,
    task_id: str = typer.Argument(..., help="The task's id (see `whetstone tasks list`)."),
    overrides: list[str] = OVERRIDES,
    config: Path | None = CONFIG,
    reveal: bool = typer.Option(False, help="Also print the hidden tests and the reference solution."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole task record as JSON."),
) -> None:
    """Print one task: its fields, the files the agent starts with, and (with --reveal) what grades it.
    Records of other tasks that cannot be read do not hide it: they are counted in a warning."""
    from whetstone.envs.tasks.registry import source_records
    from whetstone.errors import WhetstoneError

    task, count, bad = None, 0, []
    for record in source_records(source, overrides, config):
        if record.task is None and record.id == task_id:
            raise WhetstoneError(f"task {task_id!r} ({record.where}) cannot be read: {record.problem}")
        if record.task is None:
            bad.append(record)
        else:
            count += 1
            task = record.task if record.task.id == task_id else task
    unreadable = f"{len(bad)} records cannot be read (first: {bad[0].where}: {bad[0].problem})" if bad else ""
    if task is None:
        raise WhetstoneError(
            f"no task {task_id!r} in {source} ({count} tasks; see `whetstone tasks list`)"
            + (f"; {unreadable}, see `whetstone tasks validate`" if bad else "")
        )
    if bad:
        typer.echo(f"warning: {source}: {unreadable}; `whetstone tasks validate` lists them", err=True)
    if as_json:
        typer.echo(task.model_dump_json(indent=2))
        return
    shown = {"repo_files": task.repo_files}
    if reveal:
        shown |= {"hidden_tests": task.hidden_tests, "solution_files": task.solution_files}
    fields = task.model_dump(
        exclude={"repo_files", "hidden_tests", "solution_files", "solution_patch"}, exclude_defaults=True
    )
    for key, value in fields.items():
        typer.echo(f"{key}: {value}")
    if reveal and task.solution_patch:
        typer.echo(f"\n=== solution_patch ===\n{task.solution_patch}")
    for group, files in shown.items():
        for path, text in sorted(files.items()):
            typer.echo(f"\n=== {group}: {path} ===\n{text}")


@app.command()
def export(
    source: str = SOURCE,
    output: Path = typer.Argument(
        ..., help="OUT.jsonl (one task per line), or a directory (a folder per task; a name without a suffix)."
    ),
    overrides: list[str] = OVERRIDES,
    config: Path | None = CONFIG,
    layout: str | None = typer.Option(
        None,
        help="jsonl or folders (default: jsonl for *.jsonl, folders for a name without a suffix; "
        "other suffixes are refused).",
    ),
    valid_only: bool = typer.Option(False, help="Validate first and write only the tasks that pass."),
    workers: int = typer.Option(2, min=1, help="Tasks validated at once, with --valid-only."),
) -> None:
    """Write a source's tasks to a JSONL file or a folder per task (atomically). A record that cannot be
    read stops it before anything is written, named: the copy would silently lack that task
    (`--valid-only` writes the valid tasks and lists the others)."""
    from whetstone.envs.tasks.io import output_layout, write_tasks
    from whetstone.envs.tasks.registry import load_source, source_records
    from whetstone.envs.tasks.validate import validate_records

    layout = output_layout(output, layout)  # refuse a bad output before generating (minutes, for mutate)
    if valid_only:
        report = validate_records(source_records(source, overrides, config), workers=workers)
        for item in report.invalid:
            typer.echo(f"skipping invalid {item['id']}: {item['reason']}", err=True)
        tasks = report.valid
    else:
        tasks = load_source(source, overrides, config)
    write_tasks(tasks, output, layout)
    typer.echo(f"wrote {len(tasks)} tasks to {output}")


if __name__ == "__main__":  # `python -m whetstone.envs.cli ...` is `whetstone tasks ...`
    import sys

    from whetstone.cli import main

    main(["tasks", *sys.argv[1:]])
