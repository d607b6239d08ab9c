import socket
import threading
import uuid
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.store.s3_permissions import allow, s3_credentials, s3_user
from whetstone.errors import WhetstoneError
from whetstone.store import AccessDeniedError, LocalStore, MissingObjectError, open_store


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


@pytest.mark.parametrize(
    "error",
    [FileNotFoundError(2, "No such file or directory"), PermissionError(13, "Permission denied")],
    ids=["deleted meanwhile", "unreadable"],
)
def test_a_folder_deleted_while_listing_is_skipped_and_one_that_cannot_be_read_fails(tmp_path, monkeypatch, error):
    # Deleted after the walk saw it and before it went in: two publishers racing (the loser drops
    # its chunks while the winner collects garbage). Unreadable (another user's, an I/O error):
    # its keys must not silently go missing from the list.
    import os

    store = LocalStore(tmp_path / "store")
    for key in ["versions/1/a/c.bin", "versions/2/m.json", "fleet/servers/a.json"]:
        store.put(key, b"x")
    failing, scandir = tmp_path / "store" / "versions" / "1", os.scandir

    def scan(path="."):
        if os.fspath(path) == os.fspath(failing):
            raise type(error)(error.errno, error.strerror, os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", scan)
    assert store.list("fleet/") == ["fleet/servers/a.json"]
    if isinstance(error, FileNotFoundError):
        assert store.list("versions/") == ["versions/2/m.json"]
        return
    for prefix in ("versions/", ""):
        with pytest.raises(PermissionError, match="versions/1"):
            store.list(prefix)


def test_delete_is_idempotent(store):
    store.put("a/b", b"x")
    store.delete("a/b")
    store.delete("a/b")
    assert not store.exists("a/b")
    assert store.list() == []


def test_delete_folder_deletes_what_is_under_the_folder_alone(store):
    for key in ["v/1/a/c.bin", "v/1/m.json", "v/10/m.json", "v/1.json"]:
        store.put(key, b"x")
    store.delete_folder("v/1/")
    store.delete_folder("v/2/")  # none: not an error
    assert store.list() == ["v/1.json", "v/10/m.json"]


@pytest.mark.parametrize("prefix", ["", "v", "v/1", "v/1/m.json"])
def test_delete_folder_refuses_a_prefix_that_names_no_folder_before_deleting_anything(store, prefix):
    """An empty prefix would delete the whole store, and one ending in part of a name (`v/1`) the
    folders beside it too (`v/10/`): both are a caller's mistake, refused up front."""
    for key in ["v/1/m.json", "v/10/m.json", "w.bin"]:
        store.put(key, b"x")
    with pytest.raises(WhetstoneError, match=f"invalid object folder {prefix!r}"):
        store.delete_folder(prefix)
    assert store.list() == ["v/1/m.json", "v/10/m.json", "w.bin"]


def test_delete_folder_below_an_object_deletes_nothing(store):
    store.put("a/b.bin", b"x")
    assert store.list("a/b.bin/") == []
    store.delete_folder("a/b.bin/")  # no such folder: not an error
    assert store.list() == ["a/b.bin"]


def test_delete_folder_removes_the_temporary_files_of_killed_writes_in_a_local_store(tmp_path):
    store = LocalStore(tmp_path)
    store.put("v/1/a/c.bin", b"x")
    (tmp_path / "v" / "2").mkdir()
    for name in ["v/1/a/.d.bin.k1ll3d.tmp", "v/1/.m.json.k1ll3d.tmp", "v/2/.m.json.w0rk1n.tmp"]:
        (tmp_path / name).write_bytes(b"half")
    store.delete_folder("v/1/")
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))] == [
        "v",
        "v/2",
        "v/2/.m.json.w0rk1n.tmp",
    ]


