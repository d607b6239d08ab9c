"""The versioned weight store on top of an object store: manifests, chunks, latest pointer, GC.

Publishing is atomic: chunks first, then the manifest, then `latest.json`. A reader that finds a
manifest finds all its chunks; a reader that follows `latest.json` finds the manifest. A version
is created once: its manifest is written with the store's exclusive create (`put_if_absent`),
so of two publishers racing for one version number (a rollback and the online loop, two
trainers) exactly one publishes it and the other gets `VersionExistsError`. Garbage collection
deletes manifests first, so a version disappears before its chunks do.
"""

from __future__ import annotations

import json
import logging

from whetstone.errors import WhetstoneError
from whetstone.store import MissingObjectError, ObjectExistsError, ObjectStore, open_store
from whetstone.sync.chunks import checksum
from whetstone.sync.codec import CorruptDataError
from whetstone.sync.config import SyncConfig
from whetstone.sync.manifest import LATEST_KEY, ChunkInfo, Manifest, manifest_key, parse_manifest, version_prefix

log = logging.getLogger("whetstone.sync")


class VersionExistsError(WhetstoneError):
    """Another publisher created this version number first; this one was not published."""


class WeightStore:
    def __init__(self, objects: ObjectStore):
        self.objects = objects

    @classmethod
    def open(cls, config: SyncConfig) -> "WeightStore":
        return cls(open_store(config.store, endpoint_url=config.endpoint_url))

    def __repr__(self) -> str:
        return f"WeightStore({self.objects!r})"

    def latest(self) -> int | None:
        """The newest published version, or None if nothing was published yet."""
        try:
            data = self.objects.get(LATEST_KEY)
        except MissingObjectError:
            return None
        try:
            return int(json.loads(data)["version"])
        except (ValueError, KeyError, TypeError):
            raise WhetstoneError(f"{LATEST_KEY} in {self.objects!r} is not {{'version': N}}: {data[:100]!r}") from None

    def versions(self) -> list[int]:
        """Every version with a manifest, oldest first."""
        keys = self.objects.list("versions/")
        return sorted(int(key.split("/")[1]) for key in keys if key.endswith("/manifest.json"))

    def manifest(self, version: int) -> Manifest:
        return parse_manifest(self.objects.get(manifest_key(version)), version)

    def put_chunk(self, key: str, blob: bytes) -> ChunkInfo:
        self.objects.put(key, blob)
        return ChunkInfo(key=key, size=len(blob), checksum=checksum(blob))

    def fetch_chunk(self, info: ChunkInfo) -> bytes:
        """The chunk's bytes, verified against the manifest's size and checksum."""
        blob = self.objects.get(info.key)
        if len(blob) != info.size:
            raise CorruptDataError(f"chunk {info.key} has {len(blob)} bytes, the manifest says {info.size} (truncated?)")
        if checksum(blob) != info.checksum:
            raise CorruptDataError(f"chunk {info.key} fails its checksum ({checksum(blob)} != {info.checksum})")
        return blob

    def publish(self, manifest: Manifest) -> None:
        """Make a version visible: its manifest, then the latest pointer. Its chunks must be in.
        Raises `VersionExistsError` (and changes nothing) if the version exists already."""
        try:
            self.objects.put_if_absent(manifest_key(manifest.version), manifest.model_dump_json(indent=1).encode())
        except ObjectExistsError:
            raise VersionExistsError(f"version {manifest.version} already exists in {self.objects!r}: another "
                                     "publisher created it first (a rollback, a second trainer or online loop?); "
                                     "this one was not published") from None
        self.objects.put(LATEST_KEY, json.dumps({"version": manifest.version}).encode())

    def delete_version(self, version: int) -> None:
        self.objects.delete(manifest_key(version))
        for key in self.objects.list(version_prefix(version)):
            self.objects.delete(key)

    def collect_garbage(self, keep_keyframes: int) -> list[int]:
        """Delete every version older than the `keep_keyframes`-th newest keyframe: a subscriber
        that far behind catches up from a newer keyframe. Also deletes chunks that a crashed
        publish left without a manifest. Returns the versions deleted."""
        latest = self.latest()
        if latest is None:
            return []
        oldest_kept = self.manifest(latest).keyframe
        for _ in range(keep_keyframes - 1):
            if oldest_kept == 0:
                break
            try:
                oldest_kept = self.manifest(oldest_kept - 1).keyframe
            except WhetstoneError:  # already collected, or unreadable: keep what is newer
                break
        stored = {int(key.split("/")[1]) for key in self.objects.list("versions/")}
        doomed = sorted(v for v in stored if v < oldest_kept)
        for version in doomed:
            self.delete_version(version)
        if doomed:
            log.info("garbage collection deleted versions %s..%s", doomed[0], doomed[-1])
        return doomed
