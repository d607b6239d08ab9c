"""Fixtures: the two-style tiny model (session), a world of server, loop and users, and a real
PostgreSQL server started here."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.online.online_fixtures import API_KEY, PREFERS_CODE, World, online_config, running_server, two_style_model
from whetstone.utils.processes import free_port

PG_BINS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
PG_BIN = PG_BINS[-1] if PG_BINS else Path("/usr/lib/postgresql/15/bin")  # Debian's layout; the newest installed


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
    serve = ServeConfig(model_path=str(two_style_dir), threads=1, default_max_tokens=12, auth_token=API_KEY,
                        sync=config.sync, feedback={"store": config.feedback_store}, engine=engine)  # fmt: skip
    loop = OnlineLoop(config)  # publishes version 0 into the empty store
    with ExitStack() as stack:
        url = stack.enter_context(running_server(build_app(serve)))
        users = UserSimulator([url], "two-style", API_KEY, MatchesPattern(PREFERS_CODE), max_tokens=12, seed=0)
        stack.callback(users.close)
        yield World(config, url, loop, users)


def _as_postgres_user(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run it as the `postgres` system user."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@pytest.fixture(scope="session")
def postgres_url():
    """A throwaway PostgreSQL server on a free port (data in a temp dir, trust auth), its URL."""
    if not (PG_BIN / "initdb").exists():
        pytest.skip(f"PostgreSQL binaries not found in {PG_BIN} (apt-get install postgresql)")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        pytest.skip("running as root without runuser: cannot start PostgreSQL as another user")
    home = Path(tempfile.mkdtemp(prefix="whetstone-pg-"))  # not under pytest's root-only tmp dir
    if os.geteuid() == 0:
        shutil.chown(home, "postgres")
    data, port = home / "data", free_port()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "check": True}
    subprocess.run(_as_postgres_user([str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                                      "--no-sync", "-E", "UTF8"]), **quiet)  # fmt: skip
    options = f"-p {port} -k {home} -c listen_addresses=127.0.0.1"
    subprocess.run(_as_postgres_user([str(PG_BIN / "pg_ctl"), "-D", str(data), "-o", options, "-l",
                                      str(home / "log"), "-w", "start"]), **quiet)  # fmt: skip
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(_as_postgres_user([str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def fresh_postgres(postgres_url):
    """The server's database with whetstone's tables dropped (each test starts empty)."""
    import sqlalchemy as sa

    from whetstone.online.store import database_url, metadata

    engine = sa.create_engine(database_url(postgres_url))
    metadata.drop_all(engine)
    engine.dispose()
    return postgres_url
