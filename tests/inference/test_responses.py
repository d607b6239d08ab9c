import asyncio
from types import SimpleNamespace

import pytest
from tokenizers import pre_tokenizers

from tests.inference.inference_fixtures import WEATHER_CALL, WEATHER_TOOL
from tests.inference.test_stream import Replay
from whetstone.inference.protocol import ChatRequest
from whetstone.inference.responses import BYTE_OF_CHAR, chat_choice, chat_logprobs, completion_logprobs, token_bytes
from whetstone.inference.sampling import SamplingParams
from whetstone.inference.sequence import Sequence
from whetstone.inference.stream import chat_stream


def test_the_byte_alphabet_is_the_byte_level_tokenizers():
    assert set(BYTE_OF_CHAR) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(BYTE_OF_CHAR.values()) == list(range(256))
    assert BYTE_OF_CHAR["Ġ"] == ord(" ") and BYTE_OF_CHAR["a"] == ord("a")


def test_chat_logprobs_give_each_tokens_own_bytes(tokenizer):
    """A token holding part of a character decodes to U+FFFD; its bytes are still its own, so a
    client joining the tokens' bytes gets the text."""
    text = "café 東京 ☕<|im_end|>"
    seq = Sequence("s", [1], SamplingParams())
    seq.output_ids = tokenizer.encode(text)
    seq.logprobs = [0.0] * len(seq.output_ids)
    entries = chat_logprobs(seq, 0, len(seq.output_ids), tokenizer)["content"]
    assert any(entry["token"] == "\ufffd" for entry in entries)  # some tokens are parts of characters
    assert bytes(b for entry in entries for b in entry["bytes"]) == text.encode()
    assert token_bytes(tokenizer, tokenizer.im_end_id) == list(b"<|im_end|>")


def test_completion_top_logprobs_keep_the_likelier_of_two_tokens_with_one_text(tokenizer):
    """Two tokens that are parts of different characters both decode to U+FFFD, one key of the
    legacy format's text -> logprob dict: it holds the likelier token's logprob."""
    partial = [t for t in tokenizer.encode("東京 ☕ café") if tokenizer.decode([t]) == "\ufffd"]
    first, second = sorted(set(partial))[:2]
    seq = Sequence("s", [1], SamplingParams(top_logprobs=3))
    seq.output_ids, seq.logprobs = [first], [-0.5]
    seq.top_logprobs = [[(first, -0.5), (second, -1.5), (tokenizer.encode("a")[0], -3.0)]]
    top = completion_logprobs(seq, 0, 1, tokenizer.decode, 0)["top_logprobs"]
    assert top == [{"\ufffd": -0.5, "a": -3.0}]


ROME_CALL = WEATHER_CALL.replace("Paris", "Rome")
TWO_CALLS = "Let me look.\n" + WEATHER_CALL + "\n" + ROME_CALL


def replies(text: str, parallel: bool | None) -> tuple[dict, dict]:
    """The reply not streamed and what a client accumulates from the stream, as the server sends
    them."""
    body = ChatRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL], parallel_tool_calls=parallel
    )
    submission = Replay([text[i : i + 5] for i in range(0, len(text), 5)])

    async def collect():
        events = chat_stream(
            submission, body.model_copy(update={"stream": True}), "id", "m", None, SimpleNamespace(is_disconnected=None)
        )
        return [chunk async for chunk in events]

    choices = [choice for chunk in asyncio.run(collect()) for choice in chunk["choices"]]
    streamed = {
        "content": "".join(c["delta"].get("content", "") for c in choices) or None,
        "tool_calls": [call for c in choices for call in c["delta"].get("tool_calls", [])],
        "finish": choices[-1]["finish_reason"],
    }
    return chat_choice(submission.seq, 0, body, None), streamed


@pytest.mark.parametrize("parallel", [None, True, False])
def test_parallel_tool_calls_false_keeps_the_first_call_only(parallel):
    whole, streamed = replies(TWO_CALLS, parallel)
    calls = whole["message"]["tool_calls"]
    arguments = [call["function"]["arguments"] for call in calls]
    expected = ['{"city": "Paris"}'] if parallel is False else ['{"city": "Paris"}', '{"city": "Rome"}']
    assert arguments == expected
    assert whole["message"]["content"] == streamed["content"] == "Let me look."
    assert streamed["tool_calls"] == [{"index": k, **call} for k, call in enumerate(calls)]
    assert whole["finish_reason"] == streamed["finish"] == "tool_calls"
