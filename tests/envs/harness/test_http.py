"""`HttpPolicy` against the real inference server (engine + HTTP app, served by uvicorn in this
process on a free port), and the harness over HTTP: token ids, logprobs, versions and routes
exactly as the server sampled them. How the policy meets a busy server (429) is scripted."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import torch

from tests.envs.harness.harness_support import (
    assert_one_growing_sequence,
    call,
    save_tiny_model,
    serve_in_thread,
    synth_task,
    tokenizer,
)
from whetstone.envs.harness import (
    AgentHarness,
    EndpointConfig,
    HarnessConfig,
    HttpPolicy,
    PolicyError,
    RolloutConfig,
    Sampling,
    rollout,
)
from whetstone.inference.protocol import decode_routes
from whetstone.utils.processes import free_port

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_in_thread(save_tiny_model(tmp_path_factory.mktemp("model"))) as url:
        yield url


def test_connect_finds_the_model_and_its_context(server):
    async def connect():
        policy = await HttpPolicy.connect(EndpointConfig(base_url=server))
        await policy.close()
        return policy

    policy = asyncio.run(connect())
    assert (policy.model, policy.context_limit) == ("tiny-agent", 1024)


def test_a_completion_carries_what_was_sampled(server):
    prompt = tokenizer().encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")

    async def complete():
        policy = await HttpPolicy.connect(EndpointConfig(base_url=server))
        try:
            return await policy.complete(prompt, Sampling(max_tokens=12, priority="batch"))
        finally:
            await policy.close()

    completion = asyncio.run(complete())
    n = len(completion.ids)
    assert 1 <= n <= 12 and len(completion.logprobs) == n and completion.versions == [0] * n
    assert all(lp <= 0.0 for lp in completion.logprobs)
    stops = (tokenizer().im_end_id, tokenizer().endoftext_id)  # a stop token ends the ids, not the text
    shown = completion.ids[:-1] if completion.ids[-1] in stops else completion.ids
    assert completion.text == tokenizer().decode(shown)
    routes = decode_routes(completion.routes)
    assert routes.shape == (len(prompt) + n - 1, 2, 2)  # every token fed: prompt, then all but the last sampled


def test_server_errors_are_policy_errors_that_name_the_problem(server):
    async def ask(config, prompt):
        policy = await HttpPolicy.connect(config)
        try:
            return await policy.complete(prompt, Sampling(max_tokens=4))
        finally:
            await policy.close()

    with pytest.raises(PolicyError, match="token ids must be in"):
        asyncio.run(ask(EndpointConfig(base_url=server), [10**6]))
    with pytest.raises(PolicyError, match="does not serve model 'other'"):
        asyncio.run(ask(EndpointConfig(base_url=server, model="other"), [1]))


def test_an_unreachable_server_is_a_policy_error_after_retries():
    config = EndpointConfig(base_url=f"http://127.0.0.1:{free_port()}/v1", retries=1)
    with pytest.raises(PolicyError, match="ConnectError"):
        asyncio.run(HttpPolicy.connect(config))


def test_a_rollout_over_http_records_one_growing_sequence(server):
    task = synth_task()
    config = HarnessConfig(max_turns=3, max_turn_tokens=24, max_tool_tokens=256, summary_tokens=64)
    harness = AgentHarness(config, tokenizer())

    async def go():
        policy = await HttpPolicy.connect(EndpointConfig(base_url=server))
        try:
            return await rollout(task, policy, harness, RolloutConfig())
        finally:
            await policy.close()

    trajectory = asyncio.run(go())
    assert trajectory.status == "ok", trajectory.error
    assert trajectory.turns == 3 and len(trajectory.segments) == 1
    calls = trajectory.calls
    assert_one_growing_sequence(calls)
    # random weights rarely write a tool call: the loop answers and goes on, counting each
    assert trajectory.invalid_tool_calls <= 3 and "tests" in trajectory.reward_breakdown
    assert call("submit") not in tokenizer().decode(calls[0].completion_ids)


def test_answers_of_other_servers_are_read_or_refused_by_name():
    policy = HttpPolicy(EndpointConfig(weight_version=3), "m", None, client=None)
    vllm_like = {
        "choices": [
            {
                "text": "hi",
                "finish_reason": "length",
                "token_ids": [5, 6],
                "prompt_token_ids": [1],
                "logprobs": {"token_logprobs": [-0.5, -1.5]},
            }
        ]
    }
    completion = policy._parse(vllm_like, [1])
    assert (completion.ids, completion.versions, completion.routes, completion.finish_reason) == (
        [5, 6],
        [3, 3],
        None,
        "length",
    )
    with pytest.raises(PolicyError, match="did not use the prompt's token ids"):
        policy._parse(vllm_like, [2])
    with pytest.raises(PolicyError, match="must support `return_token_ids`"):
        policy._parse({"choices": [{"text": "hi"}]}, [1])
    with pytest.raises(PolicyError, match="returned no logprobs for 2 tokens"):
        policy._parse({"choices": [{"token_ids": [5, 6]}]}, [1])


def scripted_policy(answers: list[httpx.Response], retries: int = 0, timeout_s: float = 600.0):
    """An `HttpPolicy` whose server answers `answers` in turn; also the requests it got."""
    requests = []

    def answer(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return answers[len(requests) - 1]

    client = httpx.AsyncClient(base_url="http://server/v1/", transport=httpx.MockTransport(answer), timeout=timeout_s)
    return HttpPolicy(EndpointConfig(retries=retries), "m", None, client), requests


BUSY = httpx.Response(429, headers={"Retry-After": "7"}, json={"error": {"message": "queue full"}})
SERVED = httpx.Response(
    200, json={"choices": [{"text": "hi", "token_ids": [5], "logprobs": {"token_logprobs": [-0.5]}}]}
)


def recorded_waits(monkeypatch) -> list[float]:
    """The policy's waits (`asyncio.sleep` as its module calls it), recorded and returned at once.
    The patch is asyncio's own function: a wait in another thread (a server thread of an earlier
    test still stopping) sleeps as before and is not recorded."""
    waits, real_sleep, caller = [], asyncio.sleep, threading.get_ident()

    async def sleep(seconds, *args):
        if threading.get_ident() != caller:
            return await real_sleep(seconds, *args)
        waits.append(seconds)

    monkeypatch.setattr("whetstone.envs.harness.policy.asyncio.sleep", sleep)
    return waits


def test_a_429_is_waited_out_as_its_retry_after_says_without_spending_retries(monkeypatch):
    waits = recorded_waits(monkeypatch)
    policy, requests = scripted_policy([BUSY, BUSY, SERVED], retries=0)
    completion = asyncio.run(policy.complete([1], Sampling(max_tokens=1)))
    assert completion.ids == [5] and len(requests) == 3 and waits == [7.0, 7.0]


def test_a_server_busy_for_longer_than_the_timeout_is_a_policy_error(monkeypatch):
    recorded_waits(monkeypatch)
    policy, requests = scripted_policy([BUSY] * 5, timeout_s=20.0)  # 7 s, 7 s, then over 20 s
    with pytest.raises(PolicyError, match=r"HTTP 429 for 14 s \(3 answers\): queue full"):
        asyncio.run(policy.complete([1], Sampling(max_tokens=1)))
    assert len(requests) == 3
    failing, requests = scripted_policy([httpx.Response(503, text="down"), SERVED], retries=0)
    with pytest.raises(PolicyError, match="HTTP 503"):  # a 5xx spends retries, as before
        asyncio.run(failing.complete([1], Sampling(max_tokens=1)))


def test_a_429_asking_no_wait_is_still_waited_a_little_and_given_up_in_time(monkeypatch):
    waits = recorded_waits(monkeypatch)
    now = httpx.Response(429, headers={"Retry-After": "0"}, json={"error": {"message": "queue full"}})
    policy, requests = scripted_policy([now] * 100, timeout_s=2.0)
    with pytest.raises(PolicyError, match=r"HTTP 429 for 2 s \(9 answers\): queue full"):
        asyncio.run(policy.complete([1], Sampling(max_tokens=1)))
    assert len(requests) == 9 and waits == [0.25] * 8
