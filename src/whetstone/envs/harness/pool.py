"""A pool of inference servers behind one `Policy` per rollout: least-loaded dispatch among the
current servers, a dead server taken out (the call it lost re-run on another), a restarted one
taken back when healthy.

    pool = await ServerPool.connect(config.servers, config.endpoint)
    async with pool.lease(harness.context_tokens) as policy:   # the least-loaded current live server
        trajectory = await rollout(task, policy, harness, rollout_config)     # that holds the window
    await pool.close()

A rollout sticks to its server (its context stays in that server's cache), and moves only when
the server dies. The harness keeps the context as token ids, so any server can continue it:
the lost call is sent again elsewhere, the tokens sampled before stay with their versions, and
no rollout is lost to a server failure. A call that fails while its server is healthy (a bad
request) is the rollout's own failure and is not retried.

In a fleet of servers with different context limits, a rollout leased for a window
(`harness.context_tokens`) goes only to a server whose limit holds it; a window larger than
every server's limit is one configuration error, not a failure of each rollout.

A server that is up but behind (its /health says "weights stale", or its weight version is older
than `min_version`) gets new rollouts only while no current server has room: their samples would
mostly be dropped as too stale, but a fleet that is all behind still serves. Its rollouts in
flight stay on it, and it is preferred again once its health check shows it caught up.

With a fleet registry (`whetstone.fleet`), the pool also takes the servers announced there: a new
one joins at the next health round (`health_interval_s`) once it holds a useful weight version,
and one that leaves the registry (stopped, or its heartbeat stale) is taken out, its rollouts
moving as from a dead server. Every health round also probes every live server, refreshing its
version and whether it is behind; an idle one that stops answering is taken out at once (a busy
one shows its death by failing its calls). Records silent for `forget_after_s` are deleted. Each
server has its cluster label; `cluster_stats` reports rollouts/s and weight version lag per cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

from whetstone.envs.harness.config import EndpointConfig
from whetstone.envs.harness.policy import Completion, HttpPolicy, Policy, PolicyError, Sampling
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.fleet import FleetRegistry

log = logging.getLogger("whetstone.pool")
HEALTH_TIMEOUT_S = 5.0
STALE_WEIGHTS = "weights stale"
"""The /health status (with a 503) of a whetstone server that is up but cannot take the weight
store's newest version (`inference/server.py`)."""


