import dataclasses
import json
import re

import pydantic_core
import pytest
import torch
from pydantic import BaseModel, ValidationError

from whetstone.inference import protocol
from whetstone.inference.protocol import (
    MAX_SEQUENCES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_IDS,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    FeedbackRequest,
    StreamOptions,
    decode_routes,
    encode_routes,
)
from whetstone.inference.sampling import SamplingParams

USER = [{"role": "user", "content": "x"}]


def problems(model, body: dict) -> list[tuple[str, str]]:
    """(where, message) of each error of `body` as JSON, parsed as the server may parse it:
    straight from the bytes, or into Python first; both must agree."""
    raw = json.dumps(body).encode()
    found = []
    for parse in (model.model_validate_json, lambda raw: model.model_validate(pydantic_core.from_json(raw))):
        try:
            parse(raw)
            found.append([])
        except ValidationError as err:
            found.append([(".".join(str(p) for p in e["loc"]), e["msg"]) for e in err.errors()])
    assert found[0] == found[1]
    return found[0]


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


def test_stop_token_ids_reach_the_engine_as_a_set():
    """The engine thread looks every sampled token up in them: a set, built once per choice."""
    request = CompletionRequest(model="m", prompt="x", stop_token_ids=[7, 3, 7])
    params = request.sampling(max_tokens=5, top_logprobs=0, choice=0)
    assert isinstance(params.stop_token_ids, frozenset) and params.stop_token_ids == {3, 7}
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == frozenset({5, 6})
    assert dataclasses.replace(params, stop_token_ids=[1]).stop_token_ids == frozenset({1})
    assert CompletionRequest(model="m", prompt="x").sampling(5, 0, 0).stop_token_ids == frozenset()


def test_a_top_k_beyond_the_vocabulary_is_clamped_to_it():
    request = CompletionRequest(model="m", prompt="x", top_k=10**20)
    assert request.sampling(max_tokens=5, top_logprobs=0, choice=0, vocab_size=512).top_k == 512
    assert CompletionRequest(model="m", prompt="x", top_k=7).sampling(5, 0, 0, vocab_size=512).top_k == 7


