"""A real PostgreSQL server started for the tests (the feedback store's second backend)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from whetstone.utils.processes import free_port

PG_BINS = sorted(
    Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0
)
PG_BIN = PG_BINS[-1] if PG_BINS else Path("/usr/lib/postgresql/15/bin")  # Debian's layout; the newest installed


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
    subprocess.run(
        _as_postgres_user(
            [str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"]
        ),
        **quiet,
    )
    options = f"-p {port} -k {home} -c listen_addresses=127.0.0.1"
    subprocess.run(
        _as_postgres_user(
            [str(PG_BIN / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(home / "log"), "-w", "start"]
        ),
        **quiet,
    )
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            _as_postgres_user([str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def fresh_postgres(postgres_url):
    """The server's database with whetstone's tables dropped (each test starts empty)."""
    import sqlalchemy as sa

    from whetstone.store.feedback import database_url, metadata

    engine = sa.create_engine(database_url(postgres_url))
    metadata.drop_all(engine)
    engine.dispose()
    return postgres_url
