import uuid

import pytest

from tests.store.postgres_fixtures import fresh_postgres, postgres_url  # noqa: F401 (fixtures)
from whetstone.store import LocalStore
from whetstone.store.moto import local_s3


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 for the whole session (bucket `whetstone`)."""
    with local_s3("whetstone") as endpoint:
        yield endpoint


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """The same contract, on each backend."""
    if request.param == "local":
        return LocalStore(tmp_path / "objects")
    from whetstone.store.s3 import S3Store

    endpoint = request.getfixturevalue("s3_endpoint")
    return S3Store("whetstone", prefix=f"test-{uuid.uuid4().hex}", endpoint_url=endpoint)
