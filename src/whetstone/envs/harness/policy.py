"""The model behind the harness: token ids in, sampled token ids (with logprobs, routes and
weight versions) out.

`HttpPolicy` calls an OpenAI-compatible `/v1/completions` with the prompt as token ids and
`return_token_ids`, so the harness records exactly the tokens that were sampled and never
re-tokenizes model output. vLLM and SGLang take token-id prompts too; whetstone's extension
fields (logprob per token, weight versions, routed experts, priority) are asked for and used
when the server has them. Tests can put a scripted policy behind the same interface.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from whetstone.envs.harness.config import EndpointConfig, SamplingConfig
from whetstone.errors import WhetstoneError

RETRY_STATUS = {500, 502, 503, 504}
"""Answers retried with backoff, each retry spending one of `EndpointConfig.retries`."""
BUSY = 429
"""A server whose queue is full: waited out (its Retry-After) and retried without spending retries."""
MAX_RETRY_AFTER_S = 60.0
"""The longest single wait a 429's Retry-After gets."""
MIN_RETRY_AFTER_S = 0.25
"""The shortest: a server answering `Retry-After: 0` is not asked again at once, for ever."""
NO_ROUTES = "the server returned no routed experts: the trainer routes with its own router, no replay"


class PolicyError(WhetstoneError):
    """The model could not be asked or answered something unusable; the rollout fails with this reason."""


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    priority: str = "batch"
    seed: int | None = None
    """The server's sampling seed (same seed, prompt and weights: same tokens); None = unseeded."""

    @classmethod
    def of(cls, config: SamplingConfig, max_tokens: int) -> Sampling:
        return cls(max_tokens, config.temperature, config.top_p, config.top_k, config.priority)


