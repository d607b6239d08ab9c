"""OpenAI response bodies (whole and streamed) built from finished or running sequences.

Every function reads a sequence only up to a `Progress` snapshot or after it finished, so it
never sees a half-written step of the engine thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from whetstone.inference.protocol import ChatRequest, CompletionRequest, encode_routes
from whetstone.inference.sequence import Sequence
from whetstone.tokenizer import parse_assistant

Decode = Callable[[list[int]], str]


def header(response_id: str, kind: str, model: str) -> dict[str, Any]:
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": model}


def usage(prompt_lengths: list[int], seqs: list[Sequence]) -> dict[str, int]:
    prompt = sum(prompt_lengths)
    completion = sum(len(s.output_ids) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def rl_fields(
    seq: Sequence, request: CompletionRequest | ChatRequest, start: int, end: int, final: bool
) -> dict[str, Any]:
    """The extension fields a request asked for, for output tokens start..end. A stream carries
    the prompt's ids in its first chunk and the routes in its last."""
    fields: dict[str, Any] = {}
    if request.return_token_ids:
        if start == 0:
            fields["prompt_token_ids"] = seq.prompt_ids
        fields["token_ids"] = seq.output_ids[start:end]
        fields["weight_versions"] = seq.versions[start:end]
    if request.return_routed_experts and final:
        fields["routed_experts"] = None if seq.routes is None else encode_routes(seq.routes)
    return fields


def completion_logprobs(seq: Sequence, start: int, end: int, decode: Decode, offset: int) -> dict[str, Any]:
    """OpenAI completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [decode([t]) for t in seq.output_ids[start:end]]
    offsets, position = [], offset
    for text in tokens:
        offsets.append(position)
        position += len(text)
    top = None
    if seq.params.top_logprobs:
        top = [{decode([t]): lp for t, lp in alternatives} for alternatives in seq.top_logprobs[start:end]]
    return {"tokens": tokens, "token_logprobs": seq.logprobs[start:end], "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(seq: Sequence, start: int, end: int, decode: Decode) -> dict[str, Any]:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for i in range(start, end):
        item = entry(seq.output_ids[i], seq.logprobs[i])
        alternatives = seq.top_logprobs[i] if seq.params.top_logprobs else []
        item["top_logprobs"] = [entry(t, lp) for t, lp in alternatives]
        content.append(item)
    return {"content": content}


def completion_choice(seq: Sequence, index: int, request: CompletionRequest, decode: Decode) -> dict[str, Any]:
    n = len(seq.output_ids)
    choice = {"index": index, "text": seq.text.text, "finish_reason": seq.finish_reason, "logprobs": None}
    if request.logprobs is not None:
        choice["logprobs"] = completion_logprobs(seq, 0, n, decode, 0)
    return choice | rl_fields(seq, request, 0, n, final=True)


def assistant_message(text: str, use_tools: bool) -> tuple[dict[str, Any], bool]:
    """The assistant message for `text`, and whether it calls tools.

    A malformed tool call keeps the whole text as content (nothing is lost) and its problems
    in `tool_call_errors`.
    """
    if not use_tools:
        return {"role": "assistant", "content": text}, False
    content, calls, errors = parse_assistant(text)
    message: dict[str, Any] = {"role": "assistant", "content": (text if errors else content) or None}
    if calls:
        message["tool_calls"] = calls
    if errors:
        message["tool_call_errors"] = errors
    return message, bool(calls)


def chat_choice(seq: Sequence, index: int, request: ChatRequest, decode: Decode) -> dict[str, Any]:
    n = len(seq.output_ids)
    message, calls_tools = assistant_message(seq.text.text, request.use_tools)
    finish = "tool_calls" if calls_tools and seq.finish_reason == "stop" else seq.finish_reason
    choice = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
    if request.logprobs:
        choice["logprobs"] = chat_logprobs(seq, 0, n, decode)
    return choice | rl_fields(seq, request, 0, n, final=True)
