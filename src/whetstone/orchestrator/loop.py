"""The orchestrator's loop: rollouts in, batches out.

    put = asyncio.run(Orchestrator(config).run())      # indices of the batches it put

Rollout side: groups of `group_size` rollouts of one task are started while fewer than
`rollout.concurrency` rollouts are unfinished, so every server stays busy, and (asynchronous
mode) while a group started now would still be within the staleness bound when trained, given the
version the servers hold (`_has_room`); each rollout runs on the least-loaded live server, one behind on weights last
(`pool.py`). A finished group is scored (`score_groups`: failed,
cheat-flagged and no-variance ones dropped and counted), turned into samples and buffered.

Batch side: batch n is what the trainer's optimizer step n consumes, under weight version n.
It is put only once the trainer has published version n - max_off_policy_steps (never further
ahead), from buffered samples whose staleness n - oldest_version is within the bound (older
ones are dropped and counted), as `batches/<n:010d>.batch` in the batch store. While the next
batch's groups wait for the trainer, no new groups start (they would only grow stale).

Synchronous mode (`synchronous = true`, the baseline of `whetstone bench pipeline`): batch n is
"open" only once the trainer has published version n and every server holds it; only then do
its groups start, and only as many as it still needs (a dropped group is replaced). So
generation and training strictly alternate and every token of batch n is sampled by version n.

The two modes differ only in their gate (`AsynchronousGate`, `SynchronousGate`), chosen once:
how far ahead of the trainer a batch may be put, when a group may start, what opens and closes
a batch, and whether a follower task tracks the trainer's and the servers' versions.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from whetstone.config import expand_path
from whetstone.envs.harness import AgentHarness, ServerPool, rollout
from whetstone.envs.task import Task
from whetstone.envs.trajectory import Trajectory
from whetstone.errors import WhetstoneError
from whetstone.fleet import FleetRegistry
from whetstone.orchestrator.batches import Group, Window, build_batch, drop_stale, flat_metrics
from whetstone.orchestrator.config import OrchestratorConfig
from whetstone.orchestrator.curriculum import Curriculum
from whetstone.rl.advantages.groups import score_groups
from whetstone.rl.batch_store import next_batch_index, put_batch
from whetstone.rl.samples import trajectory_samples
from whetstone.store import MissingObjectError, open_store
from whetstone.sync import WeightStore
from whetstone.utils.atomic import atomic_write_json
from whetstone.utils.metrics import MetricsWriter

log = logging.getLogger("whetstone.orchestrator")
STATE_KEY = "orchestrator/state.json"
"""In the batch store: the orchestrator's state as of the newest batch it put (`Orchestrator._state`)."""
UNKNOWN_SERVER_LAG = 1
"""Versions a server is taken to be behind the trainer's latest when no live server reports its
version (SGLang, or vLLM without whetstone's worker extension, do not): each loads a version as it is
published, so one at most."""
FRUITLESS_WARNING_GROUPS = 4
"""Warn after this many batches' worth of groups in a row gave nothing to train on."""


class NothingToTrainOn(WhetstoneError):
    """`max_fruitless_batches` batches' worth of groups in a row gave nothing to train on."""


