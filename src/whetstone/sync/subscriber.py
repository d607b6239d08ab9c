"""An inference server's side of weight sync: follow the store, keep up, hand over updates.

A background thread polls the store. For each new version it fetches the chunks, verifies sizes
and checksums and that the delta's base is the version it holds, decodes against its own copy
of the weights (`state`), and queues the update; the engine takes it with `take_update()` and
writes it in place with `apply_update` between decode steps. A subscriber that starts empty or
falls behind the current chain catches up from the newest keyframe. A version that fails
verification is rejected and logged: the subscriber stays where it is, and recovers at the next
keyframe (a later delta cannot apply on top of a version it never held), or as soon as the
rejected version is published again under another manifest (a repair).

A version whose objects are missing (its manifest or a chunk) is unavailable, not rejected: it is
retried at every poll (a chunk collected under its feet, a store hiccup, a mirror catching up).
Once it has stayed unavailable at every attempt for `SyncConfig.unavailable_after` seconds (a
chunk deleted for good, a partial copy), `blocked` reports it as it reports a rejected version,
and keeps retrying it; the report clears when the version is taken.

The subscriber remembers the digest of the manifest it applied last. If that version is withdrawn
from the store (a repair: its manifest is gone or is another one now), or a delta continues
another publish of it, the chain it holds no longer exists: it forgets its version and re-syncs
from the newest keyframe, which rewrites every tensor. A delta on a withdrawn publish that is
still in the way after that (a publisher raced the repair) is rejected.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from whetstone.errors import WhetstoneError
from whetstone.store import MissingObjectError
from whetstone.sync.bits import dtype_from_name
from whetstone.sync.chunks import decode_chunk
from whetstone.sync.codec import CorruptDataError
from whetstone.sync.config import SyncConfig
from whetstone.sync.manifest import Manifest
from whetstone.sync.update import WeightUpdate, apply_update, build_update, merge_updates
from whetstone.sync.weight_store import Head, WeightStore

log = logging.getLogger("whetstone.sync")


class RejectedVersion(WhetstoneError):
    """A version that can never be applied: corrupt, truncated, or coded against another base."""


class ChainWithdrawn(WhetstoneError):
    """The version this subscriber holds is no longer in the store as it was applied."""


@dataclass
class Unavailable:
    """A version whose objects were missing at every attempt to take it since `since`."""

    reason: str
    """The latest attempt's error."""
    digest: str | None
    """Its manifest's digest at the first attempt (None: no manifest); another one starts over."""
    since: float
    """`time.monotonic()` at the first failed attempt."""
    last: float
    """... and at the latest."""
    attempts: int = 1


