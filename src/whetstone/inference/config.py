"""Configs of the inference engine and of `whetstone serve`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from whetstone.config import Config
from whetstone.fleet.config import FleetConfig
from whetstone.inference.feedback import FeedbackConfig
from whetstone.sync.config import SyncConfig
from whetstone.utils.device import DeviceName


class EngineConfig(Config):
    device: DeviceName = "auto"
    """Where the model, KV cache and sampling live: `auto` (CUDA when present, else the CPU),
    `cpu`, `cuda` or `cuda:N`."""
    cuda_graphs: bool = True
    """On CUDA, capture each decode batch size's forward once in a CUDA graph and replay it, so a
    step is one launch instead of hundreds of Python-issued kernels (ignored on the CPU)."""
    overlap_steps: bool = True
    """On CUDA, launch decode step n + 1 before reading step n's tokens back (it is fed them on
    the device), so the GPU computes while the host hands out step n's tokens and schedules: a
    step then costs the longer of the two, not their sum. A sequence that stops at step n wastes
    its row of step n + 1 (ignored on the CPU, where nothing runs ahead)."""
    max_batch: int = Field(16, ge=1)
    """Most sequences decoded together (KV-cache slots)."""
    context_limit: int = Field(0, ge=0)
    """Longest prompt + completion in tokens; 0 = the model's max_position_embeddings."""
    batch_beside_interactive: int = Field(0, ge=0)
    """While interactive sequences run, at most this many batch sequences decode beside them
    (the others are preempted and resume later, and none starts): on a CPU a step costs about
    linearly in the batch (the default model: 3.8 ms with one row, 6.9 ms with three), so users
    get the whole step. Raise it where a row is nearly free (accelerators); max_batch = rollouts
    share every step."""
    interactive_grace_s: float = Field(0.5, ge=0)
    """Seconds the batch class stays capped after the last interactive sequence ends (users
    come back: the next turn, the next request), so it does not churn between full and capped
    with every request."""
    prefill_tokens_per_step: int = Field(512, ge=1)
    """Prompt tokens prefilled between two decode steps (at least one sequence is admitted), so
    new long prompts do not stall the sequences already decoding."""
    share_prefixes: bool = True
    """A new sequence whose tokens start like those of one already running (the G rollouts of a
    task, n > 1, a shared system prompt) or recently finished (`keep_finished`) copies that
    prefix's keys, values and routes instead of computing them again, if they were computed
    under the current weights. Off: every prompt is prefilled in full."""
    keep_finished: int = Field(16, ge=0)
    """KV-cache slots, besides `max_batch`, that keep the caches of the most recently finished
    sequences (under the current weights), so a request that continues one (an agent's next
    turn: the history, then the tool results) copies that prefix instead of prefilling it again
    (with `share_prefixes`). Each slot holds `context_limit` positions of keys and values."""
    prefill_chunk: int = Field(512, ge=1)
    """Longest piece of a prompt fed in one forward (bounds attention memory)."""
    swap_policy: Literal["continue", "finish"] = "continue"
    """What a new weight version does to sequences in flight: `continue` under the new weights
    at once (each token carries its version), or `finish` them on the old weights first (new
    requests wait until they are done)."""
    numerics: Literal["fast", "invariant"] = "fast"
    """`invariant`: batch-invariant kernels, so a token's logprob and routes do not depend on
    what else is batched, on prefill chunking or on the KV cache, and equal bit for bit what a
    trainer with the same `numerics` and `dtype` computes (docs/consistency.md, with its cost)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype: `bfloat16` runs the forward under bf16 autocast, exactly as the trainer's
    `dtype = "bfloat16"` does; the engine keeps its matmul weights in bf16, the values autocast
    casts them to (same bits, half their memory, no per-step cast)."""


