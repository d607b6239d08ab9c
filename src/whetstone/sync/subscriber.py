"""An inference server's side of weight sync: follow the store, keep up, hand over updates.

A background thread polls the store. For each new version it fetches the chunks, verifies sizes
and checksums and that the delta's base is the version it holds, decodes against its own copy
of the weights (`state`), and queues the update; the engine takes it with `take_update()` and
writes it in place with `apply_update` between decode steps. A subscriber that starts empty or
falls behind the current chain catches up from the newest keyframe. A version that fails
verification is rejected and logged: the subscriber stays where it is, and recovers at the next
keyframe (a later delta cannot apply on top of a version it never held).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from whetstone.errors import WhetstoneError
from whetstone.sync.bits import dtype_from_name
from whetstone.sync.chunks import decode_chunk
from whetstone.sync.config import SyncConfig
from whetstone.sync.manifest import Manifest
from whetstone.sync.update import WeightUpdate, apply_update, build_update, merge_updates
from whetstone.sync.weight_store import WeightStore
from whetstone.store import MissingObjectError

log = logging.getLogger("whetstone.sync")


class RejectedVersion(WhetstoneError):
    """A version that can never be applied: corrupt, truncated, or coded against another base."""


class Subscriber:
    def __init__(self, store: WeightStore, config: SyncConfig | None = None, name: str = "subscriber",
                 state: dict[str, torch.Tensor] | None = None, version: int | None = None):
        """Start empty, or from `state` known to be published `version` (copied)."""
        self.store = store
        self.config = config or SyncConfig()
        self.name = name
        self.state = {k: v.detach().clone() for k, v in (state or {}).items()}
        self.version = version if state is not None else None
        self.rejected: dict[int, str] = {}
        self._pending: list[WeightUpdate] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # The engine's side.

    def take_update(self) -> WeightUpdate | None:
        """Everything decoded since the last call, merged into one update (None if nothing new)."""
        with self._changed:
            pending, self._pending = self._pending, []
        return merge_updates(pending) if pending else None

    def wait_for(self, version: int, timeout: float) -> bool:
        """Block until the subscriber holds `version` or newer; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self.version is not None and self.version >= version, timeout)

    # The background thread.

    def start(self) -> "Subscriber":
        self._thread = threading.Thread(target=self._run, name=f"sync-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "Subscriber":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as err:  # a store outage must not kill the thread: retry next poll
                log.warning("%s: polling the weight store failed: %s", self.name, err)
            self._stop.wait(self.config.poll_interval)

    def poll(self) -> int | None:
        """Catch up with the newest version as far as possible; returns the version held."""
        latest = self.store.latest()
        if latest is None or (self.version is not None and latest <= self.version):
            return self.version
        keyframe = self.store.manifest(latest).keyframe
        start = self.version + 1 if self.version is not None and self.version >= keyframe else keyframe
        for version in range(start, latest + 1):
            if version in self.rejected or not self._advance(version):
                break
        return self.version

    def _advance(self, version: int) -> bool:
        """Fetch, verify, decode and take `version`; False (staying put) if that fails."""
        try:
            manifest = self.store.manifest(version)
            if manifest.kind == "delta" and manifest.base != self.version:
                raise RejectedVersion(f"version {version} is a delta on version {manifest.base}, "
                                      f"but this subscriber holds {self.version}")
            update = self._decode(manifest)
        except MissingObjectError as err:  # collected under our feet, or a store hiccup: retry later
            log.warning("%s: version %d unavailable: %s", self.name, version, err)
            return False
        except WhetstoneError as err:  # corrupt, truncated, wrong base, undecodable: never retried
            self.rejected[version] = str(err)
            log.warning("%s: rejected version %d, staying on %s: %s", self.name, version, self.version, err)
            return False
        apply_update(self.state, update)
        with self._changed:
            self.version = version
            self._pending.append(update)
            self._changed.notify_all()
        log.info("%s: now on version %d (%d values written)", self.name, version, update.values_written)
        return True

    def _decode(self, manifest: Manifest) -> WeightUpdate:
        dtypes = {info.name: dtype_from_name(info.dtype) for info in manifest.tensors}
        base = self.state if manifest.kind == "delta" else None

        def fetch_and_decode(chunk):
            return decode_chunk(self.store.fetch_chunk(chunk), base, dtypes)

        with ThreadPoolExecutor(self.config.workers) as pool:
            pieces = [piece for chunk in pool.map(fetch_and_decode, manifest.chunks) for piece in chunk]
        return build_update(manifest, pieces, self.state if self.version is not None else None)
