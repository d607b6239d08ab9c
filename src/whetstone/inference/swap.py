"""Hot weight swap: new weight versions written in place into the serving model.

Updates are the weight-sync subscriber's `WeightUpdate`s (whole tensors or sparse overwrites:
flat indices + values). Everything slow happens outside the decode loop: the subscriber fetches
and decodes in its own thread (on the CPU), `WeightFollower` hands each update to the engine, and
the engine checks and casts it in the caller's thread and, when it serves on CUDA, copies it to
the device there, on a stream of its own, so the copy overlaps decoding (`prepare`). The decode
loop pauses only for `write`, the in-place overwrite between two decode steps (values are
overwritten, never added, so there is no floating-point drift). Writing in place keeps every
parameter's storage, so the engine's CUDA graphs stay valid. A write that fails part-way puts
back what it overwrote, so the served weights stay one version whole; the engine then tells the
sender (`PreparedUpdate.error`), and `WeightFollower` sends that version again as it does one the
engine refused.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

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


class WeightWriteError(WhetstoneError):
    """Writing a version failed, and so did putting the overwritten values back: the served
    tensors hold parts of two versions. Raised by `write` here and by the vLLM follower
    (`integrations.vllm_worker.ServedWeights.load`)."""


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
    base: int | None = None
    """The version the update applies on (`WeightUpdate.base`); None for a full one."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set once the engine has written the update or given up on it (`error`)."""
    error: str | None = None
    """Why the engine did not write the update (its weights stayed as they were)."""

    def settle(self, error: str | None = None) -> None:
        """Record how the engine's write went (None: written) and set `done`."""
        self.error = error
        self.done.set()


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
    return _upload(PreparedUpdate(update.version, writes, base=update.base))


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
        return PreparedUpdate(update.version, writes, base=update.base)
    stream = torch.cuda.Stream(device)  # normal priority: never the decode graphs' capture stream
    # values already on the device (the online gate's) were cast on the caller's stream: `ready`
    # must follow that cast too
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        writes = [
            (t, None if i is None else tensor_to_device(i, device), tensor_to_device(v, device))
            for t, i, v in update.writes
        ]
    return PreparedUpdate(update.version, writes, stream.record_event(), update.base)


@torch.no_grad()
def write(update: PreparedUpdate) -> float:
    """Overwrite the served tensors in place; returns the seconds taken (the decode pause).

    Sparse values go in with `scatter_`, about 10x faster than `index_put_` on CPU for the few
    percent of values an RL step changes. On CUDA the pause lasts until the device has written
    them (and received them, if the upload is still under way).

    Each tensor's overwritten values are first copied aside, then go into the update's own
    values once the tensor is written (they are its private copies, `_private`): one tensor's
    copy at a time beside the update, and the update is used up. If a write raises, every
    tensor written is put back and the error raised: the served weights are the version they
    were. If putting them back raises too, `WeightWriteError`."""
    start = time.perf_counter()
    device = update.writes[0][0].device if update.writes else None
    undo: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
    try:
        if update.ready is not None:
            torch.cuda.current_stream(device).wait_event(update.ready)
        for target, indices, values in update.writes:
            old = target.clone() if indices is None else target.gather(0, indices)
            undo.append((target, indices, old))
            _put(target, indices, values)
            values.copy_(old)
            undo[-1] = (target, indices, values)
            del old
        if device is not None:  # a device error shows here; the uploaded tensors may be freed after
            synchronize(device)
    except Exception as err:
        try:
            for target, indices, old in reversed(undo):
                _put(target, indices, old)
            if device is not None:
                synchronize(device)
        except Exception as again:
            raise WeightWriteError(
                f"writing weight version {update.version} failed ({type(err).__name__}: {err}), and putting "
                f"the overwritten values back failed too ({type(again).__name__}: {again}): the served "
                "weights hold parts of two versions"
            ) from again
        raise
    return time.perf_counter() - start


def _put(target: torch.Tensor, indices: torch.Tensor | None, values: torch.Tensor) -> None:
    """Write `values` into flat `target` at `indices` (None: all of it)."""
    if indices is None:
        target.copy_(values)
    else:
        target.scatter_(0, indices, values)


RETRY_FIRST_S, RETRY_MAX_S = 1.0, 60.0
"""How soon a `WeightFollower` retries a version the engine refused when no newer one came, and
how far the wait doubles to."""


