"""What one request may cost the server: its body is bounded (413 before it is read) and must
arrive in time (408), a text that cannot fit the context is refused without tokenizing it, and
parsing and tokenizing run off the event loop, so /health answers while a big prompt is being
tokenized. What many may cost: the engine's queue is bounded (429 with Retry-After, which the
harness's HTTP policy waits out), and so are the connections served at once (503). A client
that leaves costs no more generation and no error log (499). Plus the request log, a busy port,
and non-finite sampling values. A real uvicorn on a real socket, the real engine, and the served
model's own tokenizer (wrapped to count and hold its calls)."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.inference.inference_fixtures import GREETING, tiny_model, wait_until
from tests.online.online_fixtures import running_server
from whetstone.envs.harness import EndpointConfig, HttpPolicy, Sampling
from whetstone.errors import ConfigError
from whetstone.inference import server
from whetstone.inference.config import EngineConfig, ServeConfig
from whetstone.inference.engine import Engine
from whetstone.inference.launch import build_app, uvicorn_config
from whetstone.inference.server import create_app
from whetstone.model.hf import load_hf, save_hf
from whetstone.tokenizer import Tokenizer
from whetstone.utils.processes import free_port

LIMIT = 64 * 1024
BODY_TIMEOUT_S = 2.0
QUEUE_BOUND = 4
HOLD = "HOLD "
"""Texts starting with this wait in `encode` until the test releases them."""
CRASH = "CRASH "
"""Texts holding this make `encode` raise: a handler's unhandled error."""


class HeldTokenizer:
    """The real tokenizer, whose `encode` records every text and holds those marked HOLD."""

    def __init__(self, folder):
        self.tokenizer = Tokenizer.load(folder)
        self.encoded: list[str] = []
        self.holding = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str) -> list[int]:
        self.encoded.append(text)
        if CRASH in text:
            raise RuntimeError("the tokenizer broke")
        if HOLD in text:
            self.holding.set()
            assert self.release.wait(60), "the test never released the held prompt"
        return self.tokenizer.encode(text)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def app_for(folder, tokenizer, max_batch: int = 4, **config):
    engine_config = EngineConfig(max_batch=max_batch, context_limit=512)
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
    app = app_for(served_model_dir, held, max_request_bytes=LIMIT, body_timeout_s=BODY_TIMEOUT_S)
    with running_server(app) as api:
        yield api.removesuffix("/v1")


@pytest.fixture(scope="module")
def bounded(served_model_dir, held):
    """A server decoding one sequence at a time, with at most QUEUE_BOUND waiting."""
    with running_server(app_for(served_model_dir, held, max_batch=1, max_waiting_sequences=QUEUE_BOUND)) as api:
        yield api.removesuffix("/v1")


def completion(url, **body):
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny-chat", "max_tokens": 4} | body, timeout=60)


def metrics(url) -> dict[str, float]:
    """/metrics as {name{labels}: value}, without the model label."""
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("whetstone_"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'model="[^"]*",?', "", name.removeprefix("whetstone_")).removesuffix("{}")
            samples[name] = float(value)
    return samples


ABORTED = 'requests_total{reason="abort"}'


def idle(url) -> bool:
    now = metrics(url)
    return now["running_sequences"] == 0 and now['queue_depth{priority="interactive"}'] == 0


def request_on_a_socket(url, body: dict, route: str = "/v1/completions") -> socket.socket:
    """Send a whole request on a socket of its own and return it unread: closing it is the
    client leaving."""
    address = urlsplit(url)
    raw = json.dumps({"model": "tiny-chat"} | body).encode()
    sock = socket.create_connection((address.hostname, address.port), timeout=30)
    head = f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    sock.sendall(head.encode() + raw)
    return sock


def start_of_a_body(url, sent: bytes = b'{"model":') -> socket.socket:
    """A socket that sent a request's headers (a 1000-byte body) and only `sent` of its body."""
    address = urlsplit(url)
    sock = socket.create_connection((address.hostname, address.port), timeout=30)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(head + b"Content-Length: 1000\r\n\r\n" + sent)
    return sock


