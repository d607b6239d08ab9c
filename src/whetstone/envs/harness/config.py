"""Configs of the agent harness, the model endpoint it talks to, and concurrent rollouts."""

from __future__ import annotations

from typing import Annotated, Literal

import httpx
from pydantic import AfterValidator, Field, model_validator

from whetstone.config import Config
from whetstone.envs.grading.reward import RewardConfig
from whetstone.envs.sandbox import SandboxConfig


def check_api_root(url: str) -> str:
    """`url` if it can be an inference server's API root (`http(s)://host[:port]/...`): a mistyped
    one (`http://gpu-3:$PORT/v1`) is refused when the config loads, rather than waited on as a
    server that never comes up."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as err:
        raise ValueError(f"{url!r} is not a server address: {err}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url!r} is not a server address: give http(s)://host:port/v1")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise ValueError(f"{url!r} is not a server address: port {parsed.port} is not in 1..65535")
    if any(mark in parsed.host for mark in "${}"):
        raise ValueError(f"{url!r} is not a server address: {parsed.host!r} is a placeholder (set the host itself)")
    return url


ApiRoot = Annotated[str, AfterValidator(check_api_root)]
"""An inference server's API root, checked to be one (`check_api_root`)."""


class SamplingConfig(Config):
    """How each model call samples."""

    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature. In RL the batches carry it and the trainer divides its logits by it,
    so its logprobs are those of the distribution sampled (0 = greedy, as is anything below 1e-5:
    cannot be trained on)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = Field(0, ge=0)
    """Sample among the k most likely tokens (0 = off)."""
    priority: Literal["interactive", "batch", "none"] = "batch"
    """Server priority: `batch` for rollouts (preemptible), `interactive` for users, `none` to not
    send it (vLLM and SGLang take an integer `priority` of their own)."""


class EndpointConfig(Config):
    """An OpenAI-compatible server (`whetstone serve`, vLLM, SGLang) taking token-id prompts."""

    base_url: ApiRoot = "http://127.0.0.1:8000/v1"
    """API root; requests go to `{base_url}/completions`."""
    model: str = ""
    """Model id to request; empty = the first model the server lists."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (the key itself never goes in a config).
    `whetstone run` sets it for its orchestrator and evaluations when its servers take a token
    (`servers.serve.auth_token`), and gives only their processes that variable."""
    timeout_s: float = Field(600.0, gt=0)
    """Timeout of one request (a long completion under load can take minutes on CPU)."""
    retries: int = Field(2, ge=0)
    """Retries of a request that failed to connect or got a 5xx answer, with backoff (a 429 waits
    its Retry-After and spends none, up to `timeout_s` in all)."""
    return_routed_experts: bool = True
    """Ask for the routed experts of every token (MoE router replay); servers without them return none."""
    weight_version: int = Field(0, ge=0)
    """Version recorded for tokens from a server that does not report weight versions (SGLang, a
    vLLM whose weights carry no whetstone version)."""
    engine: Literal["whetstone", "vllm"] = "whetstone"
    """The protocol the servers speak: `whetstone` (`whetstone serve`, or any OpenAI server taking
    token-id prompts with `return_token_ids`), or `vllm` (vLLM's token-in/token-out route, with
    per-token weight versions; docs/vllm.md)."""


class HarnessConfig(Config):
    """The agent loop: budgets, limits, self-summarization."""

    tokenizer_path: str = ""
    """Folder holding the served model's `tokenizer.json` (usually the model folder itself)."""
    max_turns: int = Field(50, ge=1)
    """Most model calls in a rollout, summaries included."""
    context_tokens: int = Field(0, ge=0)
    """Context window of one segment (prompt + completion); 0 = the server's `max_model_len`."""
    max_turn_tokens: int = Field(512, ge=1)
    """Completion budget of one model call."""
    max_tool_tokens: int = Field(512, ge=64)
    """Most tokens the tool results of one turn may take; longer outputs keep their head and tail."""
    max_calls_per_turn: int = Field(8, ge=1)
    """Tool calls run per model reply; more are refused and count as invalid."""
    max_invalid_replies: int = Field(0, ge=0)
    """End the rollout (stop reason `invalid_replies`, still graded) after this many replies in a
    row with no call that could run; 0 = never. A model that has lost the format rarely finds
    it again, and its rambling costs generation time and fills the batch with noise."""
    max_total_tokens: int = Field(100_000, ge=1)
    """Completion tokens over the whole rollout; the rollout stops (and is graded) once they are spent."""
    summarize: bool = True
    """When the context is full, have the model summarize its work and restart from the summary;
    otherwise the rollout stops there."""
    summary_tokens: int = Field(256, ge=16)
    """Completion budget of a summary."""
    run_timeout_s: float = Field(30.0, gt=0)
    """Limit of one `run` command (a `run_tests` call gets the task's `test_time_limit_s`)."""
    train_cut_off_calls: bool = False
    """Train on calls cut off by the completion budget (finish_reason `length`); by default their
    tokens get loss mask 0."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters of every call."""

    @model_validator(mode="after")
    def _room_for_a_turn(self) -> HarnessConfig:
        needed = self.max_turn_tokens + self.max_tool_tokens + self.summary_tokens
        if self.context_tokens and needed >= self.context_tokens:
            raise ValueError(
                f"context_tokens={self.context_tokens} leaves no room for the task: a turn needs max_turn_tokens + "
                f"max_tool_tokens + summary_tokens = {needed} tokens besides the prompt"
            )
        if self.max_tool_tokens < 32 * self.max_calls_per_turn:
            raise ValueError(
                f"max_tool_tokens={self.max_tool_tokens} is too small for max_calls_per_turn="
                f"{self.max_calls_per_turn} results (at least 32 tokens each)"
            )
        return self


class RolloutConfig(Config):
    """Running rollouts: how many at once, and the sandboxes and grading they use."""

    concurrency: int = Field(8, ge=1)
    """Rollouts in flight at once (their sandboxes, tools and HTTP calls overlap)."""
    sandbox: SandboxConfig = SandboxConfig()
    """Limits of the rollout sandbox the agent works in."""
    reward: RewardConfig = RewardConfig()
    """Grading: reward terms, penalties, and the grading sandbox."""
