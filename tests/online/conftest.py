"""Fixtures: the two-style tiny model (session), a world of server, loop and users, and a real
PostgreSQL server (tests.store.postgres_fixtures)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.online.online_fixtures import API_KEY, PREFERS_CODE, World, online_config, running_server, two_style_model
from tests.store.postgres_fixtures import fresh_postgres, postgres_url  # noqa: F401 (fixtures)


@pytest.fixture(scope="session")
def two_style_dir(tmp_path_factory) -> Path:
    return two_style_model(tmp_path_factory.mktemp("two-style"))


@pytest.fixture
def world(tmp_path, two_style_dir, request):
    """A server (real HTTP) following the loop's weight store and keeping feedback, with the
    loop's numerics and dtype (as docs/online.md asks), the loop, and seeded simulated users who
    like replies that start with code. Parametrize indirectly with changes of the loop's config."""
    from whetstone.inference.config import EngineConfig, ServeConfig
    from whetstone.inference.launch import build_app
    from whetstone.online.loop import OnlineLoop
    from whetstone.online.preferences import MatchesPattern
    from whetstone.online.simulator import UserSimulator

    config = online_config(tmp_path, two_style_dir, **getattr(request, "param", {}))
    engine = EngineConfig(max_batch=8, context_limit=512, numerics=config.numerics, dtype=config.dtype)
    serve = ServeConfig(
        model_path=str(two_style_dir),
        threads=1,
        default_max_tokens=12,
        auth_token=API_KEY,
        sync=config.sync,
        feedback={"store": config.feedback_store},
        engine=engine,
    )
    loop = OnlineLoop(config)  # publishes version 0 into the empty store
    with ExitStack() as stack:
        url = stack.enter_context(running_server(build_app(serve)))
        users = UserSimulator([url], "two-style", API_KEY, MatchesPattern(PREFERS_CODE), max_tokens=12, seed=0)
        stack.callback(users.close)
        yield World(config, url, loop, users)