def test_a_request_may_start_at_most_max_sequences():
    CompletionRequest(model="m", prompt=[[1]] * (MAX_SEQUENCES // 64), n=64)
    CompletionRequest(model="m", prompt=[1] * 5000, n=64)  # one prompt of token ids
    with pytest.raises(ValidationError, match=f"1000 prompts x n=64 = 64000 sequences; .* at most {MAX_SEQUENCES}"):
        CompletionRequest(model="m", prompt=[[1]] * 1000, n=64)
    with pytest.raises(ValidationError, match=f"at most {MAX_SEQUENCES} items after validation, not 30000"):
        CompletionRequest(model="m", prompt=[[1]] * 30000)


@pytest.mark.parametrize(
    "prompt, where, message",
    [
        ([1] * (MAX_TOKEN_IDS + 1), "prompt.token_ids", f"at most {MAX_TOKEN_IDS} items after validation, not"),
        ([[1]] * (MAX_SEQUENCES + 1), "prompt.token_id_lists", f"at most {MAX_SEQUENCES} items"),
        ([[1], [1] * (MAX_TOKEN_IDS + 1)], "prompt.token_id_lists.1", f"at most {MAX_TOKEN_IDS} items"),
        (["a"] * (MAX_SEQUENCES + 1), "prompt.texts", f"at most {MAX_SEQUENCES} items"),
        ([1.5] * 1000, "prompt.token_ids.0", "valid integer"),
        ([1, 2, "a", "b"], "prompt.token_ids.2", "valid integer"),
        (["a", [1]] * 500, "prompt.texts.1", "valid string"),
        ([[1], [True]], "prompt.token_id_lists.1.0", "valid integer"),
        (5, "prompt", "must be a string, a list of token ids, or a list of strings or of token-id lists"),
    ],
    ids=["ids", "id-lists", "ids-in-a-list", "texts", "floats", "ids-then-texts", "mixed", "bool", "number"],
)
def test_a_prompt_of_the_wrong_form_or_length_gets_one_error_naming_it(prompt, where, message):
    """Each form is validated alone and stops at its first bad item, and the lengths are checked
    before the items: one error, not one per item for every form the prompt is not."""
    [(got_where, got)] = problems(CompletionRequest, {"model": "m", "prompt": prompt})
    assert got_where == where and message in got


def test_other_lists_are_bounded():
    body = {"model": "m", "prompt": "x"}
    [(where, message)] = problems(CompletionRequest, body | {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))})
    assert where == "stop_token_ids" and f"at most {MAX_STOP_TOKEN_IDS} items" in message
    [(where, message)] = problems(CompletionRequest, body | {"stop": ["a"] * (MAX_STOP_STRINGS + 1)})
    assert where == "stop.texts" and f"at most {MAX_STOP_STRINGS} items" in message
    assert problems(CompletionRequest, body | {"stop": 5}) == [("stop", "must be a string or a list of strings")]
    assert problems(CompletionRequest, body | {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS)), "stop": []}) == []


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_tokens", "3", "valid integer"),
        ("max_tokens", True, "valid integer"),
        ("max_tokens", 3.0, "valid integer"),
        ("top_k", 2.0, "valid integer"),
        ("n", True, "valid integer"),
        ("seed", "7", "valid integer"),
        ("temperature", "0", "valid number"),
        ("top_p", True, "valid number"),
        ("stream", "no", "valid boolean"),
        ("stream", 0, "valid boolean"),
        ("ignore_eos", "on", "valid boolean"),
        ("return_token_ids", 1, "valid boolean"),
        ("model", 5, "valid string"),
        ("user", 5, "valid string"),
        ("logprobs", "yes", "valid boolean"),
        ("top_logprobs", "2", "valid integer"),
        ("max_completion_tokens", "5", "valid integer"),
        ("parallel_tool_calls", "true", "valid boolean"),
    ],
)
def test_values_of_the_wrong_type_are_refused_not_converted(field, value, message):
    [(where, got)] = problems(ChatRequest, {"model": "m", "messages": USER, field: value})
    assert where == field and message in got


@pytest.mark.parametrize(
    "model, required",
    [(CompletionRequest, {"model": "m", "prompt": "x"}), (ChatRequest, {"model": "m", "messages": USER})],
    ids=["completion", "chat"],
)
def test_null_for_an_optional_field_means_its_default(model, required):
    optional = [name for name, field in model.model_fields.items() if not field.is_required()]
    assert {"temperature", "n", "stream", "max_tokens", "stop", "seed", "user"} <= set(optional)
    assert problems(model, required | dict.fromkeys(optional)) == []
    nulls = model.model_validate_json(json.dumps(required | dict.fromkeys(optional)))
    assert nulls == model.model_validate(required)
    assert (nulls.temperature, nulls.n, nulls.stream, nulls.top_p) == (1.0, 1, False, 1.0)


BODIES = {
    StreamOptions: {},
    ChatMessage: {"role": "user"},
    FeedbackRequest: {"id": "chatcmpl-1", "rating": "thumbs_up"},
    CompletionRequest: {"model": "m", "prompt": "x"},
    ChatRequest: {"model": "m", "messages": USER},
}
"""Each request model of the protocol (a body, or an object inside one) with its required fields."""


@pytest.mark.parametrize("model", BODIES, ids=lambda model: model.__name__)
def test_every_request_model_takes_null_for_each_optional_field_as_its_default(model):
    models = {value for value in vars(protocol).values() if isinstance(value, type) and issubclass(value, BaseModel)}
    assert {m for m in models if m.__module__ == protocol.__name__ and not m.__name__.startswith("_")} == set(BODIES)
    required = BODIES[model]
    optional = [name for name, field in model.model_fields.items() if not field.is_required()]
    assert optional
    assert problems(model, required | dict.fromkeys(optional)) == []
    assert model.model_validate_json(json.dumps(required | dict.fromkeys(optional))) == model.model_validate(required)


