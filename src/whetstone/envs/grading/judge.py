"""An LLM judge: a rubric score in [0, 1] from any OpenAI-compatible chat-completions endpoint.

The judge sees the task, its rubric, the agent's diff and the test summary, and must end its
answer with `SCORE: <0-10>`. Its weight in the reward is bounded (`RewardConfig.judge_weight`),
and it is never asked about a rollout already flagged for cheating.
"""

from __future__ import annotations

import json
import os
import re
import time

import httpx
from pydantic import Field

from whetstone.config import Config
from whetstone.errors import WhetstoneError

SYSTEM_PROMPT = (
    "You review a code change made by an AI agent for a coding task. Judge it only against the rubric. "
    "Explain briefly, then end with a line `SCORE: N` where N is an integer from 0 (fails the rubric) "
    "to 10 (fully meets it)."
)
SCORE_LINE = re.compile(r"SCORE:\s*(\d+(?:\.\d+)?)", re.IGNORECASE)
MAX_DIFF_CHARS = 20_000
MAX_RESPONSE_BYTES = 4 << 20
"""A chat completion of `max_tokens` tokens is a few kilobytes; a larger response is not one."""


class JudgeError(WhetstoneError):
    """The judge endpoint failed or answered without a score."""


class JudgeConfig(Config):
    """Where the judge lives and how to ask it."""

    base_url: str | None = None
    """OpenAI-compatible API root, e.g. `http://localhost:8000/v1`; unset = no judge."""
    model: str = "judge"
    """Model name sent in the request."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (the key itself never goes in a config)."""
    timeout_s: float = Field(60.0, gt=0)
    """Timeout of one judge request."""
    max_tokens: int = Field(512, gt=0)
    """Completion budget of the judge's answer."""


def build_messages(instruction: str, rubric: str, diff: str, test_summary: str) -> list[dict[str, str]]:
    if len(diff) > MAX_DIFF_CHARS:
        diff = diff[:MAX_DIFF_CHARS] + f"\n[diff truncated: {len(diff) - MAX_DIFF_CHARS} more characters]"
    sections = {"Task": instruction, "Rubric": rubric, "Tests": test_summary, "Change": f"```diff\n{diff}\n```"}
    user = "\n\n".join(f"## {title}\n{text}" for title, text in sections.items())
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def parse_score(text: str) -> float:
    """The last `SCORE: N` in the answer, scaled from 0-10 to [0, 1]."""
    matches = SCORE_LINE.findall(text)
    if not matches:
        raise JudgeError(f"judge answer has no `SCORE: N` line: {text[-200:]!r}")
    return min(10.0, float(matches[-1])) / 10.0


def judge_score(instruction: str, rubric: str, diff: str, test_summary: str, config: JudgeConfig) -> tuple[float, str]:
    """(score in [0, 1], the judge's answer). Raises JudgeError on any failure."""
    if not config.base_url:
        raise JudgeError("no judge configured (reward.judge.base_url is unset)")
    headers = {}
    if config.api_key_env:
        key = os.environ.get(config.api_key_env)
        if not key:
            raise JudgeError(f"reward.judge.api_key_env names {config.api_key_env}, which is not set")
        headers["Authorization"] = f"Bearer {key}"
    body = {
        "model": config.model,
        "messages": build_messages(instruction, rubric, diff, test_summary),
        "max_tokens": config.max_tokens,
        "temperature": 0.0,
    }
    url = config.base_url.rstrip("/") + "/chat/completions"
    try:
        answer = json.loads(_post(url, body, headers, config.timeout_s))["choices"][0]["message"]["content"] or ""
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as err:
        raise JudgeError(f"judge request to {url} failed: {err}") from None
    if not isinstance(answer, str):
        raise JudgeError(f"judge answer from {url} is not text: {str(answer)[:200]!r}")
    return parse_score(answer), answer


def _post(url: str, body: dict, headers: dict[str, str], timeout_s: float) -> bytes:
    """The body of a successful POST. httpx's timeout bounds each read, so an endpoint that sends
    a byte now and then would hold the grade forever: the body must also be whole within
    `timeout_s` of the request, and at most MAX_RESPONSE_BYTES long (JudgeError otherwise). The
    deadline is checked as each piece arrives, so a stream that stalls just before it takes at
    most one more read timeout (`timeout_s`): about twice `timeout_s` in all."""
    deadline = time.monotonic() + timeout_s
    data = bytearray()
    with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout_s) as response:
        response.raise_for_status()
        for chunk in response.iter_bytes():
            data += chunk
            if len(data) > MAX_RESPONSE_BYTES:
                raise JudgeError(f"judge response from {url} is over {MAX_RESPONSE_BYTES} bytes: not a chat completion")
            if time.monotonic() > deadline:
                raise JudgeError(f"judge response from {url} took longer than timeout_s={timeout_s:g} s")
    return bytes(data)