def test_temporaries_are_the_temporary_files_of_unfinished_writes_that_list_skips(tmp_path, s3_endpoint):
    from whetstone.store.s3 import S3Store

    store = LocalStore(tmp_path)
    store.put("v/1/a/c.bin", b"x")
    (tmp_path / "v" / "2" / "b").mkdir(parents=True)
    for name in ["v/1/a/.d.bin.k1ll3d.tmp", "v/2/b/.c.bin.w0rk1n.tmp", "v/2/.hidden", ".w.json.k1ll3d.tmp"]:
        (tmp_path / name).write_bytes(b"half")
    assert store.temporaries("v/") == ["v/1/a/.d.bin.k1ll3d.tmp", "v/2/b/.c.bin.w0rk1n.tmp"]
    assert store.temporaries() == [".w.json.k1ll3d.tmp", "v/1/a/.d.bin.k1ll3d.tmp", "v/2/b/.c.bin.w0rk1n.tmp"]
    assert store.list("v/") == ["v/1/a/c.bin"]
    assert S3Store("whetstone", f"test-{uuid.uuid4().hex}", endpoint_url=s3_endpoint).temporaries() == []


def test_delete_temporaries_removes_the_old_temporary_files_alone(tmp_path, s3_endpoint):
    import os
    import time

    from whetstone.store.s3 import S3Store

    store = LocalStore(tmp_path)
    store.put("v/1/c.bin", b"x")
    (tmp_path / "v" / "2").mkdir()
    old = ["v/1/.d.bin.k1ll3d.tmp", "v/2/.m.json.k1ll3d.tmp", ".w.json.k1ll3d.tmp"]
    for name in [*old, "v/1/.e.bin.w0rk1n.tmp"]:
        (tmp_path / name).write_bytes(b"half")
    for name in old:
        os.utime(tmp_path / name, (time.time() - 60, time.time() - 60))
    assert store.delete_temporaries("v/", older_than_s=30) == ["v/1/.d.bin.k1ll3d.tmp", "v/2/.m.json.k1ll3d.tmp"]
    assert store.temporaries() == [".w.json.k1ll3d.tmp", "v/1/.e.bin.w0rk1n.tmp"]
    assert not (tmp_path / "v" / "2").exists() and store.list() == ["v/1/c.bin"]  # the folder left empty is gone
    assert S3Store("whetstone", f"test-{uuid.uuid4().hex}", endpoint_url=s3_endpoint).delete_temporaries("", 0) == []


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


@pytest.mark.parametrize(
    ("url", "bucket"), [("s3://", ""), ("s3:///weights", ""), ("s3://my bucket/weights", "my bucket")]
)
def test_an_s3_url_without_a_valid_bucket_name_is_a_clear_error(url, bucket):
    """A URL typed by hand (`whetstone sync inspect s3:///weights`) is refused before any request,
    naming the bucket, not left to botocore's traceback at the first request."""
    with pytest.raises(WhetstoneError, match=f"invalid bucket name {bucket!r} in s3://"):
        open_store(url, endpoint_url="http://127.0.0.1:9").list()


def test_folder_markers_in_a_bucket_are_not_objects(s3_endpoint):
    """S3 consoles make a folder as an empty object named like it (`weights/`): no key of the store
    (keys name no folder), so a store whose folder was made so is empty, and one that holds it can
    be listed and deleted by folder."""
    from whetstone.store.s3 import S3Store

    prefix = f"test-{uuid.uuid4().hex}"
    store = S3Store("whetstone", prefix, endpoint_url=s3_endpoint)
    for marker in ["", "versions/", "versions/0000000003/"]:
        store._client.put_object(Bucket="whetstone", Key=f"{prefix}/{marker}", Body=b"")
    assert store.list() == []
    store.put("versions/0000000003/m.json", b"x")
    assert store.list("versions/") == ["versions/0000000003/m.json"]
    store.delete_folder("versions/0000000003/")
    assert store.list() == []


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


@pytest.mark.parametrize("operation", ["get", "put", "put_if_absent", "list", "delete", "exists"])
def test_missing_bucket_is_a_clear_error(s3_endpoint, operation):
    from whetstone.store.s3 import S3Store

    store, arguments = S3Store("absent", endpoint_url=s3_endpoint), {"list": ()}.get(operation, ("k",))
    if operation.startswith("put"):
        arguments += (b"v",)
    with pytest.raises(WhetstoneError, match="bucket 'absent' does not exist"):
        getattr(store, operation)(*arguments)


READ_ONLY = [allow(["s3:GetObject", "s3:ListBucket"])]


