"""The bridge between an HTTP handler (asyncio) and the engine thread for one request.

The engine calls each sequence's `on_event` from its own thread; we hop onto the event loop with
`call_soon_threadsafe` and queue the `Progress` snapshot there. Handlers await the queue, so the
engine never waits for HTTP and a slow client only delays itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from whetstone.inference.engine import Engine
from whetstone.inference.sampling import SamplingParams
from whetstone.inference.sequence import Priority, Progress, Sequence

DISCONNECT_CHECK_SECONDS = 1.0


class ClientGone(Exception):
    """The client disconnected; its sequences were aborted."""


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
    ):
        """One sequence per (prompt, choice); `params[p][c]` are choice c of prompt p's parameters.
        Raises `InvalidRequest` (nothing queued) if any of them cannot be served. `loop`: the
        event loop the handler awaits the events on (default: the running one), so a big
        submission can be built in a worker thread. Each prompt is checked once, with its
        choice of the most tokens, and its choices share one copy of it."""
        for prompt, choices in zip(prompts, params):
            engine.check_request(prompt, max(choices, key=lambda sampling: sampling.max_tokens))
        self.engine = engine
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
        for seq in self.seqs:
            engine.add(seq, checked=True)

    def _on_event(self, progress: Progress) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, progress)

    def abort(self) -> None:
        for seq in self.seqs:
            if not seq.finished:
                self.engine.abort(seq)

    async def events(self, is_disconnected: Callable) -> AsyncIterator[list[Progress]]:
        """Batches of the newest progress per sequence, until every sequence has finished."""
        index = {id(seq): i for i, seq in enumerate(self.seqs)}
        unfinished = len(self.seqs)
        while unfinished:
            try:
                first = await asyncio.wait_for(self.queue.get(), DISCONNECT_CHECK_SECONDS)
            except TimeoutError:
                if await is_disconnected():
                    self.abort()
                    raise ClientGone() from None
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
