from pathlib import Path

import pytest

from whetstone.errors import WhetstoneError
from whetstone.store import LocalStore, MissingObjectError, open_store


def test_put_get_overwrite(store):
    store.put("a/b.bin", b"one")
    assert store.get("a/b.bin") == b"one"
    store.put("a/b.bin", b"two")
    assert store.get("a/b.bin") == b"two"


def test_missing_object_is_a_clear_error(store):
    with pytest.raises(MissingObjectError, match="no object 'nope/x'"):
        store.get("nope/x")
    assert not store.exists("nope/x")


def test_list_by_prefix_sorted(store):
    for key in ["v/2/m.json", "v/10/m.json", "v/1/c.bin", "w.json"]:
        store.put(key, b"x")
    assert store.list("v/") == ["v/1/c.bin", "v/10/m.json", "v/2/m.json"]
    assert store.list("v/1") == ["v/1/c.bin", "v/10/m.json"]
    assert store.list() == ["v/1/c.bin", "v/10/m.json", "v/2/m.json", "w.json"]
    assert store.list("zzz/") == []


def test_a_folder_deleted_while_listing_is_skipped(tmp_path, monkeypatch):
    # Another writer deletes versions/1/ after the walk saw it and before it went in (two
    # publishers racing: the loser drops its chunks while the winner collects garbage).
    import os

    store = LocalStore(tmp_path / "store")
    for key in ["versions/1/a/c.bin", "versions/2/m.json"]:
        store.put(key, b"x")
    gone, scandir = tmp_path / "store" / "versions" / "1", os.scandir

    def deleted_meanwhile(path="."):
        if os.fspath(path) == os.fspath(gone):
            raise FileNotFoundError(2, "No such file or directory", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", deleted_meanwhile)
    assert store.list("versions/") == ["versions/2/m.json"]


def test_delete_is_idempotent(store):
    store.put("a/b", b"x")
    store.delete("a/b")
    store.delete("a/b")
    assert not store.exists("a/b")
    assert store.list() == []


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a"])
def test_keys_cannot_escape_the_store(store, key):
    with pytest.raises(WhetstoneError, match="invalid object key"):
        store.put(key, b"x")


def test_local_store_leaves_no_temporary_files_and_no_empty_folders(tmp_path):
    store = LocalStore(tmp_path)
    store.put("versions/1/chunk.bin", b"x" * 1000)
    assert [p.name for p in (tmp_path / "versions" / "1").iterdir()] == ["chunk.bin"]
    (tmp_path / "versions" / "1" / ".chunk2.bin.123.tmp").write_bytes(b"half")  # a write in progress
    assert store.list() == ["versions/1/chunk.bin"]
    (tmp_path / "versions" / "1" / ".chunk2.bin.123.tmp").unlink()
    store.delete("versions/1/chunk.bin")
    assert list(tmp_path.iterdir()) == []


def test_open_store_picks_the_backend(tmp_path, s3_endpoint):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    remote = open_store("s3://whetstone/some/prefix", endpoint_url=s3_endpoint)
    remote.put("k", b"v")
    assert open_store("s3://whetstone/some", endpoint_url=s3_endpoint).list() == ["prefix/k"]


def test_a_local_store_path_has_home_and_variables_expanded(tmp_path, monkeypatch):
    """`batch_store = "~/batches"` is the home folder's, not a folder named `~` in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    monkeypatch.chdir(tmp_path)
    open_store("~/batches").put("k", b"v")
    open_store("file://$RUNS/weights").put("k", b"v")
    LocalStore("${RUNS}/other").put("k", b"v")
    assert (tmp_path / "home" / "batches" / "k").read_bytes() == b"v"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["other", "weights"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "runs"]
    assert open_store("~/batches", create=False).get("k") == b"v"
    with pytest.raises(WhetstoneError, match=r"no store at .*home/typo"):
        open_store("~/typo", create=False)


@pytest.mark.parametrize("operation", ["get", "put", "put_if_absent", "list", "delete"])
def test_missing_bucket_is_a_clear_error(s3_endpoint, operation):
    from whetstone.store.s3 import S3Store

    store, arguments = S3Store("absent", endpoint_url=s3_endpoint), {"list": ()}.get(operation, ("k",))
    if operation.startswith("put"):
        arguments += (b"v",)
    with pytest.raises(WhetstoneError, match="bucket 'absent' does not exist"):
        getattr(store, operation)(*arguments)


@pytest.mark.parametrize("operation", ["put", "put_if_absent"])
def test_a_write_into_a_folder_another_delete_removes_goes_on(tmp_path, monkeypatch, operation):
    # delete() drops folders left empty: another process may do so between a write making the
    # folder and creating its file there
    import tempfile

    store, mkstemp, removed = LocalStore(tmp_path), tempfile.mkstemp, []

    def folder_deleted_first(*args, dir, **kwargs):
        if not removed:
            removed.append(dir)
            Path(dir).rmdir()
        return mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", folder_deleted_first)
    getattr(store, operation)("fleet/servers/a.json", b"x")
    assert removed and store.get("fleet/servers/a.json") == b"x"


def test_moto_server_in_its_own_process_serves_real_s3_requests():
    from whetstone.store.moto import local_s3
    from whetstone.store.s3 import S3Store

    with local_s3("own", own_process=True) as endpoint:
        store = S3Store("own", endpoint_url=endpoint)
        store.put("k", b"v")
        assert store.get("k") == b"v"