def test_null_inside_objects_means_not_given():
    options = StreamOptions.model_validate({"include_usage": None, "include_obfuscation": None})
    assert (options.include_usage, options.include_obfuscation) == (False, False)
    nulls = {"name": None, "function_call": None, "tool_calls": None, "refusal": None, "audio": None}
    message = ChatMessage.model_validate({"role": "assistant", "content": "hi"} | nulls)
    assert message == ChatMessage(role="assistant", content="hi") and message.model_extra == {}
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    calling = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]})
    assert calling.as_chat_dict() == {"role": "assistant", "tool_calls": [call]}  # content null: a call only
    feedback = FeedbackRequest.model_validate(
        {"id": "chatcmpl-1", "rating": "thumbs_up", "choice": None, "score": None}
    )
    assert (feedback.choice, feedback.score) == (0, None)


def test_null_for_a_required_or_forbidden_field_inside_an_object_is_refused():
    [(where, message)] = problems(ChatRequest, {"model": "m", "messages": [{"role": None, "content": "x"}]})
    assert where == "messages.0.role" and message.startswith("Input should be 'system'")
    body = {"model": "m", "messages": USER, "stream": True, "stream_options": {"include_usage": None, "usage": None}}
    assert problems(ChatRequest, body) == [("stream_options.usage", "Extra inputs are not permitted")]
    for field in ("id", "rating"):
        [(where, _)] = problems(FeedbackRequest, {"id": "chatcmpl-1", "rating": "thumbs_up"} | {field: None})
        assert where == field


def test_null_for_a_required_or_unknown_field_is_still_refused():
    [(where, message)] = problems(ChatRequest, {"model": None, "messages": USER})
    assert (where, message) == ("model", "Input should be a valid string")
    with pytest.raises(ValidationError, match="messages\n  Input should be a valid list"):
        ChatRequest.model_validate({"model": "m", "messages": None})
    [(where, message)] = problems(ChatRequest, {"model": "m", "messages": USER, "temprature": None})
    assert (where, message) == ("temprature", "Extra inputs are not permitted")


def test_completion_logprobs_are_an_integer():
    [(where, _)] = problems(CompletionRequest, {"model": "m", "prompt": "x", "logprobs": True})
    assert where == "logprobs"


