import pytest
import torch
from pydantic import ValidationError

from whetstone.inference.protocol import (
    MAX_SEQUENCES,
    MAX_STOP_CHARS,
    ChatRequest,
    CompletionRequest,
    decode_routes,
    encode_routes,
)


@pytest.mark.parametrize("experts,dtype", [(8, "uint8"), (300, "int16")])
def test_routes_round_trip_compactly(experts, dtype):
    routes = torch.randint(0, experts, (17, 3, 2))
    encoded = encode_routes(routes)
    assert encoded["dtype"] == dtype and encoded["shape"] == [17, 3, 2]
    assert torch.equal(decode_routes(encoded), routes)


def test_prompt_forms():
    assert CompletionRequest(model="m", prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(model="m", prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(model="m", prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


def test_each_choice_samples_with_its_own_seed():
    request = CompletionRequest(model="m", prompt="x", seed=10, stop="\n", top_k=-1)
    params = [request.sampling(max_tokens=5, top_logprobs=0, choice=c) for c in range(2)]
    assert [p.seed for p in params] == [10, 11] and params[0].stop == ("\n",) and params[0].top_k == 0


def test_chat_requests_validate_their_tools_and_logprobs():
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs=true"):
        ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    request = ChatRequest(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice="none",
    )
    assert not request.use_tools


def test_a_top_k_beyond_the_vocabulary_is_clamped_to_it():
    request = CompletionRequest(model="m", prompt="x", top_k=10**20)
    assert request.sampling(max_tokens=5, top_logprobs=0, choice=0, vocab_size=512).top_k == 512
    assert CompletionRequest(model="m", prompt="x", top_k=7).sampling(5, 0, 0, vocab_size=512).top_k == 7


def test_a_request_may_start_at_most_max_sequences():
    CompletionRequest(model="m", prompt=[[1]] * (MAX_SEQUENCES // 64), n=64)
    CompletionRequest(model="m", prompt=[1] * 5000, n=64)  # one prompt of token ids
    with pytest.raises(ValidationError, match=f"30000 prompts x n=64 = 1920000 sequences; .* at most {MAX_SEQUENCES}"):
        CompletionRequest(model="m", prompt=[[1]] * 30000, n=64)


def test_stop_strings_are_bounded_in_length():
    CompletionRequest(model="m", prompt="x", stop=["a" * MAX_STOP_CHARS])
    with pytest.raises(ValidationError, match=f"stop\n.*at most {MAX_STOP_CHARS} characters"):
        CompletionRequest(model="m", prompt="x", stop=["\n", "a" * (MAX_STOP_CHARS + 1)])


@pytest.mark.parametrize(
    "call",
    [
        {"function": "f"},
        {"function": {"arguments": "{}"}},
        {"function": {"name": "", "arguments": "{}"}},
        {"function": {"name": 3, "arguments": "{}"}},
        {"function": {"name": "f", "arguments": 5}},
        {"type": "code", "function": {"name": "f", "arguments": "{}"}},
        {"name": "f", "arguments": {}},
    ],
)
def test_malformed_tool_calls_in_messages_are_named(call):
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [WELL_FORMED, call]}]
    with pytest.raises(ValidationError, match=r"messages\[1\]\.tool_calls\[1\] must be"):
        ChatRequest(model="m", messages=messages)


WELL_FORMED = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_well_formed_tool_calls_pass():
    calls = [
        WELL_FORMED,
        {"function": {"name": "g", "arguments": {"a": 1}}},
        {"function": {"name": "h", "arguments": ""}},
    ]
    ChatRequest(model="m", messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": calls}])


def test_a_tool_call_without_arguments_is_named():
    """Qwen3's chat template cannot render one (it fails on tojson of undefined)."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"function": {"name": "h"}}]}]
    with pytest.raises(ValidationError, match=r"messages\[1\]\.tool_calls\[0\]\.function has no 'arguments'"):
        ChatRequest(model="m", messages=messages)
