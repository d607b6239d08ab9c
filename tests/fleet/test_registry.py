"""The fleet registry on a real object store (a local directory): records, staleness, heartbeats."""

import asyncio
import json
import threading
import time

import httpx
import pytest

from whetstone.envs.harness.config import EndpointConfig
from whetstone.envs.harness.pool import ServerPool
from whetstone.errors import WhetstoneError
from whetstone.fleet import Announcer, FleetConfig, FleetRegistry, ServerRecord
from whetstone.fleet.registry import advertised_url
from whetstone.inference.config import ServeConfig
from whetstone.store import LocalStore
from whetstone.sync import SyncConfig


@pytest.fixture
def registry(tmp_path):
    return FleetRegistry(LocalStore(tmp_path / "weights"))


def test_announced_servers_are_listed_until_forgotten(registry):
    eu, us = ServerRecord.new("http://10.0.0.1:8000/v1", "eu"), ServerRecord.new("http://10.0.0.2:8000/v1", "us")
    registry.announce(eu), registry.announce(us)
    assert [(r.url, r.cluster) for r in registry.live(stale_after_s=10)] == [(eu.url, "eu"), (us.url, "us")]
    registry.forget(eu)
    assert registry.live(stale_after_s=10) == [us]
    assert registry.objects.list("versions/") == []  # beside the weight versions, not among them


def test_a_server_whose_heartbeat_is_stale_is_forgotten(registry):
    record = ServerRecord.new("http://10.0.0.1:8000/v1")
    registry.announce(record)
    assert registry.live(stale_after_s=10, now=record.heartbeat + 9.9) == [record]
    assert registry.live(stale_after_s=10, now=record.heartbeat + 10.0) == []
    assert registry.records() == [record]  # still in the store: only readers decide it is stale


def test_a_restarted_server_at_the_same_address_counts_once_with_its_newest_record(registry):
    old = ServerRecord("a", "http://10.0.0.1:8000/v1", "eu", 100.0, 100.0)
    new = ServerRecord("b", "http://10.0.0.1:8000/v1", "eu", 105.0, 106.0)
    registry.announce(new), registry.announce(old)
    assert registry.live(stale_after_s=10, now=107.0) == [new]


def test_a_record_that_does_not_parse_is_skipped(registry, caplog):
    registry.objects.put("fleet/servers/junk.json", b"{not json")
    registry.objects.put("fleet/servers/other.json", json.dumps({"url": "x"}).encode())
    record = ServerRecord.new("http://10.0.0.1:8000/v1")
    registry.announce(record)
    assert registry.live(stale_after_s=10) == [record]
    assert "fleet/servers/junk.json" in caplog.text and "fleet/servers/other.json" in caplog.text


WRONG_TYPES = {
    "heartbeat as text": {"heartbeat": "2025-01-01T00:00:00Z"},
    "heartbeat null": {"heartbeat": None},
    "url a list": {"url": ["http://x/v1"]},
    "empty url": {"url": ""},
    "started true": {"started": True},
    "slots negative": {"rollout_slots": -1},
    "slots as text": {"rollout_slots": "2"},
    "heartbeat beyond a float": {"heartbeat": 10**400},  # float() overflows rather than giving inf
}


@pytest.mark.parametrize("wrong", WRONG_TYPES.values(), ids=WRONG_TYPES.keys())
def test_a_record_of_the_wrong_types_is_skipped_and_deleted_by_a_reader(registry, wrong):
    fields = {"id": "odd", "url": "http://odd/v1", "cluster": "c", "started": 0, "heartbeat": time.time()}
    registry.objects.put("fleet/servers/odd.json", json.dumps(fields | wrong).encode())
    good = ServerRecord.new("http://10.0.0.1:8000/v1")
    registry.announce(good)
    assert registry.live(stale_after_s=10) == [good] and registry.records() == [good]
    assert registry.prune(forget_after_s=300) == []
    assert registry.objects.list("fleet/servers/") == [good.key]  # it could never name a usable server


def test_a_heartbeat_that_is_not_finite_never_keeps_a_record_live(registry):
    for heartbeat in (b"Infinity", b"NaN", b"1e999"):  # json.loads takes them all
        registry.objects.put(
            "fleet/servers/dead.json",
            b'{"id": "dead", "url": "http://dead/v1", "cluster": "c", "started": 0, "heartbeat": ' + heartbeat + b"}",
        )
        assert registry.live(stale_after_s=10, now=time.time() + 1e9) == []
        registry.prune(forget_after_s=300)
        assert registry.objects.list("fleet/servers/") == []


