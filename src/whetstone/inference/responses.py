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
from whetstone.tokenizer import Tokenizer, parse_assistant
from whetstone.tokenizer.chat import TOOL_CALL_OPEN

Decode = Callable[[list[int]], str]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _byte_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level BPE token string stands for (GPT-2's
    `bytes_to_unicode` backwards, the mapping Qwen's tokenizers and ours use): printable bytes
    stand for themselves, the others, in order, for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + len(chars) - len(printable))
    return {char: byte for byte, char in chars.items()}


BYTE_OF_CHAR = _byte_alphabet()


def token_bytes(tokenizer: Tokenizer, token_id: int) -> list[int]:
    """The UTF-8 bytes a token stands for, also when it holds only part of a character (its text
    is then U+FFFD): from its byte-level string, so a client joining a completion's tokens' bytes
    gets its text. A token whose text is whole characters (control and markup tokens included)
    is those characters' bytes."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return list(text.encode())
    token = tokenizer.id_to_token(token_id)
    if token is None or any(char not in BYTE_OF_CHAR for char in token):  # an added token: its text
        return list(text.encode())
    return [BYTE_OF_CHAR[char] for char in token]


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


def top_by_text(alternatives: list[tuple[int, float]], decode: Decode) -> dict[str, float]:
    """A token's alternatives as the completions format has them, text -> logprob. Tokens that
    decode to one text (parts of different characters are all U+FFFD) share its key, which holds
    the likeliest one's logprob: the format has room for one, and a lower one must not take the
    place of the token a client compares with `token_logprobs`."""
    top: dict[str, float] = {}
    for token, logprob in alternatives:
        text = decode([token])
        if text not in top or logprob > top[text]:
            top[text] = logprob
    return top


def completion_logprobs(seq: Sequence, start: int, end: int, decode: Decode, offset: int) -> dict[str, Any]:
    """OpenAI completions shape: tokens, token_logprobs, top_logprobs (`top_by_text`), text_offset."""
    tokens = [decode([t]) for t in seq.output_ids[start:end]]
    offsets, position = [], offset
    for text in tokens:
        offsets.append(position)
        position += len(text)
    top = None
    if seq.params.top_logprobs:
        top = [top_by_text(alternatives, decode) for alternatives in seq.top_logprobs[start:end]]
    return {"tokens": tokens, "token_logprobs": seq.logprobs[start:end], "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(seq: Sequence, start: int, end: int, tokenizer: Tokenizer) -> dict[str, Any]:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs}]}; `bytes` are the
    token's own (`token_bytes`)."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tokenizer.decode([token_id]), "logprob": logprob, "bytes": token_bytes(tokenizer, token_id)}

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


def without_think(text: str) -> str:
    """`text` without the think block it starts with (`<think>` ... `</think>` and the newlines
    after it), as a reply with tools shows it. A think block that never closed stays: it is all
    the model wrote."""
    if text.startswith(THINK_OPEN):
        _, closed, answer = text.partition(THINK_CLOSE)
        if closed:
            return answer.lstrip("\n")
    return text


def content_before_calls(answer: str) -> str:
    """The content of a reply with tools: its answer (`without_think`) up to its first tool call,
    without the newline `render_chat` puts before a call."""
    cut = answer.find(TOOL_CALL_OPEN)
    return answer if cut < 0 else answer[:cut].removesuffix("\n")


def assistant_message(text: str, use_tools: bool, parallel_calls: bool = True) -> tuple[dict[str, Any], bool]:
    """The assistant message for `text`, and whether it calls tools.

    With tools, the think block the text starts with is dropped, and the calls are parsed from
    the rest (the answer); without `parallel_calls` (a request's `parallel_tool_calls: false`)
    the first call alone is kept: the model may write several, and those after the first are
    left out (as vLLM does), not sent for the client to run. A malformed tool call keeps the
    whole answer as content (nothing of it is lost) and its problems in `tool_call_errors`.
    Either content starts with what a stream shows while the text grows
    (`stream.visible_content`), so a stream sends the same content.
    """
    if not use_tools:
        return {"role": "assistant", "content": text}, False
    answer = without_think(text)
    _, calls, errors = parse_assistant(answer)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": (answer if errors else content_before_calls(answer)) or None,
    }
    if calls:
        message["tool_calls"] = calls if parallel_calls else calls[:1]
    if errors:
        message["tool_call_errors"] = errors
    return message, bool(calls)


def chat_choice(seq: Sequence, index: int, request: ChatRequest, tokenizer: Tokenizer) -> dict[str, Any]:
    n = len(seq.output_ids)
    message, calls_tools = assistant_message(seq.text.text, request.use_tools, request.parallel_tool_calls is not False)
    finish = "tool_calls" if calls_tools and seq.finish_reason == "stop" else seq.finish_reason
    choice = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
    if request.logprobs:
        choice["logprobs"] = chat_logprobs(seq, 0, n, tokenizer)
    return choice | rl_fields(seq, request, 0, n, final=True)