@pytest.mark.parametrize("operation", ["put", "put_if_absent", "delete"])
def test_a_refused_write_is_an_access_error_naming_the_bucket_the_key_and_what_to_check(
    s3_endpoint, monkeypatch, operation
):
    from whetstone.store.s3 import S3Store

    prefix = f"test-{uuid.uuid4().hex}"
    S3Store("whetstone", prefix, endpoint_url=s3_endpoint).put("a/b", b"x")
    with s3_user(s3_endpoint, monkeypatch, READ_ONLY):
        store = S3Store("whetstone", prefix, endpoint_url=s3_endpoint)
        assert store.get("a/b") == b"x" and store.list() == ["a/b"] and store.exists("a/b")
        arguments = ("a/b", b"y") if operation.startswith("put") else ("a/b",)
        with pytest.raises(AccessDeniedError) as refused:
            getattr(store, operation)(*arguments)
    message = str(refused.value)
    assert f"s3://whetstone/{prefix}/a/b at {s3_endpoint} was refused (AccessDenied" in message
    assert "check the credentials" in message and "bucket policy allow s3:" in message
    assert (refused.value.bucket, refused.value.key) == ("whetstone", f"{prefix}/a/b")
    # what callers take for missing or damaged content is another thing
    assert isinstance(refused.value, PermissionError) and not isinstance(refused.value, WhetstoneError)


@pytest.mark.parametrize("operation", ["get", "exists", "list"])
def test_credentials_the_store_does_not_know_are_an_access_error(s3_endpoint, monkeypatch, operation):
    from whetstone.store.s3 import S3Store

    with s3_credentials(monkeypatch, "AKIAUNKNOWNUNKNOWN00", "not-a-secret"):
        store = S3Store("whetstone", "run", endpoint_url=s3_endpoint)
        with pytest.raises(AccessDeniedError, match=r"s3://whetstone/run/.* was refused .*check the credentials"):
            getattr(store, operation)(*(() if operation == "list" else ("k",)))


def test_no_credentials_at_all_are_an_access_error_saying_where_they_come_from(s3_endpoint, monkeypatch, tmp_path):
    import boto3

    from whetstone.store.s3 import S3Store

    for name in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask for
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    with pytest.raises(AccessDeniedError, match=r"no AWS credentials found for s3://whetstone/run/k .*AWS_PROFILE"):
        S3Store("whetstone", "run", endpoint_url=s3_endpoint).get("k")


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


@contextmanager
def s3_breaking_off(data: bytes, breaks: int):
    """An S3 endpoint (real HTTP) serving `data` for every GET, whose first `breaks` answers break
    off after 100 bytes of the body (a dropped connection); yields it and the paths asked for."""
    asked = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if len(asked) > breaks:
                self.wfile.write(data)
                return
            self.wfile.write(data[:100])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def placeholder_credentials(monkeypatch):
    """What boto3 signs requests with (the endpoints here accept any)."""
    for name, value in [
        ("AWS_ACCESS_KEY_ID", "local"),
        ("AWS_SECRET_ACCESS_KEY", "local"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ]:
        monkeypatch.setenv(name, value)


def test_an_s3_read_that_breaks_off_is_fetched_again(placeholder_credentials):
    from whetstone.store.s3 import S3Store

    data = bytes(range(256)) * 40
    with s3_breaking_off(data, breaks=1) as (endpoint, asked):
        assert S3Store("bucket", "run", endpoint_url=endpoint).get("batches/0.batch") == data
    assert asked == ["/bucket/run/batches/0.batch"] * 2


def test_an_s3_read_that_keeps_breaking_off_is_an_error_naming_the_object(placeholder_credentials, monkeypatch):
    from whetstone.store import s3

    monkeypatch.setattr(s3, "READ_RETRIES", 2)
    with s3_breaking_off(b"x" * 1000, breaks=2) as (endpoint, asked):
        with pytest.raises(
            ConnectionError, match=r"reading 'batches/0.batch' from s3://bucket/run/ .* broke off 2 times"
        ):
            s3.S3Store("bucket", "run", endpoint_url=endpoint).get("batches/0.batch")
    assert len(asked) == 2


def test_a_file_where_a_local_stores_folder_goes_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("not a folder")
    with pytest.raises(WhetstoneError, match=r"cannot make a store at .*notes.txt: a file is in the way"):
        LocalStore(tmp_path / "notes.txt")
    with pytest.raises(WhetstoneError, match=r"cannot make a store at .*notes.txt/weights: a file is in the path"):
        LocalStore(tmp_path / "notes.txt" / "weights")