def answer_to_a_partial_body(url, headers: dict[str, str], sent: bytes) -> tuple[int, dict, http.client.HTTPMessage]:
    """Send the headers and only `sent` of the body, then read the answer (which must come
    without the rest of the body): its status, JSON body and headers."""
    address = urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    connection.putrequest("POST", "/v1/completions")
    for name, value in (headers | {"Content-Type": "application/json"}).items():
        connection.putheader(name, value)
    connection.endheaders()
    connection.send(sent)
    response = connection.getresponse()
    try:
        return response.status, json.loads(response.read()), response.headers
    finally:
        connection.close()


def test_a_body_declared_too_large_is_refused_before_it_is_sent(url):
    status, body, headers = answer_to_a_partial_body(url, {"Content-Length": str(10**9)}, b'{"model": "tiny-chat", ')
    assert status == 413 and headers["Connection"] == "close"  # the rest of the body is never read
    message = body["error"]["message"]
    assert f"at most {LIMIT} bytes" in message and "max_request_bytes" in message and str(10**9) in message


def test_a_chunked_body_is_refused_once_it_passes_the_limit(url):
    chunk = b" " * 16384
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(LIMIT // len(chunk) + 1))
    status, body, headers = answer_to_a_partial_body(url, {"Transfer-Encoding": "chunked"}, chunked)  # no last chunk
    assert status == 413 and f"at most {LIMIT} bytes" in body["error"]["message"]
    assert headers["Connection"] == "close"


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


@pytest.mark.parametrize(
    "field,raw,problem",
    [
        ("temperature", "NaN", "a finite number"),
        ("temperature", '"nan"', "a valid number"),  # a string is no number (strict)
        ("top_p", "Infinity", "a finite number"),
    ],
)
def test_non_finite_sampling_values_are_named(url, field, raw, problem):
    content = f'{{"model": "tiny-chat", "prompt": "x", "{field}": {raw}}}'
    response = httpx.post(f"{url}/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"{field}: Input should be {problem}"


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


def test_a_request_whose_client_left_is_aborted_while_its_sequences_keep_finishing(url):
    """400 sequences of 100 tokens, 4 decoded at a time: some finish every few steps, so events
    keep coming; the client leaves once the first have finished, and the rest are aborted."""
    before = metrics(url)
    finished = 'requests_total{reason="length"}'
    prompts = [[7, 8, 9, i] for i in range(100)]
    sock = request_on_a_socket(url, {"prompt": prompts, "n": 4, "max_tokens": 100, "ignore_eos": True})
    wait_until(lambda: metrics(url)[finished] > before[finished])
    sock.close()
    wait_until(lambda: metrics(url)[ABORTED] > before[ABORTED], timeout=10)
    wait_until(lambda: idle(url))
    after = metrics(url)
    assert after[ABORTED] - before[ABORTED] + after[finished] - before[finished] == 400
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 400 * 100 / 2


def test_a_stream_whose_client_left_is_logged_as_499(url, caplog):
    caplog.set_level(logging.INFO, logger="whetstone.requests")
    before = metrics(url)
    sock = request_on_a_socket(url, {"prompt": [7, 8, 9], "max_tokens": 400, "ignore_eos": True, "stream": True})
    received = b""
    while b"data: " not in received:  # the first chunk came: the stream is under way
        received += sock.recv(4096)
    sock.close()
    wait_until(lambda: metrics(url)[ABORTED] > before[ABORTED], timeout=10)

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "whetstone.requests"]

    wait_until(lambda: lines())
    assert len(lines()) == 1 and " POST /v1/completions 499 tokens=3/" in lines()[0]


def test_a_client_that_leaves_mid_upload_is_a_quiet_499(url, caplog):
    caplog.set_level(logging.INFO, logger="whetstone.requests")
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's own logger does not reach the root
    uvicorn_log.addHandler(caplog.handler)
    try:
        for _ in range(3):
            start_of_a_body(url).close()

        def lines():
            return [r.getMessage() for r in caplog.records if r.name == "whetstone.requests"]

        wait_until(lambda: len(lines()) == 3)
        time.sleep(0.2)  # anything logged after the request line
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert all(" POST /v1/chat/completions 499 " in line for line in lines())
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]


