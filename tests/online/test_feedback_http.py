"""Capture on the server: every response a user gets is kept under its id (whole and streamed),
and POST /v1/feedback takes one rating per choice from authenticated clients, refusing the rest
with a clear 4xx."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.online.online_fixtures import API_KEY, running_server
from whetstone.errors import ConfigError
from whetstone.inference.capture import Capture, Reply
from whetstone.inference.config import EngineConfig, ServeConfig
from whetstone.inference.feedback import FeedbackConfig
from whetstone.inference.launch import build_app
from whetstone.inference.sampling import SamplingParams
from whetstone.inference.sequence import Sequence
from whetstone.inference.server import sse
from whetstone.store.feedback import FeedbackStore, UnknownResponse

AUTH = {"Authorization": f"Bearer {API_KEY}"}
HELLO = [{"role": "user", "content": "Write solve(x)."}]


def serve_config(model_dir, store, **changes) -> ServeConfig:
    fields = dict(
        model_path=str(model_dir),
        threads=1,
        default_max_tokens=8,
        auth_token=API_KEY,
        feedback={"store": str(store)},
        engine=EngineConfig(max_batch=4, context_limit=512),
    )
    return ServeConfig(**(fields | changes))


@pytest.fixture
def db(tmp_path):
    return tmp_path / "feedback.db"


@pytest.fixture
def http(two_style_dir, db):
    with TestClient(build_app(serve_config(two_style_dir, db))) as client:
        yield client


def chat(http, **body) -> dict:
    response = http.post("/v1/chat/completions", headers=AUTH, json={"model": "two-style", "messages": HELLO} | body)
    assert response.status_code == 200, response.text
    return response.json()


def feedback(http, headers=AUTH, **body):
    return http.post("/v1/feedback", headers=headers, json=body)


def test_a_response_is_kept_with_what_the_trainer_needs(http, db):
    answer = chat(http, seed=1, logprobs=True, return_token_ids=True)
    choice = answer["choices"][0]
    kept = FeedbackStore.open(str(db)).response(answer["id"])
    assert kept.completion_ids == choice["token_ids"] and kept.prompt_ids == choice["prompt_token_ids"]
    assert kept.logprobs == [item["logprob"] for item in choice["logprobs"]["content"]]
    assert kept.versions == choice["weight_versions"] == [0] * len(kept.completion_ids)
    assert kept.routes["shape"] == [len(kept.prompt_ids) + len(kept.completion_ids) - 1, 2, 2]
    assert (kept.temperature, kept.priority, kept.model) == (1.0, "interactive", "two-style")

    accepted = feedback(http, id=answer["id"], rating="thumbs_up")
    assert accepted.status_code == 200
    assert accepted.json() | {"seq": 0} == {
        "object": "feedback",
        "id": answer["id"],
        "choice": 0,
        "rating": "thumbs_up",
        "score": None,
        "seq": 0,
    }


def test_a_streamed_response_is_kept_before_its_last_event(http):
    with http.stream(
        "POST", "/v1/chat/completions", headers=AUTH, json={"model": "two-style", "messages": HELLO, "stream": True}
    ) as response:
        lines = [line for line in response.iter_lines() if line]
        # the client may rate as soon as it reads [DONE]: the response is already stored
        assert lines[-1] == "data: [DONE]"
        first = json.loads(lines[0].removeprefix("data: "))
        assert feedback(http, id=first["id"], rating="score", score=0.5).status_code == 200


def test_each_choice_of_a_completion_is_rated_once(http):
    answer = http.post("/v1/completions", headers=AUTH, json={"model": "two-style", "prompt": "def", "n": 2}).json()
    assert feedback(http, id=answer["id"], choice=1, rating="edit_kept").status_code == 200
    assert feedback(http, id=answer["id"], choice=0, rating="edit_reverted").status_code == 200
    again = feedback(http, id=answer["id"], choice=1, rating="edit_reverted")
    assert again.status_code == 409 and again.json()["error"]["code"] == "duplicate_feedback"
    missing = feedback(http, id=answer["id"], choice=2, rating="thumbs_up")
    assert missing.status_code == 404 and "has choices [0, 1], not 2" in missing.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, problem",
    [
        ({"id": "x", "rating": "love_it"}, "rating"),
        ({"id": "x", "rating": "score"}, "give `score` (0 to 1) with rating 'score'"),
        ({"id": "x", "rating": "thumbs_up", "score": 1.0}, "give `score` (0 to 1) with rating 'score'"),
        ({"id": "x", "rating": "score", "score": 1.5}, "score"),
        ({"id": "x", "rating": "thumbs_up", "reward": 9}, "reward"),
        ({"rating": "thumbs_up"}, "id"),
        ({"id": "x", "choice": -1, "rating": "thumbs_up"}, "choice"),
        ({"id": "x", "choice": "1", "rating": "thumbs_up"}, "choice"),
        ({"id": "x", "rating": "score", "score": True}, "score"),
        ({"id": "chatcmpl-\u0000", "rating": "thumbs_up"}, "id"),
    ],
)
def test_malformed_feedback_is_refused_naming_the_problem(http, body, problem):
    response = feedback(http, **body)
    assert response.status_code == 400 and problem in response.json()["error"]["message"]


def test_unknown_unauthenticated_and_non_json_feedback_are_refused(http):
    unknown = feedback(http, id="chatcmpl-nope", rating="thumbs_up")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "response_not_found"
    answer = chat(http)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = feedback(http, headers=headers, id=answer["id"], rating="thumbs_up")
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    garbage = http.post("/v1/feedback", headers=AUTH | {"Content-Type": "application/json"}, content=b"{not json")
    assert garbage.status_code == 400 and "malformed JSON" in garbage.json()["error"]["message"]
    assert feedback(http, id=answer["id"], rating="thumbs_up").status_code == 200  # none of that counted


def test_rollout_requests_are_not_kept_unless_asked(two_style_dir, tmp_path, http):
    batch = chat(http, priority="batch")
    assert feedback(http, id=batch["id"], rating="thumbs_up").status_code == 404
    config = serve_config(
        two_style_dir, tmp_path / "all.db", feedback={"store": str(tmp_path / "all.db"), "record": "all"}
    )
    with TestClient(build_app(config)) as everything:
        batch = chat(everything, priority="batch")
        assert feedback(everything, id=batch["id"], rating="thumbs_up").status_code == 200


def test_feedback_survives_a_server_restart(two_style_dir, db):
    with TestClient(build_app(serve_config(two_style_dir, db))) as first:
        rated, unrated = chat(first), chat(first)
        assert feedback(first, id=rated["id"], rating="thumbs_down").status_code == 200
    with TestClient(build_app(serve_config(two_style_dir, db))) as second:  # a new process on the same database
        assert feedback(second, id=rated["id"], rating="thumbs_up").status_code == 409
        assert feedback(second, id=unrated["id"], rating="thumbs_up").status_code == 200
    ratings = [r.rating for r in FeedbackStore.open(str(db)).rated_after(0, 10)]
    assert ratings == ["thumbs_down", "thumbs_up"]


def test_a_server_without_capture_says_so(two_style_dir):
    config = ServeConfig(model_path=str(two_style_dir), threads=1, engine=EngineConfig(max_batch=2, context_limit=512))
    with TestClient(build_app(config)) as plain:
        response = plain.post("/v1/feedback", json={"id": "chatcmpl-x", "rating": "thumbs_up"})
    assert response.status_code == 404 and "feedback.store is not set" in response.json()["error"]["message"]


def test_capture_needs_authenticated_clients(two_style_dir, db):
    with pytest.raises(ConfigError, match="auth_token is empty"):
        build_app(serve_config(two_style_dir, db, auth_token=""))


def test_many_servers_share_one_postgresql_database(two_style_dir, fresh_postgres):
    with (
        TestClient(build_app(serve_config(two_style_dir, fresh_postgres))) as one,
        TestClient(build_app(serve_config(two_style_dir, fresh_postgres))) as two,
    ):
        answer = chat(one)
        assert feedback(two, id=answer["id"], rating="thumbs_up").status_code == 200  # rated via another server
        assert feedback(one, id=answer["id"], rating="thumbs_up").status_code == 409
    assert FeedbackStore.open(fresh_postgres).rated_after(0, 10)[0].response.response_id == answer["id"]


def slow_writes(monkeypatch, seconds: float = 0.5) -> None:
    """Storing a reply takes `seconds` longer: a reply stored only after its last chunk went out
    is then surely not stored yet when a client rates it on reading that chunk."""
    record = FeedbackStore.record

    def slow(self, records):
        time.sleep(seconds)
        record(self, records)

    monkeypatch.setattr(FeedbackStore, "record", slow)


STREAMS = [
    ("/chat/completions", {"messages": HELLO}),
    ("/completions", {"prompt": "def"}),
]


def read_to_last_finish(lines, choices: int) -> str:
    """Read a stream's lines up to the chunk with its last finish_reason; the response id."""
    finished = set()
    for line in lines:
        if line.startswith("data: {"):
            event = json.loads(line.removeprefix("data: "))
            finished |= {c["index"] for c in event["choices"] if c["finish_reason"] is not None}
            if len(finished) == choices:
                return event["id"]
    raise AssertionError("the stream ended before every choice finished")


