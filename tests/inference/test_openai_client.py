"""A real `whetstone serve` process, driven with the official `openai` client.

The served model is the tiny one from conftest that learned to greet and to call
`get_weather`, so chat replies and tool calls are real model output, parsed by the server.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.inference.inference_fixtures import GREETING, GREETING_REPLY, WEATHER_QUESTION, WEATHER_TOOL
from whetstone.inference.protocol import decode_routes
from whetstone.utils.processes import serving

openai = pytest.importorskip("openai")  # a test dependency; the GPU machine's image lacks it

TOKEN = "test-token"
MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def server(served_model_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("serve") / "serve.toml"
    config.write_text(
        f'model_path = "{served_model_dir}"\nauth_token = "{TOKEN}"\nthreads = 1\n'
        "[engine]\nmax_batch = 4\ncontext_limit = 512\n"
    )
    with serving([str(config)], config.with_name("server.log")) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=TOKEN, max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_reply(client):
    reply = client.chat.completions.create(model=MODEL, messages=GREETING, temperature=0, max_tokens=20)
    choice = reply.choices[0]
    assert choice.message.content == GREETING_REPLY and choice.finish_reason == "stop"
    assert reply.id.startswith("chatcmpl-") and reply.usage.completion_tokens > 0


def test_chat_tool_call(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], temperature=0, max_tokens=40
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_chat_streaming_with_and_without_tools(client):
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=GREETING, temperature=0, max_tokens=20, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == GREETING_REPLY
    assert chunks[-1].choices[0].finish_reason == "stop"

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], temperature=0, max_tokens=40, stream=True
        )
    )
    calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""  # the call is not content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_completion_with_rl_extensions(client):
    reply = client.completions.create(
        model=MODEL,
        prompt="def main():",
        max_tokens=6,
        seed=3,
        logprobs=2,
        extra_body={"return_token_ids": True, "return_routed_experts": True, "priority": "batch", "ignore_eos": True},
    )
    choice = reply.choices[0]
    extra = choice.model_extra
    assert len(extra["token_ids"]) == 6 and extra["weight_versions"] == [0] * 6
    assert len(choice.logprobs.token_logprobs) == 6 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    routes = decode_routes(extra["routed_experts"])
    assert routes.shape == (len(extra["prompt_token_ids"]) + 6 - 1, 1, 2)  # every token fed; 1 MoE layer, top-2
    again = client.completions.create(
        model=MODEL,
        prompt="def main():",
        max_tokens=6,
        seed=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert again.choices[0].model_extra["token_ids"] == extra["token_ids"]  # same seed, same tokens


def test_completion_streaming(client):
    full = client.completions.create(
        model=MODEL, prompt="import os", max_tokens=8, seed=1, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="import os", max_tokens=8, seed=1, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_every_parameter_the_client_sends_is_taken(client):
    """Each parameter whetstone takes, as the client sends it (integers for numbers included)."""
    chat = dict(
        model=MODEL,
        messages=WEATHER_QUESTION,
        temperature=0,
        top_p=1,
        n=2,
        stop=["\n\n"],
        seed=1,
        max_completion_tokens=5,
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
        user="someone",
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "text"},
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        parallel_tool_calls=True,
        extra_body={"top_k": 5, "ignore_eos": False, "stop_token_ids": [1], "return_token_ids": True},
    )
    assert len(client.chat.completions.create(**chat).choices) == 2
    chunks = list(client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens > 0
    text = dict(model=MODEL, max_tokens=3, temperature=0.5, top_p=0.9, n=1, stop="\n", seed=2, user="u")
    extra = dict(logprobs=0, echo=False, best_of=1, suffix=None, presence_penalty=0, frequency_penalty=0)
    assert client.completions.create(prompt=[11, 12, 13], **text, **extra).choices[0].text is not None
    assert client.completions.create(prompt=["a", "b"], **text).choices[1].index == 1
    chunks = list(client.completions.create(prompt="x", stream=True, stream_options={"include_usage": True}, **text))
    assert chunks[-1].usage.completion_tokens > 0


def test_wrong_types_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens: Input should be a valid integer"):
        client.chat.completions.create(model=MODEL, messages=GREETING, max_tokens="3")
    with pytest.raises(openai.BadRequestError, match="stream_options is only allowed with stream: true"):
        client.chat.completions.create(model=MODEL, messages=GREETING, stream_options={"include_usage": True})


def test_concurrent_users_and_rollouts(client):
    def ask(i):
        priority = "batch" if i % 2 else "interactive"
        return client.completions.create(
            model=MODEL, prompt=f"x = {i}", max_tokens=5, seed=i, extra_body={"priority": priority, "ignore_eos": True}
        )

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(8)))
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5 for r in replies)


def test_bad_requests_get_a_clear_4xx_and_the_server_keeps_serving(client, server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="context limit is 512"):
        client.completions.create(model=MODEL, prompt=[1] * 600)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens \(5000\)"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    raw = httpx.post(
        f"{server}/v1/chat/completions",
        content=b'{"model": "tiny-chat", "messages": [',
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    assert raw.status_code == 400 and "malformed JSON" in raw.json()["error"]["message"]
    lone = httpx.post(
        f"{server}/v1/chat/completions",
        content=b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "\\ud800"}]}',
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    assert lone.status_code == 400
    assert "malformed JSON: a \\uD800-\\uDFFF escape at line 1 column" in lone.json()["error"]["message"]
    assert "lacks the other half of its surrogate pair" in lone.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None


def test_bearer_token_is_required(server):
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"{server}/health").json()["status"] == "ok"  # probes need no token


def test_metrics_are_prometheus_text(client, server):
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "whetstone_queue_depth",
        "whetstone_tokens_per_second",
        "whetstone_weight_version",
        "whetstone_swap_pause_seconds_count",
        "whetstone_preemptions_total",
    ):
        assert f"\n{name}{{" in text
    assert 'whetstone_requests_total{model="tiny-chat",reason="length"}' in text
