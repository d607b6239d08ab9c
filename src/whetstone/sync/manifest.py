"""The manifest of a weight version: what a subscriber needs to fetch, verify and apply it.

Layout in the object store (a manifest is written after all its chunks: publishing is atomic):

    versions/0000000007/manifest.json                created only if absent: one publisher per version
    versions/0000000007/<attempt>/chunk-00000.bin ... each publish attempt's own chunks, so two
                                                     racing publishers never overwrite each other's
    latest.json                                      {"version": 7, "manifest": <its digest>}, written after it
    withdrawal.json                                  {"from": 5} while versions 5.. are being withdrawn

A manifest is known by its digest (a hash of its stored bytes): a version withdrawn and published
again under the same number (a repair) has another digest, which is how subscribers notice.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from whetstone.errors import WhetstoneError

MANIFEST_FORMAT = 1


class TensorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str
    shape: list[int]


class ChunkInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str
    size: int
    checksum: str


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: int = MANIFEST_FORMAT
    version: int = Field(ge=0)
    kind: Literal["full", "delta"]
    base: int | None
    """The version a delta was coded against (None for a full version)."""
    keyframe: int
    """The newest full version at or before this one: where a subscriber catches up from."""
    created: float
    tensors: list[TensorInfo]
    chunks: list[ChunkInfo]
    raw_bytes: int
    """Size of the version's tensors uncompressed."""
    encoded_bytes: int
    """Size of its chunks in the store."""
    changed: int
    """Values that differ from the base version (all of them for a full version)."""
    chain_bytes: int
    """Encoded bytes of the deltas since the keyframe, this one included (0 for a full version)."""
    base_manifest: str | None = None
    """Digest of the base version's manifest: a delta continues exactly that publish of its base
    (None for a full version, and in manifests written before digests)."""
    republishes: int | None = None
    """The earlier version whose weights this one publishes again (a rollback), itself never a
    republish; None for weights of their own. Stored only when set, so other manifests keep
    their bytes (and readers that do not know the field)."""
    _digest: str | None = PrivateAttr(None)

    @property
    def digest(self) -> str | None:
        """Digest of this manifest as stored (None until it is published or read)."""
        return self._digest

    def stored_bytes(self) -> bytes:
        """The bytes the store holds for this manifest; remembers their digest."""
        data = self.model_dump_json(indent=1, exclude=None if self.republishes is not None else {"republishes"})
        data = data.encode()
        self._digest = manifest_digest(data)
        return data

    @property
    def ratio(self) -> float:
        return self.raw_bytes / max(1, self.encoded_bytes)

    @property
    def elements(self) -> int:
        total = 0
        for info in self.tensors:
            count = 1
            for dim in info.shape:
                count *= dim
            total += count
        return total


def version_prefix(version: int) -> str:
    return f"versions/{version:010d}/"


def version_of(key: str) -> int | None:
    """The version whose folder (`versions/<10 digits>/`) holds `key`, or None for a key that is
    in none: a stray file or folder under `versions/` (`versions/README`, `versions/tmp/`)."""
    name, inside, _ = key.removeprefix("versions/").partition("/")
    if inside and name.isascii() and name.isdigit() and key.startswith(version_prefix(int(name))):
        return int(name)
    return None


def manifest_key(version: int) -> str:
    return version_prefix(version) + "manifest.json"


def attempt_prefix(version: int, attempt: str) -> str:
    """Where one publish attempt of `version` puts its chunks."""
    return f"{version_prefix(version)}{attempt}/"


def chunk_key(version: int, attempt: str, index: int) -> str:
    return f"{attempt_prefix(version, attempt)}chunk-{index:05d}.bin"


LATEST_KEY = "latest.json"

WITHDRAWAL_KEY = "withdrawal.json"
"""Present while a withdrawal is in progress, or after one whose process died before it finished."""


def manifest_digest(data: bytes) -> str:
    """What tells two publishes of a version apart: a hash of the manifest's stored bytes."""
    return hashlib.sha256(data).hexdigest()[:16]


def parse_manifest(data: bytes, version: int) -> Manifest:
    try:
        manifest = Manifest.model_validate_json(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "the manifest"
        raise WhetstoneError(f"manifest of version {version} is invalid: {field}: {first['msg']}") from None
    if manifest.format != MANIFEST_FORMAT:
        raise WhetstoneError(f"manifest of version {version} has format {manifest.format}, expected {MANIFEST_FORMAT}")
    if manifest.version != version:
        raise WhetstoneError(f"manifest at version {version} says it is version {manifest.version}")
    if not 0 <= manifest.keyframe <= version:
        raise WhetstoneError(
            f"manifest of version {version} gives keyframe {manifest.keyframe}, which is not a version from 0 "
            f"to {version}: withdraw the version"
        )
    if manifest.kind == "delta" and (manifest.base is None or not 0 <= manifest.base < version):
        raise WhetstoneError(
            f"manifest of version {version} is a delta of base {manifest.base}, which is not a version from 0 "
            f"to {version - 1} (a delta decodes onto its base's weights): withdraw the version"
        )
    listed: set[str] = set()
    for info in manifest.tensors:
        if info.name in listed:
            raise WhetstoneError(
                f"manifest of version {version} lists tensor {info.name!r} twice (a version has each tensor "
                "once): withdraw the version"
            )
        listed.add(info.name)
    for chunk in manifest.chunks:  # a chunk's header does not say its version: its key does
        if not chunk.key.startswith(version_prefix(version)):
            raise WhetstoneError(
                f"manifest of version {version} lists chunk {chunk.key}, which is not one of its own (those "
                f"are under {version_prefix(version)}) and would decode to wrong weights: withdraw the version"
            )
    manifest._digest = manifest_digest(data)
    return manifest