@pytest.mark.parametrize("path, prompt", STREAMS)
def test_a_streamed_reply_can_be_rated_once_its_last_finish_reason_is_read(
    two_style_dir, db, monkeypatch, path, prompt
):
    slow_writes(monkeypatch)
    body = {"model": "two-style", "stream": True, "n": 2, "max_tokens": 4} | prompt
    config = serve_config(two_style_dir, db, feedback={"store": str(db), "keep_timeout_s": 30})
    with running_server(build_app(config)) as url, httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        with client.stream("POST", path, json=body) as response:
            lines = response.iter_lines()
            response_id = read_to_last_finish(lines, choices=2)
            for choice in (0, 1):
                rated = client.post("/feedback", json={"id": response_id, "choice": choice, "rating": "thumbs_up"})
                assert rated.status_code == 200, rated.text
            assert [line for line in lines if line][-1] == "data: [DONE]"


def test_a_stream_closed_at_its_last_finish_reason_is_kept(two_style_dir, db, monkeypatch):
    slow_writes(monkeypatch)
    body = {"model": "two-style", "messages": HELLO, "stream": True, "max_tokens": 4}
    config = serve_config(two_style_dir, db, feedback={"store": str(db), "keep_timeout_s": 30})
    with running_server(build_app(config)) as url:
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as streamer:
            with streamer.stream("POST", "/chat/completions", json=body) as response:
                response_id = read_to_last_finish(response.iter_lines(), choices=1)
        # the connection is closed, [DONE] unread
        rated = httpx.post(f"{url}/feedback", headers=AUTH, json={"id": response_id, "rating": "thumbs_up"})
        assert rated.status_code == 200, rated.text


