import pytest
import torch
from pydantic import ValidationError

from whetstone.inference.protocol import ChatRequest, CompletionRequest, decode_routes, encode_routes


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