@dataclass
class Server:
    url: str
    policy: HttpPolicy | None = None
    """The client while the server is in the pool; None while it is out."""
    leases: int = 0
    """Rollouts currently on this server (the load that dispatch balances)."""
    calls: int = 0
    active_calls: int = 0
    """Requests on their way (a server with none is idle)."""
    failures: int = 0
    """Times the server was found dead and taken out."""
    problem: str = "not checked yet"
    """Why the server is out of the pool (empty while it is in)."""
    cluster: str = "default"
    """Cluster label (from the fleet registry; `default` for a server it does not list)."""
    announced: bool = False
    """Found in the fleet registry (dropped when it leaves it), not given by address."""
    version: int | None = None
    """Weight version it reported at its last health check (None: never reported one)."""
    rollout_slots: int = 0
    """Most rollouts leased to it at once (from its fleet record; 0 = no limit)."""
    behind: str = ""
    """Why it was behind at its last health check ("weights stale", or a version older than the
    pool's `min_version`); empty while current. A behind server gets new rollouts last."""
    context_limit: int | None = None
    """Longest prompt + completion it accepts, as it reported when it last joined (None: unknown)."""

    @property
    def has_room(self) -> bool:
        return not self.rollout_slots or self.leases < self.rollout_slots

    @property
    def alive(self) -> bool:
        return self.policy is not None

    @property
    def health_url(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1") + "/health"


class ServerPool:
    def __init__(
        self,
        urls: list[str],
        endpoint: EndpointConfig,
        health_interval_s: float = 2.0,
        no_server_timeout_s: float = 600.0,
        min_version: Callable[[], int | None] = lambda: None,
        registry: FleetRegistry | None = None,
        stale_after_s: float = 10.0,
        forget_after_s: float = 300.0,
    ):
        self._numbers: dict[str, int] = {}
        """Each address's number in the `stats` keys (`server<n>_calls`), given when the pool
        first sees it and kept for the pool's life: a server leaving shifts no other's numbers."""
        self._counts_left: dict[str, tuple[int, int]] = {}
        """The calls and failures of the servers that left the registry, by address: one that
        comes back goes on counting under its number."""
        self.servers = [self._server(url) for url in urls]
        self.endpoint = endpoint
        self.health_interval_s = health_interval_s
        self.no_server_timeout_s = no_server_timeout_s
        self.min_version = min_version
        """Weight version a server must hold to be taken back (older ones would make only stale samples)."""
        self._changed = asyncio.Event()
        self._probe = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S)
        self._watcher: asyncio.Task | None = None
        self._retired: list[HttpPolicy] = []
        """Clients of servers taken out, closed at the first health round after the last call
        still unwinding on them ends (and at the latest when the pool closes)."""
        self._calls_on: Counter[HttpPolicy] = Counter()
        """Calls in flight on each client."""
        self.calls_rerun = 0
        self.registry = registry
        """Where servers announce themselves (None: only the servers given by address)."""
        self.stale_after_s = stale_after_s
        """An announced server whose heartbeat is this old is forgotten."""
        self.forget_after_s = forget_after_s
        """A record whose heartbeat is this old is deleted from the registry."""
        self.rollouts: Counter[str] = Counter()
        """Rollouts finished, by cluster."""
        self.clusters = {server.cluster for server in self.servers}
        """Every cluster a server of the pool had (one whose servers are all gone reports 0 of them)."""
        self._stats_at, self._rollouts_then = time.monotonic(), Counter()
        self._policy_class = HttpPolicy
        if endpoint.engine == "vllm":
            from whetstone.integrations.vllm import VllmPolicy

            self._policy_class = VllmPolicy

    def _server(self, url: str, **fields) -> Server:
        """A new `Server` at `url`, numbered for `stats` (its old number and counts if it was here before)."""
        self._numbers.setdefault(url, len(self._numbers))
        calls, failures = self._counts_left.pop(url, (0, 0))
        return Server(url, calls=calls, failures=failures, **fields)

    @classmethod
    async def connect(cls, urls: list[str], endpoint: EndpointConfig, **options) -> ServerPool:
        """Connect to every server that answers; the others join when they become healthy."""
        pool = cls(urls, endpoint, **options)
        await pool.discover()
        await pool._join_each(pool.servers)
        pool._watcher = asyncio.create_task(pool._watch(), name="server-health")
        return pool

    @property
    def context_limit(self) -> int | None:
        """The smallest context limit among the servers in the pool now (None: none reports one):
        what every one of them accepts. A server out of the pool does not count."""
        return min((s.context_limit for s in self.servers if s.alive and s.context_limit is not None), default=None)

    @property
    def model(self) -> str:
        """The model id served (by the first live server)."""
        return next((s.policy.model for s in self.servers if s.policy is not None), "")

    def require_one(self) -> None:
        """Raise, naming every server and what is wrong with it, unless one is in the pool."""
        if not any(server.alive for server in self.servers):
            problems = "; ".join(f"{s.url}: {s.problem}" for s in self.servers)
            raise PolicyError(f"no inference server is usable: {problems or 'none is announced'}")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        for server in self.servers:
            self._take_out(server, failed=False)
        for policy in self._retired:
            try:  # one that fails leaves the others to close all the same
                await policy.close()
            except Exception as err:
                log.warning("closing the client of inference server %s failed: %s", policy.config.base_url, err)
        await self._probe.aclose()

    @contextlib.asynccontextmanager
    async def lease(self, context_tokens: int = 0) -> AsyncIterator[PooledPolicy]:
        """A policy for one rollout on the server `pick` chooses (waits while none is alive).
        `context_tokens`: the context window the rollout needs (`harness.context_tokens`), which
        only a server whose limit is at least that can hold; 0 = any server (the harness then
        sizes the window by its server's limit)."""
        policy = PooledPolicy(self, await self.pick(context_tokens=context_tokens), context_tokens)
        try:
            yield policy
            self.rollouts[policy.server.cluster] += 1
        finally:
            policy.server.leases -= 1
            self._changed.set()  # a slot may have come free

    async def pick(self, context: int | None = None, context_tokens: int = 0) -> Server:
        """The live server with the fewest rollouts among those with room for one more
        (`rollout_slots`), its lease counted; a current server before any that is behind
        (`behind`), which gets one only when no current server has room. With `context` (the
        context window of a moving rollout), a server whose limit is at least that is preferred
        even over a current one. Waits while every live server is full.

        With `context_tokens`, only a server whose limit is at least that (or unknown) is taken.
        While none in the pool holds it but one out of it may (its limit unknown, or large enough
        when it was last in), this waits as for a server to come back. When every server's limit
        is known to be smaller, it raises a ConfigError naming them at once; with a registry it
        waits, since a server that holds the window may be announced yet."""
        waited_since = time.monotonic()
        while True:
            alive = [server for server in self.servers if server.alive]
            holding = [server for server in alive if _holds(server, context_tokens)]
            room = [server for server in holding if server.has_room]
            if room:
                if context is not None:
                    room = [s for s in room if _holds(s, context)] or room
                current = [server for server in room if not self.behind(server)]
                server = min(current or room, key=lambda s: s.leases)
                server.leases += 1
                return server
            if holding:  # full, not down
                waited_since = time.monotonic()
            elif alive and self.registry is None and not any(_holds(s, context_tokens) for s in self.servers):
                raise self._too_small(context_tokens)
            elif time.monotonic() - waited_since > self.no_server_timeout_s:
                raise WhetstoneError(self._none_healthy(context_tokens))
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.health_interval_s)

    def _too_small(self, context_tokens: int) -> ConfigError:
        """The error of a window larger than every server's context limit."""
        if len(self.servers) == 1:
            limit = self.servers[0].context_limit
            return ConfigError(
                f"harness.context_tokens={context_tokens} is more than the server's context limit of {limit} tokens: "
                f"set it to {limit} or less (0 = the server's limit)"
            )
        limits = ", ".join(f"{s.url}: {s.context_limit} tokens" for s in self.servers)
        largest = max(s.context_limit or 0 for s in self.servers)
        return ConfigError(
            f"harness.context_tokens={context_tokens} is more than the context limit of every inference server "
            f"({limits}): set it to {largest} or less (0 = each server's own limit)"
        )

    def _none_healthy(self, context_tokens: int) -> str:
        """Why no server has been leased for `no_server_timeout_s`."""
        if not context_tokens:
            return (
                f"no inference server has been healthy for {self.no_server_timeout_s:g} s: "
                f"{', '.join(s.url for s in self.servers)}"
            )
        servers = ", ".join(
            f"{s.url}: {s.context_limit} tokens" if s.alive else f"{s.url}: out of the pool ({s.problem or 'down'})"
            for s in self.servers
        )
        return (
            f"no inference server with a context limit of at least {context_tokens} tokens (harness.context_tokens) "
            f"has been healthy for {self.no_server_timeout_s:g} s: {servers}"
        )

    async def is_down(self, server: Server) -> bool:
        return await self.health(server) is None

    def take_out(self, server: Server) -> None:
        """Take a dead server out of the pool (idempotent); the watcher takes it back when healthy."""
        if server.alive:
            log.warning("inference server %s is down: taken out of the pool", server.url)
            self._take_out(server, failed=True)

    def behind(self, server: Server) -> str:
        """Why `server` gets new rollouts only when no current server has room (empty: it is
        current): what its last health check found, or its last reported version is older than
        `min_version()` now (the floor rises between health checks)."""
        return server.behind or self._older_than_floor(server.version)

    def _older_than_floor(self, version: object) -> str:
        floor = self.min_version()
        if floor is not None and isinstance(version, int) and version < floor:
            return f"weight version {version} is older than {floor}"
        return ""

    def stats(self) -> dict[str, int]:
        """Servers in the pool and behind, calls re-run, and each server's calls and failures as
        `server<n>_calls` and `server<n>_failures`: `n` numbers its address for the pool's life
        (the servers given by address first, in their order, then the announced ones as they come),
        so each series stays one server's while others leave; one that left is not reported."""
        alive = [s for s in self.servers if s.alive]
        out = {
            "servers_alive": len(alive),
            "servers_behind": sum(bool(self.behind(s)) for s in alive),
            "calls_rerun": self.calls_rerun,
        }
        for server in self.servers:
            number = self._numbers[server.url]
            out[f"server{number}_calls"] = server.calls
            out[f"server{number}_failures"] = server.failures
        return out

    def cluster_stats(self, latest_version: int | None) -> dict[str, float]:
        """Per cluster: live servers, rollouts/s since the last call, and how many versions its
        slowest live server is behind `latest_version` (as last reported: `probe_versions`)."""
        now = time.monotonic()
        elapsed = max(now - self._stats_at, 1e-9)
        out: dict[str, float] = {}
        for cluster in sorted(self.clusters):
            live = [s for s in self.servers if s.cluster == cluster and s.alive]
            out[f"cluster_{cluster}_servers"] = len(live)
            out[f"cluster_{cluster}_rollouts_per_s"] = (self.rollouts[cluster] - self._rollouts_then[cluster]) / elapsed
            versions = [s.version for s in live if s.version is not None]
            if latest_version is not None and versions:
                out[f"cluster_{cluster}_weight_version_lag"] = max(0, latest_version - min(versions))
        self._stats_at, self._rollouts_then = now, Counter(self.rollouts)
        return out

    async def probe_versions(self) -> None:
        """Ask every live server for its health: its weight version and whether it is behind
        (`Server.version`, `Server.behind`), busy or not. One with no call in flight that does not
        answer is taken out: a rollout's next call then goes elsewhere at once, not after a failed
        call or a stale heartbeat. (A server with calls in flight shows its death by failing them.)"""
        live = [server for server in self.servers if server.alive]
        healths = await asyncio.gather(*(self.health(server) for server in live))
        for server, health in zip(live, healths):
            if health is None and server.active_calls == 0:
                self.take_out(server)

    async def discover(self) -> None:
        """Add the servers newly announced in the registry, drop the announced ones it no longer
        lists (their rollouts move on at their next call), then delete the records long silent
        (`FleetRegistry.prune`). A registry that cannot be read leaves the pool as it is; one
        whose records cannot be deleted (read-only access) is still read."""
        if self.registry is None:
            return
        try:
            records = await asyncio.to_thread(self.registry.live, self.stale_after_s)
        except Exception as err:  # a store outage must not empty the pool
            log.warning("reading the fleet registry %r failed, servers kept as they are: %s", self.registry, err)
            return
        try:
            await asyncio.to_thread(self.registry.prune, self.forget_after_s)
        except Exception as err:  # housekeeping only: the servers were read above
            log.warning("pruning the fleet registry %r failed: %s", self.registry, err)
        listed = {record.url: record for record in records}
        for server in list(self.servers):
            record = listed.pop(server.url, None)
            if record is not None:
                server.cluster, server.rollout_slots = record.cluster, record.rollout_slots
                self.clusters.add(record.cluster)
            elif server.announced:
                log.warning("inference server %s left the fleet registry: dropped from the pool", server.url)
                self._take_out(server, failed=True)
                self.servers.remove(server)
                self._counts_left[server.url] = server.calls, server.failures
        for record in listed.values():
            server = self._server(
                record.url, cluster=record.cluster, announced=True, rollout_slots=record.rollout_slots
            )
            log.info(
                "inference server %s (cluster %s) announced itself: server%d in the metrics",
                record.url,
                record.cluster,
                self._numbers[record.url],
            )
            self.servers.append(server)
            self.clusters.add(record.cluster)

    def _take_out(self, server: Server, failed: bool) -> None:
        policy, server.policy = server.policy, None
        if policy is not None:
            server.failures += failed
            self._retired.append(policy)

    async def health(self, server: Server) -> dict | None:
        """The health answer ({} when it is not JSON, as vLLM's), or None if the server is down;
        an answer sets the server's `version` (if it reports one) and `behind`.

        A whetstone server stuck on an old weight version answers 503 "weights stale" with the
        version it serves: it is up and behind, and the staleness gate keeps it waiting. A vLLM
        server's answer is put in the same shape (`integrations.vllm.vllm_health`)."""
        body = await self._health_answer(server)
        if body is None:
            return None
        if isinstance(body.get("weight_version"), int):
            server.version = body["weight_version"]
        behind = self._older_than_floor(server.version)
        if body.get("status") == STALE_WEIGHTS:
            behind = STALE_WEIGHTS + (f": {body['weights_problem']}" if body.get("weights_problem") else "")
        if behind != server.behind and server.alive:
            log.info("inference server %s is %s", server.url, f"behind ({behind})" if behind else "current again")
        server.behind = behind
        return body

    async def _health_answer(self, server: Server) -> dict | None:
        if self.endpoint.engine == "vllm":
            from whetstone.integrations.vllm import vllm_health

            return await vllm_health(self._probe, server.url)
        try:
            response = await self._probe.get(server.health_url)
        except (httpx.HTTPError, httpx.InvalidURL):  # InvalidURL: a mistyped address (`http://host:port/v1`)
            return None
        try:
            body = response.json()
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        if response.status_code == 200:
            return body
        if response.status_code == 503 and body.get("status") == STALE_WEIGHTS:
            return body
        return None

    async def _join_each(self, servers: list[Server]) -> None:
        """`_join` each server on its own: one whose check fails (its health answer, the store
        behind `min_version`) is logged and left out until a later round, and the others join."""
        joins = await asyncio.gather(*(self._join(server) for server in servers), return_exceptions=True)
        for server, failure in zip(servers, joins):
            if isinstance(failure, Exception):
                server.problem = f"its health check failed: {type(failure).__name__}: {failure}"
                log.warning("inference server %s: %s", server.url, server.problem)

    async def _join(self, server: Server) -> None:
        health = await self.health(server)
        if health is None:
            server.problem = f"no answer from {server.health_url}"
            return
        too_old = self._older_than_floor(health.get("weight_version"))
        if too_old:
            server.problem = f"{too_old} (still catching up)"
            return
        try:
            policy = await self._policy_class.connect(self.endpoint.model_copy(update={"base_url": server.url}))
        except PolicyError as err:
            log.warning("inference server %s is not usable yet: %s", server.url, err)
            server.problem = str(err)
            return
        server.policy, server.problem, server.context_limit = policy, "", policy.context_limit
        log.info(
            "inference server %s is in the pool%s", server.url, f" (behind: {server.behind})" if server.behind else ""
        )
        self._changed.set()

    async def _close_retired(self) -> None:
        """Close the clients of servers taken out that no call is on any more: each holds its
        connections open, and a server taken out and back in many times makes a new one each time."""
        for policy in [policy for policy in self._retired if not self._calls_on[policy]]:
            try:  # cancelled meanwhile (the pool closes), it stays retired: `close` closes it
                await policy.close()
            except Exception as err:  # its connections are gone with it all the same
                log.warning("closing the client of inference server %s failed: %s", policy.config.base_url, err)
            self._retired.remove(policy)
            del self._calls_on[policy]

    async def _watch(self) -> None:
        """Health rounds until the pool closes. A round that fails is logged and the next one
        runs: the watcher ending would leave dead servers out and recovered ones unused for good."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.discover()
                await self._join_each([s for s in self.servers if not s.alive])
                await self.probe_versions()
                await self._close_retired()
            except Exception:
                log.exception(
                    "a health round of the server pool failed; the next one runs in %g s", self.health_interval_s
                )


def _holds(server: Server, context_tokens: int | None) -> bool:
    """Whether `server` can hold a context window of `context_tokens` (None or 0: any window; a
    server whose limit is unknown is taken to)."""
    return not context_tokens or server.context_limit is None or server.context_limit >= context_tokens


class PooledPolicy(Policy):
    """One rollout's policy: its server's, moved to another server when that one dies.

    The harness sizes the rollout's context by `context_tokens` when it is set (the lease took a
    server that holds it), else by the limit of the server it starts on (`started_limit`). A
    move prefers a server whose limit is at least that window (`ServerPool.pick`);
    when none has room it takes a smaller one rather than wait, and a call that does not fit
    that server's limit fails naming both limits, before it is sent: the server would refuse it,
    and the calls that do fit (a rollout whose context stayed small) still run there."""

    def __init__(self, pool: ServerPool, server: Server, context_tokens: int = 0):
        self.pool, self.server = pool, server
        self.started_limit = server.context_limit
        """The context limit of the server the rollout was leased on (what the harness planned for)."""
        self.context_tokens = context_tokens
        """The context window the rollout was leased for (0: its server's limit)."""

    @property
    def context_limit(self) -> int | None:
        """The context limit of the server the rollout is on now."""
        return self.server.context_limit

    async def complete(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        while True:
            server = self.server
            if server.policy is None:  # taken out since the last call
                await self._move()
                continue
            self._check_fits(server, len(prompt_ids) + sampling.max_tokens)
            client = server.policy
            server.calls += 1
            server.active_calls += 1
            self.pool._calls_on[client] += 1
            try:
                return await client.complete(prompt_ids, sampling)
            except PolicyError:
                if not await self.pool.is_down(server):
                    raise  # the server is fine: the request itself was refused
                self.pool.take_out(server)
                self.pool.calls_rerun += 1
            finally:
                server.active_calls -= 1
                self.pool._calls_on[client] -= 1

    def _check_fits(self, server: Server, tokens: int) -> None:
        """Raise unless a call of `tokens` (prompt + max_tokens) fits `server`, when its limit is
        smaller than the one the rollout started with (on that one the harness keeps it in)."""
        limit, started = server.context_limit, self.started_limit
        if limit is not None and started is not None and limit < started and tokens > limit:
            raise PolicyError(
                f"the rollout started on a server with a {started}-token context limit; the one it is on now, "
                f"{server.url}, has a limit of {limit} tokens: its call of prompt + max_tokens = {tokens} does not fit"
            )

    async def _move(self) -> None:
        # if none comes back this raises, and the lease still counts here
        new = await self.pool.pick(self.context_tokens or self.started_limit)
        self.server.leases -= 1
        self.server = new
