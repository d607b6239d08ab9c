"""`put_if_absent`: an object is created once, on a local directory and on S3 (moto) alike. Of
writers racing to create one key, exactly one succeeds and readers only ever see its bytes.

The concurrent race runs on the local store only: moto honours `If-None-Match: *` but checks
and writes without a lock, so two requests at the same instant can both pass its check (real S3
makes the conditional write atomic). Sequential conflicts are tested on both."""

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from whetstone.store import LocalStore, ObjectExistsError


def test_a_key_is_created_once(store):
    store.put_if_absent("versions/1/manifest.json", b"first")
    with pytest.raises(ObjectExistsError, match="'versions/1/manifest.json' already exists"):
        store.put_if_absent("versions/1/manifest.json", b"second")
    assert store.get("versions/1/manifest.json") == b"first"
    assert store.list() == ["versions/1/manifest.json"]  # nothing of the refused write is left


def test_writing_the_same_bytes_again_is_a_retry_not_a_conflict(store):
    store.put_if_absent("k", b"same")
    store.put_if_absent("k", b"same")  # e.g. a request that landed but whose answer was lost
    assert store.get("k") == b"same"


def test_of_racing_writers_exactly_one_wins(tmp_path):
    store = LocalStore(tmp_path)

    def create(writer: int) -> int | None:
        try:
            store.put_if_absent("race/manifest.json", f"writer {writer}".encode())
            return writer
        except ObjectExistsError:
            return None

    with ThreadPoolExecutor(8) as pool:
        winners = [w for w in pool.map(create, range(8)) if w is not None]
    assert len(winners) == 1
    assert store.get("race/manifest.json") == f"writer {winners[0]}".encode()


def test_a_local_create_leaves_no_temporary_file(tmp_path):
    store = LocalStore(tmp_path)
    store.put_if_absent("a/b.json", b"x")
    with pytest.raises(ObjectExistsError):
        store.put_if_absent("a/b.json", b"y")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.json"]


def test_a_conflicting_conditional_write_in_flight_is_waited_out(s3_endpoint, monkeypatch):
    # S3 answers 409 while another conditional write of the key is in flight (maybe this one's own
    # first attempt, timed out and retried by boto3): once it settles the write lands or is refused
    from botocore.exceptions import ClientError

    from whetstone.store.s3 import S3Store

    store = S3Store("whetstone", prefix=f"test-{uuid.uuid4().hex}", endpoint_url=s3_endpoint)
    put, conflicts = store._client.put_object, []

    def conflict_once(**kwargs):
        if not conflicts:
            conflicts.append(kwargs["Key"])
            raise ClientError({"Error": {"Code": "ConditionalRequestConflict"}}, "PutObject")
        return put(**kwargs)

    monkeypatch.setattr(store._client, "put_object", conflict_once)
    store.put_if_absent("batches/0.batch", b"batch")
    assert conflicts and store.get("batches/0.batch") == b"batch"


def test_a_store_without_conditional_writes_is_a_clear_error(s3_endpoint, monkeypatch):
    # An S3-compatible store that does not implement `If-None-Match: *` answers 501 NotImplemented
    from botocore.exceptions import ClientError

    from whetstone.errors import WhetstoneError
    from whetstone.store.s3 import S3Store

    store = S3Store("whetstone", prefix=f"test-{uuid.uuid4().hex}", endpoint_url=s3_endpoint)

    def not_implemented(**kwargs):
        error = {
            "Code": "NotImplemented",
            "Message": "A header you provided implies functionality that is not implemented",
        }
        raise ClientError({"Error": error | {"Header": "If-None-Match"}}, "PutObject")

    monkeypatch.setattr(store._client, "put_object", not_implemented)
    refused = r"cannot create 'versions/1/manifest.json' in s3://whetstone/test-.* does not implement conditional"
    with pytest.raises(WhetstoneError, match=refused):
        store.put_if_absent("versions/1/manifest.json", b"first")


@pytest.mark.parametrize("there", [None, b"other", b"batch"], ids=["nothing", "another's", "its own"])
def test_a_conflict_that_lasts_every_try_is_not_taken_for_an_existing_object(s3_endpoint, monkeypatch, there):
    # S3 answering 409 to every try says nothing about the key: only what is there decides
    from botocore.exceptions import ClientError

    from whetstone.store import s3
    from whetstone.store.s3 import S3Store

    monkeypatch.setattr(s3, "CONFLICT_BACKOFF_S", 0.001)
    store = S3Store("whetstone", prefix=f"test-{uuid.uuid4().hex}", endpoint_url=s3_endpoint)
    if there is not None:
        store.put("batches/0.batch", there)
    tries = []

    def always_conflict(**kwargs):
        tries.append(kwargs["Key"])
        raise ClientError({"Error": {"Code": "ConditionalRequestConflict"}}, "PutObject")

    monkeypatch.setattr(store._client, "put_object", always_conflict)
    if there is None:
        refused = r"cannot create 'batches/0.batch' in s3://whetstone/test-.*: .*409 ConditionalRequestConflict"
        with pytest.raises(ConnectionError, match=refused):
            store.put_if_absent("batches/0.batch", b"batch")
        assert not store.exists("batches/0.batch")
    elif there == b"other":
        with pytest.raises(ObjectExistsError, match="'batches/0.batch' already exists"):
            store.put_if_absent("batches/0.batch", b"batch")
    else:
        store.put_if_absent("batches/0.batch", b"batch")
    assert len(tries) == s3.CONFLICT_RETRIES


def test_a_create_whose_mode_cannot_be_set_leaves_no_temporary_file_and_no_descriptor(tmp_path, monkeypatch):
    """fchmod fails on some mounts (EPERM on a filesystem without Unix permissions): the create
    fails with that errno, and neither the temporary file nor its descriptor is left."""
    import os

    def refuse(fd: int, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    store = LocalStore(tmp_path)
    store.put("a/other.json", b"x")  # the folder stays: what is left in it shows
    monkeypatch.setattr(os, "fchmod", refuse)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(PermissionError):
        store.put_if_absent("a/b.json", b"x")
    assert set(os.listdir("/proc/self/fd")) == before
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["other.json"]


@pytest.mark.parametrize("name", ["x" * 236 + ".json", "x" * 245 + ".json", "x" * 250 + ".json", "é" * 125 + ".json"])
def test_a_key_whose_name_is_as_long_as_a_folder_allows_is_created(tmp_path, name):
    """The temporary file's name adds a dot, a random part and `.tmp` to the key's last part: it
    is shortened to fit, so any name `put` takes, `put_if_absent` takes too."""
    store = LocalStore(tmp_path)
    store.put_if_absent(f"v/{name}", b"first")
    store.put_if_absent(f"v/{name}", b"first")
    with pytest.raises(ObjectExistsError):
        store.put_if_absent(f"v/{name}", b"second")
    assert store.get(f"v/{name}") == b"first"
    assert [p.name for p in (tmp_path / "v").iterdir()] == [name]


def test_a_local_retry_of_a_create_that_landed_fsyncs_the_folder(tmp_path, monkeypatch):
    """A writer killed between linking the key and fsyncing its folder leaves a name that may not
    survive a crash: the retry that finds it reports it created, so it fsyncs the folder as well."""
    from whetstone.store import local

    store = LocalStore(tmp_path)
    store.put_if_absent("a/b.json", b"x")
    synced = []
    monkeypatch.setattr(local, "fsync_dir", synced.append)
    store.put_if_absent("a/b.json", b"x")
    assert synced == [tmp_path / "a"]
