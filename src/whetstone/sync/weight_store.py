"""The versioned weight store on top of an object store: manifests, chunks, latest pointer, GC.

Publishing is atomic: chunks first, then the manifest, then `latest.json`. A reader that finds a
manifest finds all its chunks; a reader that follows `latest.json` finds the manifest. A version
is created once: its manifest is written with the store's exclusive create (`put_if_absent`),
so of two publishers racing for one version number (a rollback and the online loop, two
trainers) exactly one publishes it and the other gets `VersionExistsError`. A number can be free
behind the pointer, collected after another publisher went past it: a manifest created there is
removed again when the pointer is found past it right after (`StalePublisherError`), so a
publisher that fell behind the store never believes it published. Garbage collection deletes
manifests first, so a version disappears before its chunks do.

Readers follow the latest pointer alone (`head`: one read per poll). A manifest is the version
all the same: where the pointer lags behind one (a publisher died between the two), the
publisher side moves the pointer forward over it (`heal`, at `Publisher.resume`, and every
publish moves it to its own version); the pointer never moves back except in `withdraw`.

A repair withdraws versions (`withdraw`): it records the withdrawal (`withdrawal.json`: each
withdrawn publish's version, manifest digest and chunk folders), moves the latest pointer back,
deletes manifests newest first, then chunks, and last the record. Readers stop seeing the
withdrawn versions as the pointer moves, and never find a hole in the middle of a chain. While
the record stands, the publishes it lists do not count as published: a withdrawal whose process
died is finished by the next publisher (`finish_withdrawal`, before it heals or publishes), never
undone. Finishing removes only what the record lists, so a late finisher (one that read the
record before another process completed the withdrawal) leaves a version published again under a
withdrawn number, and its chunks, alone. The next publish can take the withdrawn numbers again,
under a new manifest digest.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import NamedTuple

from whetstone.errors import WhetstoneError
from whetstone.store import MissingObjectError, ObjectExistsError, ObjectStore, open_store
from whetstone.sync.chunks import checksum, read_header
from whetstone.sync.codec import CorruptDataError
from whetstone.sync.config import SyncConfig
from whetstone.sync.manifest import (
    LATEST_KEY,
    WITHDRAWAL_KEY,
    ChunkInfo,
    Manifest,
    manifest_digest,
    manifest_key,
    parse_manifest,
    version_of,
    version_prefix,
)

log = logging.getLogger("whetstone.sync")


class VersionExistsError(WhetstoneError):
    """Another publisher created this version number first; this one was not published."""


class StalePublisherError(VersionExistsError):
    """The store's latest pointer is past the version a publisher was about to publish: another
    publisher writes to the store, and went on from there (the number may have been collected
    since, and be free). Nothing was published. A `VersionExistsError`, since callers handle it
    alike: the store moved on without this publisher, which can `resume()` after its latest."""


class Head(NamedTuple):
    """The latest pointer: the newest version and its manifest's digest (None in pointers written
    before digests)."""

    version: int
    digest: str | None


MIRROR_TRIES = 3
"""How often `WeightStore.mirror` copies again when the source changed while it copied."""


class _Doomed(NamedTuple):
    """One publish a withdrawal removes: its version, its manifest's digest, and where its chunks
    are (attempt folders, or keys)."""

    version: int
    manifest: str
    chunks: tuple[str, ...]


class _Withdrawal(NamedTuple):
    """A withdrawal record (`withdrawal.json`) as read or written."""

    first: int
    doomed: tuple[_Doomed, ...]
    data: bytes
    """The record's bytes: it is removed only while it is still these."""


