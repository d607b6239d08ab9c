"""Read back what the tracking sinks wrote, with the tools users have: TensorBoard's own event
reader and W&B's `wandb leet inspect` (which reads an offline run's .wandb file)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator


def event_scalars(log_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar of a TensorBoard log folder: {tag: [(step, value, wall time), ...]} in the
    order written."""
    events = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})
    events.Reload()
    return {
        tag: [(event.step, event.value, event.wall_time) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def jsonl_scalars(records: list[dict], key: str, step_key: str = "step") -> list[tuple[int, float, float]]:
    """What the event files should hold for `key`: (step, value, time) of every record in which it
    is a number (a record may hold None, e.g. a batch's reward_mean with no reward in its window)."""
    return [
        (r[step_key], as_event_value(r[key]), r["time"]) for r in records if isinstance(r.get(key), bool | int | float)
    ]


def as_event_value(value: float) -> float:
    """A number as an event file holds it: TensorBoard keeps scalars as 32-bit floats."""
    return float(np.float32(value))


def use_offline_wandb(monkeypatch, folder: Path) -> None:
    """W&B without network or a home folder: whatever it writes of its own stays under `folder`."""
    for name, sub in (("WANDB_DIR", "wandb-dir"), ("WANDB_CONFIG_DIR", "wandb-config"), ("WANDB_CACHE_DIR", "cache")):
        monkeypatch.setenv(name, str(folder / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def wandb_records(folder: Path) -> list[dict]:
    """Every record of the one offline W&B run under `folder/wandb/`, as `wandb leet inspect --json` prints them."""
    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def wandb_history(folder: Path) -> dict[int, dict]:
    """The offline run's history rows by step, W&B's own fields (`_step`, `_runtime`, ...) left out."""
    rows = [r["history"] for r in wandb_records(folder) if r.get("type") == "history"]
    return {
        int(row.get("step", {}).get("num", 0)): {k: v for k, v in row["item"].items() if not k.startswith("_")}
        for row in rows
    }


def assert_tracked(log_dir: Path, records: list[dict], step_key: str = "step") -> None:
    """Every top-level number of every metrics record is in the event files, at its step and time."""
    events = event_scalars(log_dir)
    keys = {
        k for r in records for k, v in r.items() if k not in (step_key, "time") and isinstance(v, bool | int | float)
    }
    for key in keys:
        assert events[key] == jsonl_scalars(records, key, step_key), key