class Subscriber:
    def __init__(
        self,
        store: WeightStore,
        config: SyncConfig | None = None,
        name: str = "subscriber",
        state: dict[str, torch.Tensor] | None = None,
        version: int | None = None,
    ):
        """Start empty, or from `state` known to be published `version` (copied)."""
        self.store = store
        self.config = config or SyncConfig()
        self.name = name
        self.state = {k: v.detach().clone() for k, v in (state or {}).items()}
        self.version = version if state is not None else None
        self.rejected: dict[int, str] = {}
        """Versions that failed verification, with the reason; one is tried again once its
        manifest changes (it was published again)."""
        self.rejections = 0
        """Rejections so far (a version rejected again after a change counts again)."""
        self.unavailable: dict[int, Unavailable] = {}
        """Versions ahead of the one held whose objects were missing at every attempt so far."""
        self.latest: int | None = None
        """The store's newest version at the last poll."""
        self._held_digest: str | None = None
        self._rejected_digests: dict[int, str | None] = {}
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

    def blocked(self) -> str | None:
        """Why this subscriber cannot take the store's newest version (a rejected version in the
        way, or one unavailable at every attempt for `unavailable_after` seconds), or None if it
        holds it or is only on its way."""
        latest, held, rejected, unavailable = self.latest, self.version, dict(self.rejected), dict(self.unavailable)
        if latest is None or (held is not None and held >= latest):
            return None
        after = self.config.unavailable_after
        lasting = {v for v, u in unavailable.items() if u.last - u.since >= after}
        ahead = sorted(v for v in set(rejected) | lasting if (held is None or v > held) and v <= latest)
        if not ahead:
            return None
        first = ahead[0]
        if first in rejected:
            return f"cannot take weight version {latest}: version {first} was rejected ({rejected[first]})"
        return (
            f"cannot take weight version {latest}: version {first} has been unavailable for {after:g} s or more, "
            f"retried at every poll ({unavailable[first].reason})"
        )

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
            self.try_poll()
            self._stop.wait(self.config.poll_interval)

    def try_poll(self) -> int | None:
        """`poll`, with a failure (a store outage) logged instead of raised: a follower retries it
        at its next poll. Returns the version held."""
        try:
            return self.poll()
        except Exception as err:
            log.warning("%s: polling the weight store failed: %s", self.name, err)
            return self.version

    def poll(self) -> int | None:
        """Catch up with the newest version as far as possible; returns the version held."""
        head = self.store.head()
        self.latest = None if head is None else head.version
        if self.unavailable:  # withdrawn since, or taken: replaced whole, as other threads read it
            self.unavailable = {
                v: u for v, u in self.unavailable.items() if self.latest is not None and v <= self.latest
            }
        if self.version is not None and self._held_withdrawn(head):
            self._forget(f"version {self.version} was withdrawn from the store")
        if head is None or (self.version is not None and head.version <= self.version):
            return self.version
        try:
            self._catch_up(head.version)
        except ChainWithdrawn as err:
            self._forget(str(err))
            self._catch_up(head.version, resynced=True)
        return self.version

    def _catch_up(self, latest: int, resynced: bool = False) -> None:
        """Walk to `latest` from the version held, or from its keyframe. `resynced`: the walk starts
        over from the keyframe after a `ChainWithdrawn`, which then rejects the version instead (a
        delta on a withdrawn publish: a publisher raced the repair)."""
        try:
            keyframe = self.store.manifest(latest).keyframe
        except MissingObjectError as err:  # the pointer copied without its manifest (a partial copy)
            self._note_unavailable(latest, err)
            return
        except WhetstoneError as err:  # unreadable, or of a newer format: where to start is unknown
            if latest not in self.rejected or self._changed_since_rejected(latest):
                self._reject(latest, err)
            return
        start = self.version + 1 if self.version is not None and self.version >= keyframe else keyframe
        if any(v < start for v in self.unavailable):  # no longer on the way (a newer keyframe is)
            self.unavailable = {v: u for v, u in self.unavailable.items() if v >= start}
        for version in range(start, latest + 1):
            if version in self.rejected and not self._changed_since_rejected(version):
                break
            if not self._advance(version, resynced):
                break

    def _held_withdrawn(self, head: Head | None) -> bool:
        """Whether the version held is gone from the store, or is another publish of it now."""
        if self._held_digest is None:  # started from a given state: take the store's word for it
            try:
                self._held_digest = self.store.manifest_digest(self.version)
            except MissingObjectError:
                return head is not None  # nothing to compare with while the store is empty
            return False
        if head is not None and (
            head.version > self.version or (head.version == self.version and head.digest in (None, self._held_digest))
        ):
            return False  # newer versions check their base as they are taken
        try:
            return self.store.manifest_digest(self.version) != self._held_digest
        except MissingObjectError:
            return True

    def _forget(self, why: str) -> None:
        """Drop the version held (its chain is gone); the weights stay until a keyframe rewrites them."""
        log.warning("%s: %s; re-syncing from the newest keyframe", self.name, why)
        with self._changed:
            self.version, self._held_digest = None, None

    def _changed_since_rejected(self, version: int) -> bool:
        """A rejected version is tried again once its manifest is another one (published again)."""
        if self._current_digest(version) == self._rejected_digests.get(version):
            return False
        log.info("%s: version %d was published again since it was rejected: trying it", self.name, version)
        del self.rejected[version]
        return True

    def _current_digest(self, version: int) -> str | None:
        try:
            return self.store.manifest_digest(version)
        except MissingObjectError:
            return None

    def _advance(self, version: int, resynced: bool = False) -> bool:
        """Fetch, verify, decode and take `version`; False (staying put) if that fails. Raises
        `ChainWithdrawn` unless `resynced` (see `_catch_up`)."""
        try:
            manifest = self.store.manifest(version)
            if manifest.kind == "delta" and manifest.base != self.version:
                raise RejectedVersion(
                    f"version {version} is a delta on version {manifest.base}, but this subscriber holds {self.version}"
                )
            if manifest.kind == "delta" and manifest.base_manifest not in (None, self._held_digest):
                raise ChainWithdrawn(
                    f"version {version} continues another publish of version {manifest.base} "
                    "than the one held (it was withdrawn and published again)"
                )
            update = self._decode(manifest)
            apply_update(self.state, update, convert=False)  # checks it fits before writing anything
        except MissingObjectError as err:  # collected under our feet, or a store hiccup: retry later
            self._note_unavailable(version, err)
            return False
        except WhetstoneError as err:  # corrupt, truncated, wrong base, undecodable: retried only once changed
            if isinstance(err, ChainWithdrawn) and not resynced:
                raise
            self._reject(version, err)
            return False
        with self._changed:
            self.version, self._held_digest = version, manifest.digest
            self._pending.append(update)
            self._changed.notify_all()
        if self.unavailable:
            self.unavailable = {v: u for v, u in self.unavailable.items() if v > version}
        log.info("%s: now on version %d (%d values written)", self.name, version, update.values_written)
        return True

    def _reject(self, version: int, err: WhetstoneError) -> None:
        """Record `version` as one that cannot be taken (tried again once its manifest changes)."""
        self.rejected[version] = str(err)
        self._rejected_digests[version] = self._current_digest(version)
        self.rejections += 1
        log.warning("%s: rejected version %d, staying on %s: %s", self.name, version, self.version, err)

    def _note_unavailable(self, version: int, err: MissingObjectError) -> None:
        """Record a failed attempt at `version` for want of an object (see `blocked`). Logged as a
        warning at the first attempt only: a lasting one is reported by `blocked`'s reader."""
        now, digest = time.monotonic(), self._current_digest(version)
        known = self.unavailable.get(version)
        if known is None or known.digest != digest:  # first seen, or published again since
            log.warning("%s: version %d unavailable (retried at every poll): %s", self.name, version, err)
            self.unavailable[version] = Unavailable(str(err), digest, now, now)
        else:
            log.debug("%s: version %d still unavailable: %s", self.name, version, err)
            known.reason, known.last, known.attempts = str(err), now, known.attempts + 1

    def _decode(self, manifest: Manifest) -> WeightUpdate:
        dtypes = {info.name: dtype_from_name(info.dtype) for info in manifest.tensors}
        numels = {info.name: math.prod(info.shape) for info in manifest.tensors}
        base = self.state if manifest.kind == "delta" else None

        def fetch_and_decode(chunk):
            blob = self.store.fetch_chunk(chunk)  # its errors name the chunk
            try:
                return decode_chunk(blob, base, dtypes, numels)
            except CorruptDataError as err:
                raise CorruptDataError(f"chunk {chunk.key}: {err}") from None

        with ThreadPoolExecutor(self.config.workers) as pool:
            pieces = [piece for chunk in pool.map(fetch_and_decode, manifest.chunks) for piece in chunk]
        return build_update(manifest, pieces, self.state)
