"""Where a role's metrics go besides its metrics.jsonl: TensorBoard event files and, when asked
for, Weights & Biases runs. `MetricsWriter` (utils/metrics.py) hands every record's numbers to
the sinks opened here; metrics.jsonl stays the record the report reads.

Both sinks write in the background: TensorBoard's event writer queues each record for its own
thread (one event per record), and W&B's sink queues it for a thread that calls `run.log` (about
a millisecond per record, W&B's encoding and hand-off to its service process), so the training
loop waits on neither.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import queue
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import field_validator

from whetstone.config import Config, expand_path
from whetstone.errors import WhetstoneError
from whetstone.utils.atomic import write_errors

log = logging.getLogger(__name__)

TENSORBOARD_FLUSH_S = 10
"""Seconds between flushes of the event files: how far a live TensorBoard lags behind the run
(and what a killed process can lose of them; metrics.jsonl is flushed every record)."""
TENSORBOARD_QUEUE = 1000
"""Records the event writer may hold before `write` waits for its thread."""


class TrackingConfig(Config):
    """Metrics to TensorBoard and Weights & Biases, besides each role's metrics.jsonl."""

    tensorboard: bool = True
    """Write every metrics record's numbers as TensorBoard event files in `<dir>/tensorboard/<role>/`
    (`tensorboard --logdir runs/`), at the step of metrics.jsonl."""
    wandb: bool = False
    """Log them to Weights & Biases too, one W&B run per role (needs `pip install 'whetstone[wandb]'`)."""
    wandb_project: str = "whetstone"
    """W&B project of the runs."""
    wandb_entity: str = ""
    """W&B entity (user or team); empty = the logged-in account's default."""
    wandb_mode: Literal["online", "offline"] = "online"
    """`offline`: no network; the runs are kept in `<dir>/wandb/` (upload later with `wandb sync`)."""
    wandb_group: str = ""
    """W&B group of the roles' runs; empty = none. `whetstone run` sets its run name, so a run's
    roles show together."""
    dir: str = ""
    """Folder of the event files and W&B's local files; empty = the folder of the role's
    metrics.jsonl. `whetstone run` sets its run folder."""

    @field_validator("wandb")
    @classmethod
    def _wandb_installed(cls, on: bool) -> bool:
        if on and importlib.util.find_spec("wandb") is None:
            raise ValueError("W&B logging needs the wandb package: pip install 'whetstone[wandb]'")
        return on


class Sink(Protocol):
    """Where a metrics record's numbers go besides the JSONL: `log` must not block the caller."""

    def log(self, values: dict[str, float], step: int, walltime: float) -> None: ...

    def close(self, failed: bool) -> None: ...


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """A record's numbers by tag: nested tables as `table/key`, booleans as 0 or 1; text, lists
    and nulls are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, bool | int | float):
            out[f"{prefix}{key}"] = float(value)
    return out


class TensorBoardSink:
    """One event per record; TensorBoard keeps scalars as 32-bit floats.

    The event file is written by the writer's own thread: a write there that fails (a full
    disk) is raised by the next `log` or by `close`, as a WhetstoneError naming the folder
    (`write_errors`), as a metrics line that cannot be written is."""

    def __init__(self, log_dir: Path):
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.writer import FileWriter

        self._summary = Summary
        self.log_dir = log_dir
        self._writer = FileWriter(str(log_dir), max_queue=TENSORBOARD_QUEUE, flush_secs=TENSORBOARD_FLUSH_S)

    def log(self, values: dict[str, float], step: int, walltime: float) -> None:
        value = [self._summary.Value(tag=tag, simple_value=number) for tag, number in values.items()]
        with write_errors(self.log_dir):
            self._writer.add_summary(self._summary(value=value), step, walltime)

    def close(self, failed: bool) -> None:
        with write_errors(self.log_dir):
            self._writer.close()  # flushes what is queued


class WandbSink:
    """One W&B run per role, logged to from a thread of its own; several may be open in one
    process (the pipeline's samplers). A failure there is raised by the next `log`, as the
    TensorBoard sink raises its own: the role stops with it rather than log to nowhere."""

    def __init__(self, tracking: TrackingConfig, role: str, folder: Path, config: dict[str, Any] | None):
        import wandb

        with write_errors(folder):
            folder.mkdir(parents=True, exist_ok=True)
        group = tracking.wandb_group or None
        try:
            self._run = wandb.init(
                project=tracking.wandb_project,
                entity=tracking.wandb_entity or None,
                group=group,
                job_type=role,
                name=f"{group}/{role}" if group else role,
                dir=str(folder),
                mode=tracking.wandb_mode,
                config=config,
                reinit="create_new",
                settings=wandb.Settings(console="off"),  # the roles' output has its own logs
            )
        except Exception as err:  # not logged in, no network, a project it may not write to
            raise WhetstoneError(
                f"tracking.wandb: W&B could not start {role}'s run ({type(err).__name__}: {err}): log in "
                f'(`wandb login`, or set WANDB_API_KEY), or set tracking.wandb_mode = "offline" to keep '
                f"the runs on disk, or tracking.wandb = false"
            ) from err
        self.role = role
        self.failure: Exception | None = None
        """What `wandb`'s `log` raised in the sink's thread, which then ended."""
        self._queue: queue.SimpleQueue[tuple[dict[str, float], int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name=f"wandb-{role}", daemon=True)
        self._thread.start()

    def log(self, values: dict[str, float], step: int, walltime: float) -> None:
        if self.failure is not None:
            failure = self.failure
            raise WhetstoneError(
                f"logging {self.role}'s metrics to W&B failed: {type(failure).__name__}: {failure}"
            ) from failure
        self._queue.put((values, step))

    def _drain(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                self._run.log(item[0], step=item[1])
        except Exception as err:  # raised in the role by the next `log`
            self.failure = err

    def close(self, failed: bool) -> None:
        self._queue.put(None)
        self._thread.join()
        self._run.finish(exit_code=1 if failed else 0)


def close_sinks(sinks: list[Sink], failed: bool) -> None:
    """Close every sink of `sinks`, in order, whatever another's close raises (each holds a
    thread, an event file or a W&B run); what a close raised is raised once all are closed (the
    last such exception, the earlier ones as its context)."""
    with contextlib.ExitStack() as closing:
        for sink in reversed(sinks):  # the stack closes the last one pushed first
            closing.callback(sink.close, failed)


def open_sinks(tracking: TrackingConfig, role: str, folder: Path, config: dict[str, Any] | None) -> list[Sink]:
    """The sinks `tracking` asks for, for role `role`; `folder` is used when `tracking.dir` is empty."""
    root = expand_path(tracking.dir) if tracking.dir else folder
    sinks: list[Sink] = []
    if tracking.tensorboard:
        events = root / "tensorboard" / role
        try:
            with write_errors(events):  # a folder it cannot make (tracking.dir on a file, read-only)
                sinks.append(TensorBoardSink(events))
        except ImportError:
            # A dependency of whetstone, so missing only where it runs from source without its
            # dependencies installed (a GPU machine's image): the metrics still go to metrics.jsonl.
            log.warning("tracking.tensorboard is on, but tensorboard is not installed: no event files for %s", role)
    if tracking.wandb:
        try:
            sinks.append(WandbSink(tracking, role, root, config))
        except BaseException:
            close_sinks(sinks, failed=True)
            raise
    return sinks