class ServeConfig(Config):
    model_path: str = ""
    """Hugging Face model folder to serve (config.json, safetensors weights, tokenizer.json)."""
    model_name: str = ""
    """Model id clients must send; empty = the folder's name."""
    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(8000, ge=1, le=65535)
    """TCP port."""
    auth_token: str = ""
    """If set, /v1/* requests need `Authorization: Bearer <auth_token>` (and /docs, /openapi.json are not served)."""
    threads: int = Field(0, ge=0)
    """Torch threads for the engine (0 = every core it may run on)."""
    default_max_tokens: int = Field(256, ge=1)
    """Completion length when a request does not say (capped by the context limit)."""
    max_request_bytes: int = Field(8 * 2**20, ge=1)
    """Largest request body taken, in bytes: a larger one gets 413 before it is read (a 40960-token
    prompt of ordinary text is under 1 MiB, even with every character JSON-escaped)."""
    log_requests: bool = True
    """One INFO line per request on the `whetstone.requests` logger: response id, route, status,
    prompt/completion tokens, milliseconds."""
    header_timeout_s: float = Field(30.0, gt=0)
    """Seconds a request's headers may take to arrive, from the connection's opening (or the first
    byte of a kept-alive connection's next request): a slower one gets 408 and its connection is
    closed, so clients that send nothing or trickle headers do not hold connections. Also how long
    the rest of a body may take once its request was answered without reading it (closed then)."""
    body_timeout_s: float = Field(30.0, gt=0)
    """Seconds a request's whole body may take to arrive once its headers have: a slower one gets
    408 and its connection is closed, so stalled uploads do not hold connections."""
    max_waiting_sequences: int = Field(2048, ge=0)
    """Most sequences waiting in the engine's queue for a decode slot: a request whose sequences
    would bring them past it gets 429 with `Retry-After` (and one that alone has more, 400);
    0 = no bound. Twice the most one request may ask for (`protocol.MAX_SEQUENCES`), and far
    above what an orchestrator queues: one sequence per rollout in flight."""
    max_connections: int = Field(512, ge=1)
    """Open connections served at once (uvicorn's `limit_concurrency`): a request that arrives
    while that many are open gets 503 and its connection is closed, so a flood of connections
    does not exhaust the process's file descriptors; `serve` raises its open-files limit to fit."""
    listen_backlog: int = Field(2048, ge=1)
    """Connections the kernel holds for the server before it accepts them (`listen` backlog)."""
    engine: EngineConfig = EngineConfig()
    """Batching, context and swap policy."""
    weight_version: int = 0
    """Version label of the weights loaded from `model_path` (tokens are tagged with it until
    the first hot swap)."""
    sync: SyncConfig | None = None
    """Follow a weight store (a `[sync]` section: `store = ...`) and hot-swap every new version;
    absent = serve the loaded weights only."""
    feedback: FeedbackConfig = FeedbackConfig()
    """Keep users' responses for online RL and take their feedback (POST /v1/feedback)."""
    fleet: FleetConfig = FleetConfig()
    """Announce this server in the fleet registry (`fleet.announce`, needs `sync`; in its weight
    store unless `fleet.registry` names another), with its cluster label, so orchestrators find
    it while it runs."""

    @model_validator(mode="after")
    def _token_fits_a_header(self) -> ServeConfig:
        """A token no client can send would lock everyone out. Checked on the whole section, so the
        error names the field without the value (a field's error shows what it was given)."""
        problem = _token_problem(self.auth_token)
        if problem:
            raise ValueError(f"auth_token {problem} (its value is not shown: it is a secret)")
        return self

    @model_validator(mode="after")
    def _fleet_needs_a_store(self) -> ServeConfig:
        if self.fleet.announce and self.sync is None:
            raise ValueError("fleet.announce needs a [sync] section: the registry lives in the weight store")
        return self


def _token_problem(token: str) -> str | None:
    """Why `token` cannot be a bearer token clients send, if it cannot: an HTTP header's value is
    printable ASCII (httpx and the `openai` client refuse other characters, servers refuse control
    characters, and the server reads a value's bytes as latin-1), and loses the spaces at its ends
    on the way."""
    if any(not " " <= char <= "~" for char in token):
        return "must be printable ASCII (' ' to '~'): an HTTP header cannot carry its other characters"
    if token != token.strip(" "):
        return "must not start or end with a space: an HTTP header's value loses those on the way"
    return None
