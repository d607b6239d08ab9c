"""Streamed responses: OpenAI's chunk objects, one per engine event, for SSE.

Chat streams show the content of the reply that is not streamed (`assistant_message`), as it
comes: with tools, they hold back a think block the text starts with (that reply drops it) and
anything that may turn out to be the start of a `<tool_call>`. The last chunk of a choice sends
whatever content is left, and the calls, parsed from the finished text and sent whole (name and
arguments) as OpenAI clients accumulate them, or the `tool_call_errors` of malformed ones. The
content chunks of a choice join into the content of the reply that is not streamed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request

from whetstone.inference.protocol import ChatRequest, CompletionRequest
from whetstone.inference.responses import (
    THINK_CLOSE,
    THINK_OPEN,
    assistant_message,
    chat_logprobs,
    completion_logprobs,
    content_before_calls,
    header,
    rl_fields,
    usage,
    without_think,
)
from whetstone.inference.submission import ClientGone, Submission
from whetstone.tokenizer import Tokenizer
from whetstone.tokenizer.chat import TOOL_CALL_OPEN

Decode = Callable[[list[int]], str]


async def choice_events(sub: Submission, request: Request) -> AsyncIterator[tuple[int, Any, Any]]:
    """(choice index, sequence, event) for every engine event of the submission, until all are
    finished or the client goes away; whatever is still generating is aborted either way."""
    index = {id(seq): i for i, seq in enumerate(sub.seqs)}
    try:
        async for events in sub.events(request.is_disconnected):
            for event in events:
                yield index[id(event.seq)], event.seq, event
    except ClientGone:
        return
    finally:
        sub.abort()  # no-op when all finished; stops generation if the client went away


def error_chunk(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


async def completion_stream(
    sub: Submission, body: CompletionRequest, response_id: str, model: str, decode: Decode, request: Request
) -> AsyncIterator[dict[str, Any]]:
    top = header(response_id, "text_completion", model)
    sent_tokens = [0] * len(sub.seqs)
    sent_text = [0] * len(sub.seqs)
    # where the next token's text starts (`text_offset`), counted as the reply that is not streamed
    # counts it: the tokens sent, whether or not their text was released yet
    token_offset = [0] * len(sub.seqs)
    async with aclosing(choice_events(sub, request)) as events:
        async for i, seq, event in events:
            if seq.error:
                yield error_chunk(seq.error)
                return
            start, end = sent_tokens[i], event.num_output
            text = seq.text.text[sent_text[i] : event.text_released]
            if start == end and not text and not event.finished:
                continue
            choice = {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": seq.finish_reason if event.finished else None,
            }
            if body.logprobs is not None:
                choice["logprobs"] = logprobs = completion_logprobs(seq, start, end, decode, token_offset[i])
                token_offset[i] += sum(len(token) for token in logprobs["tokens"])
            yield top | {"choices": [choice | rl_fields(seq, body, start, end, event.finished)]}
            sent_tokens[i], sent_text[i] = end, max(sent_text[i], event.text_released)
    if body.stream_options and body.stream_options.include_usage:  # a gone client reads nothing more
        yield top | {"choices": [], "usage": usage(sub.prompt_lengths, sub.seqs)}


def visible_content(text: str, released: int, use_tools: bool) -> str:
    """The part of the text that is surely content: the start of the content the finished reply
    will have (`assistant_message`), however the text goes on. With tools, that leaves out a
    think block the text starts with (all of it while it is open, or may be opening) and anything
    from the start of a tool call on."""
    visible = text[:released]
    if not use_tools:
        return visible
    if THINK_OPEN.startswith(visible) or (visible.startswith(THINK_OPEN) and THINK_CLOSE not in visible):
        return ""
    visible = content_before_calls(without_think(visible))
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(visible)), 0, -1):
        if visible.endswith(TOOL_CALL_OPEN[:size]):
            visible = visible[:-size]
            break
    return visible.rstrip("\n")  # the newline before a call is not content


async def chat_stream(
    sub: Submission, body: ChatRequest, response_id: str, model: str, tokenizer: Tokenizer, request: Request
) -> AsyncIterator[dict[str, Any]]:
    top = header(response_id, "chat.completion.chunk", model)
    count = len(sub.seqs)
    sent_tokens, sent_content, started = [0] * count, [""] * count, [False] * count
    async with aclosing(choice_events(sub, request)) as events:
        async for i, seq, event in events:
            if seq.error:
                yield error_chunk(seq.error)
                return
            delta: dict[str, Any] = {}
            if not started[i]:
                delta["role"] = "assistant"
                started[i] = True
            finish = None
            if event.finished:
                parallel = body.parallel_tool_calls is not False
                message, calls_tools = assistant_message(seq.text.text, body.use_tools, parallel)
                content = message["content"] or ""
                finish = "tool_calls" if calls_tools and seq.finish_reason == "stop" else seq.finish_reason
                if message.get("tool_calls"):
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
                if message.get("tool_call_errors"):
                    delta["tool_call_errors"] = message["tool_call_errors"]
            else:
                content = visible_content(seq.text.text, event.text_released, body.use_tools)
            if content.startswith(sent_content[i]) and len(content) > len(sent_content[i]):
                delta["content"] = content[len(sent_content[i]) :]
                sent_content[i] = content
            start, end = sent_tokens[i], event.num_output
            if not delta and start == end and not event.finished:
                continue
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            if body.logprobs:
                choice["logprobs"] = chat_logprobs(seq, start, end, tokenizer)
            yield top | {"choices": [choice | rl_fields(seq, body, start, end, event.finished)]}
            sent_tokens[i] = end
    if body.stream_options and body.stream_options.include_usage:  # a gone client reads nothing more
        yield top | {"choices": [], "usage": usage(sub.prompt_lengths, sub.seqs)}
