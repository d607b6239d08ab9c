"""The trainer process: wait for batch n, take optimizer step n, publish weight version n + 1.

    <output_dir>/config.toml      the config as last run
    <output_dir>/metrics.jsonl    one record per step (loss metrics, routing, timings, batch meta)
    <output_dir>/checkpoints/     step_<N>/ (midtrain's checkpoint format; N = next batch index)

The loop polls the batch store for `batches/<n:010d>.batch` (written whole by one atomic put),
so it never sees half a batch and never needs to know who wrote it or how advantages were made.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any

import torch

from whetstone.config import write_toml
from whetstone.errors import WhetstoneError
from whetstone.rl.batch import Batch, check_batch, drop_impossible_rows, shuffled_parts
from whetstone.rl.batch_store import batch_indices, batch_key, get_batch
from whetstone.rl.demos import demo_rows
from whetstone.rl.staleness import staleness
from whetstone.sync import Publisher, Subscriber
from whetstone.sync.publisher import Published
from whetstone.trainer.config import TrainerConfig
from whetstone.trainer.distributed import global_normalizer, rank_rows
from whetstone.trainer.setup import TrainerSession, new_optimizer, open_trainer
from whetstone.trainer.step import DemoAnchor, Learner, StepSettings, check_batch_routes, train_step
from whetstone.training.distributed import (
    broadcast,
    full_state_dict,
    on_rank_0,
    save_sharded_checkpoint,
    sum_over_ranks,
    torchrun_group,
)
from whetstone.training.schedule import lr_at
from whetstone.utils.metrics import MetricsWriter
from whetstone.utils.processes import stop_on_signals
from whetstone.utils.progress import progress_bar

log = logging.getLogger("whetstone.trainer")
BATCH_META_SCALARS = ("reward_mean", "samples", "rollouts")


def read_batch(session: TrainerSession, index: int) -> Batch | None:
    """Batch `index` from the store, or None if it is not there yet."""
    batch = get_batch(session.batches, index)
    if batch is None:
        return None
    if batch.meta.get("index", index) != index:
        raise WhetstoneError(f"{batch_key(index)} says it is batch {batch.meta['index']}, expected {index}")
    return batch


BATCH_SEEN_WITHIN = 30.0
"""Seconds a rank retries a batch rank 0 has read before it gives up: a shared filesystem can
show a new file to another machine seconds late (NFS caches what a folder holds)."""


def read_batch_rank_0_read(session: TrainerSession, index: int, within: float = BATCH_SEEN_WITHIN) -> Batch:
    """Batch `index`, which rank 0 has read, as this rank sees the store: retried for `within`
    seconds, then an error that says the ranks do not share one store."""
    give_up = time.monotonic() + within
    while (batch := read_batch(session, index)) is None:
        if time.monotonic() >= give_up:
            raise WhetstoneError(
                f"rank {session.rank} cannot read {batch_key(index)} from {session.batches!r}, which "
                f"rank 0 read {within:g} s ago: every rank needs the same batch_store (object "
                "storage or a shared filesystem)"
            )
        time.sleep(min(0.5, within / 10))
    return batch


IDLE_REPORT_S = 60.0
"""Seconds between reports of a trainer still waiting for a batch."""


def report_waiting(session: TrainerSession, index: int, waited_s: float = 0.0) -> None:
    """Say where the trainer waits for batch `index`, and for how long it has: a warning while the
    batch store holds no batch at all (a mistyped batch_store is a new, empty store that no
    orchestrator writes, where the trainer would otherwise wait silently, for ever with
    idle_timeout = 0); an info line otherwise. Nothing at the start (`waited_s` 0) of a store
    that holds batches. A warning too, each time, while the store holds a later batch but not
    this one: one deleted or lost, which no orchestrator writes again (it only appends)."""
    indices = batch_indices(session.batches)
    newest = max(indices, default=-1)
    still = f"still waiting for batch {index} after {waited_s:.0f} s: " if waited_s else ""
    if newest > index and index not in indices:
        log.warning(
            "%s%s is missing from the batch store %r, which holds later batches (up to %d): it was deleted "
            "or lost, and no orchestrator writes it again. The trainer trains (or, after a restart, "
            "replays) every batch from its checkpoint's step on, in order: put the batch back, or start "
            "the run afresh (a new output_dir, weight store and batch store)",
            still,
            batch_key(index),
            session.batches,
            newest,
        )
    elif newest < 0:
        timeout = session.config.idle_timeout
        log.warning(
            "%sthe batch store %r holds no batches (a new or empty store: is batch_store the path the "
            "orchestrator writes to?); the trainer waits for batch %d there %s",
            still,
            session.batches,
            index,
            f"until idle_timeout ({timeout:g} s) passes" if timeout else "for ever (idle_timeout = 0)",
        )
    elif waited_s:
        log.info("%sthe batch store %r holds batches up to %d", still, session.batches, newest)


def wait_for_batch(
    session: TrainerSession, index: int, stop: threading.Event, before_idle: Callable[[], None] = lambda: None
) -> Batch | None:
    """Batch `index` once it is in the store; None if `stop` is set or none came within `idle_timeout`.
    `before_idle` runs (on rank 0) once, when the batch is not there at the first look; every
    `IDLE_REPORT_S` of waiting, rank 0 says so (`report_waiting`).

    Under torchrun rank 0 polls and decides, and tells the other ranks after every poll (they
    then read the batch themselves): all ranks stop together, and none sits in one collective
    for longer than a poll interval, however long the orchestrator takes. A batch rank 0 cannot
    read (damaged, another batch's, a store that fails) is refused on every rank, each raising
    the error rank 0 met, rather than by rank 0 alone while the others wait in the collective.
    So is a failure of what rank 0 does while it waits (`before_idle`, listing the store:
    `on_rank_0`), and a batch another rank cannot read (`read_on_every_rank`).
    """
    config = session.config
    started = time.monotonic()
    deadline = started + config.idle_timeout if config.idle_timeout else None
    report_at = started + IDLE_REPORT_S
    while True:
        batch = decision = failed = None
        if session.rank == 0:
            try:
                batch = None if stop.is_set() else read_batch(session, index)
            except Exception as err:  # raised on every rank, once the others know
                failed = err
            timed_out = deadline is not None and time.monotonic() >= deadline
            decision = "train" if batch is not None else "stop" if stop.is_set() or timed_out else "wait"
            if failed is not None:
                known = isinstance(failed, WhetstoneError)
                decision = ("error", str(failed) if known else f"rank 0 cannot read {batch_key(index)}: {failed!r}")
        decision = broadcast(decision)  # rank 0's, on every rank
        if isinstance(decision, tuple):
            if failed is not None:
                raise failed
            raise WhetstoneError(decision[1])
        if decision == "stop":
            return None
        if decision == "train":
            return read_on_every_rank(session, index, batch)
        on_rank_0(before_idle, "finish the weight publish in flight")
        before_idle = lambda: None  # noqa: E731

        def report() -> None:
            nonlocal report_at
            if (now := time.monotonic()) >= report_at:
                report_waiting(session, index, now - started)
                report_at = now + IDLE_REPORT_S

        on_rank_0(report, f"list the batch store {session.batches!r}")
        if session.rank == 0:
            stop.wait(config.poll_interval)


def read_on_every_rank(session: TrainerSession, index: int, batch: Batch | None) -> Batch:
    """Batch `index`, which rank 0 has read (`batch` there), as every other rank reads it
    (`read_batch_rank_0_read`); every rank calls this. Whether each could is shared before any
    goes on: a rank that cannot raises its error, and every other rank an error naming the ranks
    that could not, rather than going on into the step's collectives, which those never join."""
    failed = None
    if batch is None:
        try:
            batch = read_batch_rank_0_read(session, index)
        except Exception as err:  # raised once the other ranks know
            failed = err
    if session.world_size > 1:
        mine = [float(failed is not None and rank == session.rank) for rank in range(session.world_size)]
        if failing := [rank for rank, count in enumerate(sum_over_ranks(mine)) if count]:
            if failed is not None:
                raise failed
            ranks = f"rank {failing[0]}" if len(failing) == 1 else f"ranks {', '.join(map(str, failing))}"
            raise WhetstoneError(
                f"{ranks} could not read {batch_key(index)}, which rank 0 read from {session.batches!r} "
                "(their own errors say why): every rank needs the same batch_store"
            )
    if failed is not None:
        raise failed
    return batch


def replay_matches_store(session: TrainerSession, weights: dict[str, torch.Tensor]) -> bool:
    """After replaying, do the trainer's weights (as published) equal the store's latest version?"""
    subscriber = Subscriber(session.weights, session.config.sync, name="trainer-check")
    subscriber.poll()
    mine = session.publisher.prepare(weights)
    return mine.keys() == subscriber.state.keys() and all(torch.equal(mine[k], subscriber.state[k]) for k in mine)


MISMATCH_METRICS = (
    "mismatch_kl_k3",
    "logprob_diff_mean",
    "logprob_diff_p99",
    "logprob_diff_max",
    "logprob_diff_over_ln2",
    "routing_",
)


def merge_part_metrics(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One record for a step of several mini-batches: trainer-vs-sampler mismatch as the first
    mini-batch measured it (before this batch moved the weights: pure engine/trainer mismatch),
    tokens summed, everything else averaged over the mini-batches."""
    if len(parts) == 1:
        return parts[0]
    merged: dict[str, Any] = {"optimizer_steps": len(parts)}
    for key, value in parts[0].items():
        if key.startswith(MISMATCH_METRICS) or not isinstance(value, (int, float)):
            merged[key] = value
        elif key == "logit_scale":  # where the step left it
            merged[key] = parts[-1][key]
        elif key == "tokens":
            merged[key] = sum(part[key] for part in parts)
        else:
            merged[key] = sum(part[key] for part in parts) / len(parts)
    return merged


def mini_batches(batch: Batch, parts: int, seed: int) -> list[Batch]:
    """The batch's `parts` mini-batches (`optimizer_steps_per_batch`: `shuffled_parts`), one
    optimizer step each. With several, they are cut from the rows that have a trained token: a
    row without one moves nothing, and a mini-batch of only such rows would be refused as a batch
    without trained tokens after the mini-batches before it had moved the weights (and again on
    every replay). A batch without any trained token is left whole, for the step to refuse."""
    trained = batch.loss_mask.any(dim=1)
    if parts > 1 and trained.any() and not trained.all():
        batch = batch.select(trained.nonzero().flatten().tolist())
    return shuffled_parts(batch, parts, seed)


def step_once(session: TrainerSession, batch: Batch) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """Train on `batch` (the next one) and advance the state; return the step's metrics and the
    weights to publish (None when replaying). Under torchrun every rank trains on its rows of the
    batch, and the metrics are the whole step's. Rows with a token the sampler gave probability 0
    are dropped, with a warning (`drop_impossible_rows`: a batch an older orchestrator wrote); a
    batch the model cannot train on is refused first (`check_batch`, `check_batch_routes`), by
    every rank, before the weights move."""
    config, state = session.config, session.state
    source = f"{batch_key(state.step)} in {session.batches!r}"
    tasks = [row.get("task_id") for row in batch.rows]
    batch, dropped = drop_impossible_rows(batch)
    if dropped and session.rank == 0:
        named = sorted({repr(tasks[row]) for row in dropped}) if tasks else []
        log.warning(
            "%s: dropped rows %s%s of %d, whose behavior logprob is -inf at a trained position (a token the "
            "sampler gave probability 0): the orchestrator drops such rollouts, so an older one wrote this batch",
            source,
            dropped[:10],
            f" (tasks {', '.join(named[:10])})" if named else "",
            len(dropped) + len(batch),
        )
    kept = sorted(set(range(len(dropped) + len(batch))) - set(dropped)) if dropped else None  # their stored numbers
    check_batch(batch, session.model.cfg.vocab_size, source=source, row_numbers=kept)
    check_batch_routes(batch, session.model.cfg, source=source)
    # before the step, which nothing in a row may fail once the weights moved; a row with no sampled token is 0 behind
    staleness_max = max((staleness(state.step, row.get("oldest_version")) for row in batch.rows), default=0)
    opt, replaying = config.optimizer, state.step < session.replay_until
    lr = lr_at(
        state.step,
        peak_lr=opt.lr,
        warmup_steps=opt.warmup_steps,
        total_steps=config.max_steps or 1,
        min_lr_ratio=opt.min_lr_ratio,
    )
    learner = Learner(session.model, session.optimizer, session.reference, session.logit_scale)
    settings = StepSettings.of(config)
    started = time.perf_counter()
    parts = []
    for number, part in enumerate(mini_batches(batch, config.optimizer_steps_per_batch, seed=state.step)):
        rows, normalizer, demos, demo_normalizer = part, None, None, None
        if session.demos is not None:  # seeded by (step, part): a replayed step draws the same rows
            demos = demo_rows(session.demos, config.demo_rows, seed=state.step * 1_000 + number)
        if session.world_size > 1:
            rows = rank_rows(part, session.rank, session.world_size)
            normalizer = global_normalizer(rows, config.loss.aggregation)
            if demos is not None:
                demos = rank_rows(demos, session.rank, session.world_size)
                demo_normalizer = global_normalizer(demos, "token")
        anchor = None if demos is None else DemoAnchor(demos, config.demo_coef, demo_normalizer)
        parts.append(train_step(learner, rows, settings, lr, normalizer=normalizer, anchor=anchor))
    record: dict[str, Any] = {
        "step": state.step,
        "replayed": replaying,
        "world_size": session.world_size,
        **merge_part_metrics(parts),
        "train_s": time.perf_counter() - started,
    }
    state.step += 1
    state.tokens += batch.num_loss_tokens
    state.data["next_batch"] = state.step
    if session.logit_scale is not None:
        state.data["logit_scale"] = session.logit_scale.state()
    weights = None
    if not replaying or state.step == session.replay_until:
        weights = full_state_dict(session.model)  # every rank takes part; rank 0 gets the tensors
    if replaying and state.step == session.replay_until:  # rank 0's check, its failure every rank's

        def check_replay() -> bool | None:
            return None if session.publisher is None else replay_matches_store(session, weights)

        matches = on_rank_0(check_replay, f"compare the replayed weights with the weight store's version {state.step}")
        if matches is not None:
            record["replay_matches_store"] = matches
        if matches is False:
            log.warning(
                "replayed weights differ from the store's version %d (non-deterministic kernels or "
                "another thread count?); the next delta carries the difference",
                state.step,
            )
    record.update(
        {key: batch.meta[key] for key in BATCH_META_SCALARS if key in batch.meta},
        staleness_max=staleness_max,
        staleness_histogram=batch.meta.get("staleness_histogram", {}),
        groups=batch.meta.get("groups", {}),
        rows=len(batch),
    )
    return record, None if replaying else weights


class Publishing:
    """The trainer's weight versions, and the step records that wait for theirs.

    With `background`, version n + 1 is copied off the model at once and then encoded and uploaded
    on the publisher's worker thread while step n + 1 trains: a step costs max(train, publish)
    instead of their sum when batches are waiting (a 380M model's publish took longer than its
    training step on one H200). One publish is in flight at most: the next step's publish, a
    checkpoint (which must not get ahead of the store) and going idle for want of a batch wait for
    it first. A step's record is written once its version is published, with `publish_s` the
    seconds the loop was held up by it and `publish_total_s` the whole publish."""

    def __init__(self, publisher: Publisher | None, background: bool, write: Callable[[dict[str, Any]], None]):
        self.publisher, self.background, self.write = publisher, background, write
        self._pending: tuple[dict[str, Any], Future[Published], int] | None = None
        """The step record whose version is being published, the publish, and the version expected."""

    def step_done(self, record: dict[str, Any], weights: dict[str, torch.Tensor] | None, version: int) -> None:
        """Publish `weights` as `version` (record `record` once it is out), or write `record` now
        when there is nothing to publish (a replayed step)."""
        self.finish()
        if weights is None or self.publisher is None:
            record.setdefault("publish_s", 0.0)
            self.write(record)
            return
        started = time.perf_counter()
        publish = self.publisher.publish_later(weights)
        record["publish_s"] = time.perf_counter() - started
        self._pending = (record, publish, version)
        if not self.background:  # inline: the step waits for its own publish
            self.finish()

    @contextmanager
    def recording_on_failure(self) -> Iterator[None]:
        """If the loop fails, still wait for the publish in flight and write its step's record
        (its version is out), logging rather than raising a failure of that publish."""
        try:
            yield
        except BaseException:
            try:
                self.finish()
            except Exception:
                log.exception("the publish in flight when the trainer failed did not complete")
            raise

    def finish(self, held_up: bool = True) -> None:
        """Wait for the publish in flight, if any, and write its step's record. `held_up`: the
        wait counts as the loop's publish time (False when the loop would be idle anyway)."""
        if self._pending is None:
            return
        record, publish, version = self._pending
        self._pending = None
        waited = time.perf_counter()
        manifest, seconds = publish.result()  # a failed publish fails the trainer here, as it would inline
        if held_up:
            record["publish_s"] += time.perf_counter() - waited
        if manifest.version != version:
            raise WhetstoneError(
                f"published version {manifest.version} after step {version - 1}: "
                f"another trainer writes to {self.publisher.store!r}?"
            )
        record.update(
            version=manifest.version,
            publish_total_s=seconds,
            delta_bytes=manifest.encoded_bytes,
            delta_kind=manifest.kind,
            delta_ratio=manifest.ratio,
        )
        self.write(record)


def run_trainer(config: TrainerConfig) -> dict[str, Any]:
    """Train until `max_steps`, until `idle_timeout` passes without a batch, or until SIGTERM /
    SIGINT; checkpoint, and return a summary. Under torchrun, on every rank (training.distributed)."""
    # the signals taken from the start: ranks told to stop while one is still setting up must all
    # reach the loop, where rank 0 decides for all (a rank killed there would leave the others
    # waiting in a collective)
    with torchrun_group(config.device), stop_on_signals() as stop:
        return _run(open_trainer(config), stop)


def _run(session: TrainerSession, stop: threading.Event) -> dict[str, Any]:
    """The loop, on every rank. What rank 0 alone does (its files, publishing, listing the batch
    store) goes through `on_rank_0` wherever the ranks go on into a collective after it, so that
    its failure is every rank's there, not rank 0's alone while the others wait for it."""
    config, state = session.config, session.state
    lead = session.rank == 0  # the one rank that writes files and publishes
    first_step, checkpointed = state.step, state.step

    def write(record: dict[str, Any]) -> None:
        if lead:
            work = record["train_s"] + record["publish_s"]
            record["busy"] = work / max(work + record["wait_s"], 1e-9)
            metrics.write(record)
            bar.update(1, step=record["step"] + 1, loss=record["loss"], kl=record["mismatch_kl_k3"])

    publishing = Publishing(session.publisher, config.publish_in_background, write)

    def checkpoint() -> None:
        nonlocal checkpointed
        # the store must not be behind a checkpoint (a restart refuses that)
        on_rank_0(publishing.finish, "finish the weight publish in flight")
        save_sharded_checkpoint(
            session.checkpoints,
            session.model,
            session.optimizer,
            partial(new_optimizer, config),
            state,
            config.model_dump(mode="json"),
            config.keep_checkpoints,
        )
        checkpointed = state.step

    total = config.max_steps - first_step if config.max_steps else None
    with ExitStack() as lead_files:  # rank 0's metrics and progress bar

        def start() -> tuple[MetricsWriter, Any]:
            session.run_dir.mkdir(parents=True, exist_ok=True)
            write_toml(session.run_dir / "config.toml", config)
            if not config.max_steps or state.step < config.max_steps:
                report_waiting(session, state.step)  # an empty batch store is named at the start
            # steps below the store's newest version were published: their records stand (their replays
            # are logged as `replayed`); those from it on are of versions the store no longer holds
            writer = MetricsWriter(
                session.run_dir / "metrics.jsonl",
                config.tracking,
                role="trainer",
                run_config=config,
                resume_at=max(first_step, session.replay_until),
            )
            return lead_files.enter_context(writer), lead_files.enter_context(progress_bar(total, "trainer", "step"))

        metrics, bar = on_rank_0(start, f"start its record in output_dir {session.run_dir}") or (None, None)
        with publishing.recording_on_failure():
            while not config.max_steps or state.step < config.max_steps:
                waited = time.perf_counter()
                batch = wait_for_batch(session, state.step, stop, before_idle=partial(publishing.finish, held_up=False))
                if batch is None:
                    log.info("stopping at batch %d (signal or idle_timeout)", state.step)
                    break
                wait_s = time.perf_counter() - waited
                started_cpu = time.process_time()
                record, weights = step_once(session, batch)
                record["wait_s"] = wait_s
                # this process's CPU (every thread: the previous version's background publish too)
                record["cpu_s"] = time.process_time() - started_cpu
                publish = partial(publishing.step_done, record, weights, version=state.step)
                on_rank_0(publish, f"publish weight version {state.step}")
                if state.step % config.checkpoint_interval == 0:
                    checkpoint()
            if state.step != checkpointed:
                checkpoint()
            on_rank_0(publishing.finish, "finish the weight publish in flight")
        on_rank_0(lead_files.close, f"close {session.run_dir / 'metrics.jsonl'}")
    if session.publisher is not None:
        session.publisher.close()

    def latest() -> int | None:
        return session.weights.latest() if session.weights is not None else None

    return {
        "output_dir": str(session.run_dir),
        "step": state.step,
        "version": on_rank_0(latest, f"read the latest version in the weight store {config.sync.store}"),
        "steps_this_run": state.step - first_step,
        "replayed": max(0, session.replay_until - first_step),
        "resumed_from": str(session.resumed_from) if session.resumed_from else None,
        "rank": session.rank,
        "world_size": session.world_size,
        "device": str(session.device),
    }
