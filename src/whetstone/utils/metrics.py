"""Metrics as JSONL: one JSON object per line, appended and flushed as they happen; with a
tracking config, the same records' numbers also go to TensorBoard and W&B (utils/tracking.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from whetstone.config import without_secrets
from whetstone.utils.tracking import Sink, TrackingConfig, open_sinks, scalars


class MetricsWriter:
    """Append-only JSONL log; every record gets a wall-clock `time` unless it has one.

    With `tracking`, each record's numbers (`tracking.scalars`) also go to the sinks it asks for,
    as role `role`, at the record's `step_key` (else the record's index in its series) and its
    `time`. `series_key` names a field that tells series apart in one file (the servers'
    samples): its value prefixes the tags (`server0/...`). `run_config` is the role's config,
    shown with its W&B run (its secrets as `***`: `without_secrets`). The JSONL line is written
    and flushed first, so a crash loses none of it but the line it was writing; that torn line is
    ended when the file is opened again, so that the next record starts a line of its own.
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
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.step_key, self.series_key = step_key, series_key
        self._counts: dict[str, int] = {}
        config = without_secrets(run_config.model_dump(mode="json")) if run_config is not None else None
        self._sinks: list[Sink] = [] if tracking is None else open_sinks(tracking, role, self.path.parent, config)
        self._handle = self.path.open("a")
        if self._handle.tell() and not _ends_a_line(self.path):
            self._handle.write("\n")

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        self._handle.write(json.dumps(record, sort_keys=True) + "\n")
        self._handle.flush()
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
        """Close the file, then the sinks (which flush); `failed` marks a W&B run as crashed."""
        self._handle.close()
        for sink in self._sinks:
            sink.close(failed)

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=kind is not None)


def _ends_a_line(path: Path) -> bool:
    with path.open("rb") as file:
        file.seek(-1, 2)
        return file.read(1) == b"\n"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSONL file; a torn last line (a crash mid-write) is skipped."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
