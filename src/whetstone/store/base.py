"""The object store interface: a flat namespace of byte blobs under string keys.

Weights and batches live in object stores so that nothing assumes a shared filesystem. Keys are
`/`-separated relative paths (`versions/0000000003/manifest.json`). A `put` is atomic: readers
see the old object or the new one, never part of one. `put_if_absent` is atomic and exclusive
as well: of writers racing to create one key, exactly one succeeds (how a weight version is
created only once).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from whetstone.errors import WhetstoneError


class MissingObjectError(WhetstoneError, KeyError):
    """The key does not exist in the store."""

    def __str__(self) -> str:  # KeyError would print the repr of its argument
        return str(self.args[0])


class ObjectExistsError(WhetstoneError):
    """`put_if_absent` found the key already there (another writer created it first)."""


class ObjectStore(ABC):
    @abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> None:
        """Create the object only if the key does not exist yet, atomically (no other writer can
        slip in between the check and the write); `ObjectExistsError` if it holds other bytes.
        If it holds exactly `data`, this is a retry of a write that landed: not an error."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; `MissingObjectError` if there is none."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """All keys starting with `prefix`, sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    def temporaries(self, prefix: str = "") -> list[str]:
        """The keys starting with `prefix` of what unfinished writes left (a local store's temporary
        files: a write in progress, or one whose writer died), which `list` does not show, sorted.
        None in a store whose writes need no temporaries (S3)."""
        check_prefix(prefix)
        return []

    def delete_temporaries(self, prefix: str, older_than_s: float) -> list[str]:
        """Delete what unfinished writes under `prefix` left (`temporaries`) that nothing has
        written to for `older_than_s` seconds (their writers were killed mid-write: a write in
        progress touches its file all along), and return their keys, sorted. None in a store whose
        writes need no temporaries (S3)."""
        check_prefix(prefix)
        return []

    def delete_folder(self, prefix: str) -> None:
        """Delete every object under `prefix` (a folder: `versions/0000000003/`) and what writers
        that died left there unfinished (a local store's temporary files). Only for a folder that
        no writer uses any more: a write in progress there may lose its temporary file. A prefix
        that names no folder (`check_folder`) is refused before anything is deleted."""
        check_folder(prefix)
        for key in self.list(prefix):
            self.delete(key)


def check_key(key: str) -> str:
    """Reject keys that could escape the store's root or name nothing."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise WhetstoneError(f"invalid object key {key!r}: use a relative path like 'a/b.bin'")
    return key


def check_prefix(prefix: str) -> str:
    """Reject listing prefixes whose folder could escape the store's root: all of a prefix but
    what follows its last `/` (a partial name: `versions/00`) must be a valid key."""
    folder = prefix.rpartition("/")[0]
    if prefix.startswith("/") or (folder and any(part in ("", ".", "..") for part in folder.split("/"))):
        raise WhetstoneError(f"invalid object prefix {prefix!r}: use a relative folder like 'versions/'")
    return prefix


def check_folder(prefix: str) -> str:
    """Reject a prefix that names no folder to delete: a valid key followed by `/`. An empty one
    would name the whole store, and one ending in part of a name (`versions/1`) the folders and
    objects beside it as well (`versions/10/`, `versions/1.json`)."""
    if not prefix.endswith("/") or not prefix[:-1] or any(part in ("", ".", "..") for part in prefix[:-1].split("/")):
        raise WhetstoneError(
            f"invalid object folder {prefix!r}: use a relative folder ending in '/' like 'versions/0000000003/'"
        )
    return prefix