def keep_failures(http) -> float:
    metrics = http.get("/metrics").text
    return float(metrics.split('whetstone_feedback_keep_failures_total{model="two-style"} ')[1].split()[0])


def test_a_locked_database_does_not_hold_the_answer(two_style_dir, db):
    config = serve_config(two_style_dir, db, feedback={"store": str(db), "keep_timeout_s": 0.5})
    with TestClient(build_app(config)) as http:
        assert keep_failures(http) == 0
        lock = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        lock.execute("BEGIN EXCLUSIVE")  # another writer holds the database (the store waits up to 30 s)
        try:
            started = time.monotonic()
            answer = chat(http)
            assert time.monotonic() - started < 5
            assert keep_failures(http) == 1
            early = feedback(http, id=answer["id"], rating="thumbs_up")
            assert early.status_code == 404 and "is still being stored" in early.json()["error"]["message"]
        finally:
            lock.execute("COMMIT")
        deadline = time.monotonic() + 20  # the write that was still waiting stores it now
        while FeedbackStore.open(str(db)).response(answer["id"]) is None:
            assert time.monotonic() < deadline, "the waiting write never stored the reply"
            time.sleep(0.1)
        assert feedback(http, id=answer["id"], rating="thumbs_up").status_code == 200
        assert keep_failures(http) == 1


def test_a_reply_that_could_not_be_stored_is_answered_and_refused_saying_so(two_style_dir, db, monkeypatch):
    def broken(self, records):
        raise OSError("disk I/O error")

    with TestClient(build_app(serve_config(two_style_dir, db))) as http:
        monkeypatch.setattr(FeedbackStore, "record", broken)
        answer = chat(http)
        assert keep_failures(http) == 1
        refused = feedback(http, id=answer["id"], rating="thumbs_up")
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "response_not_found"
        assert "could not be stored" in refused.json()["error"]["message"]


