"""Simulated users over real HTTP: they ask, judge by their hidden taste, and rate what they got."""

from __future__ import annotations

import pytest

from tests.online.online_fixtures import API_KEY, PREFERS_CODE, USER_TASKS, running_server
from whetstone.envs.tasks.synth import generate
from whetstone.errors import WhetstoneError
from whetstone.inference.config import EngineConfig, ServeConfig
from whetstone.inference.launch import build_app
from whetstone.online.preferences import MatchesPattern
from whetstone.online.simulator import UserSimulator
from whetstone.store.feedback import FeedbackStore


@pytest.fixture
def users(two_style_dir, tmp_path):
    serve = ServeConfig(
        model_path=str(two_style_dir),
        threads=1,
        default_max_tokens=12,
        auth_token=API_KEY,
        feedback={"store": str(tmp_path / "feedback.db")},
        engine=EngineConfig(max_batch=4, context_limit=512),
    )
    with running_server(build_app(serve)) as url:
        simulator = UserSimulator([url], "two-style", API_KEY, MatchesPattern(PREFERS_CODE), max_tokens=12, seed=0)
        yield simulator
        simulator.close()


def test_users_rate_each_reply_by_their_hidden_taste(users, tmp_path):
    tasks = {task.id: task for task in generate(USER_TASKS)}
    exchanges = users.run(list(tasks.values()), users=2, requests=12)
    assert len(exchanges) == 12 and all(e.latency_s > 0 and e.rated_at for e in exchanges)
    assert 0 < sum(e.liked for e in exchanges) < 12  # the model still answers both ways
    taste = MatchesPattern(PREFERS_CODE)
    assert [e.liked for e in exchanges] == [taste.likes(tasks[e.task_id], e.reply) for e in exchanges]
    ratings = {
        r.response.response_id: r.rating for r in FeedbackStore.open(str(tmp_path / "feedback.db")).rated_after(0, 99)
    }
    assert ratings == {e.response_id: "thumbs_up" if e.liked else "thumbs_down" for e in exchanges}


def test_measuring_the_preference_gives_no_feedback(users, tmp_path):
    # The rate is the share of replies the taste likes: a taste for anything likes them all, a
    # taste for nothing none, the hidden one some (the model answers both ways).
    tasks = generate(USER_TASKS)[:6]
    rates = []
    for pattern in ("", r"(?!)", PREFERS_CODE):
        users.preference = MatchesPattern(pattern)
        rates.append(users.preference_rate(tasks, samples=2))
    assert rates[:2] == [1.0, 0.0] and 0.0 < rates[2] < 1.0
    assert FeedbackStore.open(str(tmp_path / "feedback.db")).count_after(0) == 0


def test_users_need_a_way_to_stop(users):
    with pytest.raises(WhetstoneError, match="never stop"):
        users.run(generate(USER_TASKS))
