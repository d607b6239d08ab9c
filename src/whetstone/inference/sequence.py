"""One generation in flight: its tokens, logprobs, routes, versions and where it is in the engine.

A sequence's tokens are `prompt_ids + output_ids`; the first `num_cached` of them have their
keys/values in the KV cache. Each decode step feeds the one token after them. A preempted
sequence drops its cache (`num_cached = 0`) but keeps everything it generated and its routes, so
on resume it refills the cache by replaying its recorded routes and then carries on exactly where
it stopped (its random draws are a function of its seed and token index): nothing is lost and
nothing is sampled twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from whetstone.inference.detokenize import IncrementalText
from whetstone.inference.sampling import SamplingParams, random_seed

Priority = Literal["interactive", "batch"]
FinishReason = Literal["stop", "length", "abort"]


@dataclass(eq=False)
class Sequence:
    """Compared and hashed by identity (each is one generation, whatever its fields hold): the
    scheduler finds a queued one in O(1), never by comparing fields."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: Priority = "interactive"
    text: IncrementalText | None = None
    """Incremental text, for streams and stop strings (None: decode once at the end)."""
    on_event: Callable[["Progress"], None] | None = None
    """Called from the engine thread after each step that changed the sequence (streams) or only
    when it finishes (`stream=False`). Must be quick and must not block."""
    stream: bool = False

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Weight version that produced each output token."""
    routes: torch.Tensor | None = None
    """[tokens fed, moe_layers, top_k] int16, on the host, once the sequence has left its slot
    (finished or preempted); while it runs they live in the engine's per-slot route buffer. Every
    token is fed except the last generated one, so a finished sequence has `num_tokens - 1` rows."""
    num_cached: int = 0
    pending: int = 0
    """Decode steps launched for this sequence whose tokens are not read back yet (with
    `EngineConfig.overlap_steps`, one step runs ahead): counted in `num_cached`, not yet in
    `output_ids`."""
    launches: int = 0
    """Bumped when the sequence's pending steps are dropped (it finished, was preempted or
    aborted): a step launched before then is not its any more."""
    slot: int | None = None
    weights_epoch: int | None = None
    """The engine's weight epoch when this sequence's cache was filled under the current
    weights' own routes; None while it has no slot, and for a resumed MoE sequence (its prefill
    replays old routes). Another sequence may copy a prefix of its cache only within the same
    epoch (`EngineConfig.share_prefixes`)."""
    finish_reason: FinishReason | None = None
    error: str | None = None
    """Set when the engine failed while running this sequence (the server answers 500)."""
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    seed: int = field(init=False)
    """The request's seed, or a random one: token i is drawn with the uniform of (seed, i)."""

    def __post_init__(self) -> None:
        self.seed = random_seed() if self.params.seed is None else self.params.seed

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def tokens(self, start: int, end: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[start:end]

    def notify(self) -> None:
        if self.on_event is not None:
            released = self.text.released if self.text is not None else 0
            self.on_event(Progress(self, len(self.output_ids), released, self.finished))

    def preempt(self) -> None:
        """Give up the KV cache (the engine has saved `routes`); keep the tokens."""
        self.slot = None
        self.num_cached = 0
        self.preemptions += 1


@dataclass(frozen=True)
class Progress:
    """How far a sequence had got when its event fired: another thread may read exactly this
    much of it (its lists only grow, and text before `text_released` never changes)."""

    seq: Sequence
    num_output: int
    text_released: int
    finished: bool