class Orchestrator:
    def __init__(
        self, config: OrchestratorConfig, tasks: list[Task] | None = None, harness: AgentHarness | None = None
    ):
        """`tasks`: use these instead of loading (and validating) `config.tasks`; `harness`: this
        one instead of loading `config.harness`'s tokenizer when the run starts."""
        self.config = config
        self.tasks = tasks
        self.harness = harness
        self.batches = open_store(config.batch_store, endpoint_url=config.store_endpoint_url)
        self.weights = WeightStore(open_store(config.weight_store, endpoint_url=config.store_endpoint_url))
        self.latest_version: int | None = None
        self.put: list[int] = []
        self.pool: ServerPool | None = None
        self._buffer: list[Group] = []
        self._window = Window()
        self._unfinished = 0
        self._groups_running = 0
        """Groups started and not scored yet."""
        self._served_version: int | None = None
        """The oldest weight version the live servers reported (None: none reports one)."""
        self._asked: set[str] = set()
        """The live servers the follower asked for their version last."""
        self._unversioned: set[str] = set()
        """Servers whose health answer carries no weight version (SGLang, a vLLM without whetstone's
        worker extension): not asked again."""
        self._following = False
        """The follower task keeps `latest_version` current (asynchronous mode, once started)."""
        self._last_put = -1
        """Index of the newest batch in the batch store or being written there (by this run or an
        earlier one)."""
        self._mode: AsynchronousGate | SynchronousGate = (
            SynchronousGate(self) if config.synchronous else AsynchronousGate(self)
        )
        """What the mode decides: how far batches run ahead, when groups start, what opens a batch."""
        self._changed = asyncio.Condition()
        self._gate = asyncio.Semaphore(config.rollout.concurrency)
        self._running: set[asyncio.Task] = set()
        self._failure: BaseException | None = None
        self._validity: dict[str, str | None] = {}
        """Task id -> None if it validated, else why not (lazy validation)."""
        self._fruitless_groups = 0
        """Groups scored in a row that gave nothing to train on (to say why a batch waits)."""
        self._fruitless_drops: Counter[str] = Counter()
        """Their rollouts dropped, by reason."""
        self._stale_groups = 0
        """Kept groups dropped whole as too stale since the last batch was put (`_note_stale`)."""
        self.groups_finished = self.groups_kept = self.groups_dropped_stale = 0
        self.rollouts_dropped: Counter[str] = Counter()
        """Totals since this orchestrator started (`status()`)."""
        self.stopped: str | None = None
        """Why it gave up (`max_fruitless_batches`), once it has: `run` raises `NothingToTrainOn`."""
        self._status_written = -math.inf
        self.curriculum = Curriculum(config.curriculum)
        self._task_count = 0
        """Tasks in the set (a saved stream position must lie within it)."""
        self._task_set = ""
        """Digest of the tasks' ids: saved with the state, which another task set does not go on from."""
        self._stream_start = (0, 0)
        """(pass, position in its order) where the task stream starts: (0, 0), or where a
        restarted orchestrator's predecessor left it (`_resume`)."""
        self._stream_next = (0, 0)
        """Where the stream goes on: at the task the producer took from it and has not started yet,
        else after the last group started (the skips before it are counted already). Saved with
        each batch put."""

    async def run(self, on_batch: Callable[[dict], None] | None = None) -> list[int]:
        """Run until `max_batches` are put (or forever); returns the indices put. `on_batch` sees
        each batch's meta as it is put."""
        config = self.config
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(config.rollout.concurrency + 4, thread_name_prefix="rollout")
        )
        tasks = self.tasks if self.tasks is not None else await asyncio.to_thread(self._load_tasks)
        if not tasks:
            raise WhetstoneError(f"no usable task in tasks.source = {config.tasks.source!r}")
        harness = self.harness if self.harness is not None else AgentHarness.from_config(config.harness)
        await self._wait_for_trainer(0)
        self.pool = pool = await ServerPool.connect(
            config.servers,
            config.endpoint,
            health_interval_s=config.health_interval_s,
            no_server_timeout_s=config.no_server_timeout_s,
            min_version=self._oldest_useful_version,
            registry=FleetRegistry(self.weights.objects) if config.discover_servers else None,
            stale_after_s=config.server_heartbeat_timeout_s,
            forget_after_s=config.forget_servers_after_s,
        )
        metrics, background = None, []
        try:
            if config.metrics_path:
                metrics = MetricsWriter(
                    expand_path(config.metrics_path),
                    config.tracking,
                    role="orchestrator",
                    step_key="index",
                    run_config=config,
                )
            index = next_batch_index(self.batches)
            self._last_put = index - 1
            self._know_tasks(tasks)
            self._resume(index)
            self._write_status(now=True)  # nothing finished yet: the status says so
            background = [
                asyncio.create_task(self._produce(tasks, harness, pool), name="producer"),
                *self._mode.background(pool),
            ]
            for task in background:
                task.add_done_callback(self._note_failure)
            while (not config.max_batches or len(self.put) < config.max_batches) and (
                not config.total_batches or index < config.total_batches
            ):
                meta = await self._put_batch(index)
                if metrics is not None:
                    await pool.probe_versions()
                    clusters = pool.cluster_stats(self.latest_version)
                    metrics.write(
                        {
                            **flat_metrics(meta),
                            **pool.stats(),
                            **clusters,
                            "invalid_tasks": self.invalid_tasks,
                            "rested_tasks": self.curriculum.rested,
                        }
                    )
                if on_batch is not None:
                    on_batch(meta)
                index += 1
        finally:
            for task in [*background, *self._running]:
                task.cancel()
            ending = sys.exception()  # what ends the run, if anything does: it comes out, not a status failure
            await asyncio.gather(*background, *self._running, return_exceptions=True)
            try:
                self._write_status(now=True)  # may fail (a full disk): the pool and the metrics close all the same
            except Exception as err:
                if ending is None:
                    raise
                log.error("the orchestrator's last status could not be written: %s", err)
            finally:
                try:
                    await pool.close()
                finally:
                    if metrics is not None:
                        metrics.close()
        return self.put

    @property
    def buffered_groups(self) -> int:
        """Kept groups waiting for a batch."""
        return len(self._buffer)

    def _load_tasks(self) -> list[Task]:
        from whetstone.envs.tasks import load_tasks, load_valid_tasks

        if self.config.validate_tasks and not self.config.validate_lazily:
            return load_valid_tasks(self.config.tasks, self.config.rollout.reward)
        return load_tasks(self.config.tasks)

    async def _is_valid(self, task: Task) -> bool:
        """Lazy validation: the task's reference passes and its starting repository fails (once per task)."""
        if not (self.config.validate_tasks and self.config.validate_lazily):
            return True
        if task.id not in self._validity:
            from whetstone.envs.tasks.validate import check_task

            self._validity[task.id] = reason = await asyncio.to_thread(check_task, task, self.config.rollout.reward)
            if reason is not None:
                log.warning("skipping invalid task %s: %s", task.id, reason)
        return self._validity[task.id] is None

    @property
    def invalid_tasks(self) -> int:
        return sum(reason is not None for reason in self._validity.values())

    def _oldest_useful_version(self) -> int | None:
        """A server further behind than this makes only samples too stale to train on."""
        if self.latest_version is None:
            return None
        return self.latest_version - self.config.staleness.max_off_policy_steps

    # -- rollouts ---------------------------------------------------------------------------------

    def _task_stream(self, tasks: list[Task]) -> Iterator[tuple[int, int, Task]]:
        """(pass number, position in its order, task): every task once per pass, in a new seeded
        order each pass, less the tasks the curriculum rests in that pass; from `_stream_start`."""
        epoch, start = self._stream_start
        while True:
            order = list(tasks)
            random.Random(self.config.seed * 1_000_003 + epoch).shuffle(order)
            for position in range(start, len(order)):
                if not self.curriculum.rests(order[position].id, epoch):
                    yield epoch, position, order[position]
            epoch, start = epoch + 1, 0

    def _groups_ahead(self) -> int:
        """Groups queued for batches after the one the trainer is on: in the batch store, buffered
        and running. Each batch's worth of them is one more step of staleness for a group started now."""
        trainer_on = -1 if self.latest_version is None else self.latest_version  # batch n trains under version n
        put_ahead = max(0, self._last_put - trainer_on)
        return put_ahead * self.config.groups_per_batch + len(self._buffer) + self._groups_running

    def _trainer_waits(self) -> bool:
        """The trainer waits for a batch not put yet: the one its latest version trains on."""
        return self.latest_version is None or self._last_put < self.latest_version

    def _has_room(self) -> bool:
        config = self.config
        if self._unfinished >= config.rollout.concurrency or len(self._buffer) >= config.groups_per_batch:
            return False
        return self._mode.has_room()

    def _server_lag(self) -> int:
        """Versions the slowest live server is behind the trainer's latest."""
        if self._served_version is None or self.latest_version is None:
            return UNKNOWN_SERVER_LAG
        return max(0, self.latest_version - self._served_version)

    async def _follow_trainer(self, pool: ServerPool) -> None:
        """Keep `latest_version` and, while they are behind it, the servers' version current, waking
        the producer when either moves (asynchronous mode's gate on starting groups). The put loop
        then waits on it instead of reading the weight store too."""
        self._following = True
        while True:
            latest = await asyncio.to_thread(self.weights.latest)
            if latest is not None and self.latest_version is not None:
                latest = max(latest, self.latest_version)  # never back below what the put loop read at start
            served = self._served_version
            asked = [server for server in pool.servers if server.alive and server.url not in self._unversioned]
            joined, self._asked = {server.url for server in asked} - self._asked, {server.url for server in asked}
            if not asked:
                served = None
            elif latest is not None and (served is None or served < latest or joined):  # one may join behind
                healths = await asyncio.gather(*(pool.health(server) for server in asked))
                versions = []
                for server, health in zip(asked, healths):
                    if health is not None and isinstance(health.get("weight_version"), int):
                        versions.append(health["weight_version"])
                    elif health is not None:
                        self._unversioned.add(server.url)
                served = min(versions) if versions else None
            if (latest, served) != (self.latest_version, self._served_version):
                async with self._changed:
                    self.latest_version = latest
                    self._served_version = served
                    self._changed.notify_all()
            await asyncio.sleep(self.config.poll_interval_s)

    async def _produce(self, tasks: list[Task], harness: AgentHarness, pool: ServerPool) -> None:
        for number, (pass_number, position, task) in enumerate(self._task_stream(tasks)):
            # a restart goes on from this task, counting no rest before it again
            self._stream_next = (pass_number, position)
            if self._validity.get(task.id) is not None:  # known invalid
                if self.invalid_tasks == len(tasks):
                    self._failure = WhetstoneError(
                        f"none of the {len(tasks)} tasks of {self.config.tasks.source!r} "
                        f"validates (e.g. {task.id}: {self._validity[task.id]})"
                    )
                    await self._notify()
                    return
                continue
            async with self._changed:
                await self._changed.wait_for(self._has_room)
                self._unfinished += self.config.group_size
                self._groups_running += 1
                self._stream_next = (pass_number, position + 1)
            group = asyncio.create_task(self._run_group(f"{number}/{task.id}", task, harness, pool, pass_number))
            self._running.add(group)
            group.add_done_callback(self._group_done)

    def _group_done(self, group: asyncio.Task) -> None:
        self._running.discard(group)
        self._note_failure(group)

    def _note_failure(self, task: asyncio.Task) -> None:
        """A group, the producer or the follower raised (e.g. no server left, an unreadable weight
        store): the batch side raises it."""
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _run_group(
        self, group_id: str, task: Task, harness: AgentHarness, pool: ServerPool, pass_number: int
    ) -> None:
        try:
            await self._score_group(group_id, task, harness, pool, pass_number)
        finally:  # after the group is buffered, so running + buffered never undercounts
            async with self._changed:
                self._groups_running -= 1
                self._changed.notify_all()

    async def _score_group(
        self, group_id: str, task: Task, harness: AgentHarness, pool: ServerPool, pass_number: int
    ) -> None:
        async def one() -> tuple[Trajectory, str]:
            """A rollout, and the cluster of the server that finished it."""
            try:
                async with self._gate, pool.lease(harness.context_tokens) as policy:
                    trajectory = await rollout(task, policy, harness, self.config.rollout, group_id=group_id)
                    return trajectory, policy.server.cluster
            finally:
                async with self._changed:
                    self._unfinished -= 1
                    self._changed.notify_all()

        if not await self._is_valid(task):
            async with self._changed:
                self._unfinished -= self.config.group_size
                self._changed.notify_all()
            return
        done = await asyncio.gather(*(one() for _ in range(self.config.group_size)))
        trajectories, cluster_of = [t for t, _ in done], {id(t): cluster for t, cluster in done}
        ran = [t for t in trajectories if t.status == "ok"]  # a broken rollout says nothing of the task
        self.curriculum.record(task.id, sum(t.solved for t in ran), len(ran), pass_number)
        kept, report = score_groups(trajectories, self.config.advantages)
        samples, clusters, rollout_of = [], [], []
        try:
            for number, (trajectory, advantage) in enumerate(kept):
                made = trajectory_samples(trajectory, advantage)
                samples += made
                clusters += [cluster_of[id(trajectory)]] * len(made)
                rollout_of += [number] * len(made)
        except WhetstoneError as err:  # e.g. routes of the wrong shape: the group cannot be trained on
            log.error("dropping group %s: %s", group_id, err)
            report.dropped["invalid"] += report.kept_rollouts
            report.kept_groups, report.kept_rollouts, samples = 0, 0, []
        async with self._changed:
            self._window.add(trajectories, report.metrics())
            if samples:
                self._buffer.append(Group(samples, report.kept_rollouts, clusters, rollout_of))
                self._fruitless_groups = 0
                self._fruitless_drops.clear()
            else:
                self._note_fruitless(report.dropped)
            self.groups_finished += 1
            self.groups_kept += bool(samples)
            self.rollouts_dropped.update(report.dropped)
            self._write_status()
            self._changed.notify_all()

    def _state(self, index: int) -> dict:
        """What a restarted orchestrator goes on from, as of batch `index` put: where the task stream
        goes on (groups in flight then are not run again) and the curriculum's record."""
        return {
            "batch_index": index,
            "stream": list(self._stream_next),
            "curriculum": self.curriculum.state(),
            "tasks": self._task_set,
            "seed": self.config.seed,
        }

    def _know_tasks(self, tasks: list[Task]) -> None:
        """The task set this run goes through: a state saved for another one is not gone on from."""
        self._task_count = len(tasks)
        self._task_set = hashlib.sha256("\n".join(sorted(task.id for task in tasks)).encode()).hexdigest()[:16]

    def _resume(self, index: int) -> None:
        """With batches in the store already, go on from the state saved with the newest one
        (`STATE_KEY`): the task stream where it was, the curriculum's record. None (batches of an
        older version), an unreadable one, or one of other tasks or another seed: the stream
        starts afresh, saying why (the batches are the contract; the state only saves repeats)."""
        if index == 0:
            return
        try:
            state = json.loads(self.batches.get(STATE_KEY))
            if (state["tasks"], state["seed"]) != (self._task_set, self.config.seed):
                log.warning(
                    "%s is of another task set or seed (%s) than this run's: the task stream starts afresh",
                    STATE_KEY,
                    state["seed"] if state["tasks"] == self._task_set else "tasks",
                )
                return
            pass_number, position = (int(value) for value in state["stream"])
            if pass_number < 0 or not 0 <= position <= self._task_count:
                raise ValueError(f"no pass {pass_number}, position {position} in {self._task_count} tasks")
            stream = (pass_number, position)
            self.curriculum.load(state["curriculum"])
        except MissingObjectError:
            log.warning("batches 0..%d are there but no %s: the task stream starts afresh", index - 1, STATE_KEY)
            return
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            log.warning("%s is unreadable (%s: %s): the task stream starts afresh", STATE_KEY, type(err).__name__, err)
            return
        self._stream_start = self._stream_next = stream
        log.info(
            "going on from batch %s's state: the task stream at pass %d, position %d; the curriculum's "
            "record of %d tasks",
            state.get("batch_index"),
            *stream,
            len(state["curriculum"]["last"]),
        )

    def status(self) -> dict:
        """The run's totals so far: groups finished and kept, rollouts dropped by reason, batches
        put; and `stopped`, why the orchestrator gave up, once it has."""
        return {
            "groups_finished": self.groups_finished,
            "groups_kept": self.groups_kept,
            "groups_dropped_stale": self.groups_dropped_stale,
            "rollouts_dropped": {reason: count for reason, count in self.rollouts_dropped.items() if count},
            "batches_put": len(self.put),
            **({"stopped": self.stopped} if self.stopped else {}),
        }

    def _write_status(self, now: bool = False) -> None:
        """Rewrite `status_path` (if set) with `status()`: at once when `now`, else at most once a second."""
        path, clock = self.config.status_path, time.monotonic()
        if path and (now or clock - self._status_written >= 1.0):
            atomic_write_json(expand_path(path), {**self.status(), "time": time.time()})
            self._status_written = clock

    def _note_fruitless(self, dropped: Counter[str]) -> None:
        """Say so when groups keep giving nothing to train on: otherwise the run just stops moving
        (e.g. a few tasks the policy now always solves, or never does); stop after
        `max_fruitless_batches` batches' worth of them."""
        self._fruitless_drops.update(dropped)
        self._fruitless_groups += 1
        per_batch = self.config.groups_per_batch
        limit = self.config.max_fruitless_batches * per_batch
        reasons = ", ".join(f"{reason} {count}" for reason, count in self._fruitless_drops.items() if count)
        what = (
            f"the last {self._fruitless_groups} groups gave nothing to train on (rollouts dropped: {reasons or 'none'})"
        )
        if limit and self._fruitless_groups >= limit and self._failure is None:
            self.stopped = (
                f"{what}: stopped at orchestrator.max_fruitless_batches = {self.config.max_fruitless_batches}"
            )
            self._failure = NothingToTrainOn(f"{self.stopped} (0 waits for ever)")
            log.error("%s", self._failure)
        elif self._fruitless_groups % (FRUITLESS_WARNING_GROUPS * per_batch) == 0:
            log.warning(
                "%s; the next batch waits for groups with reward variance: are the tasks all too easy or "
                "too hard for the policy?",
                what,
            )

    def _note_stale(self, groups: int) -> None:
        """`groups` kept groups were too stale for the next batch by the time it could take them.
        Now and then that is a slow rollout; `max_fruitless_batches` batches' worth of them before
        a batch is put is servers that do not follow the trainer (e.g. started without the weight
        store): stop and say so, rather than generate and drop for ever."""
        self._stale_groups += groups
        self.groups_dropped_stale += groups
        limit = self.config.max_fruitless_batches * self.config.groups_per_batch
        if limit and self._stale_groups >= limit and self._failure is None:
            self.stopped = (
                f"the last {self._stale_groups} kept groups were too stale to train on by the time a batch "
                f"could take them (the trainer is at weight version {self.latest_version}, the slowest server "
                f"reported {self._served_version}, staleness.max_off_policy_steps = "
                f"{self.config.staleness.max_off_policy_steps}): do the servers follow the trainer's weight "
                f"store? Stopped at orchestrator.max_fruitless_batches = {self.config.max_fruitless_batches}"
            )
            self._failure = NothingToTrainOn(f"{self.stopped} (0 waits for ever)")
            log.error("%s", self._failure)

    # -- batches ----------------------------------------------------------------------------------

    async def _wait_for_trainer(self, index: int) -> None:
        """Until the trainer has published version index - the mode's `trainer_lead` (and some
        version): index - max_off_policy_steps, or index itself in synchronous mode."""
        ahead = self._mode.trainer_lead
        if self._following:  # the follower reads the weight store already: wait for it to say

            def published() -> bool:
                latest = self.latest_version
                return self._failure is not None or (latest is not None and latest >= index - ahead)

            async with self._changed:
                if not published():
                    log.info(
                        "batch %d waits for the trainer to publish weight version %d", index, max(0, index - ahead)
                    )
                    await self._changed.wait_for(published)
            if self._failure is not None:
                raise self._failure
            return
        logged = False
        while True:
            self.latest_version = await asyncio.to_thread(self.weights.latest)
            if self.latest_version is not None and self.latest_version >= index - ahead:
                return
            if self._failure is not None:
                raise self._failure
            if not logged:
                log.info("batch %d waits for the trainer to publish weight version %d", index, max(0, index - ahead))
                logged = True
            await asyncio.sleep(self.config.poll_interval_s)

    async def _put_batch(self, index: int) -> dict:
        await self._wait_for_trainer(index)
        await self._mode.open_batch(index)
        groups, window = await self._take_groups(index)
        batch = build_batch(
            index, groups, window, self.config.staleness, self.latest_version, self.config.harness.sampling.temperature
        )
        await asyncio.to_thread(put_batch, self.batches, index, batch)
        await asyncio.to_thread(self.batches.put, STATE_KEY, json.dumps(self._state(index)).encode())
        self.put.append(index)
        self._write_status(now=True)
        meta = batch.meta
        log.info(
            "put batch %d: %d samples from %d rollouts, reward %.3f",
            index,
            meta["samples"],
            meta["rollouts"],
            meta["reward_mean"] or 0.0,
        )
        return meta

    async def _take_groups(self, index: int) -> tuple[list[Group], Window]:
        """The first `groups_per_batch` buffered groups fresh enough for batch `index`, and the
        window's counts (stale samples dropped on the way)."""
        async with self._changed:
            while True:
                buffered = len(self._buffer)
                self._buffer = drop_stale(self._buffer, index, self.config.staleness, self._window)
                if len(self._buffer) < buffered:
                    self._note_stale(buffered - len(self._buffer))
                if self._failure is not None:
                    raise self._failure
                if len(self._buffer) >= self.config.groups_per_batch:
                    break
                if len(self._buffer) < buffered:  # room for new groups: the producer may be waiting for it
                    self._changed.notify_all()
                await self._changed.wait()
            self._mode.close_batch()
            groups = self._buffer[: self.config.groups_per_batch]
            del self._buffer[: self.config.groups_per_batch]
            self._last_put = index  # counted as put from here: its groups left the buffer
            self._stale_groups = 0
            window, self._window = self._window, Window()
            self._changed.notify_all()  # room for new groups
        return groups, window


