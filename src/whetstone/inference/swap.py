"""Hot weight swap: new weight versions written in place into the serving model.

Updates are the weight-sync subscriber's `WeightUpdate`s (whole tensors or sparse overwrites:
flat indices + values). Everything slow happens outside the decode loop: the subscriber fetches
and decodes in its own thread (on the CPU), `WeightFollower` hands each update to the engine, and
the engine checks and casts it in the caller's thread and, when it serves on CUDA, copies it to
the device there, on a stream of its own, so the copy overlaps decoding (`prepare`). The decode
loop pauses only for `write`, the in-place overwrite between two decode steps (values are
overwritten, never added, so there is no floating-point drift). Writing in place keeps every
parameter's storage, so the engine's CUDA graphs stay valid.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from whetstone.errors import WhetstoneError
from whetstone.inference.metrics import WeightsReport
from whetstone.model.layout import flat_storage, in_storage_order, storage_indices
from whetstone.sync.update import TensorUpdate, WeightUpdate, merge_updates
from whetstone.utils.device import synchronize
from whetstone.utils.transfer import tensor_to_device

log = logging.getLogger(__name__)


class WeightUpdateError(WhetstoneError):
    """An update that does not fit the served model; nothing was written."""


def serving_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by state-dict name, sharing the model's storage."""
    return dict(model.state_dict())


def full_update(state: Mapping[str, torch.Tensor], version: int) -> WeightUpdate:
    """A whole state dict as an update (for weights that do not come through the weight store)."""
    tensors = {name: TensorUpdate(t.detach().reshape(-1), None, tuple(t.shape)) for name, t in state.items()}
    return WeightUpdate(version, None, tensors)


@dataclass
class PreparedUpdate:
    """An update checked against the served tensors, reduced to the writes the pause performs."""

    version: int
    writes: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]
    """(flat view of a served tensor's memory, positions in it or None for the whole tensor,
    values in the served dtype and in storage order), so the pause never reorders anything.
    Positions and values are on the served tensor's device."""
    ready: torch.cuda.Event | None = None
    """On CUDA: recorded on the upload's stream once the copies are queued; `write` waits for it."""


def prepare(update: WeightUpdate, tensors: Mapping[str, torch.Tensor]) -> PreparedUpdate:
    """Check `update` against the served tensors and cast its values; raises before anything is
    written if it does not fit. Runs in the caller's thread, off the decode loop."""
    where = f"weight version {update.version}"
    writes = []
    for name, change in update.tensors.items():
        target = tensors.get(name)
        if target is None:
            raise WeightUpdateError(f"{where}: the served model has no tensor {name!r}")
        if tuple(change.shape) != tuple(target.shape):
            raise WeightUpdateError(
                f"{where}: {name} has shape {tuple(change.shape)}, the served model has {tuple(target.shape)}"
            )
        values = change.values.reshape(-1)
        if change.indices is None:
            if values.numel() != target.numel():
                raise WeightUpdateError(f"{where}: {name} carries {values.numel()} values, needs {target.numel()}")
            prepared = in_storage_order(target, values.to(target.dtype))
            writes.append((flat_storage(target), None, _private(prepared, change.values, target.device)))
            continue
        indices = change.indices.reshape(-1).long()
        if indices.numel() != values.numel():
            raise WeightUpdateError(f"{where}: {name} has {indices.numel()} indices but {values.numel()} values")
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= target.numel()):
            raise WeightUpdateError(f"{where}: {name} has an index outside 0..{target.numel() - 1}")
        positions = _private(storage_indices(target, indices), change.indices, target.device)
        writes.append(
            (flat_storage(target), positions, _private(values.to(target.dtype), change.values, target.device))
        )
    served = [name for name in update.removed if name in tensors]
    if served:
        raise WeightUpdateError(f"{where} removes tensors the served model needs: {served[:5]}")
    return _upload(PreparedUpdate(update.version, writes))