@contextmanager
def every_log_record(caplog):
    """caplog's records, uvicorn's own (its logger does not reach the root) among them."""
    caplog.set_level(logging.INFO, logger="whetstone.requests")
    uvicorn_log = logging.getLogger("uvicorn")
    uvicorn_log.addHandler(caplog.handler)
    try:
        yield
    finally:
        uvicorn_log.removeHandler(caplog.handler)


def test_an_unhandled_error_is_logged_once_with_its_traceback(url, caplog):
    with every_log_record(caplog):
        response = completion(url, prompt=CRASH + "x")
        assert response.status_code == 500
        assert response.json()["error"]["message"] == "internal error: RuntimeError: the tokenizer broke"
        wait_until(lambda: any(r.name == "whetstone.requests" for r in caplog.records))
        time.sleep(0.2)  # anything logged after the request line
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1, [r.getMessage() for r in caplog.records]
    assert "/v1/completions" in tracebacks[0].getMessage() and tracebacks[0].exc_info[0] is RuntimeError
    [line] = [r.getMessage() for r in caplog.records if r.name == "whetstone.requests"]
    assert " POST /v1/completions 500 " in line


def test_a_stream_that_fails_midway_is_cut_and_logged_once(url, caplog, monkeypatch):
    async def failing(submission, *args):
        await submission.wait(lambda: asyncio.sleep(0, False))
        yield {"choices": []}
        raise RuntimeError("the stream broke")

    monkeypatch.setattr(server, "completion_stream", failing)
    with every_log_record(caplog):
        with pytest.raises(httpx.RemoteProtocolError):  # cut short: no clean end, no [DONE]
            with httpx.stream(
                "POST",
                f"{url}/v1/completions",
                json={"model": "tiny-chat", "prompt": "x", "max_tokens": 2, "stream": True},
            ) as response:
                assert response.status_code == 200
                for _ in response.iter_lines():
                    pass
        wait_until(lambda: any(r.exc_info for r in caplog.records))
        time.sleep(0.2)
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1, [r.getMessage() for r in caplog.records]
    assert str(tracebacks[0].exc_info[1]) == "the stream broke"


def test_a_body_that_stalls_past_the_timeout_gets_408_and_its_connection_is_closed(url):
    start = time.monotonic()  # before the connection: the server's clock cannot start earlier
    sock = start_of_a_body(url)
    answer = b""
    while chunk := sock.recv(4096):  # the server closes the connection after its answer
        answer += chunk
    sock.close()
    assert BODY_TIMEOUT_S <= time.monotonic() - start < BODY_TIMEOUT_S + 10
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert f"within {BODY_TIMEOUT_S:g} s (body_timeout_s)" in json.loads(body)["error"]["message"]


def test_a_request_past_the_queue_bound_gets_429_with_retry_after(bounded):
    before = metrics(bounded)
    blocker = request_on_a_socket(
        bounded, {"prompt": [7, 8, 9], "n": QUEUE_BOUND, "max_tokens": 400, "ignore_eos": True}
    )
    try:
        wait_until(lambda: metrics(bounded)["running_sequences"] == 1)  # the others wait
        refused = completion(bounded, prompt=[7, 8], n=2)
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "max_waiting_sequences" in error["message"]
        too_many = completion(bounded, prompt=[7, 8], n=QUEUE_BOUND + 1)  # never fits: no use retrying
        assert too_many.status_code == 400 and "max_waiting_sequences" in too_many.json()["error"]["message"]
        now = metrics(bounded)
        assert now["queue_limit"] == QUEUE_BOUND
        assert (
            now['requests_refused_total{reason="queue_full"}']
            == before['requests_refused_total{reason="queue_full"}'] + 1
        )
    finally:
        blocker.close()
    wait_until(lambda: idle(bounded))  # the aborted sequences left the queue's count too
    assert completion(bounded, prompt=[7, 8], n=2).status_code == 200


