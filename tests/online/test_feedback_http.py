"""Capture on the server: every response a user gets is kept under its id (whole and streamed),
and POST /v1/feedback takes one rating per choice from authenticated clients, refusing the rest
with a clear 4xx."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.online.online_fixtures import API_KEY
from whetstone.errors import ConfigError
from whetstone.inference.config import EngineConfig, ServeConfig
from whetstone.inference.launch import build_app
from whetstone.store.feedback import FeedbackStore

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
