"""Progress bars for long work: done/total, rate in the work's own unit, ETA, live fields."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class ProgressBar:
    """One bar. `update(n, loss=...)` advances it by n units and shows the fields after it."""

    def __init__(self, progress: Progress, task_id: int, unit: str):
        self._progress = progress
        self._task_id = task_id
        self._unit = unit

    def update(self, advance: float = 1, **fields: object) -> None:
        self._progress.update(self._task_id, advance=advance)
        speed = self._progress.tasks[self._task_id].speed
        rate = f"{speed:,.1f} {self._unit}/s" if speed else ""
        shown = "  ".join(f"{key}={_fmt(value)}" for key, value in fields.items())
        self._progress.update(self._task_id, rate=rate, fields=shown)


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


@contextmanager
def progress_bar(total: float | None, description: str, unit: str = "it") -> Iterator[ProgressBar]:
    """A rich progress bar: `with progress_bar(steps, "midtrain", "step") as bar: bar.update()`.

    Drawn on stderr, so stdout stays clean for results (`--json`)."""
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[fields]}"),
        console=Console(stderr=True),
    )
    with progress:
        task_id = progress.add_task(description, total=total, rate="", fields="")
        yield ProgressBar(progress, task_id, unit)