def test_a_request_the_engine_took_part_of_is_aborted_and_each_sequence_counted_out_once(
    served_model_dir, held, monkeypatch
):
    """`engine.add` failing after it queued some of a request's sequences: those are aborted
    (not left running for a request that got a 500), and each sequence leaves the queue's
    count once (the queued ones as they finish, the others at once), so the bound stays exact."""
    import whetstone.inference.server as server

    backlogs = []

    class Recorded(server.Backlog):
        def __init__(self, *args):
            super().__init__(*args)
            backlogs.append(self)

    monkeypatch.setattr(server, "Backlog", Recorded)
    app = app_for(served_model_dir, held, max_batch=1, max_waiting_sequences=QUEUE_BOUND)
    [backlog] = backlogs
    engine, queued = backlog.engine, []

    def add(seq, checked=False):
        if len(queued) == 2:
            raise RuntimeError("the engine refused the third")
        queued.append(seq)
        Engine.add(engine, seq, checked)

    monkeypatch.setattr(engine, "add", add)
    with TestClient(app, raise_server_exceptions=False) as client:
        body = {"model": "tiny-chat", "prompt": [7, 8, 9], "n": 3, "max_tokens": 400, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 500
        wait_until(lambda: all(seq.finished for seq in queued), timeout=60)
        assert [seq.finish_reason for seq in queued] == ["abort", "abort"]
        assert backlog.unfinished == 0


def test_the_http_policy_waits_out_a_429_and_is_served(bounded):
    """With no retries to spend, the harness's policy is refused (the queue is full), waits the
    Retry-After and is served once the queue has room."""
    refusals = 'requests_refused_total{reason="queue_full"}'
    before = metrics(bounded)
    running = request_on_a_socket(bounded, {"prompt": [7, 8, 9], "max_tokens": 400, "ignore_eos": True})
    wait_until(lambda: metrics(bounded)["running_sequences"] == 1)
    waiting = request_on_a_socket(
        bounded, {"prompt": [7, 8, 9], "n": QUEUE_BOUND, "max_tokens": 400, "ignore_eos": True}
    )
    wait_until(lambda: metrics(bounded)['queue_depth{priority="interactive"}'] == QUEUE_BOUND)

    async def ask():
        policy = await HttpPolicy.connect(EndpointConfig(base_url=f"{bounded}/v1", retries=0, timeout_s=30))
        try:
            return await policy.complete([7, 8], Sampling(max_tokens=3, priority="interactive"))
        finally:
            await policy.close()

    def leave():
        try:
            wait_until(lambda: metrics(bounded)[refusals] > before[refusals])
        finally:
            running.close()
            waiting.close()

    leaving = threading.Thread(target=leave)
    leaving.start()
    try:
        completion = asyncio.run(ask())
    finally:
        leaving.join(60)
    assert len(completion.ids) == 3 and metrics(bounded)[refusals] > before[refusals]


@contextmanager
def served_as_serve_runs_it(app, config: ServeConfig):
    """`app` under uvicorn as `whetstone serve` configures it (`launch.uvicorn_config`), in a thread."""
    import uvicorn

    server = uvicorn.Server(uvicorn_config(app, config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive())
        assert thread.is_alive(), "the server did not start"
        yield f"http://{config.host}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_connections_past_max_connections_get_503(served_model_dir, held):
    config = ServeConfig(model_path=str(served_model_dir), port=free_port(), max_connections=3)
    with served_as_serve_runs_it(app_for(served_model_dir, held), config) as url:
        address = urlsplit(url)
        held_open = [socket.create_connection((address.hostname, address.port)) for _ in range(2)]
        try:
            with httpx.Client() as client:  # a third connection
                assert client.get(f"{url}/health").status_code == 503
        finally:
            for sock in held_open:
                sock.close()
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200)


def test_serve_raises_its_open_files_limit_to_fit_max_connections():
    script = textwrap.dedent(
        """
        import resource
        from whetstone.errors import ConfigError
        from whetstone.inference.launch import make_room_for_connections
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
        make_room_for_connections(512)
        print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))
        try:
            make_room_for_connections(512)
        except ConfigError as err:
            print(err)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    raised, refused = result.stdout.splitlines()
    assert int(raised) == 512 + 256
    assert "max_connections = 512 needs about 768 open files" in refused and "at most 300" in refused


def read_until_closed(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(4096):  # the server closes the connection after its answer
        answer += chunk
    sock.close()
    return answer


def test_headers_that_do_not_arrive_in_time_get_408_and_the_connection_closes(served_model_dir, held):
    timeout_s = 1.0
    config = ServeConfig(model_path=str(served_model_dir), port=free_port(), header_timeout_s=timeout_s)
    with served_as_serve_runs_it(app_for(served_model_dir, held), config) as url:
        address = urlsplit(url)

        def connect() -> socket.socket:
            return socket.create_connection((address.hostname, address.port), timeout=30)

        silent, trickling, kept_alive = connect(), connect(), connect()
        start = time.monotonic()
        trickling.sendall(b"GET /health HTTP/1.1\r\n")
        kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # answered; its next request trickles
        answered = kept_alive.makefile("rb")  # the whole first answer, before the next request
        assert answered.readline().startswith(b"HTTP/1.1 200 ")
        length = next(int(line.split(b":")[1]) for line in iter(answered.readline, b"\r\n") if b"length" in line)
        answered.read(length)
        kept_alive.sendall(b"GET /health HTTP/1.1\r\n")
        for _ in range(3):  # each byte before the deadline: trickling does not buy time
            time.sleep(timeout_s / 4)
            trickling.sendall(b"X")
        answers = [read_until_closed(sock) for sock in (silent, trickling, kept_alive)]
        assert timeout_s <= time.monotonic() - start < timeout_s + 10
        for answer in answers:
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
            assert json.loads(body)["error"]["message"] == (
                f"the request's headers did not arrive within {timeout_s:g} s (header_timeout_s)"
            )
        # headers sent in pieces within the deadline, and a body slower than it: served
        with connect() as sock:
            raw = json.dumps({"model": "tiny-chat", "prompt": "hi", "max_tokens": 1}).encode()
            head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
            sock.sendall(head[:10])
            time.sleep(timeout_s / 2)
            sock.sendall(head[10:])
            time.sleep(timeout_s * 1.5)  # the body has its own deadline (body_timeout_s)
            sock.sendall(raw)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")


def test_a_body_trickled_after_its_answer_does_not_hold_the_connection(served_model_dir, held):
    """A route may answer without reading the body (/health, an unknown route, a 401): the rest of
    the body, which nothing reads, must come within header_timeout_s too, or the connection
    closes; trickling it a byte at a time does not keep the connection open."""
    timeout_s = 0.5
    config = ServeConfig(model_path=str(served_model_dir), port=free_port(), header_timeout_s=timeout_s)
    with served_as_serve_runs_it(app_for(served_model_dir, held), config) as url:
        address = urlsplit(url)
        with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
            answered = sock.makefile("rb")
            assert answered.readline().startswith(b"HTTP/1.1 200 ")
            length = next(int(line.split(b":")[1]) for line in iter(answered.readline, b"\r\n") if b"length" in line)
            answered.read(length)
            start, closed = time.monotonic(), False
            sock.settimeout(timeout_s / 4)
            while not closed and time.monotonic() - start < timeout_s * 6:
                try:
                    sock.sendall(b"X")  # a byte of the body before every keep-alive or header deadline
                    closed = sock.recv(4096) == b""
                except TimeoutError:
                    pass
                except ConnectionError:  # reset: the server closed it
                    closed = True
            assert closed, "the connection was still open"
            assert time.monotonic() - start < timeout_s * 4


def test_serve_refuses_a_tokenizer_with_more_ids_than_the_model_naming_both_files(served_model_dir, tmp_path):
    """An id past the model's embedding would fail mid-request: refused at start, before the weights load."""
    folder = save_hf(tiny_model(vocab_size=64), tmp_path / "model", tokenizer_dir=served_model_dir)
    ids = Tokenizer.load(folder).vocab_size
    with pytest.raises(ConfigError) as refused:
        build_app(ServeConfig(model_path=str(folder), threads=1))
    assert str(refused.value).startswith(
        f"the tokenizer {folder / 'tokenizer.json'} has {ids} token ids, "
        f"but the model's vocab_size ({folder / 'config.json'}) is only 64"
    )