class WeightFollower:
    """Feeds the engine every version a weight-sync `Subscriber` decodes, from its own thread, and
    reports (`report`, logged as it changes) when the server cannot take the store's newest
    version: one was rejected (corrupt, wrong base) or the engine refused it, or could not write
    it (the engine kept its weights; it writes no version built on that one until it is sent
    again)."""

    def __init__(self, subscriber, engine, poll_seconds: float = 0.2):
        self.subscriber, self.engine, self.poll_seconds = subscriber, engine, poll_seconds
        self.refused: dict[int, str] = {}
        """Versions the engine refused (they do not fit the served model) or failed to write,
        until one is taken."""
        self.refusals = 0
        self._unapplied: WeightUpdate | None = None
        """What the engine refused or failed to write, merged with every version since: the
        subscriber hands each version over once, and a later delta written without it would
        leave the values only it changed stale (serving weights of no version). Retried with
        each new version, and alone after `_retry_in` seconds (doubling up to RETRY_MAX_S): a
        GPU short of memory for a moment takes it once memory is free, even when no version
        follows."""
        self._sent: deque[tuple[WeightUpdate, PreparedUpdate]] = deque()
        """Versions the engine took and has not written yet (oldest first), with the handle it
        reports the write on: one that fails is sent again with those after it."""
        self._retry_in, self._retry_at = RETRY_FIRST_S, 0.0
        self._problem: str | None = None
        self.stopped_by: str | None = None
        """What ended the follower's thread when something unforeseen did: the server serves its
        weights as they are, and /health says it is stale for good."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def report(self) -> WeightsReport:
        subscriber, refused = self.subscriber, dict(self.refused)
        served = self.engine.version
        rejected = {v: why for v, why in dict(subscriber.rejected).items() if v > served} | refused
        problem = None
        if self.stopped_by is not None:
            problem = f"the server stopped following the weight store ({self.stopped_by}): restart it"
        elif refused:
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
        try:
            while not self._stop.is_set():
                held = self.subscriber.version
                self.subscriber.wait_for(0 if held is None else held + 1, timeout=self.poll_seconds)
                update = self.subscriber.take_update()
                self._check_writes()
                if self._unapplied is not None:
                    if update is not None:
                        update = merge_updates([self._unapplied, update])
                    elif time.monotonic() >= self._retry_at:
                        update = self._unapplied
                if update is not None:
                    self._apply(update)
                self._log_problem()
        except Exception as err:  # a version taken from the subscriber may be lost: follow no more
            self.stopped_by = f"{type(err).__name__}: {err}"
            log.exception("following the weight store stopped at version %s", self.engine.version)

    def _apply(self, update: WeightUpdate) -> None:
        try:
            sent = self.engine.update_weights(update)
        except Exception as err:  # another model's store, or no GPU memory for now: keep serving
            self._refuse(update, update.version, str(err))
            return
        self._unapplied = None
        if isinstance(sent, PreparedUpdate):  # the engine writes it between two steps, and says how that went
            self._sent.append((update, sent))
        else:
            self._taken(update.version)

    def _taken(self, version: int) -> None:
        """Version `version` is in (written, with what was refused before it merged in): the
        versions refused up to it are no longer, and once nothing is left to retry the next
        refusal's waits start from the shortest. Not before the write: until then /health would
        say "ok" for a moment between two failed retries, and each retry would start the waits
        over. A newer version refused meanwhile stays refused."""
        for refused in [v for v in self.refused if v <= version]:
            del self.refused[refused]
        if self._unapplied is None and not self.refused:
            self._retry_in = RETRY_FIRST_S

    def _check_writes(self) -> None:
        """Learn how the engine's writes of the versions sent went. A failed one is refused: it
        goes back to `_unapplied` with every version sent after it (the engine writes none of
        those without it) and any refused since."""
        while self._sent and self._sent[0][1].done.is_set():
            update, sent = self._sent[0]
            if sent.error is None:
                self._sent.popleft()
                self._taken(update.version)
                continue
            failed = [update for update, _ in self._sent] + ([] if self._unapplied is None else [self._unapplied])
            self._sent.clear()
            self._refuse(merge_updates(failed) if len(failed) > 1 else update, update.version, sent.error)

    def _refuse(self, update: WeightUpdate, version: int, why: str) -> None:
        """The engine did not take version `version`: `update` (it, merged with those since) is
        retried later, and the refusal reported until a version is taken."""
        if version not in self.refused:  # a retry of the same version says nothing new
            log.error("not applying weight version %d: %s", version, why)
            self.refusals += 1
        self._unapplied = update
        self.refused[version] = why
        self._retry_at = time.monotonic() + self._retry_in
        self._retry_in = min(RETRY_MAX_S, 2 * self._retry_in)