def test_a_heartbeat_ahead_of_the_readers_clock_does_not_keep_a_dead_server_live(registry, caplog):
    """A server whose clock is ahead (or a hand-written time) died: its record must not be live
    until that time comes, and is deleted once it is as far ahead as a silent one is old."""
    ahead = ServerRecord("ahead", "http://10.0.0.1:8000/v1", "eu", 0.0, 1000.0)
    slightly = ServerRecord("slightly", "http://10.0.0.2:8000/v1", "eu", 0.0, 400.5)  # within the tolerance
    registry.announce(ahead), registry.announce(slightly)
    assert registry.live(stale_after_s=10, now=400.0) == [slightly]
    assert registry.live(stale_after_s=10, now=400.0) == [slightly]
    assert caplog.text.count("ahead of this machine's clock") == 1  # logged once per record
    assert registry.prune(forget_after_s=300, now=400.0) == [ahead]
    assert registry.records() == [slightly]


def test_fields_a_newer_writer_adds_are_ignored(registry):
    record = ServerRecord.new("http://10.0.0.1:8000/v1")
    registry.objects.put(record.key, json.dumps({**record.__dict__, "gpu": "h100"}).encode())
    assert registry.live(stale_after_s=10) == [record]


def test_a_malformed_record_does_not_freeze_the_pools_discovery(registry):
    """A registry read that raises reads as a store outage to the pool (servers kept as they
    are): one bad record must not stop servers joining and leaving."""

    async def scenario():
        first = ServerRecord.new("http://10.0.0.1:8000/v1")
        registry.announce(first)
        pool = ServerPool([], EndpointConfig(), registry=registry)
        await pool.discover()
        odd = {"id": "odd", "url": "http://odd/v1", "cluster": "c", "started": 0, "heartbeat": "0"}
        registry.objects.put("fleet/servers/odd.json", json.dumps(odd).encode())
        registry.forget(first)
        second = ServerRecord.new("http://10.0.0.2:8000/v1")
        registry.announce(second)
        await pool.discover()
        assert [server.url for server in pool.servers] == [second.url]
        await pool.close()

    asyncio.run(scenario())


def test_the_announcer_keeps_the_heartbeat_fresh_and_removes_the_record_on_stop(registry):
    record = ServerRecord.new("http://10.0.0.1:8000/v1", "eu")
    with Announcer(registry, record, heartbeat_s=0.05) as announcer:
        assert registry.records() == [record]  # written before start returns
        deadline = time.monotonic() + 30
        while registry.records()[0].heartbeat == record.heartbeat:
            assert time.monotonic() < deadline, "the heartbeat was never refreshed"
            time.sleep(0.02)
        assert announcer.record.started == record.started and announcer.record.id == record.id
    assert registry.records() == []


def test_announcing_needs_a_weight_store_and_a_plain_cluster_label():
    with pytest.raises(ValueError, match="fleet.announce needs a \\[sync\\] section"):
        ServeConfig(fleet=FleetConfig(announce=True))
    with pytest.raises(ValueError, match="cluster"):
        FleetConfig(cluster="eu west")
    assert ServeConfig(sync=SyncConfig(store="w"), fleet=FleetConfig(announce=True)).fleet.cluster == "default"


def test_records_silent_past_the_grace_are_deleted_by_a_reader(registry):
    gone = ServerRecord("a", "http://10.0.0.1:8000/v1", "eu", 100.0, 100.0)
    cut_off = ServerRecord("b", "http://10.0.0.2:8000/v1", "eu", 100.0, 350.0)
    registry.announce(gone), registry.announce(cut_off)
    assert registry.prune(forget_after_s=300, now=400.0) == [gone]
    assert registry.records() == [cut_off]  # stale for `live`, but kept: it may come back


def test_a_server_starting_at_a_dead_ones_address_replaces_its_record(registry):
    dead = ServerRecord("a", "http://10.0.0.1:8000/v1", "eu", 100.0, 100.0)
    other = ServerRecord("b", "http://10.0.0.2:8000/v1", "eu", 100.0, 100.0)
    registry.announce(dead), registry.announce(other)
    successor = ServerRecord.new(dead.url, "eu")
    with Announcer(registry, successor, heartbeat_s=60):
        assert sorted(r.id for r in registry.records()) == sorted([successor.id, other.id])


