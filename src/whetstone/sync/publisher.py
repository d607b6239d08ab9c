"""The trainer's side of weight sync: publish a state dict as the next version.

The publisher keeps a copy of what it last published (in the published dtype) to code the next
version against. Chunks are encoded and uploaded by `workers` threads (numpy and zstd release
the GIL), each holding one chunk at a time, then the manifest makes the version visible.

Chunk keys carry a random name of the publish attempt (`versions/<n>/<attempt>/chunk-<i>.bin`),
so two publishers racing for one version never overwrite each other's chunks: the manifest,
created only once (`WeightStore.publish`), names the winner's, and the loser deletes its own.

With `mirrors` (`SyncConfig.mirrors`), each publish is then copied into every mirror store
(`WeightStore.mirror`: the chunks from memory, then the manifest, then the latest pointer), so the
servers of each inference cluster read the weights near them. A mirror that fails (an outage) is
logged and brought up to date at the next publish; it never fails the publish itself. Nor does
garbage collection after a publish (`WeightStore.collect_garbage`): a failure is logged, and what
it left is collected at the next publish.

`publish_later` takes the copy at once and does the rest (encoding, uploading, the manifest) on
one worker thread, so a trainer's next step runs while its last version is published; versions
are published in the order submitted.

Before each publish the publisher finishes a withdrawal whose process died
(`WeightStore.finish_withdrawal`: only the publishes its record lists go, so one that another
process completes meanwhile, followed by a repair, loses nothing published since), and checks
that the version it published last is still in the store as it published it: if a repair
withdrew it, there is no chain left to extend, and the publish is a keyframe at the next free
version number instead. If the store's pointer is past that version (still there, or collected
since), another publisher went on from it: the publish is refused before anything is uploaded
(`StalePublisherError`, a `VersionExistsError`), and refused as well, its manifest removed again,
where the pointer went past while the chunks were uploaded (`WeightStore.publish`). A delta's
base is checked again right before its manifest is created (withdrawn while the delta was coded:
its chunks go, and the same weights are published as a keyframe) and once more after (withdrawn
at that very moment: the next version is a keyframe). A failed publish leaves none of its chunks
behind, unless its manifest made it into the store.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from whetstone.errors import WhetstoneError
from whetstone.store import MissingObjectError, open_store
from whetstone.sync.bits import DTYPES, dtype_name
from whetstone.sync.chunks import encode_chunk, plan_chunks
from whetstone.sync.config import SyncConfig
from whetstone.sync.manifest import ChunkInfo, Manifest, TensorInfo, attempt_prefix, chunk_key
from whetstone.sync.weight_store import StalePublisherError, WeightStore

log = logging.getLogger("whetstone.sync")


class Published(NamedTuple):
    """A version `publish_later` published."""

    manifest: Manifest
    seconds: float
    """From hand-over (the copy included) until the version was in the store and the mirrors."""


def prepare_state(
    state: dict[str, torch.Tensor], publish_dtype: str, tables: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """The tensors as published: floats in `publish_dtype`, contiguous, copied off the trainer
    onto the host. A GPU's tensors are cast where they are, then copied: the GPU casts in a
    moment and the copy moves half the bytes (a 380M model's fp32 weights take ~0.8 s to cast on
    one CPU core). `autocast`: matrices in bf16 except `tables` (the embedding tables, a tied head
    among them: `model.layout.autocast_tables`), every other float in fp32.

    A CUDA tensor's copy is asynchronous into pinned host memory (what `to("cpu",
    non_blocking=True)` allocates), at the link's full speed where pageable memory takes about
    half; one wait on each device's stream at the end, before the host reads any of them and
    before the trainer's next step changes the weights in place."""
    published, pending = {}, set()
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise WhetstoneError(f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor")
        tensor = tensor.detach()
        dtype = _published_dtype(name, tensor, publish_dtype, tables)
        dtype_name(dtype)  # rejects dtypes sync cannot carry, naming them
        if tensor.device.type == "cpu":
            published[name] = tensor.to(dtype=dtype, copy=True).contiguous()
        elif tensor.is_cuda:
            published[name] = tensor.to(dtype=dtype).contiguous().to("cpu", non_blocking=True)
            pending.add(tensor.device)
        else:
            published[name] = tensor.to(dtype=dtype).contiguous().cpu()
    for device in pending:
        torch.cuda.current_stream(device).synchronize()
    return published


def _published_dtype(name: str, tensor: torch.Tensor, publish_dtype: str, tables: frozenset[str]) -> torch.dtype:
    if not tensor.is_floating_point() or publish_dtype == "keep":
        return tensor.dtype
    if publish_dtype == "autocast":
        return torch.bfloat16 if tensor.dim() >= 2 and name not in tables else torch.float32
    return DTYPES[publish_dtype]


class Publisher:
    def __init__(self, store: WeightStore, config: SyncConfig | None = None, tables: frozenset[str] = frozenset()):
        """`tables`: the names of the state's embedding tables, which `publish_dtype = "autocast"`
        keeps in fp32 (`model.layout.autocast_tables`)."""
        self.store = store
        self.config = config or SyncConfig()
        self.tables = tables
        self._previous: dict[str, torch.Tensor] | None = None
        self._previous_manifest: Manifest | None = None
        self._keyframe_bytes = 0
        self._background: ThreadPoolExecutor | None = None
        self.mirrors = [
            WeightStore(open_store(url, endpoint_url=self.config.endpoint_url)) for url in self.config.mirrors
        ]
        """The clusters' stores every version is copied into (`SyncConfig.mirrors`)."""

    def resume(self) -> int | None:
        """Continue the store's chain after a restart: heal the store (`WeightStore.heal`: finish
        a withdrawal that did not complete, move a pointer left behind by a crash forward), then
        rebuild the latest version from the store (exactly as a subscriber would) to code the
        next delta against. Returns its number."""
        from whetstone.sync.subscriber import Subscriber

        self.store.heal()
        subscriber = Subscriber(self.store, self.config, name="publisher")
        held, latest = subscriber.poll(), self.store.latest()
        if held is None or held != latest:
            if latest is not None:  # a publish on `held` would take a number that exists
                why = "; ".join(f"version {v}: {reason}" for v, reason in subscriber.rejected.items())
                log.warning(
                    "cannot continue the chain of %r at version %d (%s): the next publish is a keyframe",
                    self.store,
                    latest,
                    why or "a chunk is missing",
                )
            return None
        self._previous = subscriber.state
        self._previous_manifest = self.store.manifest(subscriber.version)
        self._keyframe_bytes = self.store.manifest(self._previous_manifest.keyframe).encoded_bytes
        return subscriber.version

    def prepare(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return prepare_state(state, self.config.publish_dtype, self.tables)

    def publish(self, state: dict[str, torch.Tensor], full: bool = False, republishes: int | None = None) -> Manifest:
        """Publish `state` as the next version (a full one if `full`, or if the policy says so).
        `republishes`: the earlier version whose weights `state` is (a rollback; the manifest
        says so). `VersionExistsError` if another publisher created that version first, and
        `StalePublisherError` (one) if the store's latest version is past it: another publisher
        went on from this one's last version. When it fails (that, or a store error) nothing of
        this attempt stays in the store, and the publisher is as before the call."""
        return self._publish_prepared(self.prepare(state), full, time.perf_counter(), republishes)

    def publish_later(self, state: dict[str, torch.Tensor], full: bool = False) -> Future[Published]:
        """`publish`, with `state` copied now (the caller may go on changing it) and everything
        else done on the publisher's worker thread; the future holds what was published, or the
        error. Bad input (a tensor sync cannot carry) is refused at once."""
        started = time.perf_counter()
        new = self.prepare(state)
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="publish")

        def publish() -> Published:
            manifest = self._publish_prepared(new, full, started)
            return Published(manifest, time.perf_counter() - started)

        return self._background.submit(publish)

    def close(self) -> None:
        """Wait for the versions `publish_later` was given, and stop its worker thread."""
        if self._background is not None:
            self._background.shutdown(wait=True)
            self._background = None

    def _publish_prepared(
        self, new: dict[str, torch.Tensor], full: bool, started: float, republishes: int | None = None
    ) -> Manifest:
        self.store.finish_withdrawal()  # one whose process died: the versions it lists must not be built on
        if self._previous_manifest is not None and not self._check_previous(self._previous_manifest):
            self._forget_withdrawn()
        previous = self._previous_manifest
        if previous is None:
            latest = self.store.latest()
            version = max([*self.store.versions(), -1 if latest is None else latest]) + 1
        else:
            version = previous.version + 1
        keyframe = full or self._needs_keyframe(version)
        base = None if keyframe else self._previous

        plan = plan_chunks([(name, t.numel()) for name, t in new.items()], self.config.chunk_elements)
        attempt = uuid.uuid4().hex[:12]

        blobs: dict[str, bytes] = {}  # kept for the mirrors only

        def encode_and_put(index: int) -> tuple[ChunkInfo, int]:
            blob, changed = encode_chunk(plan[index], new, base, self.config.zstd_level)
            info = self.store.put_chunk(chunk_key(version, attempt, index), blob)
            if self.mirrors:
                blobs[info.key] = blob
            return info, changed

        manifest = None
        try:
            with ThreadPoolExecutor(self.config.workers) as pool:
                results = list(pool.map(encode_and_put, range(len(plan))))
            chunks = [info for info, _ in results]
            encoded = sum(info.size for info in chunks)
            manifest = Manifest(
                version=version,
                kind="full" if keyframe else "delta",
                base=None if keyframe else previous.version,
                keyframe=version if keyframe else previous.keyframe,
                created=time.time(),
                tensors=[TensorInfo(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape)) for n, t in new.items()],
                chunks=chunks,
                raw_bytes=sum(t.numel() * t.element_size() for t in new.values()),
                encoded_bytes=encoded,
                changed=sum(changed for _, changed in results),
                chain_bytes=0 if keyframe else previous.chain_bytes + encoded,
                base_manifest=None if keyframe else previous.digest,
                republishes=republishes,
            )
            # the base again, right before the version is created: a repair may have withdrawn it
            # meanwhile, or another publisher gone past it (and collected it)
            withdrawn = not keyframe and not self._check_previous(previous)
            if not withdrawn:
                self.store.publish(manifest)
        except BaseException:  # a failed upload, a lost race (the winner's chunks have other keys)...
            if manifest is None or not self._still_published(manifest):  # ...but not a version that is out
                self._delete_attempt(version, attempt)
            raise
        if withdrawn:
            self._delete_attempt(version, attempt)
            self._forget_withdrawn()
            return self._publish_prepared(new, full, started, republishes)
        if keyframe:
            self._keyframe_bytes = encoded
        elif not self._still_published(previous):  # withdrawn as this version was created: no chain to extend
            log.warning(
                "version %d was withdrawn as version %d was published on it: the next is a keyframe",
                previous.version,
                version,
            )
            new = None
        self._previous, self._previous_manifest = new, manifest
        log.info(
            "published version %d (%s, %.1fx, %d values changed) in %.2fs",
            version,
            manifest.kind,
            manifest.ratio,
            manifest.changed,
            time.perf_counter() - started,
        )
        self._collect_garbage()
        self.update_mirrors(blobs)
        return manifest

    def _collect_garbage(self) -> None:
        """`WeightStore.collect_garbage` after a publish, with a failure (a store outage) logged:
        the version is out, and what is left is collected at the next publish."""
        try:
            self.store.collect_garbage(self.config.keep_keyframes)
        except Exception as err:
            log.warning("garbage collection in %r failed (retried at the next publish): %s", self.store, err)

    def update_mirrors(self, blobs: dict[str, bytes] | None = None) -> None:
        """Bring every mirror up to the store (`blobs`: chunks in memory, fetched otherwise)."""
        for mirror in self.mirrors:
            try:
                mirror.mirror(self.store, blobs)
            except Exception as err:  # an outage of one cluster's store must not stop training
                log.warning("could not update the weight mirror %r (retried at the next publish): %s", mirror, err)

    def _delete_attempt(self, version: int, attempt: str) -> None:
        """Delete the chunks a publish attempt that did not make its version uploaded."""
        for key in self.store.objects.list(attempt_prefix(version, attempt)):
            self.store.objects.delete(key)

    def _check_previous(self, previous: Manifest) -> bool:
        """Whether `previous` (the version published last, which the publish is numbered after)
        is still in the store as published. `StalePublisherError` if the store's pointer is past
        it while it is there, or gone (collected: another publisher went on from it). False if a
        repair withdrew it (gone with the pointer moved back before it, or its number published
        again): the publish is then a keyframe at the next free version."""
        digest = self._published_digest(previous.version)
        try:
            head = self.store.head()
        except WhetstoneError:  # unreadable: the publish replaces it
            head = None
        if head is not None and head.version > previous.version and digest in (previous.digest, None):
            raise StalePublisherError(
                f"version {previous.version + 1} was not published in {self.store!r}: the store's latest version "
                f"is {head.version}, another publisher's, past version {previous.version} that this one published "
                "last (a rollback, a second trainer or online loop?). Stop the other publisher, or give each its "
                f"own store; a restarted trainer or loop goes on after version {head.version}"
            )
        return digest == previous.digest

    def _forget_withdrawn(self) -> None:
        """Drop the version published last, which a repair withdrew: the next one is a keyframe."""
        log.warning(
            "version %d, published last by this publisher, was withdrawn from %r: publishing a "
            "keyframe at the next free version",
            self._previous_manifest.version,
            self.store,
        )
        self._previous, self._previous_manifest = None, None

    def _still_published(self, manifest: Manifest) -> bool:
        digest = self._published_digest(manifest.version)
        return digest is not None and digest == manifest.digest  # a manifest not yet created has no digest

    def _published_digest(self, version: int) -> str | None:
        """The digest of the manifest of `version` in the store, None if it has none."""
        try:
            return self.store.manifest_digest(version)
        except MissingObjectError:
            return None

    def _needs_keyframe(self, version: int) -> bool:
        previous = self._previous_manifest
        if previous is None or self._previous is None:
            return True  # nothing to code against (first publish, or a restarted trainer)
        if version - previous.keyframe >= self.config.keyframe_interval:
            return True
        return previous.chain_bytes >= self.config.chain_budget * self._keyframe_bytes
