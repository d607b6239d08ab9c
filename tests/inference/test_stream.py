"""`chat_stream` driven directly by a stand-in submission that replays the engine's events for a
text growing piece by piece: the streamed content joins into the content of the reply that is
not streamed (`chat_choice`), and the calls and call errors come as that reply has them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tests.inference.inference_fixtures import WEATHER_CALL, WEATHER_TOOL
from whetstone.inference.detokenize import IncrementalText
from whetstone.inference.protocol import ChatRequest, CompletionRequest
from whetstone.inference.responses import chat_choice, completion_choice
from whetstone.inference.sampling import SamplingParams
from whetstone.inference.sequence import Progress, Sequence
from whetstone.inference.stream import chat_stream, completion_stream

BAD_CALL = "<tool_call>\n{not json}\n</tool_call>"
TEXTS = {
    "plain": "Hello there, friend.",
    "think": "<think>user wants hi</think>\nHello there, friend.",
    "think-multiline": "<think>\nthe user greets\n</think>\n\nHello!\nHow are you?",
    "think-then-call": "<think>\nneeds the weather\n</think>\n\n" + WEATHER_CALL,
    "think-content-call": "<think>w</think>\nLet me look.\n\n" + WEATHER_CALL,
    "call": WEATHER_CALL,
    "content-call": "Let me look.\n" + WEATHER_CALL,
    "two-calls": WEATHER_CALL + "\n" + WEATHER_CALL,
    "bad-call": "Sure.\n" + BAD_CALL,
    "think-bad-call": "<think>r</think>\nSure.\n" + BAD_CALL,
    "unclosed-call": 'Hi\n<tool_call>\n{"name": "get_',
    "unclosed-think": "<think>still thinking about",
    "think-only": "<think>done</think>\n",
    "angle-brackets": "a < b, <thinking> and <tool> are text",
    "stray-close": "<think>a</think>\nx </think> y",
    "close-without-open": "reason</think>\nanswer",
    "lone-angle": "<",
}


class Replay:
    """A submission of one choice whose text grows through `pieces`; the last event finishes it.
    `held` characters of each text are not released yet (as a pending stop string holds them)."""

    def __init__(self, pieces: list[str], held: int = 0):
        self.seq = SimpleNamespace(
            text=SimpleNamespace(text=""),
            error=None,
            finish_reason=None,
            output_ids=[],
            logprobs=[],
            top_logprobs=[],
            params=None,
        )
        self.seqs, self.prompt_lengths, self.pieces, self.held = [self.seq], [3], pieces, held

    async def events(self, is_disconnected):
        text = ""
        for number, piece in enumerate(self.pieces):
            text += piece
            self.seq.text.text = text
            self.seq.output_ids.append(number)
            last = number == len(self.pieces) - 1
            if last:
                self.seq.finish_reason = "stop"
            released = len(text) if last else max(0, len(text) - self.held)
            yield [Progress(self.seq, len(self.seq.output_ids), released, last)]

    def abort(self):
        pass


def streamed(pieces: list[str], tools: bool, held: int = 0) -> tuple[list[dict], dict]:
    """The stream's choice deltas (and last finish_reason), and the reply not streamed."""
    body = ChatRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL] if tools else None, stream=True
    )
    submission = Replay(pieces, held)

    async def collect():
        request = SimpleNamespace(is_disconnected=None)
        return [chunk async for chunk in chat_stream(submission, body, "id", "m", None, request)]

    chunks = asyncio.run(collect())
    whole = chat_choice(submission.seq, 0, body.model_copy(update={"stream": False}), None)
    return [choice for chunk in chunks for choice in chunk["choices"]], whole


def joined(choices: list[dict]) -> dict:
    """What a client accumulates from a choice's deltas."""
    content = "".join(c["delta"].get("content", "") for c in choices)
    calls = [call for c in choices for call in c["delta"].get("tool_calls", [])]
    errors = [error for c in choices for error in c["delta"].get("tool_call_errors", [])]
    return {"content": content, "tool_calls": calls, "tool_call_errors": errors, "finish": choices[-1]["finish_reason"]}


def splits(text: str) -> dict[str, list[str]]:
    """Ways the text may arrive: whole, a character at a time (every tag split across chunks),
    and in pieces of 3 and 7 characters."""
    return {
        "whole": [text],
        "chars": list(text),
        "by3": [text[i : i + 3] for i in range(0, len(text), 3)],
        "by7": [text[i : i + 7] for i in range(0, len(text), 7)],
    }


