"""The object store interface: a flat namespace of byte blobs under string keys.

Weights and batches live in object stores so that nothing assumes a shared filesystem. Keys are
`/`-separated relative paths (`versions/0000000003/manifest.json`). A `put` is atomic: readers
see the old object or the new one, never part of one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from whetstone.errors import WhetstoneError


class MissingObjectError(WhetstoneError, KeyError):
    """The key does not exist in the store."""

    def __str__(self) -> str:  # KeyError would print the repr of its argument
        return str(self.args[0])


class ObjectStore(ABC):
    @abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

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


def check_key(key: str) -> str:
    """Reject keys that could escape the store's root or name nothing."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise WhetstoneError(f"invalid object key {key!r}: use a relative path like 'a/b.bin'")
    return key
