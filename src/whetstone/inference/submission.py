"""The bridge between an HTTP handler (asyncio) and the engine thread for one request.

The engine calls each sequence's `on_event` from its own thread; we hop onto the event loop with
`call_soon_threadsafe` and queue the `Progress` snapshot there. Handlers await the queue, so the
engine never waits for HTTP and a slow client only delays itself. `Backlog` counts the
sequences queued this way, so a request that would overfill the engine's queue is refused.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from whetstone.inference.engine import Engine
from whetstone.inference.sampling import InvalidRequest, SamplingParams
from whetstone.inference.sequence import Priority, Progress, Sequence

DISCONNECT_CHECK_SECONDS = 0.5
"""How often a request waiting for its sequences asks whether its client is still there."""
RETRY_AFTER_S = 1
"""What a request refused for a full queue is told to wait before it tries again."""


class ClientGone(Exception):
    """The client disconnected; its sequences were aborted."""


class QueueFull(Exception):
    """The engine's queue has no room for a request's sequences now (429: retry later)."""


class Backlog:
    """The sequences queued by the server that have not finished; those waiting for a decode
    slot are all of them but the engine's running ones. `take` refuses a request that would bring
    the waiting ones past `limit` (0 = no bound), and counts each refusal in `refused_total`."""

    def __init__(self, engine: Engine, limit: int):
        self.engine = engine
        self.limit = limit
        self.unfinished = 0
        self.refused_total = 0
        self._lock = threading.Lock()  # taken in worker threads, let go in the engine thread

    @property
    def waiting(self) -> int:
        return max(0, self.unfinished - self.engine.stats.running)

    def take(self, count: int) -> None:
        """Count a request's `count` sequences in; raises `InvalidRequest` if they alone are more
        than the bound, `QueueFull` (counting nothing) if there is no room for them now."""
        if self.limit and count > self.limit:
            raise InvalidRequest(
                f"the request has {count} sequences (prompts x n); this server queues at most "
                f"{self.limit} (max_waiting_sequences): split it into several requests"
            )
        with self._lock:
            waiting = self.waiting
            if self.limit and waiting + count > self.limit:
                self.refused_total += 1
                raise QueueFull(
                    f"the server is busy: {waiting} sequences are waiting, at most {self.limit} may "
                    f"(max_waiting_sequences), and this request adds {count}; retry after "
                    f"{RETRY_AFTER_S} s (Retry-After)"
                )
            self.unfinished += count

    def release(self, count: int = 1) -> None:
        with self._lock:
            self.unfinished -= count


class Submission:
    def __init__(
        self,
        engine: Engine,
        request_id: str,
        prompts: list[list[int]],
        params: list[list[SamplingParams]],
        priority: Priority,
        stream: bool,
        loop: asyncio.AbstractEventLoop | None = None,
        backlog: Backlog | None = None,
    ):
        """One sequence per (prompt, choice); `params[p][c]` are choice c of prompt p's parameters;
        `enqueue` hands them to the engine. Raises `InvalidRequest` if any of them cannot be
        served. `loop`: the event loop the handler awaits the events on (default: the running
        one), so a big submission can be built in a worker thread. Each prompt is checked once,
        with its choice of the most tokens, and its choices share one copy of it. `backlog`:
        where the caller counted these sequences in (`Backlog.take`); from `enqueue` on, each
        leaves it once: as it finishes, or in `enqueue` if the engine never took it."""
        for prompt, choices in zip(prompts, params):
            engine.check_request(prompt, max(choices, key=lambda sampling: sampling.max_tokens))
        self.engine = engine
        self.backlog = backlog
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue[Progress] = asyncio.Queue()
        self.prompt_lengths = [len(p) for p in prompts]
        self.seqs = [
            Sequence(
                f"{request_id}-{len(choices) * p + c}",
                prompt,
                sampling,
                priority,
                on_event=self._on_event,
                stream=stream,
            )
            for p, (prompt, choices) in enumerate(zip((list(prompt) for prompt in prompts), params))
            for c, sampling in enumerate(choices)
        ]

    def enqueue(self) -> None:
        """Hand every sequence to the engine. If that fails part way, the sequences it took are
        aborted (each counts itself out of the backlog as it finishes) and the rest are counted
        out here, before the error goes on."""
        queued = 0
        try:
            for seq in self.seqs:
                self.engine.add(seq, checked=True)
                queued += 1
        except BaseException:
            for seq in self.seqs[:queued]:
                self.engine.abort(seq)
            if self.backlog is not None:
                self.backlog.release(len(self.seqs) - queued)
            raise

    def _on_event(self, progress: Progress) -> None:  # engine thread
        if progress.finished and self.backlog is not None:
            self.backlog.release()
        self.loop.call_soon_threadsafe(self.queue.put_nowait, progress)

    def abort(self) -> None:
        for seq in self.seqs:
            if not seq.finished:
                self.engine.abort(seq)

    async def events(self, is_disconnected: Callable) -> AsyncIterator[list[Progress]]:
        """Batches of the newest progress per sequence, until every sequence has finished. Every
        `DISCONNECT_CHECK_SECONDS`, events or not, it asks whether the client is still there; if
        not, it aborts the unfinished sequences and raises `ClientGone`."""
        index = {id(seq): i for i, seq in enumerate(self.seqs)}
        unfinished = len(self.seqs)
        clock = asyncio.get_running_loop()
        check_at = clock.time() + DISCONNECT_CHECK_SECONDS
        while unfinished:
            first = None
            try:
                async with asyncio.timeout_at(check_at):
                    first = await self.queue.get()
            except TimeoutError:
                pass
            if clock.time() >= check_at:
                if await is_disconnected():
                    self.abort()
                    raise ClientGone()
                check_at = clock.time() + DISCONNECT_CHECK_SECONDS
            if first is None:
                continue
            latest = {index[id(first.seq)]: first}
            while not self.queue.empty():  # coalesce what piled up meanwhile
                event = self.queue.get_nowait()
                latest[index[id(event.seq)]] = event
            unfinished -= sum(1 for event in latest.values() if event.finished)
            yield [latest[i] for i in sorted(latest)]

    async def wait(self, is_disconnected: Callable) -> None:
        async for _ in self.events(is_disconnected):
            pass
