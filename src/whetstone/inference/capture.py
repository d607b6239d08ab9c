"""The server's side of online RL: keep each response users get, take their feedback on it.

`Capture` is what `whetstone serve` holds when `feedback.store` is set. Each request's handler
holds a `Reply`, which stores the response once every choice has finished: before the response,
or a stream's chunk with the last `finish_reason`, goes out, so feedback can follow at once (and
when a streaming client leaves after the generation finished). Storing waits at most
`feedback.keep_timeout_s`: a locked database does not hold the user's answer. `rate` takes
POST /v1/feedback. Database calls run in worker threads: the event loop keeps serving meanwhile.
A store whose tables are gone (its SQLite file deleted) is said so, logged once with what to do
(`lost_tables`), and its feedback refused with that reason; the tables are not created again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from whetstone.inference.feedback import FeedbackConfig, lost_tables
from whetstone.inference.protocol import encode_routes
from whetstone.inference.sequence import Sequence
from whetstone.store.feedback import FeedbackStore, FeedbackStoreError, ResponseRecord, UnknownResponse

log = logging.getLogger("whetstone.online")

KEEP_WRITERS = 4
"""Threads writing replies to the store: while the database is locked, at most this many writes
wait on it; later replies' writes queue and are dropped at `keep_timeout_s`."""
UNSTORED_REMEMBERED = 10_000
"""Replies this server remembers as not (yet) stored, to tell a client rating one why."""


def response_records(response_id: str, seqs: list[Sequence], model: str) -> list[ResponseRecord]:
    """One record per choice (choice i = the response's choice index i); none if any choice did
    not finish whole (aborted, failed): the user never saw that response."""
    if any(seq.error or seq.finish_reason in (None, "abort") for seq in seqs):
        return []
    return [
        ResponseRecord(
            response_id=response_id,
            choice=index,
            model=model,
            priority=seq.priority,
            temperature=seq.params.temperature,
            top_p=seq.params.top_p,
            top_k=seq.params.top_k,
            finish_reason=seq.finish_reason,
            prompt_ids=list(seq.prompt_ids),
            completion_ids=list(seq.output_ids),
            logprobs=list(seq.logprobs),
            versions=list(seq.versions),
            routes=None if seq.routes is None else encode_routes(seq.routes),
        )
        for index, seq in enumerate(seqs)
    ]