class ReadOnlyStore(LocalStore):
    """A store this reader may only read, as an orchestrator's read-only S3 credentials: every
    delete is refused (a plain file mode would not stop root)."""

    def delete(self, key: str) -> None:
        raise PermissionError(f"Access Denied: DeleteObject {key}")


def test_a_registry_the_reader_may_not_delete_from_is_still_read(tmp_path, caplog):
    """Pruning is housekeeping: a refused delete leaves the dead record (skipped as stale), is
    logged once per record, and servers still join and leave at every look."""
    registry = FleetRegistry(ReadOnlyStore(tmp_path / "weights"))
    dead = ServerRecord("dead", "http://10.0.0.9:8000/v1", "eu", 0.0, 0.0)
    first = ServerRecord.new("http://10.0.0.1:8000/v1")
    registry.announce(dead), registry.announce(first)
    registry.objects.put("fleet/servers/junk.json", b"{not json")
    assert registry.prune(forget_after_s=300) == []  # nothing could be deleted, nothing raised
    assert sorted(r.id for r in registry.records()) == sorted([dead.id, first.id])

    async def scenario():
        pool = ServerPool([], EndpointConfig(), registry=registry)
        await pool.discover()
        assert [server.url for server in pool.servers] == [first.url]
        LocalStore.delete(registry.objects, first.key)  # the server stopped and removed its own record
        second = ServerRecord.new("http://10.0.0.2:8000/v1")
        registry.announce(second)
        await pool.discover()
        assert [server.url for server in pool.servers] == [second.url]
        await pool.close()

    asyncio.run(scenario())
    for key in (dead.key, "fleet/servers/junk.json"):  # refused at three looks, logged at the first
        assert caplog.text.count(f"could not delete the fleet record {key} ") == 1
    assert "reading the fleet registry" not in caplog.text


def deny_reading(registry, monkeypatch, *keys: str, error=PermissionError) -> None:
    """Make the store fail to read `keys`: by default refuse them, as a local store refuses a
    record another user wrote with umask 077 (the tests run as root, whom file modes do not stop)."""
    get = registry.objects.get

    def refusing(key: str) -> bytes:
        if key in keys:
            raise error(f"cannot read {key}")
        return get(key)

    monkeypatch.setattr(registry.objects, "get", refusing)


def test_a_record_the_reader_may_not_read_is_skipped_and_logged_once(registry, monkeypatch, caplog):
    """It names no server this reader could use; the others are still read, listed and pruned,
    and it is not deleted (it may be a live server's)."""
    hidden, good = ServerRecord.new("http://10.0.0.9:8000/v1"), ServerRecord.new("http://10.0.0.1:8000/v1")
    dead = ServerRecord("dead", "http://10.0.0.8:8000/v1", "eu", 0.0, 0.0)
    for record in (hidden, good, dead):
        registry.announce(record)
    deny_reading(registry, monkeypatch, hidden.key)
    for _ in range(2):
        assert registry.live(stale_after_s=10) == [good]
    assert sorted(r.id for r in registry.records()) == sorted([good.id, dead.id])
    assert registry.prune(forget_after_s=300) == [dead]
    assert sorted(registry.objects.list("fleet/servers/")) == sorted([hidden.key, good.key])
    assert caplog.text.count(f"cannot read the fleet record {hidden.key} ") == 1


def test_a_registry_whose_listing_or_every_read_fails_raises(registry, monkeypatch):
    """A store that fails the listing, or every read but by refusing it (an outage), is failing
    as a whole: the pool keeps its servers as they are rather than read an empty registry. Only
    records refused to this reader read as none."""
    record = ServerRecord.new("http://10.0.0.1:8000/v1")
    registry.announce(record)
    deny_reading(registry, monkeypatch, record.key)
    assert registry.live(stale_after_s=10) == [] and registry.prune(forget_after_s=0) == []
    deny_reading(registry, monkeypatch, record.key, error=ConnectionError)
    with pytest.raises(ConnectionError, match=f"cannot read {record.key}"):
        registry.live(stale_after_s=10)
    monkeypatch.undo()
    assert registry.live(stale_after_s=10) == [record]

    def refused(prefix: str = "") -> list[str]:
        raise PermissionError(f"cannot list {prefix}")

    monkeypatch.setattr(registry.objects, "list", refused)
    with pytest.raises(PermissionError, match="cannot list fleet/servers/"):
        registry.live(stale_after_s=10)