@pytest.mark.parametrize("tools", [True, False], ids=["tools", "no-tools"])
@pytest.mark.parametrize("name", list(TEXTS))
def test_the_stream_joins_into_the_reply_that_is_not_streamed(name, tools):
    for how, pieces in splits(TEXTS[name]).items():
        for held in (0, 2):
            choices, whole = streamed(pieces, tools, held)
            got = joined(choices)
            message = whole["message"]
            expected_calls = [{"index": k, **call} for k, call in enumerate(message.get("tool_calls", []))]
            where = f"{name}, {how}, held {held}"
            assert got["content"] == (message["content"] or ""), where
            assert got["tool_calls"] == expected_calls, where
            assert got["tool_call_errors"] == message.get("tool_call_errors", []), where
            assert got["finish"] == whole["finish_reason"], where
            assert all(c["finish_reason"] is None for c in choices[:-1]), where


def test_a_think_block_is_held_back_and_the_tail_is_sent():
    """With tools, the reply drops the think block: the stream never shows it, and the content
    generated after the last chunk comes in the finishing one."""
    text = TEXTS["think"]
    pieces = ["<think>user wants hi</think>\n", "Hel", "lo there, friend."]
    choices, whole = streamed(pieces, tools=True)
    assert whole["message"]["content"] == "Hello there, friend."
    assert [c["delta"].get("content") for c in choices] == [None, "Hel", "lo there, friend."]
    assert not any("<think>" in (c["delta"].get("content") or "") for c in choices)
    choices, whole = streamed(pieces, tools=False)  # without tools the text is the content, as it is
    assert joined(choices)["content"] == whole["message"]["content"] == text


def test_malformed_calls_are_streamed_as_tool_call_errors():
    choices, whole = streamed(splits(TEXTS["think-bad-call"])["by3"], tools=True)
    assert whole["message"]["content"] == "Sure.\n" + BAD_CALL  # the answer, without the think block
    assert whole["message"]["tool_call_errors"][0].startswith("tool call 0: invalid JSON")
    last = choices[-1]
    assert last["delta"]["tool_call_errors"] == whole["message"]["tool_call_errors"]
    assert "tool_calls" not in last["delta"] and last["finish_reason"] == "stop"


class Generation:
    """A submission of one real sequence fed `tokens` one per event, as the engine feeds it."""

    def __init__(self, seq: Sequence, tokens: list[int]):
        self.seq, self.tokens = seq, tokens
        self.seqs, self.prompt_lengths = [seq], [len(seq.prompt_ids)]

    async def events(self, is_disconnected):
        for number, token in enumerate(self.tokens):
            self.seq.output_ids.append(token)
            self.seq.logprobs.append(-1.0)
            self.seq.text.push([token])
            last = number == len(self.tokens) - 1
            if last:
                self.seq.text.finish()
                self.seq.finish_reason = "length"
            yield [Progress(self.seq, len(self.seq.output_ids), self.seq.text.released, last)]

    def abort(self):
        pass


def test_streamed_text_offsets_are_those_of_the_reply_that_is_not_streamed():
    """A token whose text is held back (it may start a stop string) still takes its place in the
    text: the next token's `text_offset` counts it, in a stream as in the whole reply."""
    pieces = {1: "ab", 2: "c", 3: "d", 4: "e"}

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    seq = Sequence("s", [9], SamplingParams(max_tokens=4, stop=("cx",)), stream=True)
    seq.text = IncrementalText(decode, seq.params.stop)
    body = CompletionRequest(model="m", prompt=[9], logprobs=0, stream=True)

    async def collect():
        request = SimpleNamespace(is_disconnected=None)
        return [
            chunk async for chunk in completion_stream(Generation(seq, [1, 2, 3, 4]), body, "id", "m", decode, request)
        ]

    choices = [choice for chunk in asyncio.run(collect()) for choice in chunk["choices"]]
    assert [c["text"] for c in choices] == ["ab", "", "cd", "e"]  # "c" waited: it may have begun "cx"
    streamed_offsets = [offset for c in choices for offset in c["logprobs"]["text_offset"]]
    assert streamed_offsets == completion_choice(seq, 0, body, decode)["logprobs"]["text_offset"] == [0, 2, 3, 4]