class Capture:
    def __init__(self, config: FeedbackConfig, model: str):
        self.config = config
        self.model = model
        self.store = FeedbackStore.open(config.store)
        self.failures = 0
        """Responses whose answer went out unstored: the write failed or outlasted `keep_timeout_s`."""
        self.unstored: OrderedDict[str, str] = OrderedDict()
        """Why a reply of this server is not in the store (yet), oldest first; a stored one is removed."""
        self._lock = threading.Lock()  # `unstored` also changes in the writer threads
        self._writer = ThreadPoolExecutor(KEEP_WRITERS, thread_name_prefix="feedback-keep")
        self._closed = False  # set by `close` (under `_lock`): no write is handed to `_writer` after it
        self._lost_said = False  # the store's lost tables were logged with what to do (under `_lock`)
        self.tasks: set[asyncio.Task] = set()
        """Replies' storing tasks under way (the event loop holds its tasks only weakly)."""

    def wants(self, priority: str) -> bool:
        return self.config.record == "all" or priority == "interactive"

    def note(self, response_id: str, why: str | None) -> None:
        """Remember why a reply is not in the store (None: it is)."""
        with self._lock:
            self.unstored.pop(response_id, None)
            if why is not None:
                self.unstored[response_id] = why
                if len(self.unstored) > UNSTORED_REMEMBERED:
                    self.unstored.popitem(last=False)

    async def keep(self, response_id: str, seqs: list[Sequence], priority: str) -> None:
        """Store the response if its priority is kept and every choice finished whole, waiting at
        most `keep_timeout_s`. A failure, or a write still waiting then, is logged and counted, not
        raised: the user gets the answer all the same (feedback on it may be refused)."""
        if not self.wants(priority):
            return
        records = response_records(response_id, seqs, self.model)
        if not records:
            self.note(response_id, "did not finish whole (aborted, failed, or its client left), so it was not kept")
            return
        self.note(response_id, "is still being stored: try again in a moment")
        started = time.monotonic()
        with self._lock:
            write = None if self._closed else self._writer.submit(self.store.record, records)
        if write is None:
            self.note(response_id, "was not stored: the server was shutting down")
            log.warning("response %s is not kept for feedback: the server is shutting down", response_id)
            return
        try:
            await asyncio.wait_for(asyncio.wrap_future(write), self.config.keep_timeout_s)
        except TimeoutError:
            self.failures += 1
            limit = self.config.keep_timeout_s
            if write.cancel():  # no writer thread had taken it up (they all wait on the database)
                self.note(response_id, f"could not be stored: the feedback database did not take it within {limit:g} s")
                log.error(
                    "response %s was not kept for feedback: the database is busy (waited %g s)", response_id, limit
                )
            else:
                log.error(
                    "response %s is not kept for feedback after %g s (the database is locked or slow); "
                    "its answer goes out, and it is stored if the write still succeeds",
                    response_id,
                    limit,
                )
                write.add_done_callback(lambda done: self._late(response_id, done, started))
        except Exception as err:
            self.failures += 1
            self.note(response_id, "could not be stored (a database error on the server: see its log)")
            log.error("could not keep response %s for feedback: %s", response_id, self.explained(err))
        else:
            self.stored()
            self.note(response_id, None)

    def explained(self, err: BaseException) -> BaseException:
        """`err`, or, when it says the store's tables are gone, a FeedbackStoreError saying so
        briefly. What happened and what to do (`lost_tables`: the database's path or address) is
        logged the first time (again once the store stored something meanwhile); a client is told
        only that the operator must act (`reason`)."""
        why = lost_tables(err, self.store) if isinstance(err, FeedbackStoreError) else None
        if why is None:
            return err
        with self._lock:
            first, self._lost_said = not self._lost_said, True
        if first:
            log.error("%s", why)
        where = f"at {self.store.path}" if self.store.path is not None else self.store.name
        return FeedbackStoreError(
            f"the feedback store's database {where} has lost its tables (see the log)",
            "the feedback store's database has lost its tables; the server's operator must restore it",
            transient=False,
        )

    def stored(self) -> None:
        """A write succeeded: lost tables found later are logged again with what to do."""
        with self._lock:
            self._lost_said = False

    def _late(self, response_id: str, write: Future, started: float) -> None:
        """The outcome of a write the answer did not wait for (in its writer thread)."""
        if write.exception() is None:
            self.stored()
            self.note(response_id, None)
            log.warning(
                "response %s was kept for feedback after all, %.1f s late", response_id, time.monotonic() - started
            )
        else:
            self.note(response_id, "could not be stored (a database error on the server: see its log)")
            log.error("could not keep response %s for feedback: %s", response_id, self.explained(write.exception()))

    async def rate(self, response_id: str, choice: int, rating: str, score: float | None) -> int:
        """Store one feedback event; raises UnknownResponse / DuplicateFeedback (the client's fault),
        or FeedbackStoreError (the database's). A reply of this server that is not stored (yet) is
        refused saying why."""
        try:
            seq = await asyncio.to_thread(self.store.add_feedback, response_id, choice, rating, score)
        except FeedbackStoreError as err:
            raise self.explained(err) from None
        except UnknownResponse:
            with self._lock:
                why = self.unstored.get(response_id)
            if why is None:
                raise
            raise UnknownResponse(f"response {response_id!r} {why}") from None
        self.stored()
        return seq

    def close(self) -> None:
        """Stop handing writes to the writer threads first, then let the writes under way finish
        (the store's own lock timeout bounds them) and disconnect. A reply whose storing task
        starts later (`Reply.end` does not wait for it) is noted as not stored, not counted as a
        failed write."""
        with self._lock:
            self._closed = True
        self._writer.shutdown(wait=True)
        self.store.close()


class Reply:
    """One response on its way to the feedback store (nothing to do without a `Capture`).

    `keep` stores it, at most once, in a task of its own: a client going away while it is being
    written does not cut the write short. `end`, when the request is over however it ended,
    keeps a response that finished but was not kept yet (a streaming client left before the last
    chunk) and notes any other as not kept."""

    def __init__(self, capture: Capture | None, response_id: str, seqs: list[Sequence], priority: str):
        self.capture = capture
        self.response_id = response_id
        self.seqs = seqs
        self.priority = priority
        self._keeping: asyncio.Task | None = None
        if capture is not None and capture.wants(priority):
            capture.note(response_id, "has not finished yet: rate it once every choice has its finish_reason")

    @property
    def finished(self) -> bool:
        """Every choice has finished (the engine sets a finish reason after the sequence's tokens,
        logprobs and routes)."""
        return all(seq.finished for seq in self.seqs)

    def start(self) -> asyncio.Task | None:
        """The task storing the response, started on the first call."""
        capture = self.capture
        if capture is not None and self._keeping is None:
            self._keeping = asyncio.ensure_future(capture.keep(self.response_id, self.seqs, self.priority))
            capture.tasks.add(self._keeping)
            self._keeping.add_done_callback(capture.tasks.discard)
        return self._keeping

    async def keep(self) -> None:
        """Store the response (once); returns when it is stored or the capture stopped waiting."""
        keeping = self.start()
        if keeping is not None:
            await asyncio.shield(keeping)

    def end(self) -> None:
        """The request is over: keep the response if that has not started (`Capture.keep` notes
        one that did not finish whole as not kept)."""
        self.start()