def test_an_unreadable_record_does_not_freeze_the_pools_discovery(registry, monkeypatch):
    """Servers still join and leave the pool while a record cannot be read, the last one too."""

    async def scenario():
        first = ServerRecord.new("http://10.0.0.1:8000/v1")
        registry.announce(first)
        pool = ServerPool([], EndpointConfig(), registry=registry)
        await pool.discover()
        hidden = ServerRecord.new("http://10.0.0.9:8000/v1")
        registry.announce(hidden)
        deny_reading(registry, monkeypatch, hidden.key)
        registry.forget(first)
        second = ServerRecord.new("http://10.0.0.2:8000/v1")
        registry.announce(second)
        await pool.discover()
        assert [server.url for server in pool.servers] == [second.url]
        registry.forget(second)  # the unreadable record is the only one left
        await pool.discover()
        assert pool.servers == []
        await pool.close()

    asyncio.run(scenario())


class StallingStore(LocalStore):
    """A store whose writes and deletes hang once `stall` is set, until `release` is: a store
    outage as boto3 meets it, retrying for minutes."""

    def __init__(self, root):
        super().__init__(root)
        self.stall, self.stalled, self.release = threading.Event(), threading.Event(), threading.Event()

    def _wait_if_stalled(self) -> None:
        if self.stall.is_set():
            self.stalled.set()
            self.release.wait()

    def put(self, key: str, data: bytes) -> None:
        self._wait_if_stalled()
        super().put(key, data)

    def delete(self, key: str) -> None:
        self._wait_if_stalled()
        super().delete(key)


def test_stopping_the_announcer_in_a_store_outage_waits_no_longer_than_its_bound(tmp_path, caplog):
    store = StallingStore(tmp_path / "weights")
    registry = FleetRegistry(store)
    announcer = Announcer(registry, ServerRecord.new("http://10.0.0.1:8000/v1"), heartbeat_s=0.01, stop_timeout_s=0.1)
    announcer.start()
    try:
        store.stall.set()
        assert store.stalled.wait(30), "the heartbeat never reached the store"
        stopping = threading.Thread(target=announcer.stop, daemon=True)
        stopping.start()
        stopping.join(30)  # the store answers nothing until released: only the bound can end `stop`
        assert not stopping.is_alive(), "stop waited for the stalled store"
        assert "did not answer within 0.1 s: stopping without removing http://10.0.0.1:8000/v1" in caplog.text
    finally:
        store.release.set()
    deadline = time.monotonic() + 30
    while registry.records():  # the store back: the heartbeat thread's last write, then the delete
        assert time.monotonic() < deadline, "the record was never removed"
        time.sleep(0.02)


def test_an_ipv6_address_is_announced_in_brackets():
    url = httpx.URL(advertised_url("fd00::5", 8000))
    assert (url.host, url.port, url.path) == ("fd00::5", 8000, "/v1")
    assert advertised_url("10.0.0.7", 8000) == "http://10.0.0.7:8000/v1"


def test_a_second_server_at_a_live_ones_address_is_refused_and_leaves_its_record(registry):
    """Two servers announcing one URL (a copied `fleet.url`, a restart while the old process
    still runs): the newcomer must not delete the live one's record, but fail naming the URL."""
    url = "http://10.0.0.1:8000/v1"
    live = Announcer(registry, ServerRecord.new(url), heartbeat_s=0.05).start()
    try:
        second = Announcer(registry, ServerRecord.new(url), heartbeat_s=0.05, stale_after_s=30)
        with pytest.raises(WhetstoneError, match=f"cannot announce {url}: another server announces it"):
            second.start()
        assert [r.id for r in registry.records()] == [live.record.id]  # its own record removed again
    finally:
        live.stop()
    assert registry.records() == []