def _private(prepared: torch.Tensor, given: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`prepared`, copied if it is still the memory of `given` (the caller's tensor: the same
    dtype and order need no cast) and no upload to `device` will copy it: the update is taken
    when `update_weights` returns, so a caller reusing its tensors must not change what is
    served. A host tensor bound for a GPU is copied there anyway."""
    if prepared.device == device and prepared.untyped_storage().data_ptr() == given.untyped_storage().data_ptr():
        return prepared.clone()
    return prepared


def _upload(update: PreparedUpdate) -> PreparedUpdate:
    """The update with its positions and values on the served tensors' device: on CUDA copied
    through pinned memory on a side stream, without waiting for the copies."""
    if not update.writes:
        return update
    device = update.writes[0][0].device
    if device.type != "cuda":
        writes = [(t, None if i is None else i.to(device), v.to(device)) for t, i, v in update.writes]
        return PreparedUpdate(update.version, writes)
    stream = torch.cuda.Stream(device)  # normal priority: never the decode graphs' capture stream
    # values already on the device (the online gate's) were cast on the caller's stream: `ready`
    # must follow that cast too
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        writes = [
            (t, None if i is None else tensor_to_device(i, device), tensor_to_device(v, device))
            for t, i, v in update.writes
        ]
    return PreparedUpdate(update.version, writes, stream.record_event())


@torch.no_grad()
def write(update: PreparedUpdate) -> float:
    """Overwrite the served tensors in place; returns the seconds taken (the decode pause).

    Sparse values go in with `scatter_`, about 10x faster than `index_put_` on CPU for the few
    percent of values an RL step changes. On CUDA the pause lasts until the device has written
    them (and received them, if the upload is still under way)."""
    start = time.perf_counter()
    if update.ready is not None:
        torch.cuda.current_stream(update.writes[0][0].device).wait_event(update.ready)
    try:
        for target, indices, values in update.writes:
            if indices is None:
                target.copy_(values)
            else:
                target.scatter_(0, indices, values)
    finally:
        if update.writes:  # the uploaded tensors may be freed after (also when a write failed)
            synchronize(update.writes[0][0].device)
    return time.perf_counter() - start


RETRY_FIRST_S, RETRY_MAX_S = 1.0, 60.0
"""How soon a `WeightFollower` retries a version the engine refused when no newer one came, and
how far the wait doubles to."""


class WeightFollower:
    """Feeds the engine every version a weight-sync `Subscriber` decodes, from its own thread, and
    reports (`report`, logged as it changes) when the server cannot take the store's newest
    version: one was rejected (corrupt, wrong base) or the engine refused it."""

    def __init__(self, subscriber, engine, poll_seconds: float = 0.2):
        self.subscriber, self.engine, self.poll_seconds = subscriber, engine, poll_seconds
        self.refused: dict[int, str] = {}
        """Versions the engine refused (they do not fit the served model), until one fits."""
        self.refusals = 0
        self._unapplied: WeightUpdate | None = None
        """What the engine refused, merged with every version since: the subscriber hands each
        version over once, and a later delta written without it would leave the values only it
        changed stale (serving weights of no version). Retried with each new version, and alone
        after `_retry_in` seconds (doubling up to RETRY_MAX_S): a GPU short of memory for a
        moment takes it once memory is free, even when no version follows."""
        self._retry_in, self._retry_at = RETRY_FIRST_S, 0.0
        self._problem: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def report(self) -> WeightsReport:
        subscriber, refused = self.subscriber, dict(self.refused)
        served = self.engine.version
        rejected = {v: why for v, why in dict(subscriber.rejected).items() if v > served} | refused
        problem = None
        if refused:
            newest = max(refused)
            problem = f"the engine refused weight version {newest}: {refused[newest]}"
        else:
            problem = subscriber.blocked()
        return WeightsReport(subscriber.latest, rejected, subscriber.rejections + self.refusals, problem)

    def _log_problem(self) -> None:
        problem = self.report().problem
        if problem != self._problem:
            if problem is not None:
                log.error("serving weight version %s: %s", self.engine.version, problem)
            else:
                log.info("weights caught up: serving version %s", self.engine.version)
            self._problem = problem

    def start(self) -> "WeightFollower":
        self.subscriber.start()
        self._thread = threading.Thread(target=self._run, name="whetstone-weights", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.subscriber.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            held = self.subscriber.version
            self.subscriber.wait_for(0 if held is None else held + 1, timeout=self.poll_seconds)
            update = self.subscriber.take_update()
            if self._unapplied is not None:
                if update is not None:
                    update = merge_updates([self._unapplied, update])
                elif time.monotonic() >= self._retry_at:
                    update = self._unapplied
            if update is not None:
                self._apply(update)
            self._log_problem()

    def _apply(self, update: WeightUpdate) -> None:
        try:
            self.engine.update_weights(update)
        except Exception as err:  # another model's store, or no GPU memory for now: keep serving
            if update.version not in self.refused:  # a retry of the same version says nothing new
                log.error("not applying weight version %d: %s", update.version, err)
                self.refusals += 1
            self._unapplied = update
            self.refused[update.version] = str(err)
            self._retry_at = time.monotonic() + self._retry_in
            self._retry_in = min(RETRY_MAX_S, 2 * self._retry_in)
            return
        self._unapplied = None
        self.refused.clear()
        self._retry_in = RETRY_FIRST_S