def _version_number(value: object) -> int:
    """A version number read from a JSON record: an integer from 0 on. JSON gives a float for
    1e400 (infinity, which `int` refuses with an OverflowError) or 2.7, and a bool for true, which
    `int` would silently turn into another version; `ValueError` for each of them."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a version number")
    return value


def _parse_withdrawal(data: bytes, objects: ObjectStore) -> tuple[int, tuple[_Doomed, ...] | None]:
    """A withdrawal record's first version and the publishes it lists (None: it lists none)."""
    try:
        record = json.loads(data)
        first = _version_number(record["from"])
        listed = record.get("versions")
        if listed is None:
            return first, None
        return first, tuple(
            _Doomed(_version_number(d["version"]), str(d["manifest"]), tuple(str(c) for c in d["chunks"]))
            for d in listed
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        raise WhetstoneError(f"{WITHDRAWAL_KEY} in {objects!r} is not {{'from': N, ...}}: {data[:100]!r}") from None


class WeightStore:
    def __init__(self, objects: ObjectStore):
        self.objects = objects
        self._strays: set[str] = set()
        """What under `versions/` is not a version folder, and was said so in the log."""

    @classmethod
    def open(cls, config: SyncConfig, create: bool = True) -> "WeightStore":
        """`create=False` for readers: a local store that does not exist is an error naming it
        (a mistyped path), not a new empty directory to wait on. Publishers create it."""
        return cls(open_store(config.store, endpoint_url=config.endpoint_url, create=create))

    def __repr__(self) -> str:
        return f"WeightStore({self.objects!r})"

    def head(self) -> Head | None:
        """What the latest pointer (`latest.json`) says: the newest version readers take and its
        manifest's digest, or None if there is none. One read: readers poll it."""
        try:
            data = self.objects.get(LATEST_KEY)
        except MissingObjectError:
            return None
        try:
            pointer = json.loads(data)
            digest = pointer.get("manifest")
            if digest is not None and not isinstance(digest, str):
                raise TypeError(f"manifest digest {digest!r} is not a string")
            return Head(_version_number(pointer["version"]), digest)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise WhetstoneError(f"{LATEST_KEY} in {self.objects!r} is not {{'version': N}}: {data[:100]!r}") from None

    def heal(self) -> Head | None:
        """The publisher's view of the newest version: finish a withdrawal whose process died,
        then move the pointer forward over the manifests right after it (a publisher died, or the
        store failed, between a manifest and the pointer; a manifest is written after all its
        chunks, so such a version is complete). Returns the head it leaves. Readers do not call
        this: it writes, and costs a read of the manifest after the pointer's (absent, as a rule).
        `healed_head` reads the head this leaves without writing."""
        while True:
            self.finish_withdrawal()
            pointer = self.head()
            head = self._walk_forward(pointer)
            if head == pointer:
                return head
            if self.withdrawal() is None:  # else one began during the walk: what it found may be withdrawn
                self.point_forward(head)
                return head

    def healed_head(self) -> Head | None:
        """The head `heal` would leave, read without writing anything: a standing withdrawal's
        publishes count as gone (and a pointer naming one as moved back before its first version),
        then the pointer moves forward over the manifests right after it. For a process that must
        decide whether the store is its own before it changes it (a resuming trainer)."""
        record = self._withdrawal_record()
        if record is None:
            return self._walk_forward(self.head())
        pointer = self._head_below(record.first) if self._names_withdrawn(record) else self.head()
        return self._walk_forward(pointer, record.doomed)

    def _walk_forward(self, pointer: Head | None, gone: tuple[_Doomed, ...] = ()) -> Head | None:
        """`pointer` moved forward over the manifests right after it (from version 0 if None),
        up to the first version without one; a publish in `gone` (withdrawn) counts as none."""
        withdrawn = {(doomed.version, doomed.manifest) for doomed in gone}
        head = pointer
        while True:
            version = 0 if head is None else head.version + 1
            try:
                digest = manifest_digest(self.objects.get(manifest_key(version)))
            except MissingObjectError:
                return head
            if (version, digest) in withdrawn:
                return head
            head = Head(version, digest)

    def point_forward(self, head: Head) -> None:
        """Move the latest pointer to `head` if it points at an older version (or at none). It only
        ever moves forward (only `withdraw` moves it back): a publisher that was slow to write it
        must not hide a newer version."""
        try:
            pointer = self.head()
        except WhetstoneError:  # unreadable: replaced
            pointer = None
        if pointer is None or pointer.version < head.version:
            self._point_at(head.version, head.digest)

    def latest(self) -> int | None:
        """The version the latest pointer names, or None if there is none (nothing published yet)."""
        head = self.head()
        return None if head is None else head.version

    def versions(self) -> list[int]:
        """Every version with a manifest, oldest first."""
        return sorted(self._stored(manifests=True))

    def _stored(self, manifests: bool) -> set[int]:
        """The versions with a manifest (`manifests`), or with any object. What under `versions/`
        is not a version folder (`versions/README`, `versions/tmp/`: put there by hand) is left
        alone, and said once."""
        found = set()
        for key in self.objects.list("versions/"):
            version = version_of(key)
            if version is None:
                self._note_stray(key)
            elif not manifests or key == manifest_key(version):
                found.add(version)
        return found

    def _unfinished(self) -> set[int]:
        """The versions whose folders hold what unfinished writes left (`ObjectStore.temporaries`),
        which `_stored` does not see in a folder that holds nothing else (a publish that died
        before its first chunk was in)."""
        return {version for key in self.objects.temporaries("versions/") if (version := version_of(key)) is not None}

    def _note_stray(self, key: str) -> None:
        name, inside, _ = key.removeprefix("versions/").partition("/")
        stray = f"versions/{name}{inside}"
        if stray not in self._strays:
            self._strays.add(stray)
            log.warning(
                "%s in %r is not a version (those are in versions/<10 digits>/): left alone; move it out of the store",
                stray,
                self.objects,
            )

    def manifest(self, version: int) -> Manifest:
        return parse_manifest(self.objects.get(manifest_key(version)), version)

    def manifest_digest(self, version: int) -> str:
        """The digest of `version`'s manifest as stored now; `MissingObjectError` if there is none."""
        return manifest_digest(self.objects.get(manifest_key(version)))

    def put_chunk(self, key: str, blob: bytes) -> ChunkInfo:
        self.objects.put(key, blob)
        return ChunkInfo(key=key, size=len(blob), checksum=checksum(blob))

    def fetch_chunk(self, info: ChunkInfo) -> bytes:
        """The chunk's bytes, verified against the manifest's size and checksum."""
        blob = self.objects.get(info.key)
        if len(blob) != info.size:
            raise CorruptDataError(
                f"chunk {info.key} has {len(blob)} bytes, the manifest says {info.size} (truncated?)"
            )
        if checksum(blob) != info.checksum:
            raise CorruptDataError(f"chunk {info.key} fails its checksum ({checksum(blob)} != {info.checksum})")
        return blob

    def check_chunk(self, info: ChunkInfo) -> None:
        """Fetch and verify a chunk (size, checksum) and read its header; raises naming it."""
        blob = self.fetch_chunk(info)
        try:
            read_header(blob)
        except CorruptDataError as err:
            raise CorruptDataError(f"chunk {info.key}: {err}") from None

    def publish(self, manifest: Manifest) -> None:
        """Make a version visible: its manifest, then the latest pointer. Its chunks must be in.
        Raises `VersionExistsError` (and changes nothing) if the version exists already, and
        `StalePublisherError` (its manifest removed again) if the pointer is past it once the
        manifest is in (`_passed`); the caller deletes its chunks. Otherwise the version is
        published: a failure to move the pointer is logged, not raised (readers find the version
        by its manifest, and the next publish moves it)."""
        try:
            self.objects.put_if_absent(manifest_key(manifest.version), manifest.stored_bytes())
        except ObjectExistsError:
            raise VersionExistsError(
                f"version {manifest.version} already exists in {self.objects!r}: another "
                "publisher created it first (a rollback, a second trainer or online loop?); "
                "this one was not published"
            ) from None
        passed = self._passed(manifest)
        if passed is not None:
            self._remove_manifest(manifest.version, manifest.digest)
            raise StalePublisherError(
                f"version {manifest.version} was not published in {self.objects!r}: another publisher "
                f"took the store to version {passed.version} while it was uploaded (a rollback, a second "
                "trainer or online loop?). Stop the other publisher, or give each its own store; a restarted "
                f"trainer or loop goes on after version {passed.version}"
            )
        try:
            self.point_forward(Head(manifest.version, manifest.digest))
        except Exception as err:  # the version is out all the same: it must not be published twice
            log.warning(
                "published version %d in %r, but could not move %s: %s", manifest.version, self.objects, LATEST_KEY, err
            )

    def _passed(self, manifest: Manifest) -> Head | None:
        """The latest pointer, if it names a version after that of `manifest` (just created) and
        the version right after `manifest`'s is not a delta on it: another publisher went past the
        number before this manifest was in (the number was free: collected). Readers and `heal`
        only walk forward from the pointer, so only a race of three (a `heal` onto this version,
        then a keyframe after it) lets a reader see it go; it catches up from that keyframe. None
        otherwise, and when the pointer cannot be read (moving it, next, says so in the log)."""
        try:
            head = self.head()
        except Exception:
            return None
        if head is None or head.version <= manifest.version:
            return None
        try:  # a publisher that healed the pointer onto it at that very moment, and built on it
            built_on = self.manifest(manifest.version + 1).base_manifest == manifest.digest
        except MissingObjectError:
            built_on = False
        except WhetstoneError:  # unreadable: whether it builds on this one is unknown, so it stays
            return None
        return None if built_on else head

    def _remove_manifest(self, version: int, digest: str) -> None:
        """Delete the manifest of `version` if it is still the publish of that `digest` (a number
        published again since keeps its manifest)."""
        try:
            data = self.objects.get(manifest_key(version))
        except MissingObjectError:
            return
        if manifest_digest(data) == digest:
            self.objects.delete(manifest_key(version))

    def _point_at(self, version: int | None, digest: str | None) -> None:
        if version is None:
            self.objects.delete(LATEST_KEY)
        else:
            self.objects.put(LATEST_KEY, json.dumps({"version": version, "manifest": digest}).encode())

    def _point_below(self, first: int) -> None:
        """Point `latest.json` at the newest version before `first` (none left: remove it)."""
        below = self._head_below(first)
        self._point_at(None if below is None else below.version, None if below is None else below.digest)

    def _head_below(self, first: int) -> Head | None:
        """The newest version before `first` and its manifest's digest (None: there is none)."""
        kept = [v for v in self.versions() if v < first]
        return Head(kept[-1], self.manifest_digest(kept[-1])) if kept else None

    def withdrawal(self) -> int | None:
        """The first version of a withdrawal in progress, or of one whose process died before it
        finished (`withdrawal.json`); None if there is none."""
        try:
            data = self.objects.get(WITHDRAWAL_KEY)
        except MissingObjectError:
            return None
        return _parse_withdrawal(data, self.objects)[0]

    def finish_withdrawal(self) -> list[int]:
        """Finish a withdrawal that did not complete, or help one in progress (`withdrawal`): its
        versions were withdrawn as far as readers go, and must not come back. Only what its record
        lists goes: those manifests (the same digests), those publishes' chunks (also where the
        manifest is gone already), and the pointer if it names one of them. A version published
        after the record was written, under a withdrawn number too, stays whatever this finds
        on the way. Returns the versions the record lists."""
        record = self._standing_withdrawal()
        if record is None:
            return []
        self._finish(record)
        return sorted({doomed.version for doomed in record.doomed})

    def withdraw(self, first: int) -> list[int]:
        """Withdraw every version from `first` on (a repair of a corrupt version and the deltas
        built on it); returns them. The withdrawal is recorded first (`withdrawal.json`: each
        version's manifest digest and where its chunks are), then the latest pointer moves back to
        the newest version kept, then manifests go, newest first, then their chunks, and last the
        record. Readers stop seeing the versions when the pointer moves, and never find a hole in
        a chain; one holding a withdrawn version notices (its manifest is gone or another) and
        re-syncs. Wherever this dies, the record keeps a publisher from healing the pointer onto
        the versions, and the next one finishes it (`finish_withdrawal`). A withdrawal recorded
        before and not finished is finished too (its versions are added to this one's record). A
        version a publisher creates meanwhile at `first` or later is withdrawn as well (listed
        again until none is new); the next publish takes `first` again (under a new manifest
        digest)."""
        record = self._standing_withdrawal()
        doomed = [] if record is None else list(record.doomed)
        written = False
        while True:
            fresh = self._doomable(first, doomed)
            if not fresh and (written or not doomed):
                break
            record = self._record_withdrawal(first, doomed + fresh)
            doomed, written = list(record.doomed), True
            self._point_below(record.first)
            self._delete_doomed(record.doomed)
        if record is None:
            return []
        self._finish(record, delete=False)
        withdrawn = sorted({d.version for d in doomed})
        if withdrawn:
            log.info("withdrew versions %s from %r", _span(withdrawn), self.objects)
        return withdrawn

    def _standing_withdrawal(self) -> _Withdrawal | None:
        """`_withdrawal_record`, said in the log when there is one: this process finishes it."""
        record = self._withdrawal_record()
        if record is not None:
            log.warning(
                "a withdrawal of versions from %d on is running or did not complete in %r: finishing it",
                record.first,
                self.objects,
            )
        return record

    def _withdrawal_record(self) -> _Withdrawal | None:
        """The standing withdrawal record, read in full. A record that does not list its versions
        (`{"from": N}` alone) withdraws the versions from N on stored now."""
        try:
            data = self.objects.get(WITHDRAWAL_KEY)
        except MissingObjectError:
            return None
        first, doomed = _parse_withdrawal(data, self.objects)
        return _Withdrawal(first, tuple(self._doomable(first, [])) if doomed is None else doomed, data)

    def _doomable(self, first: int, known: list[_Doomed]) -> list[_Doomed]:
        """The publishes of versions from `first` on stored now (newest first) that `known` does
        not list: their manifest digests and where their chunks are."""
        listed = {(doomed.version, doomed.manifest) for doomed in known}
        found = []
        for version in reversed(self.versions()):
            if version < first:
                break
            try:
                data = self.objects.get(manifest_key(version))
            except MissingObjectError:  # deleted since it was listed
                continue
            if (version, manifest_digest(data)) not in listed:
                found.append(_Doomed(version, manifest_digest(data), self._chunk_places(version, data)))
        return found

    def _chunk_places(self, version: int, data: bytes) -> tuple[str, ...]:
        """Where the chunks of one publish of `version` (its manifest: `data`) are: the folders of
        its publish attempt (`versions/<n>/<attempt>/`), or the keys themselves when they are not
        in one. Another publish of the number has its own attempt folder. An unreadable manifest
        (the repair of one): the attempt folders under the version now."""
        prefix = version_prefix(version)
        try:
            keys = [str(chunk["key"]) for chunk in json.loads(data)["chunks"]]
        except (ValueError, KeyError, TypeError):
            keys = [key for key in self.objects.list(prefix) if key != manifest_key(version)]
        places = set()
        for key in keys:
            if key.startswith(prefix) and key != manifest_key(version):
                folder = key.rpartition("/")[0] + "/"
                places.add(folder if folder != prefix else key)
        return tuple(sorted(places))

    def _record_withdrawal(self, first: int, doomed: list[_Doomed]) -> _Withdrawal:
        """Write the withdrawal record, with the versions of one that stands (another withdraw
        began meanwhile, or died): they stay withdrawn."""
        standing = self._withdrawal_record()
        if standing is not None:
            first = min(first, standing.first)
            doomed = doomed + [d for d in standing.doomed if d not in doomed]
        listed = [{"version": d.version, "manifest": d.manifest, "chunks": list(d.chunks)} for d in doomed]
        data = json.dumps({"from": first, "versions": listed}).encode()
        self.objects.put(WITHDRAWAL_KEY, data)
        return _Withdrawal(first, tuple(doomed), data)

    def _delete_doomed(self, doomed: tuple[_Doomed, ...]) -> None:
        """Delete the manifests of these publishes (newest first), then their chunks. A manifest
        is deleted only if it is the same publish (digest), and a chunk that the version's manifest
        lists is kept if that is another publish (the number published again since)."""
        newest_first = sorted(doomed, key=lambda d: d.version, reverse=True)
        listed = {(d.version, d.manifest) for d in doomed}
        for entry in newest_first:
            self._remove_manifest(entry.version, entry.manifest)
        for entry in newest_first:
            prefix, kept = version_prefix(entry.version), set()
            try:  # read again, after every delete: the number may have been published again since
                data = self.objects.get(manifest_key(entry.version))
            except MissingObjectError:
                data = None
            if data is not None and (entry.version, manifest_digest(data)) not in listed:
                try:
                    kept = {chunk["key"] for chunk in json.loads(data)["chunks"]}
                except (ValueError, KeyError, TypeError):  # cannot tell which are its chunks: none go
                    continue
            for place in entry.chunks:
                if place.startswith(prefix):
                    for key in self.objects.list(place):
                        if key not in kept and key != manifest_key(entry.version):
                            self.objects.delete(key)

    def _finish(self, record: _Withdrawal, delete: bool = True) -> None:
        """Complete a recorded withdrawal: the pointer back if it names a withdrawn publish, the
        manifests and chunks the record lists (unless `delete` is False: done already), the
        pointer again (a publisher slow to write it), and last the record if it is still this one
        (another withdraw may have added to it: that one removes it)."""
        if delete:
            self._point_back(record)
            self._delete_doomed(record.doomed)
        self._point_back(record)
        try:
            standing = self.objects.get(WITHDRAWAL_KEY)
        except MissingObjectError:
            return
        if standing == record.data:
            self.objects.delete(WITHDRAWAL_KEY)

    def _point_back(self, record: _Withdrawal) -> None:
        """Move the pointer before the record's first version if it names a publish the record
        withdraws; one that names another (published since) stays."""
        if self._names_withdrawn(record):
            self._point_below(record.first)

    def _names_withdrawn(self, record: _Withdrawal) -> bool:
        """Whether the pointer names a publish `record` withdraws, or cannot be read (replaced)."""
        try:
            pointer = self.head()
        except WhetstoneError:
            return True
        return pointer is not None and any(
            d.version == pointer.version and pointer.digest in (None, d.manifest) for d in record.doomed
        )

    def mirror(self, source: WeightStore, blobs: Mapping[str, bytes] | None = None) -> list[int]:
        """Make this store hold what readers of `source` see (this store is a mirror of it: the
        weight store an inference cluster follows, `sync.mirrors`): its versions up to its latest
        pointer; returns the versions copied. Versions past the pointer are not taken (a
        withdrawal in progress, or a publish whose pointer is still to come). Versions this store
        has that `source` no longer has as such (collected, withdrawn, or withdrawn and published
        again) go first, the way `withdraw` removes them; then each missing version's chunks, its
        manifest, and last the latest pointer: a reader here sees the same atomic publishes as
        one of `source`. The pointer moves only to a version this store holds as the source's
        pointer names it (digest), read again after the copy: a withdrawal or a publish in
        `source` meanwhile makes it copy again (a few times, then fail, to be retried). `blobs`:
        chunk bytes already in memory (the publish just made), fetched from `source` otherwise.
        One writer per mirror (its publisher), which also finishes a withdrawal here that did not
        complete."""
        blobs = blobs or {}
        self.finish_withdrawal()
        copied: list[int] = []
        for _ in range(MIRROR_TRIES):
            head = source.head()
            if head is None:
                return copied
            copied += self._copy(source, head, blobs)
            now = source.head()
            if now == head and self._holds(source, head):
                if head != self._readable_head():
                    self._point_at(head.version, head.digest)
                return copied
        raise WhetstoneError(
            f"{source!r} changed while {self!r} copied it, {MIRROR_TRIES} times: its latest pointer stays where it was"
        )

    def _readable_head(self) -> Head | None:
        """`head`, or None where the pointer cannot be read (half written by a tool that copied the
        store, say): the mirror's one writer replaces it, as `point_forward` does in a store."""
        try:
            return self.head()
        except WhetstoneError:
            return None

    def _holds(self, source: WeightStore, head: Head) -> bool:
        """Whether this store has `head`'s version as `source` published it (a pointer without a
        digest: as `source` has it now)."""
        try:
            digest = self.manifest_digest(head.version)
            return digest == (source.manifest_digest(head.version) if head.digest is None else head.digest)
        except MissingObjectError:
            return False

    def _copy(self, source: WeightStore, head: Head, blobs: Mapping[str, bytes]) -> list[int]:
        """One pass of `mirror` up to `head`, but the pointer: returns the versions copied."""
        wanted = [v for v in source.versions() if v <= head.version]
        if not wanted:
            return []
        held = self.versions()
        gone = sorted(set(held) - set(wanted))
        for version in sorted(set(held) & set(wanted), reverse=True):
            if self.manifest_digest(version) == source.manifest_digest(version):
                break  # a chain is replaced from some version on, never below a match
            gone.append(version)
        for version in (v for v in gone if v < wanted[0]):  # collected in the source
            self.delete_version(version)
        if replaced := [v for v in gone if v >= wanted[0]]:
            self.withdraw(min(replaced))
        copied = [v for v in wanted if v not in set(self.versions())]
        for version in copied:
            data = source.objects.get(manifest_key(version))
            for chunk in parse_manifest(data, version).chunks:
                blob = blobs.get(chunk.key)
                self.objects.put(chunk.key, blob if blob is not None else source.objects.get(chunk.key))
            self.objects.put(manifest_key(version), data)
        return copied

    def verify(self) -> dict[int, str]:
        """Read every chunk of every version (size, checksum, header) and check each delta's base:
        {version: what is wrong} for each version a subscriber could not take, by itself or
        because its chain goes through such a version."""
        problems: dict[int, str] = {}
        stored = self.versions()
        digests: dict[int, str | None] = {}
        for version in stored:
            try:
                manifest = self.manifest(version)
                digests[version] = manifest.digest
                for chunk in manifest.chunks:
                    self.check_chunk(chunk)
            except WhetstoneError as err:  # unreadable manifest, missing or corrupt chunk
                problems[version] = str(err)
                continue
            if manifest.kind == "full":
                continue
            if manifest.base in problems:
                problems[version] = f"a delta on version {manifest.base}, which cannot be taken"
            elif manifest.base not in digests:
                problems[version] = f"a delta on version {manifest.base}, which is not in the store"
            elif manifest.base_manifest not in (None, digests[manifest.base]):
                problems[version] = f"a delta on a withdrawn publish of version {manifest.base}"
        return problems

    def delete_version(self, version: int) -> None:
        """Delete a collected version: its manifest, then the rest of its folder, with what writers
        killed mid-write left there (`ObjectStore.delete_folder`). Only for a version garbage
        collection removes (or a mirror's, which the source collected): no publisher takes its
        number again, unlike a failed publish's or a withdrawn version's."""
        self.objects.delete(manifest_key(version))
        self.objects.delete_folder(version_prefix(version))

    def collect_garbage(self, keep_keyframes: int) -> list[int]:
        """Delete every version older than the `keep_keyframes`-th newest keyframe: a subscriber
        that far behind catches up from a newer keyframe. Also deletes chunks that a crashed
        publish left without a manifest, and the folder of one that died before its first chunk
        was in (temporary files alone). Returns the versions deleted."""
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
        doomed = sorted(v for v in self._stored(manifests=False) | self._unfinished() if v < oldest_kept)
        for version in doomed:
            self.delete_version(version)
        if doomed:
            log.info("garbage collection deleted versions %s..%s", doomed[0], doomed[-1])
        return doomed


def _span(versions: list[int]) -> str:
    return str(versions[0]) if len(versions) == 1 else f"{versions[0]}..{versions[-1]}"
