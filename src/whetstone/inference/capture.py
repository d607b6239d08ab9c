"""The server's side of online RL: keep each response users get, take their feedback on it.

`Capture` is what `whetstone serve` holds when `feedback.store` is set. The HTTP handlers call
`keep` once every choice of a response has finished (before the response, or a stream's final
`[DONE]`, goes out, so feedback can follow at once) and `rate` for POST /v1/feedback. Database
calls run in worker threads: the event loop keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import logging

from whetstone.inference.feedback import FeedbackConfig
from whetstone.inference.protocol import encode_routes
from whetstone.inference.sequence import Sequence
from whetstone.store.feedback import FeedbackStore, ResponseRecord

log = logging.getLogger("whetstone.online")


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
        """Responses that could not be kept (logged; the user got them all the same)."""

    def wants(self, priority: str) -> bool:
        return self.config.record == "all" or priority == "interactive"

    async def keep(self, response_id: str, seqs: list[Sequence], priority: str) -> None:
        """Record the response if its priority is kept. A database failure is logged and counted,
        not raised: the user still gets the answer (only feedback on it will be refused)."""
        if not self.wants(priority):
            return
        records = response_records(response_id, seqs, self.model)
        try:
            await asyncio.to_thread(self.store.record, records)
        except Exception as err:
            self.failures += 1
            log.error("could not keep response %s for feedback: %s", response_id, err)

    async def rate(self, response_id: str, choice: int, rating: str, score: float | None) -> int:
        """Store one feedback event; raises UnknownResponse / DuplicateFeedback (the client's fault)."""
        return await asyncio.to_thread(self.store.add_feedback, response_id, choice, rating, score)

    def close(self) -> None:
        self.store.close()
