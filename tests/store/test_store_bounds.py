"""What the object stores do at the edges of their namespace: listings that would leave the store,
keys below an object, and the permissions of objects created once (a local store's files)."""

import os
import stat

import pytest

from whetstone.errors import WhetstoneError
from whetstone.store import LocalStore, MissingObjectError


@pytest.mark.parametrize("prefix", ["../", "../secret", "a/../../", "/etc/", "/", "a//b"])
def test_a_listing_cannot_reach_outside_the_store(store, tmp_path, prefix):
    (tmp_path / "secret.bin").write_bytes(b"not the store's")
    store.put("a/b.bin", b"x")
    with pytest.raises(WhetstoneError, match="invalid object prefix"):
        store.list(prefix)
    with pytest.raises(WhetstoneError, match="invalid object prefix"):
        store.temporaries(prefix)
    with pytest.raises(WhetstoneError, match="invalid object"):
        store.delete_folder(prefix)
    assert (tmp_path / "secret.bin").exists() and store.list() == ["a/b.bin"]


def test_a_prefix_may_end_in_part_of_a_name(store):
    for key in ["a/b.bin", "a/bc.bin", "ab/d.bin"]:
        store.put(key, b"x")
    assert store.list("a") == ["a/b.bin", "a/bc.bin", "ab/d.bin"]
    assert store.list("a/b") == ["a/b.bin", "a/bc.bin"]
    assert store.list("a/") == ["a/b.bin", "a/bc.bin"]


def test_a_key_below_an_object_is_missing_not_an_os_error(store):
    store.put("a/b.bin", b"x")
    with pytest.raises(MissingObjectError, match="no object 'a/b.bin/c'"):
        store.get("a/b.bin/c")
    store.delete("a/b.bin/c")  # deleting a missing key is not an error
    assert not store.exists("a/b.bin/c")
    assert store.get("a/b.bin") == b"x"


def test_an_object_created_once_gets_the_permissions_of_a_plain_write(tmp_path):
    """Readers of a shared store may run as other users: a version's manifest (created once)
    must be as readable as its chunks (plain writes)."""
    store = LocalStore(tmp_path)
    store.put("v/chunk.bin", b"x")
    store.put_if_absent("v/manifest.json", b"x")
    plain = stat.S_IMODE(os.stat(tmp_path / "v" / "chunk.bin").st_mode)
    assert stat.S_IMODE(os.stat(tmp_path / "v" / "manifest.json").st_mode) == plain


@pytest.mark.parametrize("operation", ["put", "put_if_absent"])
@pytest.mark.parametrize(
    "key, there",
    [
        ("a/b.bin/c", "a file where its folder 'a/b.bin' goes"),
        ("a/b.bin/c/d", "a file where its folder 'a/b.bin' goes"),
        ("a", "a folder where it goes"),
    ],
)
def test_a_local_write_blocked_by_a_file_or_folder_names_it(tmp_path, operation, key, there):
    """A local store cannot hold both 'a/b.bin' and 'a/b.bin/c' (nor 'a' and 'a/b.bin'): such a
    write is an error naming the key and what is in its way, and leaves no temporary file."""
    store = LocalStore(tmp_path)
    store.put("a/b.bin", b"x")
    with pytest.raises(WhetstoneError, match=rf"cannot write {key!r} in {tmp_path}: {there}"):
        getattr(store, operation)(key, b"y")
    assert store.list() == ["a/b.bin"] and store.temporaries() == []
    assert store.get("a/b.bin") == b"x"


def test_deleting_a_key_that_names_a_local_folder_deletes_nothing(tmp_path):
    """A folder is no object ('a' while 'a/b.bin' is stored): deleting it is deleting a missing
    key, as `get` finds it missing."""
    store = LocalStore(tmp_path)
    store.put("a/b.bin", b"x")
    with pytest.raises(MissingObjectError):
        store.get("a")
    store.delete("a")
    assert store.list() == ["a/b.bin"]