class AsynchronousGate:
    """Asynchronous RL: batch n is put once the trainer has published version
    n - max_off_policy_steps, and a group starts while it would still be within that bound when
    trained; a follower task keeps the trainer's and the servers' versions current."""

    def __init__(self, orchestrator: Orchestrator):
        self._orchestrator = orchestrator
        self.trainer_lead = orchestrator.config.staleness.max_off_policy_steps
        """Versions batch n may be put ahead of the trainer's latest."""

    def background(self, pool: ServerPool) -> list[asyncio.Task]:
        """The follower (`Orchestrator._follow_trainer`), which wakes the producer as versions move."""
        return [asyncio.create_task(self._orchestrator._follow_trainer(pool), name="follower")]

    def has_room(self) -> bool:
        """A group started now lands in batch (trainer's) + 1 + ahead // groups_per_batch, sampled by
        servers `lag` versions behind the trainer: past the staleness bound it would only be dropped.
        Started once the servers hold the latest version, groups may run the whole bound ahead.
        The batch the trainer waits for gets its groups whatever the servers hold: with a bound of
        0, or servers behind by more than it, nothing else would fill it, and servers that do not
        follow the trainer then show as groups dropped stale (`_note_stale`). While the trainer is
        on a batch put already, a group that could only be too stale waits for its next version."""
        orchestrator, config = self._orchestrator, self._orchestrator.config
        batches = config.staleness.max_off_policy_steps - orchestrator._server_lag()
        if orchestrator._trainer_waits():
            batches = max(1, batches)
        return orchestrator._groups_ahead() < batches * config.groups_per_batch

    async def open_batch(self, index: int) -> None:
        """Nothing to wait for: groups start whenever `has_room` says so."""

    def close_batch(self) -> None:
        """Nothing to close."""


