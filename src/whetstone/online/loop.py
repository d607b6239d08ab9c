"""The online loop: fresh feedback on the deployed model -> one policy-gradient step -> held-out
gate -> publish, or discard and say why. Servers pick new versions up through the weight store.

    <output_dir>/config.toml     the config as last run
    <output_dir>/metrics.jsonl   one record per update: decision, reason, counts, loss, scores, timings
    <output_dir>/state.json      the feedback cursor (newest event read), the feedback store's id,
                                 the update count, the events an update is consuming, whose
                                 weights the versions that can still matter hold (`lineage`: a
                                 rollback's are an earlier version's; `Lineage.state`), and the
                                 weight store that lineage is of (`weight_store`: its location,
                                 the deployed version and that version's manifest digest)
    <output_dir>/checkpoints/step_<version>/   fp32 masters and AdamW moments of a version the
                                 loop published, and the update count then (the newest two;
                                 training.checkpoint's format)

The weight store says which version the loop continues from: on start, and whenever the store's
newest version is not the one the loop published last (a rollback, another publisher), the loop
adopts that version. If it saved a checkpoint of that version (a restart), it resumes its masters
and moments, after checking they publish to exactly the store's weights; otherwise it takes the
store's weights with a fresh optimizer, and logs why. Feedback is read at most once: the cursor
is saved before training, so a crash loses that update's events rather than training on them
twice; the range being consumed is saved with it, so a restart says which events were lost (log,
and `lost_events` in the next metrics record). Before a candidate is published state.json also
says which version it goes on from (`publishing_on`), and the update is recorded as finished only
after the version's checkpoint: a loop killed after the publish and before recording it finds
the version in the store on restart, and says the events were trained on and published, not
lost (log, and `unrecorded_updates` in the next metrics record). Where it was killed writing the
checkpoint, the loop takes the version's weights from the store and the AdamW moments of the
version the update stepped from (its checkpoint, checked against the store's weights of it), one
update behind rather than fresh, and saves them as the version's checkpoint. Any cursor goes
with any checkpoint: what must match is moments and weights, and the checkpoint holds both,
written as one directory.

The cursor is an event number of one database: state.json keeps the store's id beside it, and the
loop refuses a store with another id (recreated, replaced) or whose newest event is below the
cursor (restored from an older copy), where it would wait for numbers already passed and then
skip events. Each update also records in the store how far it read (`FeedbackStore.consume`): a
loop without a state.json (a new output_dir) starts there, so no event is trained twice. Update
numbers (the metrics' step) go on after the newest in metrics.jsonl and in the checkpoints when
state.json is gone.
A reply's staleness is the number of updates between the weights it was sampled with and the
deployed ones (`Lineage`): a rollback's version holds an earlier version's weights. The weight
store may collect a rollback's manifest while the loop is stopped: state.json keeps what it
said, so a restarted loop counts the replies sampled with it as the loop before did. That lineage
is of one weight store: state.json names it and the deployed version's manifest digest, and a
restarted loop refuses a store that is not that one (`check_weight_store`).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from whetstone.config import expand_path, write_toml
from whetstone.errors import CheckpointError, WhetstoneError
from whetstone.inference.feedback import lost_tables
from whetstone.model.hf import load_hf
from whetstone.model.layout import autocast_tables
from whetstone.online.config import OnlineConfig
from whetstone.online.gate import Gate, Verdict
from whetstone.online.samples import feedback_batch
from whetstone.online.weights import Lineage, load_version
from whetstone.rl.batch import Batch, check_batch
from whetstone.rl.logit_scale import LogitScale
from whetstone.store.base import MissingObjectError
from whetstone.store.feedback import FeedbackStore, FeedbackStoreError
from whetstone.sync import Publisher, SyncConfig, WeightStore
from whetstone.sync.weight_store import VersionExistsError
from whetstone.tokenizer import Tokenizer
from whetstone.trainer.step import Learner, StepSettings, check_batch_routes, train_step
from whetstone.training.checkpoint import (
    TrainState,
    checkpoint_dir,
    list_checkpoints,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from whetstone.training.optim import optimizer_for
from whetstone.utils.atomic import atomic_write_json
from whetstone.utils.device import resolve_device, use_device
from whetstone.utils.metrics import MetricsWriter, read_metrics
from whetstone.utils.runtime import configure_process

log = logging.getLogger("whetstone.online")

KEEP_CHECKPOINTS = 2

RETRY_WAIT_S = (0.5, 30.0)
"""First and longest wait between tries of a failed feedback store read (doubling)."""

T = TypeVar("T")

Count = Annotated[int, Field(ge=0)]


class _Saved(BaseModel):
    model_config = ConfigDict(strict=True)


class _SavedConsuming(_Saved):
    update: Count
    after: Count
    through: Count
    events: Count
    publishing_on: Count | None = None


class _SavedLineage(_Saved):
    newest_read: int = -1
    weights: dict[int, Count] = {}


class _SavedUnrecorded(_Saved):
    update: Count
    version: Count
    events: Count


class _SavedWeightStore(_Saved):
    store: str
    version: Count | None
    manifest: str | None


class SavedState(_Saved):
    """The shape of state.json (`OnlineLoop.save_state`), checked before the loop trusts it: a
    damaged or foreign file is refused, saying so, rather than failing somewhere in its use.
    Fields other than the cursor and the update count may be missing (an older whetstone's)."""

    cursor: Count
    updates: Count
    store: str = ""
    consuming: _SavedConsuming | None = None
    lost_events: Count = 0
    unrecorded_updates: list[_SavedUnrecorded] = []
    lineage: _SavedLineage = _SavedLineage()
    weight_store: _SavedWeightStore | None = None


def weight_store_location(config: SyncConfig) -> str:
    """Where `config`'s weight store is, as one string to compare: an S3 URL (with its endpoint,
    if any), or a local directory's absolute path (a relative one resolves against the working
    directory, so the same text from another directory is another store)."""
    if config.store.startswith("s3://"):
        return config.store if config.endpoint_url is None else f"{config.store} at {config.endpoint_url}"
    return str(expand_path(config.store.removeprefix("file://")).resolve())


class OnlineLoop:
    def __init__(self, config: OnlineConfig):
        configure_process(config.threads)
        self.config = config
        self.run_dir = expand_path(config.output_dir)
        self.checkpoints = self.run_dir / "checkpoints"
        self.device = resolve_device(config.device)
        use_device(self.device)
        self.model = load_hf(config.model_path).to(self.device)
        self.gate = Gate(
            config.gate,
            load_hf(config.model_path),
            Tokenizer.load(config.model_path),
            numerics=config.numerics,
            dtype=config.dtype,
            device=str(self.device),
        )  # the servers' (docs/online.md)
        # created once the model loaded: a wrong model_path leaves no folder behind
        self.run_dir.mkdir(parents=True, exist_ok=True)  # update() saves its cursor here, run() or not
        self.weights = WeightStore.open(config.sync)
        self.feedback = FeedbackStore.open(config.feedback_store)
        self.lineage = Lineage(self.weights)
        self.deployed_manifest: str | None = None
        """The digest of the deployed version's manifest (None if it could not be read): with the
        store's location, what ties state.json's lineage to this weight store."""
        self.stop = threading.Event()
        """Set by SIGTERM / SIGINT while `run` runs: a retry of the feedback store stops waiting."""
        self.state_path = self.run_dir / "state.json"
        self.stepped_from: dict[int, int] = {}
        """Version -> the version it is an update of, for a version an update published and was
        stopped before checkpointing (`load_state`): whose moments the loop resumes it with."""
        self.state = self.load_state()
        self.version: int | None = None
        """The deployed version: the store's newest, which the policy's weights are."""
        self.scores: dict[int, float] = {}
        """Gate score of each version scored so far."""
        self.start_score = 0.0
        """Gate score of the version the loop started from or last adopted."""
        self.last_update = time.monotonic()
        self.follow_store()

    def follow_store(self) -> int | None:
        """Make the policy the store's newest version (publishing the model's weights as version 0
        into an empty store). Returns the version adopted, or None if the policy already was it."""
        latest = self.weights.latest()
        if latest is not None and latest == self.version:
            return None
        self.publisher = Publisher(self.weights, self.config.sync, autocast_tables(self.model))
        self.optimizer = self.new_optimizer()
        if latest is None:
            manifest = self.publisher.publish(self.model.state_dict(), full=True)
            latest, self.deployed_manifest = manifest.version, manifest.digest
        else:
            served = load_version(self.weights, self.config.sync, latest)
            try:
                self.model.load_state_dict(served)
            except RuntimeError as err:  # missing or extra tensors, other shapes
                raise WhetstoneError(
                    f"version {latest} in the weight store {self.config.sync.store} is not a version of the model in "
                    f"{self.config.model_path}: {err}"
                ) from None
            self.publisher.resume()  # the next version is a delta on this one
            if self.weights.latest() != latest:  # another version (a rollback) landed meanwhile
                return self.follow_store()
            why_not = self.resume_checkpoint(latest, served)
            if why_not and latest in self.stepped_from:
                why_not = self.resume_unrecorded(latest, self.stepped_from.pop(latest), served, why_not)
            if why_not:
                self.model.load_state_dict(served)
                self.optimizer = self.new_optimizer()
                log.info("version %d: a fresh optimizer (%s)", latest, why_not)
            try:
                self.deployed_manifest = self.weights.manifest_digest(latest)
            except MissingObjectError:  # collected or withdrawn this instant: the next adoption reads it
                self.deployed_manifest = None
        self.reference = None
        if self.config.loss.kl_coef > 0:  # KL to the weights the loop started from
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
            if self.logit_scale is not None:  # as at the scale's start: the step applies the scale
                self.logit_scale.unfold(self.reference)
        self.version = latest
        self.lineage.weights_of(latest)  # remembered while its manifest is there
        if latest not in self.scores:
            self.scores[latest] = self.gate.score(self.deployed_weights(), latest)
        self.start_score = self.scores[latest]
        return latest

    def new_optimizer(self) -> torch.optim.Optimizer:
        """AdamW for the weights, and a fresh learned logit scale (`logit_scale_lr` > 0) beside it."""
        opt = self.config.optimizer
        self.logit_scale = (
            LogitScale(self.config.logit_scale_lr, beta1=opt.betas[0], beta2=opt.betas[1], eps=opt.eps)
            if self.config.logit_scale_lr > 0
            else None
        )
        return optimizer_for(self.model, opt)

    def resume_checkpoint(self, version: int, served: dict[str, torch.Tensor]) -> str:
        """Load the masters and moments the loop saved when it published `version`, if they
        publish to exactly `served` (the store's weights of it); returns why not, or "" if loaded."""
        path = checkpoint_dir(self.checkpoints, version)
        if not path.is_dir():
            return f"no optimizer state saved for it in {self.checkpoints}"
        try:
            state = load_checkpoint(path, self.model, self.optimizer)
            if self.logit_scale is not None and "logit_scale" in state.data:
                self.logit_scale.load_state(state.data["logit_scale"])
        except CheckpointError as err:
            return str(err)
        published = self.publisher.prepare(self.model.state_dict())
        differs = next((name for name, tensor in published.items() if not torch.equal(tensor, served[name])), None)
        if differs is not None:
            return f"{path} is not of the store's version {version} ({differs} differs; another store?)"
        log.info("version %d: resumed its fp32 masters and optimizer moments from %s", version, path)
        return ""

    def resume_unrecorded(self, version: int, base: int, served: dict[str, torch.Tensor], why_not: str) -> str:
        """For `version`, published by an update of `base` that was stopped before it saved its
        checkpoint: `served` (the store's weights of `version`) with the AdamW moments (and the
        learned logit scale) of `base`'s checkpoint, checked to publish to the store's weights of
        `base`, saved as `version`'s checkpoint, so a later restart resumes them too. The moments
        miss that one update's gradient; a fresh optimizer's miss every one, and its first step
        moves every weight by about the full learning rate. Returns why not (after `why_not`, why
        `version`'s own checkpoint could not be resumed), or "" if resumed."""
        self.optimizer = self.new_optimizer()  # nothing of a checkpoint of `version` that did not fit
        try:
            base_served = load_version(self.weights, self.config.sync, base)
        except WhetstoneError as err:
            return f"{why_not}; nor of version {base}, which the update that published it stepped from: {err}"
        why_base = self.resume_checkpoint(base, base_served)
        if why_base:
            return f"{why_not}; nor of version {base}, which the update that published it stepped from: {why_base}"
        self.model.load_state_dict(served)
        self.checkpoint(version)
        log.warning(
            "version %d: the store's weights, with the optimizer moments of version %d, which the update that "
            "published it stepped from (one update behind), saved as its checkpoint",
            version,
            base,
        )
        return ""

    def load_state(self) -> dict[str, Any]:
        """state.json, checked against the weight store (`check_weight_store`) and the feedback
        store (`check_store`), or a fresh loop's: it starts after the newest event a loop recorded
        reading in the store (0 in a store no loop has read), so a new output_dir or a lost
        state.json never trains an event twice, and numbers its updates on from its metrics.jsonl
        and checkpoints (`updates_recorded`). An update that read events and did not finish (a
        killed loop) is said: its events are lost, unless it published its version (`published_by`)."""
        if not self.state_path.exists():
            marks = self.read_store(self.feedback.marks)
            if marks.consumed:
                log.warning(
                    "no %s: starting after feedback event %d of %s, the newest an online loop recorded "
                    "reading there (events up to it are not read again)",
                    self.state_path,
                    marks.consumed,
                    self.feedback.name,
                )
            return {"cursor": marks.consumed, "updates": self.updates_recorded(), "store": marks.store_id}
        self.state = self.read_state_file()
        self.check_weight_store(self.state.pop("weight_store", None))  # none in a state.json of an older whetstone
        self.lineage.restore(self.state.pop("lineage", {}))  # none in a state.json of an older whetstone
        consuming = self.state.pop("consuming", None)
        published = self.published_by(consuming) if consuming is not None else None
        if published is not None:
            log.warning(
                "update %d read feedback events %d..%d (%d events), trained on them and published version %d, "
                "and was stopped or killed before recording it (it has no metrics record): they are not read "
                "again, and the next metrics record names the update (`unrecorded_updates`)",
                consuming["update"],
                consuming["after"] + 1,
                consuming["through"],
                consuming["events"],
                published,
            )
            unrecorded = {"update": consuming["update"], "version": published, "events": consuming["events"]}
            self.state["unrecorded_updates"] = [*self.state.get("unrecorded_updates", []), unrecorded]
            self.stepped_from[published] = consuming["publishing_on"]
        elif consuming is not None:  # forgotten at the next update's end, when its record says so
            log.warning(
                "update %d read feedback events %d..%d (%d events) and did not finish (the loop was "
                "stopped or killed during it): they were not trained on and are not read again",
                consuming["update"],
                consuming["after"] + 1,
                consuming["through"],
                consuming["events"],
            )
            self.state["lost_events"] = self.state.get("lost_events", 0) + consuming["events"]
        self.check_store()
        return self.state

    def published_by(self, consuming: dict[str, Any]) -> int | None:
        """The version an update that did not finish published, or None if it did not get that
        far. Its `consuming` record names the version it was publishing on (`publishing_on`,
        saved right before the publish); a publish makes the next version, exclusively, so the
        update's is that one, if it is in the store with weights of its own (a rollback's
        manifest names an earlier version's). A version another writer made there instead would
        be taken for it, as the loop takes such versions anyway (`follow_store`). A manifest that
        cannot be read says nothing: None, and the events count as lost."""
        base = consuming.get("publishing_on")
        if base is None or base + 1 not in self.weights.versions():
            return None
        try:
            manifest = self.weights.manifest(base + 1)
        except MissingObjectError:  # collected or withdrawn meanwhile
            return None
        return base + 1 if manifest.republishes is None else None

    def read_state_file(self) -> dict[str, Any]:
        """state.json as saved, or a WhetstoneError naming what is wrong with it and what to do."""
        text = self.state_path.read_bytes()
        try:
            SavedState.model_validate_json(text)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            got = "" if first["type"] in ("missing", "json_invalid") else f" (got {first['input']!r:.80})"
            problem = (f"{where}: " if where else "") + first["msg"] + got
            raise WhetstoneError(
                f"{self.state_path} is not an online loop's state ({problem}): it is damaged, or another "
                "program's. Put back a good copy; or move it away, and the loop starts after the newest feedback "
                f"event a loop recorded reading in {self.feedback.name} and adopts the weight store's newest "
                "version"
            ) from None
        return json.loads(text)

    def updates_recorded(self) -> int:
        """The number after the newest update this folder records (0 if it records none): where
        a loop whose state.json is gone (moved away, as `check_store` may ask, or lost) goes on
        numbering, so its updates do not take the numbers of the ones before (their metrics
        records, TensorBoard's and W&B's steps, and the update count beside the versions the loop
        published). metrics.jsonl has every update; each checkpoint the update count when its
        version was published, so a loop that lost metrics.jsonl too does not number updates from
        0 again beside the versions it published. The feedback and weight
        stores themselves cannot say: another loop, or the RL trainer, may have read and
        published there (a new output_dir on the RL run's store starts at update 0)."""
        path, found = self.run_dir / "metrics.jsonl", []
        if path.exists():
            numbers = [r["update"] for r in read_metrics(path) if isinstance(r.get("update"), int)]
            found += [(max(numbers) + 1, str(path))] if numbers else []
        for checkpoint in list_checkpoints(self.checkpoints):
            try:
                data = read_state(checkpoint)["data"]
            except CheckpointError:  # damaged: resuming it says so
                continue
            updates = data.get("updates")  # none in a checkpoint of an older whetstone
            if isinstance(updates, int) and updates > 0:
                found.append((updates, f"checkpoint {checkpoint}"))
        if not found:
            return 0
        updates, source = max(found, key=lambda number_and_source: number_and_source[0])  # metrics.jsonl on a tie
        log.warning("no %s: numbering updates from %d, after the newest in %s", self.state_path, updates, source)
        return updates

    def check_weight_store(self, saved: dict[str, Any] | None) -> None:
        """Refuse a weight store that is not the one state.json's lineage is of (`saved`: its
        location, and the version deployed then with its manifest digest). The lineage says whose
        weights versions hold, rollbacks whose manifests are collected among them: taken for
        another run's store, it would count replies at distances they do not have. Another
        location is that store if it holds that publish of the version (its digest: a copied or
        moved store). At the same location the store is the loop's own, whatever happened to it
        while the loop was stopped (a version collected, withdrawn and published again, the store
        wiped): the loop goes on from its newest version, as a running loop follows the store, and
        says what changed."""
        if saved is None or saved.get("manifest") is None:
            return  # a state.json of an older whetstone, or a version adopted without its digest
        where, version, digest = saved["store"], saved["version"], saved["manifest"]
        here = weight_store_location(self.config.sync)
        try:
            found = self.weights.manifest_digest(version)
        except MissingObjectError:
            found = None
        if found == digest:
            return
        holds = "not in it" if found is None else f"another publish (manifest {found})"
        problem = f"its version {version} is {holds}"
        if here == where:
            if found is not None or version > max(self.weights.versions(), default=-1):
                log.warning(
                    "the weight store %s changed while the loop was stopped: %s (withdrawn and published again, "
                    "or the store wiped); the loop goes on from its newest version",
                    here,
                    problem,
                )
            return  # or the version was collected (sync.keep_keyframes) while the loop was stopped
        raise WhetstoneError(
            f"the weight store {here} is not the one this loop published to: {self.state_path} continues "
            f"version {version} (manifest {digest}) of the weight store {where}, and {problem}. What "
            f"{self.state_path} says of the versions' weights (`lineage`) is of that store. To go on with it, "
            f"point sync.store at it; to go on with this one, move {self.state_path} away: the loop then adopts "
            "this store's newest version and starts after the newest feedback event a loop recorded reading"
        )

    def check_store(self) -> None:
        """Refuse a feedback store the saved cursor is not a position in: another id (the database
        was recreated or replaced: it numbers its events anew) or a newest event below the cursor
        (restored from an older copy): new events would take numbers the loop has passed. Events
        another loop recorded reading beyond the cursor are skipped, with a warning."""
        marks = self.read_store(self.feedback.marks)
        saved, cursor = self.state.setdefault("store", marks.store_id), self.state["cursor"]
        fresh = (
            f"move {self.state_path} away, and the loop starts after event {marks.consumed}, the newest one "
            "a loop recorded reading in it"
        )
        if marks.store_id != saved:
            raise WhetstoneError(
                f"the feedback store {self.feedback.name} is not the one this loop was reading: its id is "
                f"{marks.store_id}, and {self.state_path} is a position (event {cursor}) in the store with id "
                f"{saved}. It was recreated or replaced, and numbers its events anew. To read the old store, "
                f"point feedback_store at it; to read this one, {fresh}"
            )
        if marks.newest < cursor:
            raise WhetstoneError(
                f"the feedback store {self.feedback.name} holds events up to {marks.newest}, but this loop has "
                f"read up to event {cursor} ({self.state_path}): it was restored from an older copy (or its "
                f"events deleted), and its new events would take numbers the loop has passed. To read it, {fresh}"
            )
        if marks.consumed > cursor:
            log.warning(
                "feedback events %d..%d of %s were read by another online loop (the store records reading up "
                "to %d, %s up to %d): skipping them, so they are not trained on twice",
                cursor + 1,
                marks.consumed,
                self.feedback.name,
                marks.consumed,
                self.state_path,
                cursor,
            )
            self.state["cursor"] = marks.consumed

    def read_store(self, read: Callable[[], T]) -> T:
        """`read()` of the feedback store, tried again after a FeedbackStoreError (the waits
        doubling, each failure logged) for up to `feedback_retry_s`; then that error. A store
        whose tables are gone (`lost_tables`) is not waited for: that error at once, saying so."""
        give_up, wait = time.monotonic() + self.config.feedback_retry_s, RETRY_WAIT_S[0]
        while True:
            try:
                return read()
            except FeedbackStoreError as err:
                why = lost_tables(err, self.feedback)
                if why is not None:
                    raise FeedbackStoreError(why, why, transient=False) from None
                left = give_up - time.monotonic()
                if left <= 0 or self.stop.is_set():
                    raise
                log.warning(
                    "%s; trying again in %.1f s (giving up in %.0f s: feedback_retry_s)", err, min(wait, left), left
                )
                self.stop.wait(min(wait, left))
                wait = min(2 * wait, RETRY_WAIT_S[1])

    def due(self) -> bool:
        trigger = self.config.trigger
        self.check_store()
        pending = self.read_store(lambda: self.feedback.count_after(self.state["cursor"]))
        if pending >= trigger.every_events:
            return True
        return pending >= trigger.min_events and time.monotonic() - self.last_update >= trigger.every_seconds

    def deployed_weights(self):
        """The policy's weights as published (between updates they are the deployed version's)."""
        return self.publisher.prepare(self.model.state_dict())

    def update(self) -> dict[str, Any]:
        """One update: read the new feedback, train, gate, then publish or discard. Returns its
        metrics record (`decision`: published, discarded or skipped, and the `reason`)."""
        record: dict[str, Any] = {"update": self.state["updates"]}
        adopted = self.follow_store()
        if adopted is not None:
            record["adopted"] = adopted
            log.warning("the weight store moved to version %d (a rollback?): adopted it", adopted)
        self.check_store()
        for reported in ("lost_events", "unrecorded_updates"):
            if reported in self.state:
                record[reported] = self.state[reported]
        after = self.state["cursor"]
        rated, passed = self.read_feedback()
        record["passed_stale"] = passed
        self.state["updates"] += 1
        self.state["consuming"] = {
            "update": record["update"],
            "after": after,
            "through": self.state["cursor"],
            "events": len(rated) + passed,
        }
        self.save_state()  # before training: nothing is trained twice
        self.read_store(lambda: self.feedback.consume(self.state["store"], self.state["cursor"]))
        self.last_update = time.monotonic()
        record |= self.prune()

        built = feedback_batch(
            rated, self.config, self.version, meta={"index": record["update"]}, behind=self.behind, model=self.model.cfg
        )
        record.update(
            built.counts,
            version_before=self.version,
            reward_mean=built.reward_mean,
            first_rated_at=min((r.rated_at for r in rated), default=None),
            last_rated_at=max((r.rated_at for r in rated), default=None),
        )
        if built.batch is None:
            self.consumed()
            return record | {"decision": "skipped", "reason": built.skip_reason, "version": self.version}
        record |= self.train_and_gate(built.batch)
        if record["decision"] == "published":  # before `consumed`: a loop stopped while writing it finds
            record |= self.checkpoint()  # the version its update published (`published_by`)
        self.consumed()
        log.log(
            logging.INFO if record["decision"] == "published" else logging.WARNING,
            "update %d %s (version %d): %s",
            record["update"],
            record["decision"],
            self.version,
            record["reason"],
        )
        return record

    def consumed(self) -> None:
        """The update's events are trained on (published or discarded) or judged unusable: forget
        the range being consumed, and the lost events and unrecorded updates its record reported."""
        self.state.pop("consuming", None)
        self.state.pop("lost_events", None)
        self.state.pop("unrecorded_updates", None)
        self.save_state()

    def save_state(self) -> None:
        """Write state.json: `state`, what the lineage of the weight versions that can still
        matter is (`Lineage.state`), which the weight store may collect before a restart, and
        which weight store that is (`check_weight_store`)."""
        lineage = self.lineage.state(self.version, self.config.staleness.max_off_policy_steps)
        store = {
            "store": weight_store_location(self.config.sync),
            "version": self.version,
            "manifest": self.deployed_manifest,
        }
        atomic_write_json(self.state_path, self.state | {"lineage": lineage, "weight_store": store})

    def behind(self, versions: list[int]) -> int:
        """Updates between the weights a reply was sampled with (its token `versions`) and the
        deployed version's, up to the staleness bound (one more: beyond it)."""
        return self.lineage.behind(self.version, versions, self.config.staleness.max_off_policy_steps)

    def read_feedback(self) -> tuple[list, int]:
        """The oldest `trigger.max_events` unread events whose responses are within the staleness
        bound of the deployed version, and how many beyond it were read past on the way. Those
        can never be trained on; taken first, a backlog (users rating faster than updates land)
        would fill every update with them and leave the fresh events waiting until they, too,
        went stale. The cursor moves past everything read."""
        limit, bound = self.config.trigger.max_events, self.config.staleness.max_off_policy_steps
        fresh, passed = [], 0
        while len(fresh) < limit:
            page = self.read_store(lambda: self.feedback.rated_after(self.state["cursor"], limit - len(fresh)))
            if not page:
                break
            self.state["cursor"] = page[-1].seq
            for item in page:
                if self.behind(item.response.versions) > bound:
                    passed += 1
                else:
                    fresh.append(item)
        return fresh, passed

    def step(self, batch: Batch) -> dict[str, Any]:
        """One policy-gradient step of the policy on `batch` (the RL trainer's); its metrics. The
        batch is checked first as the RL trainer checks each of its batches (`check_batch`,
        `check_batch_routes`): one the model cannot train on is refused, naming the update and
        its feedback events, before the weights move, not failed on in the forward (an index
        error, or on a GPU a device-side assert that ends the process)."""
        source = f"update {batch.meta.get('index', '?')}'s feedback batch"
        consuming = self.state.get("consuming")
        if consuming:
            source += f" (events {consuming['after'] + 1}..{consuming['through']} of {self.feedback.name})"
        check_batch(batch, self.model.cfg.vocab_size, source=source)
        check_batch_routes(batch, self.model.cfg, source=source)
        learner = Learner(self.model, self.optimizer, self.reference, self.logit_scale)
        return train_step(learner, batch, StepSettings.of(self.config), self.config.optimizer.lr)

    def train_and_gate(self, batch: Batch) -> dict[str, Any]:
        """Step on `batch`; publish the candidate if the gate passes it, else restore the policy
        and the optimizer to before the step."""
        saved = (
            {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            copy.deepcopy(self.optimizer.state_dict()),
            self.logit_scale.state() if self.logit_scale is not None else None,
        )
        started = time.perf_counter()
        record = self.step(batch)
        record["train_s"] = time.perf_counter() - started

        started = time.perf_counter()
        candidate, deployed = self.deployed_weights(), self.scores[self.version]
        score = self.gate.score(candidate, self.version + 1)
        verdict = self.gate.verdict(score, deployed, self.start_score)
        record.update(
            gate_score=score,
            deployed_score=deployed,
            start_score=self.start_score,
            eval_s=time.perf_counter() - started,
        )
        started = time.perf_counter()
        if verdict.publish:
            if "consuming" in self.state:  # a loop killed before `consumed` finds the version it published
                self.state["consuming"]["publishing_on"] = self.version
                self.save_state()
            try:
                manifest = self.publisher.publish(candidate)
            except VersionExistsError:  # created exclusively: a rollback landed during this update
                verdict = Verdict(
                    False,
                    f"the weight store moved past version {self.version} during the update (a rollback, "
                    "or another publisher); adopting its newest version next update",
                )
        if not verdict.publish:
            self.model.load_state_dict(saved[0])
            self.optimizer.load_state_dict(saved[1])
            if saved[2] is not None:
                self.logit_scale.load_state(saved[2])
            return record | {"decision": "discarded", "reason": verdict.reason, "version": self.version}

        self.version, self.deployed_manifest = manifest.version, manifest.digest
        self.lineage.note(manifest)
        self.scores[self.version] = score
        return record | {
            "decision": "published",
            "reason": verdict.reason,
            "version": self.version,
            "publish_s": time.perf_counter() - started,
            "published_at": time.time(),
            "delta_kind": manifest.kind,
            "delta_bytes": manifest.encoded_bytes,
        }

    def checkpoint(self, version: int | None = None) -> dict[str, Any]:
        """Save the masters and moments of `version` (default: the one just published) in
        `checkpoints/`, and the update count (`updates_recorded`)."""
        started = time.perf_counter()
        data: dict[str, Any] = {"updates": self.state["updates"]}
        if self.logit_scale is not None:
            data["logit_scale"] = self.logit_scale.state()
        save_checkpoint(
            self.checkpoints,
            self.model,
            self.optimizer,
            TrainState(step=self.version if version is None else version, data=data),
            config=self.config.model_dump(mode="json"),
            keep=KEEP_CHECKPOINTS,
        )
        return {"checkpoint_s": time.perf_counter() - started}

    def prune(self) -> dict[str, Any]:
        """Delete responses older than `retention_days` whose feedback the loop has read (or that
        got none): one transaction. A failure (e.g. a feedback event racing it) is logged and the
        next update tries again."""
        days = self.config.retention_days
        if days <= 0:
            return {}
        try:  # by the database's clock, which stamped the responses
            before = self.feedback.now() - days * 86400.0
            responses, events = self.feedback.prune(before, consumed=self.state["cursor"])
        except WhetstoneError as err:
            log.warning("pruning the feedback store failed (retried next update): %s", err)
            return {"pruned_error": str(err)}
        return {"pruned_responses": responses, "pruned_feedback": events}

    def run(self) -> dict[str, Any]:
        """Update whenever the trigger says so, until `max_updates` or SIGTERM / SIGINT."""
        from whetstone.utils.processes import stop_on_signals
        from whetstone.utils.progress import progress_bar

        config = self.config
        write_toml(self.run_dir / "config.toml", config)
        counts = {"published": 0, "discarded": 0, "skipped": 0}
        with (
            MetricsWriter(
                self.run_dir / "metrics.jsonl", config.tracking, role="online", step_key="update", run_config=config
            ) as metrics,
            stop_on_signals() as stop,
            progress_bar(config.max_updates or None, "online", "update") as bar,
        ):
            self.stop = stop
            while not (config.max_updates and self.state["updates"] >= config.max_updates) and not stop.is_set():
                if not self.due():
                    stop.wait(config.poll_interval)
                    continue
                record = self.update()
                metrics.write(record)
                counts[record["decision"]] += 1
                bar.update(1, version=self.version, last=record["decision"], **counts)
        summary = {"output_dir": str(self.run_dir), "device": str(self.device), "version": self.version}
        return summary | {"updates": self.state["updates"], **counts}
