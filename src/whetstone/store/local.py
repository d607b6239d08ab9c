"""Object store in a local directory: one file per key, written atomically."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from whetstone.config import expand_path
from whetstone.errors import WhetstoneError
from whetstone.store.base import MissingObjectError, ObjectExistsError, ObjectStore, check_key, check_prefix
from whetstone.utils.atomic import atomic_write_bytes, fsync_dir


class LocalStore(ObjectStore):
    def __init__(self, root: str | Path, create: bool = True):
        """`root`: `~` and `$NAME` expanded (`expand_path`). `create`: make the directory if it does
        not exist (writers); otherwise a missing directory is an error naming it (readers: a
        mistyped path must not become an empty store)."""
        self.root = expand_path(root)
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except FileExistsError:  # a file, or a link to one, where the store's folder goes
                raise WhetstoneError(f"cannot make a store at {self.root}: a file is in the way") from None
            except NotADirectoryError:
                raise WhetstoneError(f"cannot make a store at {self.root}: a file is in the path to it") from None
        elif not self.root.is_dir():
            what = "is not a directory" if self.root.exists() else "does not exist"
            raise WhetstoneError(
                f"no store at {self.root}: the directory {what} (a mistyped path? "
                "only commands that publish create a store)"
            )

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes) -> None:
        self._write(key, lambda: atomic_write_bytes(self._path(key), data))

    def put_if_absent(self, key: str, data: bytes) -> None:
        self._write(key, lambda: self._put_if_absent(key, data))

    def _write(self, key: str, write: Callable[[], None]) -> None:
        """Run `write`, a write of `key` (again if its folder vanished: `_again_if_folder_deleted`).
        One that fails because a file is where one of the key's folders goes, or a folder where the
        key goes, is an error naming it: a directory cannot hold both `a` and `a/b` (an object and
        one below it, or a stray file of the folder the store is in)."""
        try:
            _again_if_folder_deleted(write)
        except (FileExistsError, NotADirectoryError, IsADirectoryError):
            if (blocked := self._in_the_way(key)) is None:
                raise
            raise WhetstoneError(f"cannot write {key!r} in {self.root}: {blocked}") from None

    def _in_the_way(self, key: str) -> str | None:
        """What in the store's directory stops `key` from being a file there, or None."""
        if self._path(key).is_dir():
            return "a folder where it goes"
        parts = key.split("/")
        for end in range(1, len(parts)):
            folder = "/".join(parts[:end])
            if os.path.lexists(self.root / folder) and not (self.root / folder).is_dir():
                return f"a file where its folder {folder!r} goes"
        return None

    def _put_if_absent(self, key: str, data: bytes) -> None:
        # The whole file is written under a temporary name, then hard-linked to the key
        # (`atomic_write_bytes`, exclusive): a link fails if the name exists, so exactly one
        # racing writer creates it, and a reader never sees part of it.
        path = self._path(key)
        try:
            atomic_write_bytes(path, data, exclusive=True)
        except FileExistsError:
            if not os.path.lexists(path):  # its folder's (removed and made again meanwhile), or the key
                raise  # deleted since: written again (`_again_if_folder_deleted`)
            if path.read_bytes() == data:
                # A retry of a write that landed, whose writer may have died before it fsynced the
                # folder: the name is made durable before the write is reported done.
                fsync_dir(path.parent)
                return
            raise ObjectExistsError(f"object {key!r} already exists in {self.root}") from None

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):  # the last: a key below an object's
            raise MissingObjectError(f"no object {key!r} in {self.root}") from None

    def list(self, prefix: str = "") -> list[str]:
        # Temporary files of atomic writes in progress start with a dot: not objects yet.
        return self._keys(prefix, lambda name: not name.startswith("."))

    def temporaries(self, prefix: str = "") -> list[str]:
        """`ObjectStore.temporaries`: the temporary files of atomic writes (`.<name>.*.tmp`)."""
        return self._keys(prefix, _temporary)

    def delete_temporaries(self, prefix: str, older_than_s: float) -> list[str]:
        """`ObjectStore.delete_temporaries`: the temporary files (`.<name>.*.tmp`) whose
        modification time is `older_than_s` seconds or more before this machine's clock."""
        deleted = []
        for key in self.temporaries(prefix):
            path = self._path(key)
            try:
                if time.time() - path.stat().st_mtime < older_than_s:
                    continue
                path.unlink()
            except FileNotFoundError:  # its write finished, or another process removed it
                continue
            deleted.append(key)
            self._drop_empty_folders(path.parent)
        return deleted

    def _keys(self, prefix: str, wanted: Callable[[str], bool]) -> list[str]:
        """The keys starting with `prefix` of the files whose names are `wanted`, sorted."""
        check_prefix(prefix)  # its folder inside the store
        # Walk only the deepest directory the prefix names, not the whole store.
        folder = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        if not folder.is_dir():
            return []
        keys = []
        for directory, _, names in os.walk(folder, onerror=_unless_deleted):
            for name in names:
                if wanted(name):
                    key = (Path(directory) / name).relative_to(self.root).as_posix()
                    if key.startswith(prefix):
                        keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except (NotADirectoryError, IsADirectoryError):  # a key below an object's ('a/b.bin/c'), or a
            return  # folder's ('a' of 'a/b.bin'): no object is there
        self._drop_empty_folders(path.parent)

    def delete_folder(self, prefix: str) -> None:
        """`ObjectStore.delete_folder`: the objects, then the temporary files of atomic writes
        (`.<name>.*.tmp`, which `list` skips) that a writer killed mid-write left in the folder."""
        super().delete_folder(prefix)
        folder = self._path(prefix.removesuffix("/"))
        if not folder.is_dir():  # none, or an object ('a/b.bin' of 'a/b.bin/'): nothing is below it
            return
        for directory, _, names in os.walk(folder, topdown=False, onerror=_unless_deleted):
            for name in names:
                if _temporary(name):
                    (Path(directory) / name).unlink(missing_ok=True)
            self._drop_empty_folders(Path(directory))

    def _drop_empty_folders(self, folder: Path) -> None:
        """Remove `folder` and the folders above it while they are empty, so deleted versions
        leave no trace."""
        for parent in [folder, *folder.parents]:
            if parent == self.root or not parent.is_relative_to(self.root):
                break
            try:
                parent.rmdir()
            except OSError:
                break

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()


def _temporary(name: str) -> bool:
    """Whether a file's name is that of an atomic write's temporary file (`.<name>.*.tmp`)."""
    return name.startswith(".") and name.endswith(".tmp")


def _unless_deleted(err: OSError) -> None:
    """Skip a folder deleted while `list` walks (another publisher dropping its chunks, garbage
    collection): listing must not fail because the store changed meanwhile. Any other error (a
    folder it may not read, an I/O error) is raised: a listing that silently left out a folder's
    keys would read as a store without them."""
    if not isinstance(err, FileNotFoundError):
        raise err


FOLDER_RETRIES = 5


def _again_if_folder_deleted(write) -> None:
    """Run `write` again if its folder vanished under it: `delete` removes folders left empty, and
    another process may do so between a write making the folder and creating its file there."""
    for attempt in range(FOLDER_RETRIES):
        try:
            return write()
        except (FileNotFoundError, FileExistsError):  # the folder gone, or gone and made again
            if attempt == FOLDER_RETRIES - 1:
                raise