@dataclass
class Completion:
    """What the model sampled for one prompt."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    routes: dict[str, Any] | None
    """Routed experts of every token fed (JSON of the server's compact form), or None."""
    finish_reason: str
    text: str
    """The server's decoding, for people; the harness parses its own decoding of `ids`."""
    routes_missing: str | None = None
    """Why `routes` is None although they were asked for (the server does not return them)."""


class Policy(ABC):
    """The seam between the harness and a model."""

    context_limit: int | None = None
    """Longest prompt + completion the model accepts, if known."""

    @abstractmethod
    async def complete(self, prompt_ids: list[int], sampling: Sampling) -> Completion: ...

    async def close(self) -> None:
        """Release connections (the default holds none)."""


class SeededPolicy(Policy):
    """Another policy whose k-th call samples with seed `seed + k`: a rollout seeded this way draws
    the same random numbers under any weights, so two evaluations of different weights on the same
    seeds are a paired comparison (common random numbers) rather than two independent draws."""

    def __init__(self, policy: Policy, seed: int):
        self.policy, self.seed, self.calls = policy, seed, 0

    @property
    def context_limit(self) -> int | None:
        """The other policy's limit as it is now (a pooled policy's follows its server)."""
        return self.policy.context_limit

    async def complete(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        seed, self.calls = self.seed + self.calls, self.calls + 1
        return await self.policy.complete(prompt_ids, dataclasses.replace(sampling, seed=seed))


class HttpPolicy(Policy):
    """A policy served over HTTP. `await HttpPolicy.connect(config)` finds the model and its context."""

    def __init__(self, config: EndpointConfig, model: str, context_limit: int | None, client: httpx.AsyncClient):
        self.config = config
        self.model = model
        self.context_limit = context_limit
        self._client = client

    @classmethod
    async def connect(cls, config: EndpointConfig, max_connections: int = 64) -> HttpPolicy:
        headers = {}
        if config.api_key_env:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise PolicyError(f"endpoint.api_key_env: environment variable {config.api_key_env} is not set")
            headers["Authorization"] = f"Bearer {key}"
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        client = httpx.AsyncClient(
            base_url=config.base_url.rstrip("/") + "/", headers=headers, timeout=config.timeout_s, limits=limits
        )
        try:
            card = await _find_model(client, config)
        except BaseException:
            await client.aclose()
            raise
        return cls(config, card["id"], card.get("max_model_len"), client)

    async def complete(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,
            "return_token_ids": True,
        }
        if sampling.priority != "none":
            body["priority"] = sampling.priority
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if self.config.return_routed_experts:
            body["return_routed_experts"] = True
        answer = await _request(self._client, "POST", "completions", body, self.config.retries)
        return self._parse(answer, prompt_ids)

    def _parse(self, answer: dict, prompt_ids: list[int]) -> Completion:
        try:
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise PolicyError(f"completion answer has no choices: {str(answer)[:200]}") from None
        ids = choice.get("token_ids")
        if ids is None:
            raise PolicyError(
                "the server returned no token ids: it must support `return_token_ids` "
                "(whetstone serve, vLLM >= 0.10.2, SGLang)"
            )
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and list(echoed) != prompt_ids:
            raise PolicyError("the server did not use the prompt's token ids as sent")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if logprobs is None or len(logprobs) != len(ids):
            raise PolicyError(
                f"the server returned {'no' if logprobs is None else len(logprobs)} logprobs for {len(ids)} tokens"
            )
        versions = choice.get("weight_versions") or [self.config.weight_version] * len(ids)
        routes = choice.get("routed_experts")
        return Completion(
            ids=list(ids),
            logprobs=[float(x) for x in logprobs],
            versions=list(versions),
            routes=routes,
            finish_reason=choice.get("finish_reason") or "stop",
            text=choice.get("text") or "",
            routes_missing=NO_ROUTES if self.config.return_routed_experts and routes is None else None,
        )

    async def close(self) -> None:
        await self._client.aclose()


async def _find_model(client: httpx.AsyncClient, config: EndpointConfig) -> dict:
    """The model card (id, max_model_len) of `config.model`, or of the first model served."""
    answer = await _request(client, "GET", "models", None, config.retries)
    try:
        cards = {card["id"]: card for card in answer["data"]}
    except (KeyError, TypeError):
        raise PolicyError(f"{config.base_url}/models: not an OpenAI model list: {str(answer)[:200]}") from None
    if not cards:
        raise PolicyError(f"{config.base_url} serves no model")
    if not config.model:
        return next(iter(cards.values()))
    if config.model not in cards:
        raise PolicyError(f"{config.base_url} does not serve model {config.model!r}; it serves {list(cards)}")
    return cards[config.model]


async def _request(client: httpx.AsyncClient, method: str, path: str, body: dict | None, retries: int) -> dict:
    """One JSON request to `path` under the client's API root (or to a whole URL). Connection
    failures and 5xx answers are retried `retries` times with backoff. A 429 (the server's queue
    is full: backpressure, not a failure) is retried after its `Retry-After` (else with backoff)
    without spending a retry, until the waits add up to the client's read timeout
    (`EndpointConfig.timeout_s`)."""
    where = path if "://" in path else f"{client.base_url}{path}"
    patience = client.timeout.read if client.timeout.read is not None else float("inf")
    attempt, refusals, waited = 0, 0, 0.0
    while True:
        try:
            response = await client.request(method, path, json=body)
        except httpx.TransportError as err:
            if attempt == retries:
                raise PolicyError(f"{where}: {type(err).__name__}: {err}") from None
        else:
            status = response.status_code
            if status < 400:
                try:
                    return response.json()
                except ValueError:
                    text = response.text[:200]
                    raise PolicyError(f"{where}: the answer is not JSON: {text!r}") from None
            if status == BUSY:
                asked = _retry_after(response)  # a Retry-After of 0 (or a past date) still waits a little
                wait = min(0.5 * 2**refusals, MAX_RETRY_AFTER_S) if asked is None else max(asked, MIN_RETRY_AFTER_S)
                if waited + wait > patience:
                    raise PolicyError(
                        f"{where}: HTTP 429 for {waited:.0f} s ({refusals + 1} answers): {_error_message(response)}"
                    )
                refusals, waited = refusals + 1, waited + wait
                await asyncio.sleep(wait)
                continue
            if attempt == retries or status not in RETRY_STATUS:
                raise PolicyError(f"{where}: HTTP {status}: {_error_message(response)}")
        await asyncio.sleep(0.5 * 2**attempt)
        attempt += 1


def _retry_after(response: httpx.Response) -> float | None:
    """The seconds a `Retry-After` header asks for (a number or an HTTP date), at most
    `MAX_RETRY_AFTER_S`; None without a readable one."""
    value = response.headers.get("retry-after", "").strip()
    if not value:
        return None
    if value.isdigit():  # delay-seconds
        seconds = float(value)
    else:
        try:
            seconds = (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300]
