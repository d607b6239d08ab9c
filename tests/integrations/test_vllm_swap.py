"""Weight swaps on a vLLM server without vLLM: the worker extension's `ServedWeights` over a fake
worker whose `reload_weights` can fail part-way, and the launcher's swap driver over a fake
HTTP server."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from types import SimpleNamespace

import httpx
import pytest
import torch

import whetstone.model.hf as hf
from whetstone.inference.swap import WeightFollower
from whetstone.integrations.vllm import vllm_health
from whetstone.integrations.vllm_serve import SwapDriver
from whetstone.integrations.vllm_worker import ServedWeights, WeightStoreFollower
from whetstone.sync.update import TensorUpdate, WeightUpdate

NAMES = ("a", "b", "c")


class FakeWorker:
    """vLLM's worker as the extension sees it: `reload_weights` loads tensor by tensor, and
    raises after `fail_after` of them when set (out of memory half-way, say)."""

    def __init__(self):
        self.params: dict[str, torch.Tensor] = {}
        self.fail_after: int | None = None

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        for number, (name, tensor) in enumerate(weights_iterator):
            if number == self.fail_after:
                raise RuntimeError("out of memory (simulated) during the reload")
            self.params[name] = tensor


@pytest.fixture
def served(monkeypatch):
    monkeypatch.setattr(hf, "read_hf_config", lambda model: None)
    monkeypatch.setattr(hf, "hf_pieces", lambda name, tensor, cfg: [(name, tensor)])
    monkeypatch.setattr(ServedWeights, "_process_raw_experts", lambda self: None)
    worker = FakeWorker()
    worker.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="unused"))
    return ServedWeights(worker, {name: (2,) for name in NAMES}, version=0)


def whole(version: int, value: float) -> WeightUpdate:
    return WeightUpdate(version, None, {n: TensorUpdate(torch.full((2,), value), None, (2,)) for n in NAMES})


def held(served: ServedWeights) -> dict[str, list[float]]:
    return {name: tensor.tolist() for name, tensor in sorted(served.worker.params.items())}


def following(served: ServedWeights) -> WeightStoreFollower:
    """The extension with a follower whose subscriber sees nothing wrong."""
    subscriber = SimpleNamespace(rejected={}, latest=served.staged_version, rejections=0, blocked=lambda: None)
    extension = WeightStoreFollower()
    extension._whetstone = WeightFollower(subscriber, served)
    return extension


def health_of(status: dict) -> dict:
    """What the server pool reads from a vLLM server whose worker answers `status`."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, json={"results": [status]})

    async def ask():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await vllm_health(client, "http://vllm:8000/v1")

    return asyncio.run(ask())


def test_a_reload_that_fails_part_way_keeps_the_update_staged_and_is_reported(served):
    served.update_weights(whole(1, 1.0))
    assert served.load() == 1 and held(served) == {n: [1.0, 1.0] for n in NAMES}

    served.update_weights(whole(2, 2.0))
    served.worker.fail_after = 1
    with pytest.raises(RuntimeError, match="out of memory"):
        served.load()
    assert held(served)["a"] == [2.0, 2.0] and held(served)["b"] == [1.0, 1.0]  # a mix: nothing to serve
    assert served.version == 1 and served.staged_version == 2  # kept, to be written again
    status = following(served).whetstone_status()
    assert "writing weight version 2 failed part-way" in status["weights_problem"]
    health = health_of(status)
    assert health["status"] == "weights stale" and "parts of versions 1 and 2" in health["weights_problem"]

    # a delta published meanwhile merges into the staged version; the retry writes both whole
    served.update_weights(WeightUpdate(3, 2, {"c": TensorUpdate(torch.tensor([3.0]), torch.tensor([1]), (2,))}))
    served.worker.fail_after = None
    assert served.load() == 3 and served.staged_version is None and served.problem is None
    assert held(served) == {"a": [2.0, 2.0], "b": [2.0, 2.0], "c": [2.0, 3.0]}
    assert following(served).whetstone_status()["weights_problem"] is None


def test_a_swap_keeps_one_copy_of_the_weights_on_the_host(served):
    # the update is applied to the served weights in place, and vLLM is handed a copy of one
    # tensor at a time (a swap of a model of S bytes needs S more, not 2 S)
    served.update_weights(whole(1, 1.0))
    served.load()
    storage = {name: tensor.data_ptr() for name, tensor in served.weights.items()}
    reload = served.worker.reload_weights

    def reload_counting_copies(weights_iterator, is_checkpoint_format):
        assert inspect.isgenerator(weights_iterator)  # copies made as they are taken, not all first
        for name, tensor in weights_iterator:
            assert {n: t.data_ptr() for n, t in served.weights.items()} == storage  # updated in place
            assert tensor.data_ptr() != storage[name] and tensor.tolist() == [2.0, 2.0]  # a copy, the new values
            reload(iter([(name, tensor)]), is_checkpoint_format)
            del tensor  # vLLM copied it into its parameter: the next copy is made only now

    served.worker.reload_weights = reload_counting_copies
    served.update_weights(whole(2, 2.0))
    assert served.load() == 2 and held(served) == {n: [2.0, 2.0] for n in NAMES}


def test_a_version_staged_while_one_is_written_is_written_next(served):
    served.update_weights(whole(1, 1.0))
    reload = served.worker.reload_weights

    def reload_while_a_version_arrives(weights_iterator, is_checkpoint_format):
        served.update_weights(whole(2, 2.0))  # the follower's thread, meanwhile
        reload(weights_iterator, is_checkpoint_format)

    served.worker.reload_weights = reload_while_a_version_arrives
    assert served.load() == 1 and served.staged_version == 2
    served.worker.reload_weights = reload
    assert served.load() == 2 and held(served) == {n: [2.0, 2.0] for n in NAMES}


class FakeVllm:
    """vLLM's development routes, recorded; `whetstone_apply` fails while `failing`."""

    def __init__(self):
        self.calls: list[str] = []
        self.failing = True
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        call = body.get("method") or request.url.path
        if request.url.path == "/update_weight_version":
            call += f"={body['new_version']}"
        with self.lock:
            self.calls.append(call)
        if call == "whetstone_apply":
            if self.failing:
                return httpx.Response(500, json={"error": "out of memory (simulated)"})
            return httpx.Response(200, json={"results": [{"weight_version": 2}]})
        return httpx.Response(200, json={})


def test_a_failed_swap_leaves_vllm_paused_until_a_retry_goes_through():
    vllm = FakeVllm()
    driver = SwapDriver("http://vllm:8000", "{}", version=1, poll_s=0.01)
    driver.client = httpx.Client(base_url=driver.root, transport=httpx.MockTransport(vllm))
    with pytest.raises(httpx.HTTPStatusError):
        driver.swap()
    assert vllm.calls == ["/pause", "whetstone_apply"]  # no /resume: the model may hold a mix
    assert driver.paused and driver._retry_at > 0

    vllm.calls.clear()
    vllm.failing = False
    driver.swap()
    assert vllm.calls == ["whetstone_apply", "/update_weight_version=2", "/resume"]
    assert not driver.paused