def test_a_fresh_record_of_a_killed_server_at_the_address_is_replaced_once_it_stays_silent(registry):
    """A server killed and restarted at once finds its old record still fresh: it is taken for a
    dead one's (and deleted) when its heartbeat is not rewritten within `stale_after_s`."""
    url = "http://10.0.0.1:8000/v1"
    started = time.monotonic()  # before the record's heartbeat, which its age counts from
    killed = ServerRecord.new(url)
    registry.announce(killed)
    successor = ServerRecord.new(url)
    with Announcer(registry, successor, heartbeat_s=0.05, stale_after_s=0.3):
        assert time.monotonic() - started >= 0.3
        assert [r.id for r in registry.records()] == [successor.id]


def test_a_record_at_the_address_saved_under_another_name_is_the_one_deleted(registry):
    dead = ServerRecord("dead", "http://10.0.0.1:8000/v1", "eu", 100.0, 100.0)
    registry.objects.put("fleet/servers/hand-written.json", json.dumps(dead.__dict__).encode())
    with Announcer(registry, ServerRecord.new(dead.url), heartbeat_s=60) as announcer:
        assert registry.objects.list("fleet/servers/") == [announcer.record.key]


def test_an_announcer_started_again_after_stop_keeps_its_record(registry):
    announcer = Announcer(registry, ServerRecord.new("http://10.0.0.1:8000/v1"), heartbeat_s=0.02)
    with announcer:
        pass
    assert registry.records() == []
    with announcer:
        time.sleep(0.2)  # heartbeats
        assert [r.id for r in registry.records()] == [announcer.record.id]
    assert registry.records() == []


def test_an_announcer_is_not_started_twice_nor_while_its_stop_is_still_under_way(registry, monkeypatch):
    # a second heartbeat thread would outlive `stop`; a thread still stopping would delete the
    # record of the start after it
    announcer = Announcer(registry, ServerRecord.new("http://10.0.0.1:8000/v1"), heartbeat_s=0.02)
    with announcer:
        with pytest.raises(WhetstoneError, match="announcer of http://10.0.0.1:8000/v1 is started already"):
            announcer.start()
    release = threading.Event()
    forget = registry.forget
    monkeypatch.setattr(registry, "forget", lambda record: (release.wait(30), forget(record)))
    announcer.stop_timeout_s = 0.05
    announcer.start()
    announcer.stop()  # its final delete hangs: the store does not answer
    with pytest.raises(WhetstoneError, match="is still stopping"):
        announcer.start()
    release.set()
    announcer._thread.join(5)
    with announcer:
        assert [r.id for r in registry.records()] == [announcer.record.id]
    assert registry.records() == []


def test_temporary_files_of_heartbeats_killed_mid_write_are_removed_by_a_reader(registry, caplog):
    """A server killed during a heartbeat leaves the atomic write's temporary file: readers skip
    it, and `prune` deletes it once it is as old as a record it would forget."""
    import logging
    import os

    caplog.set_level(logging.INFO, "whetstone.fleet")
    record = ServerRecord.new("http://10.0.0.1:8000/v1")
    registry.announce(record)
    folder = registry.objects.root / "fleet" / "servers"
    killed, writing = folder / ".0123456789abcdef.json.k1ll3d.tmp", folder / f".{record.id}.json.w0rk1n.tmp"
    killed.write_bytes(b'{"id": "0123'), writing.write_bytes(b"{")
    os.utime(killed, (time.time() - 301, time.time() - 301))
    assert registry.live(stale_after_s=10) == [record]
    assert registry.prune(forget_after_s=300) == []
    assert sorted(p.name for p in folder.iterdir()) == [writing.name, record.key.rpartition("/")[2]]
    assert f"fleet/servers/{killed.name}" in caplog.text


def test_a_wildcard_host_is_announced_at_an_address_others_reach_not_a_loopback_one(monkeypatch):
    """Debian's /etc/hosts maps the hostname to 127.0.1.1: a server on 0.0.0.0 must not announce
    that (other machines would call themselves), but the address its traffic leaves by."""
    import socket

    from whetstone.fleet import registry as module

    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(module, "_routed_address", lambda: "10.0.0.7")
    assert advertised_url("0.0.0.0", 8000) == "http://10.0.0.7:8000/v1"

    def unresolvable(name):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "gethostbyname", unresolvable)
    assert advertised_url("::", 8000) == "http://10.0.0.7:8000/v1"
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.0.0.5")
    assert advertised_url("0.0.0.0", 8000) == "http://10.0.0.5:8000/v1"