def test_the_bearer_scheme_name_is_case_insensitive(http):
    answer = chat(http)
    for scheme in ("bearer", "BEARER", "Bearer "):
        assert http.get("/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}).status_code == 200
    for given in ("bearer wrong", f"Basic {API_KEY}", API_KEY, f"bearer {API_KEY}x", "bearer"):
        refused = feedback(http, headers={"Authorization": given}, id=answer["id"], rating="thumbs_up")
        assert refused.status_code == 401, given
    assert (
        feedback(http, headers={"Authorization": f"bearer {API_KEY}"}, id=answer["id"], rating="thumbs_up").status_code
        == 200
    )


@pytest.mark.parametrize("finished", [True, False])
def test_a_stream_its_client_left_is_kept_if_its_generation_finished(tmp_path, finished):
    """The client left before the chunk with the last finish_reason went out: the reply is kept
    if the generation had finished all the same, and a rating of one that had not says why."""
    capture = Capture(FeedbackConfig(store=str(tmp_path / "feedback.db")), "m")
    seq = Sequence("chatcmpl-left-0", [1, 2], SamplingParams())
    reply = Reply(capture, "chatcmpl-left", [seq], "interactive")

    async def events():
        yield {"choices": [{"index": 0, "finish_reason": None}]}
        yield {"choices": [{"index": 0, "finish_reason": "stop"}]}

    async def client_leaves():
        lines = sse(events(), reply).body_iterator
        await anext(lines)
        if finished:  # the engine finishes the sequence meanwhile
            seq.output_ids, seq.logprobs, seq.versions, seq.finish_reason = [3], [-0.5], [0], "stop"
        await lines.aclose()  # the server noticed the client gone before sending the last chunk
        await asyncio.gather(*capture.tasks)
        return await capture.rate("chatcmpl-left", 0, "thumbs_up", None)

    try:
        if finished:
            asyncio.run(client_leaves())
            assert capture.store.response("chatcmpl-left").completion_ids == [3]
        else:
            with pytest.raises(UnknownResponse, match="did not finish whole"):
                asyncio.run(client_leaves())
    finally:
        capture.close()


def test_a_reply_kept_as_the_server_shuts_down_is_not_a_failed_write(tmp_path, caplog):
    """`Reply.end` starts storing without waiting; the lifespan may close the capture before
    that task runs. Its write is not handed to the stopped writer threads (which refused it
    with "cannot schedule new futures after shutdown", counted as a failed keep)."""
    capture = Capture(FeedbackConfig(store=str(tmp_path / "feedback.db")), "m")
    seq = Sequence("chatcmpl-late-0", [1, 2], SamplingParams())
    seq.output_ids, seq.logprobs, seq.versions, seq.finish_reason = [3], [-0.5], [0], "stop"

    async def shut_down():
        Reply(capture, "chatcmpl-late", [seq], "interactive").end()  # its task has not run yet
        capture.close()
        await asyncio.gather(*capture.tasks)

    asyncio.run(shut_down())
    assert capture.failures == 0 and "cannot schedule" not in caplog.text
    assert capture.unstored["chatcmpl-late"] == "was not stored: the server was shutting down"


def test_a_failing_feedback_store_is_a_503_without_sql(http, db):
    import sqlite3

    answer = chat(http)
    connection = sqlite3.connect(db)
    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    connection.close()
    with open(db, "r+b") as file:
        file.write(b"garbage!" * 64)  # a corrupt file: the database's trouble, not the client's
    refused = feedback(http, id=answer["id"], rating="thumbs_up")
    assert refused.status_code == 503
    assert refused.json()["error"] == {
        "message": "feedback store unavailable: file is not a database; retry",
        "type": "server_error",
        "param": None,
        "code": "feedback_store_unavailable",
    }


def test_a_database_deleted_under_the_server_is_a_503_saying_its_tables_are_lost(two_style_dir, db, caplog):
    """The SQLite file deleted while the server runs: the server says so, once in its log and to
    each client rating, and does not create the tables again (which would hide the loss)."""
    config = serve_config(two_style_dir, db, feedback={"store": str(db), "keep_timeout_s": 30})
    with TestClient(build_app(config)) as http:  # a reply's answer waits for its (failing) write
        answer = chat(http)
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        with caplog.at_level(logging.ERROR, logger="whetstone.online"):
            unkept = chat(http)  # answered all the same; its storing fails
            refused = [feedback(http, id=reply["id"], rating="thumbs_up") for reply in (answer, unkept, answer)]
    lost = f"the feedback store's database at {db} has lost its tables"
    for response in refused:
        assert response.status_code == 503 and response.json()["error"]["code"] == "feedback_store_unavailable"
        message = response.json()["error"]["message"]
        assert "has lost its tables; the server's operator must restore it" in message, message
        assert str(db) not in message and "no such table" not in message  # the server's own business
        assert not message.endswith("retry")  # someone must act first
    assert caplog.text.count("Put the file back") == 1 and "no file is at that path" in caplog.text  # logged once
    assert caplog.text.count(lost) == 1 + 1 + 3  # that line, then each failed keep and rating briefly
    # no empty database created in its place, behind the operator's back
    assert not any(Path(f"{db}{suffix}").exists() for suffix in ("", "-wal", "-shm"))


def test_a_postgresql_store_whose_tables_were_dropped_says_so(fresh_postgres, caplog):
    from whetstone.store.feedback import FeedbackStoreError, metadata

    capture = Capture(FeedbackConfig(store=fresh_postgres), "m")
    try:
        metadata.drop_all(capture.store.engine)
        with caplog.at_level(logging.ERROR, logger="whetstone.online"), pytest.raises(FeedbackStoreError) as lost:
            asyncio.run(capture.rate("chatcmpl-x", 0, "thumbs_up", None))
        assert str(lost.value).startswith(f"the feedback store's database {capture.store.name} has lost its tables")
        assert capture.store.name not in lost.value.reason  # what a client is told
        assert f"the feedback store's database {capture.store.name} has lost its tables" in caplog.text
        assert "they were dropped" in caplog.text and "Put them back" in caplog.text
    finally:
        capture.close()