def test_numbers_given_as_json_integers_are_numbers():
    body = {"model": "m", "messages": USER, "temperature": 0, "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0}
    assert problems(ChatRequest, body | {"seed": 2**70, "top_k": 10**20, "logit_bias": {}}) == []
    request = ChatRequest.model_validate_json(json.dumps(body))
    assert request.temperature == 0.0 and isinstance(request.temperature, float)


def test_stream_options_need_stream_and_known_keys():
    body = {"model": "m", "messages": USER}
    assert problems(ChatRequest, body | {"stream": True, "stream_options": {"include_usage": True}}) == []
    assert problems(ChatRequest, body | {"stream_options": None}) == []
    for without in ({}, {"stream": False}):
        [(where, message)] = problems(ChatRequest, body | without | {"stream_options": {"include_usage": True}})
        assert "stream_options is only allowed with stream: true" in message
    [(where, message)] = problems(ChatRequest, body | {"stream": True, "stream_options": {"include_usage": 1}})
    assert (where, message) == ("stream_options.include_usage", "Input should be a valid boolean")
    [(where, message)] = problems(ChatRequest, body | {"stream": True, "stream_options": {"x": 1}})
    assert (where, message) == ("stream_options.x", "Extra inputs are not permitted")
    assert problems(ChatRequest, body | {"stream": True, "stream_options": {"include_obfuscation": False}}) == []
    [(where, message)] = problems(ChatRequest, body | {"stream": True, "stream_options": {"include_obfuscation": True}})
    assert where == "stream_options.include_obfuscation" and "not supported" in message


@pytest.mark.parametrize(
    "function, message",
    [
        ({"name": 5}, "tools[0].function.name must be a non-empty string, got 5"),
        ({"name": ""}, "tools[0].function.name must be a non-empty string"),
        ({"name": "f", "parameters": "notadict"}, "tools[0].function.parameters must be a JSON Schema object, got str"),
        ({"name": "f", "description": 3}, "tools[0].function.description must be a string, got int"),
    ],
)
def test_malformed_tools_are_named(function, message):
    [(_, got)] = problems(
        ChatRequest, {"model": "m", "messages": USER, "tools": [{"type": "function", "function": function}]}
    )
    assert message in got


def test_stop_strings_are_bounded_in_length():
    CompletionRequest(model="m", prompt="x", stop=["a" * MAX_STOP_CHARS])
    with pytest.raises(ValidationError, match=f"stop\n.*at most {MAX_STOP_CHARS} characters"):
        CompletionRequest(model="m", prompt="x", stop=["\n", "a" * (MAX_STOP_CHARS + 1)])


@pytest.mark.parametrize(
    "call, problem",
    [
        ({"function": "f"}, ".function must be an object {'name': ..., 'arguments': ...}, got str"),
        ({"function": {"arguments": "{}"}}, ".function.name must be a non-empty string, got nothing"),
        ({"function": {"name": "", "arguments": "{}"}}, ".function.name must be a non-empty string, got ''"),
        ({"function": {"name": 3, "arguments": "{}"}}, ".function.name must be a non-empty string, got 3"),
        ({"function": {"name": "f", "arguments": 5}}, ".function.arguments must be a JSON string or object, got int"),
        ({"type": "code", "function": {"name": "f", "arguments": "{}"}}, ".type must be 'function', got 'code'"),
        ({"name": "f", "arguments": {}}, ".function must be an object {'name': ..., 'arguments': ...}, got nothing"),
    ],
)
def test_malformed_tool_calls_in_messages_are_named(call, problem):
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [WELL_FORMED, call]}]
    with pytest.raises(ValidationError, match=re.escape(f"messages[1].tool_calls[1]{problem}")):
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


@pytest.mark.parametrize(
    "content, message",
    [
        (5, "must be a string, a list of text parts ({'type': 'text', 'text': ...}), or null"),
        (
            {"type": "text", "text": "x"},
            "must be a string, a list of text parts ({'type': 'text', 'text': ...}), or null",
        ),
        ([5], "Value error, part 0: a content part must be an object {'type': 'text', 'text': ...}, got int"),
        (["x"], "Value error, part 0: a content part must be an object {'type': 'text', 'text': ...}, got str"),
    ],
)
def test_content_of_the_wrong_form_is_one_error_naming_content(content, message):
    """Not one error per form it is not, under pydantic's names for them (`content.str`)."""
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    assert problems(ChatRequest, body) == [("messages.0.content", message)]


def _plain_unions(schema, where: str = "") -> list[str]:
    """Where a core schema holds a union that is not tagged: pydantic validates a value against
    each of its members and names them in the error's location (`content.str`), so each union of
    a request body has a `Discriminator`, whose error names the field itself."""
    if isinstance(schema, dict):
        found = [where] if schema.get("type") == "union" else []
        return found + [f for key, value in schema.items() for f in _plain_unions(value, f"{where}/{key}")]
    if isinstance(schema, list):
        return [f for number, value in enumerate(schema) for f in _plain_unions(value, f"{where}/{number}")]
    return []


@pytest.mark.parametrize("model", [CompletionRequest, ChatRequest, FeedbackRequest])
def test_every_union_of_a_request_body_is_discriminated(model):
    assert _plain_unions(model.__pydantic_core_schema__) == []
