"""Metrics as JSONL: one JSON object per line, appended and flushed as they happen; with a
tracking config, the same records' numbers also go to TensorBoard and W&B (utils/tracking.py)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from whetstone.config import without_secrets
from whetstone.errors import WhetstoneError
from whetstone.utils.atomic import atomic_path, write_errors
from whetstone.utils.jsonl import read_json_lines
from whetstone.utils.tracking import Sink, TrackingConfig, close_sinks, open_sinks, scalars

log = logging.getLogger(__name__)


class MetricsWriter:
    """Append-only JSONL log; every record gets a wall-clock `time` unless it has one.

    With `tracking`, each record's numbers (`tracking.scalars`) also go to the sinks it asks for,
    as role `role`, at the record's `step_key` (else the record's index in its series) and its
    `time`. `series_key` names a field that tells series apart in one file (the servers'
    samples): its value prefixes the tags (`server0/...`). `run_config` is the role's config,
    shown with its W&B run (its secrets as `***`: `without_secrets`). The JSONL line is written
    and flushed first, so a crash loses none of it but the line it was writing; that torn line is
    ended when the file is opened again, so that the next record starts a line of its own.

    `resume_at`: for a role resumed from a checkpoint, the first step (by `step_key`) it writes
    again. The file's records at that step or later were written after the checkpoint by the
    process that stopped (a crash, a kill): the resumed run takes those steps again, so they are
    dropped before the file is opened (`drop_records_from`, logged), leaving one record per step
    for the report and the plots. Records before it, and lines without the key, stay as they were.

    A line that cannot be written (a full disk) is a WhetstoneError naming the file and the cause
    (`write_errors`), which stops the role: metrics.jsonl is the run's record (the report reads
    it), a run that goes on without it has gaps no one sees, and a disk too full for a metrics
    line fails the next checkpoint anyway; stopped now, the same command resumes from the newest.
    """

    def __init__(
        self,
        path: str | Path,
        tracking: TrackingConfig | None = None,
        *,
        role: str = "",
        step_key: str = "step",
        series_key: str = "",
        run_config: BaseModel | None = None,
        resume_at: int | None = None,
    ):
        self.path = Path(path)
        self.step_key, self.series_key = step_key, series_key
        self._counts: dict[str, int] = {}
        self._failed = False
        with write_errors(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_at is not None and (dropped := drop_records_from(self.path, step_key, resume_at)):
                log.warning(
                    "%s: dropped %d records at %s %d or later, written after the checkpoint this run resumed "
                    "(the run takes those steps again)",
                    self.path,
                    dropped,
                    step_key,
                    resume_at,
                )
            self._handle = self.path.open("a")
            if self._handle.tell() and not _ends_a_line(self.path):
                self._handle.write("\n")
                self._handle.flush()
        config = without_secrets(run_config.model_dump(mode="json")) if run_config is not None else None
        try:
            self._sinks: list[Sink] = [] if tracking is None else open_sinks(tracking, role, self.path.parent, config)
        except BaseException:
            self._handle.close()
            raise

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        try:
            with write_errors(self.path):
                self._handle.write(json.dumps(record, sort_keys=True) + "\n")
                self._handle.flush()
        except WhetstoneError:
            self._failed = True
            raise
        if self._sinks:
            self._track(record)

    def _track(self, record: dict[str, Any]) -> None:
        series = f"{self.series_key}{record[self.series_key]}/" if self.series_key in record else ""
        count = self._counts[series] = self._counts.get(series, -1) + 1
        step = record.get(self.step_key, count)
        skip = {"time", self.step_key, self.series_key}
        values = scalars({key: value for key, value in record.items() if key not in skip}, series)
        for sink in self._sinks:
            sink.log(values, int(step), record["time"])

    def close(self, failed: bool = False) -> None:
        """Close the file, then every sink (which flush: `close_sinks`, each whatever another's
        close raises); `failed` marks a W&B run as crashed.
        After a line that could not be written (already raised), the file's close does not
        raise again for what it still holds of it."""
        try:
            with write_errors(self.path):
                self._handle.close()
        except WhetstoneError:
            if not self._failed:
                raise
        finally:
            close_sinks(self._sinks, failed or self._failed)

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=kind is not None)


def _ends_a_line(path: Path) -> bool:
    with path.open("rb") as file:
        file.seek(-1, 2)
        return file.read(1) == b"\n"


def drop_records_from(path: Path, key: str, first: int) -> int:
    """Remove the records of the JSONL file `path` whose `key` is an integer `first` or more, in
    one atomic rewrite (`atomic_path`: a reader sees the old file or the new one); every other
    line (a record without `key`, a torn line) is kept byte for byte and in its place. Returns
    how many were removed; without any (or without a regular file at `path`) nothing is written."""
    if not path.is_file():
        return 0
    with path.open("rb") as file:
        dropped = {number for number, line in enumerate(file) if _at_or_after(line, key, first)}
    if dropped:
        with atomic_path(path) as tmp, path.open("rb") as source, tmp.open("wb") as target:
            target.writelines(line for number, line in enumerate(source) if number not in dropped)
    return len(dropped)


def _at_or_after(line: bytes, key: str, first: int) -> bool:
    """Whether `line` is a record whose `key` is an integer `first` or more."""
    try:
        record = json.loads(line)
    except ValueError:  # a torn line (a crash mid-write), or not UTF-8
        return False
    step = record.get(key) if isinstance(record, dict) else None
    return isinstance(step, int) and not isinstance(step, bool) and step >= first


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records (JSON objects) of a metrics file. A line that cannot be read (a torn last
    line after a crash mid-write, bytes that are not UTF-8) is skipped, and so is a line that
    holds no object: one bad line never hides the others."""
    return [line.value for line in read_json_lines(Path(path)) if isinstance(line.value, dict)]
