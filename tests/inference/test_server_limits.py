"""What one request may cost the server: its body is bounded (413 before it is read), a text
that cannot fit the context is refused without tokenizing it, and parsing and tokenizing run
off the event loop, so /health answers while a big prompt is being tokenized. Plus the request
log, a busy port, and non-finite sampling values. A real uvicorn on a real socket, the real
engine, and the served model's own tokenizer (wrapped to count and hold its calls)."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import subprocess
import sys
import threading
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.inference.inference_fixtures import GREETING
from tests.online.online_fixtures import running_server
from whetstone.inference.config import EngineConfig, ServeConfig
from whetstone.inference.engine import Engine
from whetstone.inference.server import create_app
from whetstone.model.hf import load_hf
from whetstone.tokenizer import Tokenizer

LIMIT = 64 * 1024
HOLD = "HOLD "
"""Texts starting with this wait in `encode` until the test releases them."""


class HeldTokenizer:
    """The real tokenizer, whose `encode` records every text and holds those marked HOLD."""

    def __init__(self, folder):
        self.tokenizer = Tokenizer.load(folder)
        self.encoded: list[str] = []
        self.holding = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str) -> list[int]:
        self.encoded.append(text)
        if HOLD in text:
            self.holding.set()
            assert self.release.wait(60), "the test never released the held prompt"
        return self.tokenizer.encode(text)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def app_for(folder, tokenizer, **config):
    engine_config = EngineConfig(max_batch=4, context_limit=512)
    engine = Engine(
        load_hf(folder),
        engine_config,
        eos_token_ids=(tokenizer.im_end_id, tokenizer.endoftext_id),
        decode=tokenizer.decode,
    )
    serve_config = ServeConfig(model_path=str(folder), threads=1, default_max_tokens=8, engine=engine_config, **config)
    return create_app(engine, tokenizer, serve_config, "tiny-chat")


@pytest.fixture(scope="module")
def held(served_model_dir):
    return HeldTokenizer(served_model_dir)


@pytest.fixture(scope="module")
def url(served_model_dir, held):
    with running_server(app_for(served_model_dir, held, max_request_bytes=LIMIT)) as api:
        yield api.removesuffix("/v1")


def completion(url, **body):
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny-chat", "max_tokens": 4} | body, timeout=60)


def answer_to_a_partial_body(url, headers: dict[str, str], sent: bytes) -> tuple[int, dict]:
    """Send the headers and only `sent` of the body, then read the answer (which must come
    without the rest of the body)."""
    address = urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    connection.putrequest("POST", "/v1/completions")
    for name, value in (headers | {"Content-Type": "application/json"}).items():
        connection.putheader(name, value)
    connection.endheaders()
    connection.send(sent)
    response = connection.getresponse()
    try:
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_a_body_declared_too_large_is_refused_before_it_is_sent(url):
    status, body = answer_to_a_partial_body(url, {"Content-Length": str(10**9)}, b'{"model": "tiny-chat", ')
    assert status == 413
    message = body["error"]["message"]
    assert f"at most {LIMIT} bytes" in message and "max_request_bytes" in message and str(10**9) in message


def test_a_chunked_body_is_refused_once_it_passes_the_limit(url):
    chunk = b" " * 16384
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(LIMIT // len(chunk) + 1))
    status, body = answer_to_a_partial_body(url, {"Transfer-Encoding": "chunked"}, chunked)  # no last chunk
    assert status == 413 and f"at most {LIMIT} bytes" in body["error"]["message"]


def test_a_body_within_the_limit_is_served(url):
    response = completion(url, prompt="Say hello.", user="u" * (LIMIT - 1000))
    assert response.status_code == 200, response.text


def test_a_text_that_cannot_fit_is_refused_without_tokenizing(url, held):
    text = "a = 1\n" * (LIMIT // 8)  # fits the body limit, not the 512-token context
    response = completion(url, prompt=text)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert f"the prompt has {len(text)} characters" in message and "context limit is 512 tokens" in message
    assert text not in held.encoded
    ids = completion(url, prompt=[1] * 5000)  # token ids: their count is known at once
    assert ids.status_code == 400 and "the prompt has 5000 tokens" in ids.json()["error"]["message"]


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/completions", {"prompt": HOLD + "Say hello."}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": HOLD + "Say hello."}]}),
    ],
)
def test_health_answers_while_a_prompt_is_tokenized(url, held, route, body):
    held.holding.clear()
    held.release.clear()
    answers = {}

    def request():
        answers["big"] = httpx.post(f"{url}{route}", json={"model": "tiny-chat", "max_tokens": 4} | body, timeout=120)

    thread = threading.Thread(target=request)
    thread.start()
    try:
        assert held.holding.wait(60), "the prompt never reached the tokenizer"
        health = httpx.get(f"{url}/health", timeout=30)  # the loop is free: tokenizing runs in a worker thread
        assert health.status_code == 200 and "big" not in answers
    finally:
        held.release.set()
        thread.join(120)
    assert answers["big"].status_code == 200, answers["big"].text


def test_each_request_is_logged_once(url, caplog):
    caplog.set_level(logging.INFO, logger="whetstone.requests")
    body = completion(url, prompt="Say hello.", max_tokens=3, ignore_eos=True).json()
    completion(url, prompt="x", n=0)
    lines = [r.getMessage() for r in caplog.records if r.name == "whetstone.requests"]
    usage = body["usage"]
    assert len(lines) == 2
    assert lines[0].startswith(f"{body['id']} POST /v1/completions 200 tokens={usage['prompt_tokens']}/3 ")
    assert lines[0].endswith("ms") and lines[1].startswith("- POST /v1/completions 400 tokens=-/- ")


def test_the_request_log_can_be_turned_off(served_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="whetstone.requests")
    tokenizer = Tokenizer.load(served_model_dir)
    with TestClient(app_for(served_model_dir, tokenizer, log_requests=False)) as client:
        assert (
            client.post("/v1/completions", json={"model": "tiny-chat", "prompt": "x", "max_tokens": 1}).status_code
            == 200
        )
    assert not [r for r in caplog.records if r.name == "whetstone.requests"]


def test_good_answers_to_monitoring_polls_are_logged_at_debug_only(url, caplog):
    caplog.set_level(logging.DEBUG, logger="whetstone.requests")
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
    levels = {r.getMessage().split()[2]: r.levelno for r in caplog.records if r.name == "whetstone.requests"}
    assert levels == {"/health": logging.DEBUG, "/metrics": logging.DEBUG}


@pytest.mark.parametrize("field,raw", [("temperature", "NaN"), ("temperature", '"nan"'), ("top_p", "Infinity")])
def test_non_finite_sampling_values_are_named(url, field, raw):
    content = f'{{"model": "tiny-chat", "prompt": "x", "{field}": {raw}}}'
    response = httpx.post(f"{url}/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"{field}: Input should be a finite number"


def test_serve_on_a_busy_port_says_so_and_announces_nothing(served_model_dir, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        config = tmp_path / "serve.toml"
        config.write_text(f'model_path = "{served_model_dir}"\nport = {port}\nthreads = 1\n')
        result = subprocess.run(
            [sys.executable, "-m", "whetstone.cli", "serve", str(config)], capture_output=True, text=True, timeout=300
        )
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"port {port} is in use on 127.0.0.1" in result.stderr
    assert "serving on" not in result.stdout + result.stderr


def test_serve_logs_its_requests(served_model_dir, tmp_path):
    """The `serve` process shows the request log (its logging is configured, at INFO)."""
    from whetstone.utils.processes import serving

    config = tmp_path / "serve.toml"
    config.write_text(f'model_path = "{served_model_dir}"\nthreads = 1\n')
    log = tmp_path / "server.log"
    with serving([str(config)], log) as root:
        reply = httpx.post(
            f"{root}/v1/chat/completions",
            json={"model": "tiny-chat", "messages": GREETING, "max_tokens": 2},
            timeout=60,
        ).json()
    assert f"whetstone.requests INFO {reply['id']} POST /v1/chat/completions 200 tokens=" in log.read_text()