class SynchronousGate:
    """Synchronous RL: batch n opens once the trainer has published version n and every server
    holds it; only then do its groups start, only as many as it still needs, and it closes once
    they are taken. No follower: opening the batch reads the versions."""

    trainer_lead = 0
    """Batch n waits for version n itself."""

    def __init__(self, orchestrator: Orchestrator):
        self._orchestrator = orchestrator
        self._open: int | None = None
        """The batch whose groups may start now (None until the trainer and the servers hold its version)."""

    def background(self, pool: ServerPool) -> list[asyncio.Task]:
        """None: `open_batch` is the gate."""
        return []

    def has_room(self) -> bool:
        """Only the groups the open batch still needs."""
        orchestrator = self._orchestrator
        started = orchestrator._groups_running + len(orchestrator._buffer)
        return self._open is not None and started < orchestrator.config.groups_per_batch

    async def open_batch(self, index: int) -> None:
        """Once every server holds version `index`, let the batch's groups start."""
        await self._wait_for_servers(index)
        async with self._orchestrator._changed:
            self._open = index
            self._orchestrator._changed.notify_all()

    def close_batch(self) -> None:
        """The batch's groups were taken: nothing starts before the next version."""
        self._open = None

    async def _wait_for_servers(self, version: int) -> None:
        """Until every server in the pool reports `version` or newer (each loads it on its own);
        servers that report no version are taken as they are."""
        pool, config = self._orchestrator.pool, self._orchestrator.config
        deadline = time.monotonic() + config.no_server_timeout_s
        while True:
            live = [server for server in pool.servers if server.alive]
            healths = await asyncio.gather(*(pool.health(server) for server in live))
            behind = [
                f"{server.url} ({health.get('weight_version')})"
                for server, health in zip(live, healths)
                if health is not None
                and isinstance(health.get("weight_version"), int)
                and health["weight_version"] < version
            ]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise WhetstoneError(
                    f"servers still behind weight version {version} after "
                    f"{config.no_server_timeout_s:g} s: {', '.join(behind)}"
                )
            await asyncio.sleep(config.poll_interval_s)
