"""Progress bars for long work: done/total, rate in the work's own unit, ETA, live fields.

On a terminal, a rich bar on stderr. When stderr is not a terminal (`whetstone run > log 2>&1`,
a role's log file, a pipe), rich would draw nothing until the work ends, so a plain line is
printed instead when the work starts, every `PLAIN_INTERVAL_S` seconds, and when it ends.
"""

from __future__ import annotations

import sys
import threading
import time
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


PLAIN_INTERVAL_S = 15.0
"""Seconds between plain progress lines: often enough that whoever watches a log sees within
seconds that a stage is alive and how fast it goes, seldom enough that a 10-minute stage writes
~40 lines, not one per step."""


class PlainProgress:
    """Progress as plain lines on stderr (`description: done/total unit (pct) rate elapsed eta
    fields`), from a thread at a steady pace however rarely `update` is called; same `update`
    as `ProgressBar`."""

    def __init__(self, total: float | None, description: str, unit: str, interval_s: float = PLAIN_INTERVAL_S):
        self.total, self.description, self.unit, self.interval_s = total, description, unit, interval_s
        self.done = 0.0
        self.fields = ""
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"progress {description}", daemon=True)

    def update(self, advance: float = 1, **fields: object) -> None:
        with self._lock:
            self.done += advance
            self.fields = "  ".join(f"{key}={_fmt(value)}" for key, value in fields.items())

    def line(self) -> str:
        with self._lock:
            done, fields = self.done, self.fields
        elapsed = time.monotonic() - self._started
        rate = done / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.description}: {_count(done)}"]
        if self.total:
            parts[0] += f"/{_count(self.total)} {self.unit} ({100 * done / self.total:.0f}%)"
        else:
            parts[0] += f" {self.unit}"
        if rate:
            parts.append(f"{rate:,.1f} {self.unit}/s")
        parts.append(f"elapsed {_clock(elapsed)}")
        if self.total and rate and done < self.total:
            parts.append(f"eta {_clock(max(0.0, self.total - done) / rate)}")
        return "  ".join(parts + ([fields] if fields else []))

    def _print(self) -> None:
        print(self.line(), file=sys.stderr, flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._print()

    def __enter__(self) -> PlainProgress:
        self._print()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._print()


def _count(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


def _on_terminal(console: Console) -> bool:
    """Whether `console` (on stderr) writes to a terminal, where a bar may redraw its line. Rich
    also says so of a file or a pipe under FORCE_COLOR or TTY_COMPATIBLE=1, which ask for
    colours, and a bar there rewrites its line ten times a second into a role's log file (some
    2 KB a second, a single line): so the stream itself must be a terminal too."""
    try:
        return console.is_terminal and sys.stderr.isatty()
    except (AttributeError, ValueError):  # no stderr, or a closed one
        return False


@contextmanager
def progress_bar(total: float | None, description: str, unit: str = "it") -> Iterator[ProgressBar | PlainProgress]:
    """A progress display: `with progress_bar(steps, "midtrain", "step") as bar: bar.update()`.

    On stderr, so stdout stays clean for results (`--json`): a rich bar on a terminal, plain
    lines at a steady pace elsewhere (`PlainProgress`)."""
    console = Console(stderr=True)
    if not _on_terminal(console):
        with PlainProgress(total, description, unit, PLAIN_INTERVAL_S) as plain:
            yield plain
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[fields]}"),
        console=console,
    )
    with progress:
        task_id = progress.add_task(description, total=total, rate="", fields="")
        yield ProgressBar(progress, task_id, unit)
