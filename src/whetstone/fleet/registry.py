"""The fleet registry: the inference servers that are up, as records in an object store (the
weight store's, so every machine that follows the weights can find it).

    registry = FleetRegistry(open_store("s3://bucket/weights"))
    with Announcer(registry, ServerRecord.new(url, cluster="eu"), heartbeat_s=2.0):
        ...                                           # the server runs, announced
    registry.live(stale_after_s=10.0)                 # what an orchestrator uses

Each server writes one small JSON record, `fleet/servers/<id>.json` (its URL, cluster label,
start and heartbeat times), when it starts and again every heartbeat, and deletes it when it
stops. A server that dies without deleting it is forgotten once its heartbeat is `stale_after_s`
old; its record is deleted by a reader once it is much older (`prune`, best-effort: a reader that
may not delete, or a failed delete, leaves it to be skipped as stale), or by a server that starts
at the same address once it is stale (a live server at the address makes that one's start fail).
Records are written with the store's atomic put: a reader sees a whole record or none; the
temporary file of a write whose server was killed mid-write is deleted by `prune` too.
Heartbeats are the writer's wall-clock times, so the machines' clocks must agree to well within
`stale_after_s` (NTP does): a record whose heartbeat is that far ahead of the reader's clock is
not taken either (it would keep a dead server live until the writer's time came), but logged.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING

from whetstone.errors import WhetstoneError
from whetstone.store import MissingObjectError, ObjectStore, open_store

if TYPE_CHECKING:
    from whetstone.fleet.config import FleetConfig
    from whetstone.sync import SyncConfig

log = logging.getLogger("whetstone.fleet")
PREFIX = "fleet/servers/"
"""Where the records live in the store (beside the weight store's `versions/` and `latest.json`)."""


@dataclass(frozen=True)
class ServerRecord:
    id: str
    """Unique per server process (a restarted server at the same URL is a new one)."""
    url: str
    """API root, e.g. http://10.0.0.5:8000/v1."""
    cluster: str
    started: float
    """Wall-clock time the server announced itself first."""
    heartbeat: float
    """Wall-clock time of the last rewrite."""
    rollout_slots: int = 0
    """Most rollouts it takes at once (`fleet.rollout_slots`; 0 = no limit)."""

    def __post_init__(self) -> None:
        """Refuse a record of the wrong types (a hand-edited one, another program's): its URL is
        a pool's key and its times are compared with the clock, so a record the pool cannot use
        must fail here, where the reader skips it, not in `live` or `prune`. Times must be
        finite: a heartbeat of Infinity would keep a dead server live for ever."""
        for name in ("id", "url", "cluster"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TypeError(f"{name} must be a non-empty string, not {value!r}")
        for name in ("started", "heartbeat"):
            value = getattr(self, name)
            try:
                seconds = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
            except OverflowError:  # an integer beyond a float's range
                seconds = math.inf
            if not math.isfinite(seconds):
                raise TypeError(f"{name} must be a finite number of seconds, not {value!r}")
            object.__setattr__(self, name, seconds)
        slots = self.rollout_slots
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise TypeError(f"rollout_slots must be a non-negative integer, not {slots!r}")

    @classmethod
    def from_json(cls, raw: bytes) -> ServerRecord:
        """The record stored as `raw`; fields it does not know (a newer writer's) are ignored.
        Raises ValueError or TypeError when it is not a whole, well-typed record."""
        value = json.loads(raw)
        if not isinstance(value, dict):
            raise TypeError(f"not a JSON object but {type(value).__name__}")
        known = {field.name for field in fields(cls)}
        return cls(**{name: item for name, item in value.items() if name in known})

    @classmethod
    def new(cls, url: str, cluster: str = "default", rollout_slots: int = 0) -> ServerRecord:
        now = time.time()
        return cls(uuid.uuid4().hex[:16], url, cluster, now, now, rollout_slots)

    @property
    def key(self) -> str:
        return f"{PREFIX}{self.id}.json"


class FleetRegistry:
    def __init__(self, objects: ObjectStore):
        self.objects = objects
        self._ahead: set[str] = set()
        """Ids of the records `live` found with a heartbeat ahead of the clock (each logged once)."""
        self._undeletable: set[str] = set()
        """Keys `prune` could not delete (each logged once, until a delete of it succeeds)."""
        self._unreadable: set[str] = set()
        """Keys the store refused to read (each logged once, until a read of it succeeds)."""
        self._temporaries_failed = False
        """Whether deleting the temporary files of killed writes failed at the last `prune` (logged once)."""

    def __repr__(self) -> str:
        return f"FleetRegistry({self.objects!r})"

    def announce(self, record: ServerRecord) -> None:
        """Write (or refresh) the server's record."""
        self.objects.put(record.key, json.dumps(asdict(record)).encode())

    def forget(self, record: ServerRecord) -> None:
        self.objects.delete(record.key)

    def records(self) -> list[ServerRecord]:
        """Every record in the store, fresh or not; one that vanished while listed is skipped, one
        that does not parse, or that the store refuses to read, is logged and skipped (it names no
        server that could be used)."""
        return [record for _, record in self._read()[0]]

    def keyed_records(self) -> list[tuple[str, ServerRecord]]:
        """`records`, each with the key it was read at (a hand-written record's name need not be its id)."""
        return self._read()[0]

    def _read(self) -> tuple[list[tuple[str, ServerRecord]], list[str]]:
        """The records that parse with their keys, and the keys of those that do not (each logged).

        A record the store fails to read (`OSError`: another user's file written with umask 077,
        an object this reader's credentials do not reach, a broken file) names no server this
        reader could use: it is skipped, logged once until it is read again, and not deleted (it
        may be a live server's). A failing listing raises, and so does a read failure other than a
        refusal (`PermissionError`) when no record could be read at all: that is the store failing
        (an outage), and an empty answer would drop every announced server from the pool."""
        records, unusable, failed = [], [], None
        keys = self.objects.list(PREFIX)
        self._unreadable.intersection_update(keys)  # a record gone is forgotten
        for key in keys:
            try:
                raw = self.objects.get(key)
            except MissingObjectError:
                continue
            except OSError as err:
                if not isinstance(err, PermissionError):
                    failed = failed or err
                if key not in self._unreadable:
                    self._unreadable.add(key)
                    log.warning("cannot read the fleet record %s in %r, skipping it: %s", key, self.objects, err)
                continue
            self._unreadable.discard(key)
            try:
                records.append((key, ServerRecord.from_json(raw)))
            except (ValueError, TypeError, RecursionError) as err:
                log.warning("ignoring fleet record %s in %r: %s", key, self.objects, err)
                unusable.append(key)
        if failed is not None and not records and not unusable:
            raise failed
        return records, unusable

    def live(self, stale_after_s: float, now: float | None = None) -> list[ServerRecord]:
        """The records whose heartbeat is within `stale_after_s` of `now`, one per URL (the
        newest). A heartbeat further ahead of `now` comes from a clock that is ahead of this
        one's: it is not taken (it would keep a dead server live until that clock's time came),
        and is logged once per record so that the clocks get fixed."""
        now = time.time() if now is None else now
        newest: dict[str, ServerRecord] = {}
        for record in self.records():
            if record.heartbeat - now >= stale_after_s:
                if record.id not in self._ahead:
                    self._ahead.add(record.id)
                    log.warning(
                        "ignoring the fleet record of %s: its heartbeat is %.0f s ahead of this machine's clock; "
                        "sync the machines' clocks (NTP)",
                        record.url,
                        record.heartbeat - now,
                    )
                continue
            if now - record.heartbeat < stale_after_s and record.heartbeat >= newest.get(record.url, record).heartbeat:
                newest[record.url] = record
        return sorted(newest.values(), key=lambda r: (r.cluster, r.url))

    def prune(self, forget_after_s: float, now: float | None = None) -> list[ServerRecord]:
        """Delete the records whose heartbeat is older than `forget_after_s` (servers that died
        without removing theirs), or as far ahead of `now` (a clock far off, or a hand-written
        time), and return those deleted; records that do not parse are deleted too (none could
        ever be used, and each would be logged at every read). Readers call it with a grace well
        beyond the staleness they skip records at, so a server cut off for a while can still come
        back.

        The temporary files that servers killed mid-write left (`ObjectStore.delete_temporaries`:
        a local store's, which no listing shows) are deleted once as old, by the real clock.

        Deleting is best-effort: a delete that fails (a store this reader may only read, an
        outage) is logged once per record and tried again at the next call, and the record stays
        (`live` skips it as stale). Only a failure to list the records, or to read any (`_read`), raises."""
        now = time.time() if now is None else now
        self._delete_temporaries(forget_after_s)
        records, unusable = self._read()
        for key in unusable:
            if self._delete(key):
                log.info("removed the fleet record %s: it does not parse", key)
        old = [(key, record) for key, record in records if abs(now - record.heartbeat) >= forget_after_s]
        deleted = []
        for key, record in old:
            if not self._delete(key):  # where it was read: a hand-written record's name need not be its id
                continue
            deleted.append(record)
            if record.heartbeat > now:
                log.warning(
                    "removed the fleet record of %s: its heartbeat is %.0f s ahead of this machine's clock",
                    record.url,
                    record.heartbeat - now,
                )
            else:
                log.info("removed the fleet record of %s (silent for %.0f s)", record.url, now - record.heartbeat)
        return deleted

    def _delete_temporaries(self, older_than_s: float) -> None:
        """Delete the temporary files of record writes untouched for `older_than_s`; a failure is
        logged (once until a call succeeds), not raised."""
        try:
            deleted = self.objects.delete_temporaries(PREFIX, older_than_s)
        except Exception as err:  # read-only access, an outage: they are only left
            if not self._temporaries_failed:
                self._temporaries_failed = True
                log.warning("could not delete the temporary files in %s of %r: %s", PREFIX, self.objects, err)
            return
        self._temporaries_failed = False
        for key in deleted:
            log.info("removed %s: the temporary file of a record write whose server was killed", key)

    def _delete(self, key: str) -> bool:
        """Delete the record at `key`; False, logged once per key, if the store refuses or fails."""
        try:
            self.objects.delete(key)
        except Exception as err:  # read-only credentials, a store outage: the record is only skipped
            if key not in self._undeletable:
                self._undeletable.add(key)
                log.warning(
                    "could not delete the fleet record %s in %r (%s): readers skip it, and deleting it is tried "
                    "again at each look; give this reader delete access to %s to remove such records",
                    key,
                    self.objects,
                    err,
                    PREFIX,
                )
            return False
        self._undeletable.discard(key)
        return True


STALE_HEARTBEATS = 5
"""Heartbeats a record at its URL may miss before a starting server takes it for a dead one's
(`Announcer.stale_after_s`): the orchestrator's default timeout (10 s) of the default heartbeat (2 s)."""

STOP_TIMEOUT_S = 5.0
"""Longest `Announcer.stop` waits for the store: ample for a heartbeat write and the final delete
in a healthy store (milliseconds, a second or two with a retry), and well within the grace a
scheduler gives a stopping process (30 s in Kubernetes and SLURM) before it kills it."""


class Announcer:
    """Keeps one server's record fresh from a thread while it runs, and deletes it on `stop`. A
    failed write (a store outage) is logged and tried again at the next heartbeat.

    The final delete runs on the heartbeat thread after its last write, so no heartbeat lands
    after it. `stop` waits for it at most `stop_timeout_s`: in a store outage a write can sit in
    the S3 client's retries for minutes, and a server's shutdown must not; the thread is a daemon,
    and a record it leaves behind goes stale and is pruned by readers.

    `start` deletes the records of other servers at the same URL that are dead ones' (a server
    killed, or cut off from the store, could not delete its own), and fails if one is live: two
    servers cannot share a URL (a copied `fleet.url`, a restart while the old process still runs).
    A record is a dead one's once its heartbeat is `stale_after_s` old, or not rewritten for
    `stale_after_s` while `start` watches it (a server killed and restarted at once finds its old
    record fresh, and waits that long); one that is rewritten meanwhile is a live server's. The
    judgment assumes the servers of a fleet beat alike: a live server whose heartbeat is much
    slower than `stale_after_s`, or whose writes stall that long, is taken for a dead one."""

    def __init__(
        self,
        registry: FleetRegistry,
        record: ServerRecord,
        heartbeat_s: float = 2.0,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        stale_after_s: float | None = None,
    ):
        self.registry, self.record, self.heartbeat_s = registry, record, heartbeat_s
        self.stop_timeout_s = stop_timeout_s
        self.stale_after_s = STALE_HEARTBEATS * heartbeat_s if stale_after_s is None else stale_after_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Announcer:
        """Write the record and keep it fresh, then take the URL over from dead servers' records
        (`WhetstoneError`, with this server's record deleted again, if a live server holds it).
        Refused while its heartbeat thread still runs: started already, or a `stop` that timed out
        (its thread would delete the record this start writes)."""
        if self._thread is not None and self._thread.is_alive():
            state = "still stopping (the store did not answer)" if self._stop.is_set() else "started already"
            raise WhetstoneError(f"the fleet announcer of {self.record.url} is {state}: it cannot start again now")
        self.registry.announce(self.record)  # the first write fails loudly: a wrong store is a config error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name="fleet-heartbeat", daemon=True)
        self._thread.start()  # beating during the watch below: a server starting at once at the URL sees this one live
        try:
            self._take_url()
        except BaseException:
            self.stop()
            raise
        log.info("announced %s (cluster %s) in %r", self.record.url, self.record.cluster, self.registry)
        return self

    def _take_url(self) -> None:
        """Delete the records of other servers at this URL once they are dead ones'; raise if one is rewritten."""
        watched: dict[str, tuple[float, float]] = {}  # key -> heartbeat when first read, monotonic time then
        while True:
            waiting = False
            for key, record in self.registry.keyed_records():
                if record.url != self.record.url or record.id == self.record.id:
                    continue
                heartbeat, since = watched.setdefault(key, (record.heartbeat, time.monotonic()))
                if record.heartbeat != heartbeat:
                    raise WhetstoneError(
                        f"cannot announce {self.record.url}: another server announces it in {self.registry!r} "
                        f"(its record {key}, cluster {record.cluster}, is rewritten: it is live); give each server "
                        "its own address (fleet.url, or host and port), or stop the other one first"
                    )
                silent = max(time.time() - record.heartbeat, time.monotonic() - since)
                if silent < self.stale_after_s:
                    waiting = True
                    continue
                self.registry.objects.delete(key)
                log.info("removed the fleet record %s of a server no longer at %s", key, self.record.url)
            if not waiting:
                return
            time.sleep(min(self.heartbeat_s, self.stale_after_s) / 2)

    def stop(self) -> None:
        """Stop the heartbeat and delete the record, waiting at most `stop_timeout_s` for the store."""
        self._stop.set()
        thread = self._thread
        if thread is None:
            return
        thread.join(self.stop_timeout_s)
        if not thread.is_alive():
            self._thread = None
        else:  # kept: a start meanwhile is refused
            log.warning(
                "the fleet registry %r did not answer within %g s: stopping without removing %s "
                "(its record goes stale, and orchestrators drop it after their heartbeat timeout)",
                self.registry,
                self.stop_timeout_s,
                self.record.url,
            )

    def __enter__(self) -> Announcer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, stopping: threading.Event) -> None:
        while not stopping.wait(self.heartbeat_s):
            self.record = replace(self.record, heartbeat=time.time())
            try:
                self.registry.announce(self.record)
            except Exception as err:  # the thread must outlive a store outage
                log.warning("fleet heartbeat of %s failed: %s", self.record.url, err)
        try:
            self.registry.forget(self.record)
        except Exception as err:  # a store outage: the record goes stale instead
            log.warning("could not remove %s from the fleet registry: %s", self.record.url, err)


def fleet_announcer(fleet: FleetConfig, host: str, port: int, sync: SyncConfig | None) -> Announcer | None:
    """What keeps a server's record in the fleet registry while it runs, from its `FleetConfig`
    (None unless `fleet.announce`): the registry is `fleet.registry`, else the weight store the
    server follows (`sync`, at its endpoint either way); the record's URL is
    `advertised_url(host, port, fleet.url)`. Both `whetstone serve` and the vLLM server of
    `integrations.vllm_serve` announce themselves so."""
    if not fleet.announce:
        return None
    if sync is None:  # the servers' configs refuse it
        raise ValueError("a server announces itself only where it follows the weights (sync)")
    registry = FleetRegistry(open_store(fleet.registry or sync.store, endpoint_url=sync.endpoint_url, create=False))
    record = ServerRecord.new(advertised_url(host, port, fleet.url), fleet.cluster, fleet.rollout_slots)
    return Announcer(registry, record, fleet.heartbeat_s)


def advertised_url(host: str, port: int, url: str = "") -> str:
    """The API root a server announces: `url` if given, else its host and port, with this
    machine's address in place of a wildcard host."""
    if url:
        return url
    if host in ("0.0.0.0", "::", ""):
        host = _this_machines_address()
    return api_root(host, port)


def _this_machines_address() -> str:
    """The address other machines reach this one at: its hostname's, unless that is a loopback
    one (Debian and Ubuntu map the hostname to 127.0.1.1) or does not resolve; then that of the
    interface its traffic leaves by. Loopback only where it has no other (logged: only servers
    and orchestrators on this machine can use it)."""
    try:
        named = socket.gethostbyname(socket.gethostname())
    except OSError:
        named = None
    if named is not None and not ipaddress.ip_address(named).is_loopback:
        return named
    routed = _routed_address()
    if routed is not None and not ipaddress.ip_address(routed).is_loopback:
        return routed
    address = named or "127.0.0.1"
    log.warning(
        "announcing this server at the loopback address %s (this machine has no other): only orchestrators "
        "on this machine can reach it; set fleet.url to the address others reach it at",
        address,
    )
    return address


def _routed_address() -> str | None:
    """The local address of the interface a packet to another network would leave by (None if
    there is no route): a UDP socket's connect picks it, and sends nothing."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1 (RFC 5737): any address beyond the local networks
            return probe.getsockname()[0]
    except OSError:
        return None


def api_root(host: str, port: int) -> str:
    """`http://HOST:PORT/v1`, an IPv6 address in brackets (`http://[fd00::5]:8000/v1`): without
    them the address's colons would read as the port's."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/v1"
