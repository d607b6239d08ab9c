"""What the pipeline watches while the roles run: samples of every inference server's /metrics
(to `servers.jsonl`, for the report's version, swap-pause and busy plots) and the trainer's and
orchestrator's metrics and status files (for the live progress line)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from whetstone.errors import WhetstoneError
from whetstone.utils.cgroups import CpuGroup
from whetstone.utils.jsonl import json_lines
from whetstone.utils.metrics import MetricsWriter
from whetstone.utils.processes import FailedElsewhere
from whetstone.utils.tracking import TrackingConfig

SAMPLED = {
    "whetstone_weight_version": "weight_version",
    "whetstone_running_sequences": "running_sequences",
    "whetstone_tokens_per_second": "tokens_per_second",
    "whetstone_generation_tokens_total": "generation_tokens",
    "whetstone_swap_pause_seconds_last": "swap_pause_last_s",
    "whetstone_swap_pause_seconds_count": "swap_pause_count",
}
_LINE = re.compile(r"^(\w+)(?:\{[^}]*\})?\s+(\S+)$")
log = logging.getLogger("whetstone.run")
INTERRUPT_SIGNAL = signal.SIGURG
"""What a sampler that failed sends the main thread (`ServerSampler`'s `interrupt_main`): a real
signal, so that it ends a wait in a system call at once (an event loop's poll, a sleep, a child's
wait); one nothing else here uses, and one ignored by default, so that a signal that comes after
the sampler's block ended does nothing."""


def parse_metrics(text: str) -> dict[str, float]:
    """The sampled gauges of one Prometheus text page (unlabelled by quantile)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match and match.group(1) in SAMPLED and "quantile" not in line:
            out[SAMPLED[match.group(1)]] = float(match.group(2))
    return out


class ServerSampler:
    """A thread sampling each server's /metrics every `interval_s` into a JSONL file; the newest
    sample of each server is in `latest`. A server that does not answer is recorded as down.
    With `cpu_groups` (not empty) and `cpu_path`, each round also records the CPU seconds each
    group has used so far (no cgroups here: no groups, and no `cpu_path` file). With `tracking`,
    both also go to TensorBoard / W&B as roles `servers` (tags `server<i>/...`) and `cpu`.

    A sample that cannot be written ends the sampling: a full disk (the writers' WhetstoneError),
    or a TensorBoard / W&B sink that raised (as in every other role, whose metrics writer raises
    it and stops the role). It is logged once (a sink's exception with its traceback), kept in
    `error`, and raised by `check` and when the sampler's block ends, so that the run stops with it
    rather than go on without the servers' record. With `interrupt_main`, and the block entered in
    the main thread, the failure also interrupts that thread at once wherever it waits (an
    evaluation of many minutes, RL's polling, a role's stop): `FailedElsewhere` is raised there (by
    `INTERRUPT_SIGNAL`), and the block ends with `error`. What the interrupted work does on its
    way out still runs, as on Ctrl-C (an evaluation's tool calls and gradings in flight end first;
    a role being stopped is not signalled again: `RoleProcess.terminate`)."""

    def __init__(
        self,
        api_roots: list[str],
        path: str | Path,
        interval_s: float = 2.0,
        *,
        cpu_groups: dict[str, CpuGroup] | None = None,
        cpu_path: str | Path | None = None,
        tracking: TrackingConfig | None = None,
        interrupt_main: bool = False,
    ):
        self.urls = [root.rstrip("/").removesuffix("/v1") + "/metrics" for root in api_roots]
        self.writer = MetricsWriter(path, tracking, role="servers", series_key="server")
        self.cpu_groups = cpu_groups
        try:
            self.cpu_writer = (
                MetricsWriter(cpu_path, tracking, role="cpu") if cpu_path is not None and cpu_groups else None
            )
        except BaseException as err:  # the servers' writer, open already, with its sinks, is closed
            try:
                self.writer.close(failed=True)
            except Exception as closing:  # the run ends with why cpu.jsonl could not be opened
                log.warning("closing %s after %s: %s: %s", self.writer.path, err, type(closing).__name__, closing)
            raise
        self.interval_s = interval_s
        self.started = time.time()
        """When this sampler started: its CPU samples carry it, so a resumed run's samples (new
        groups, counting from 0) are told apart from the run's before (`report.cores_used`)."""
        self.latest: dict[int, dict[str, Any]] = {}
        self.error: WhetstoneError | None = None
        """Why sampling ended before it was stopped (a sample that could not be written)."""
        self.interrupt_main = interrupt_main
        self._main: int | None = None
        """The thread a failure interrupts (the main thread, while the block runs), or None."""
        self._previous_handler: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-sampler", daemon=True)

    def __enter__(self) -> ServerSampler:
        if self.interrupt_main and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(INTERRUPT_SIGNAL, self._interrupted)
            self._main = threading.get_ident()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        main, self._main = self._main, None  # a failure from here on is raised below, not by a signal
        if main is not None:
            previous = self._previous_handler
            signal.signal(INTERRUPT_SIGNAL, signal.SIG_DFL if previous is None else previous)
        self._stop.set()
        self._thread.join()
        failed = kind is not None or self.error is not None
        with contextlib.ExitStack() as closing:  # each writer closed, whatever another's close raises
            for writer in (self.writer, self.cpu_writer):
                if writer is not None:
                    closing.callback(self._close, writer, failed)
        if kind is None or issubclass(
            kind, FailedElsewhere
        ):  # else the block's own exception is what the run ends with
            self.check()

    def _close(self, writer: MetricsWriter, failed: bool) -> None:
        """Close `writer`; after sampling failed, what its close raises too (a sink that fails
        again as it flushes) is logged: the run ends with the first failure, `error`."""
        try:
            writer.close(failed)
        except Exception as err:
            if self.error is None:
                raise
            log.warning("closing %s after sampling failed: %s: %s", writer.path, type(err).__name__, err)

    def check(self) -> None:
        """Raise why sampling ended, if it ended on its own (`error`)."""
        if self.error is not None:
            raise self.error

    def sample(self, client: httpx.Client) -> None:
        for index, url in enumerate(self.urls):
            try:
                record: dict[str, Any] = {"server": index, "up": True, **parse_metrics(client.get(url).text)}
                if "weight_version" not in record:
                    record.update(weight_info(client, url.removesuffix("/metrics")))
            except httpx.HTTPError:
                record = {"server": index, "up": False}
            self.latest[index] = record
            self.writer.write(record)
        if self.cpu_writer is not None:
            used = {}
            for side, group in list(self.cpu_groups.items()):
                with contextlib.suppress(OSError):  # removed at the end of the run
                    used[side] = group.usage_seconds()
            self.cpu_writer.write({"cpu_s": used, "sampler_started": self.started})

    def _interrupted(self, _number: int, _frame: object) -> None:
        """`INTERRUPT_SIGNAL`'s handler in the main thread while the block runs."""
        if self._main is not None and self.error is not None:
            raise FailedElsewhere(self.error)

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=2.0) as client:
                while not self._stop.is_set():
                    self.sample(client)
                    self._stop.wait(self.interval_s)
        except Exception as err:  # a full disk (WhetstoneError), a TensorBoard / W&B sink's own exception
            self._fail(err)

    def _fail(self, err: Exception) -> None:
        """Keep why sampling ended in `error` and log it once (an exception other than a
        WhetstoneError with its traceback); interrupt the main thread while the block runs."""
        if isinstance(err, WhetstoneError):
            self.error = WhetstoneError(f"sampling the servers and CPU time failed: {err}")
            log.error("%s", self.error)
        else:
            self.error = WhetstoneError(f"sampling the servers and CPU time failed: {type(err).__name__}: {err}")
            self.error.__cause__ = err
            log.error("%s", self.error, exc_info=err)
        main = self._main
        if main is not None:
            signal.pthread_kill(main, INTERRUPT_SIGNAL)


def weight_info(client: httpx.Client, root: str) -> dict[str, int]:
    """The weight version a vLLM server serves (its `/weight_info`, as `integrations.vllm_serve`
    tags it), or nothing when it reports none."""
    response = client.get(root + "/weight_info")
    try:
        version = str(response.json().get("weight_version")) if response.status_code == 200 else ""
    except (ValueError, AttributeError):  # not vLLM's JSON answer
        version = ""
    return {"weight_version": int(version)} if version.isdigit() else {}


def last_record(path: str | Path, tail_bytes: int = 1 << 16) -> dict[str, Any]:
    """The newest complete record of a metrics file ({} while there is none). Reads only the
    file's tail: the live display asks every second, and the file grows all run long."""
    try:
        with Path(path).open("rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(max(0, size - tail_bytes))
            lines = list(json_lines(handle.read().split(b"\n")))
    except FileNotFoundError:
        return {}
    # A torn last line, or the cut first line of the tail, is a line with a problem: skipped.
    return next((line.value for line in reversed(lines) if isinstance(line.value, dict)), {})


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A JSON object file's contents: {} while it is missing, unreadable or not an object (a
    role's status file before its first write, a run folder a killed run left)."""
    try:
        value = json.loads(Path(path).read_text(errors="replace"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
