"""A store that refuses a request (credentials without the permission, a bucket policy) is a
setup problem, never missing or damaged weights: no version is rejected or reported corrupt
(which would have it withdrawn) and no pointer is replaced as unreadable. Once access is
granted, sync goes on as before."""

import logging
import uuid

import pytest

from tests.store.s3_permissions import allow, deny, s3_user
from tests.sync.conftest import bit_identical, published
from whetstone.store import AccessDeniedError
from whetstone.store.s3 import S3Store
from whetstone.sync import Publisher, Subscriber, WeightStore
from whetstone.sync.weight_store import Head


@pytest.fixture
def prefix() -> str:
    return f"refused-{uuid.uuid4().hex}"


def s3_weights(endpoint: str, prefix: str) -> WeightStore:
    return WeightStore(S3Store("whetstone", prefix, endpoint_url=endpoint))


def test_chunks_a_reader_may_not_read_are_no_rejected_or_corrupt_version(
    s3_endpoint, monkeypatch, prefix, config, trainer, caplog
):
    publisher = Publisher(s3_weights(s3_endpoint, prefix), config)
    publisher.publish(trainer.step())
    state = published(trainer.step())
    publisher.publish(state)  # version 1
    chunks = f"arn:aws:s3:::whetstone/{prefix}/versions/0000000001/*/*"  # its chunks, not its manifest
    with s3_user(s3_endpoint, monkeypatch, [allow(["s3:*"]), deny(["s3:GetObject"], chunks)]):
        weights = s3_weights(s3_endpoint, prefix)
        subscriber = Subscriber(weights, config)
        with caplog.at_level(logging.WARNING, logger="whetstone.sync"):
            assert subscriber.try_poll() == 0
        assert not subscriber.rejected and subscriber.rejections == 0
        assert f"access denied: GetObject of s3://whetstone/{prefix}/versions/0000000001/" in caplog.text
        with pytest.raises(AccessDeniedError, match=f"s3://whetstone/{prefix}/versions/0000000001/"):
            weights.verify()
    assert subscriber.poll() == 1 and bit_identical(subscriber.state, state)
    assert s3_weights(s3_endpoint, prefix).verify() == {}


def test_a_pointer_a_publisher_may_not_read_is_not_replaced(s3_endpoint, monkeypatch, prefix, config, trainer):
    publisher = Publisher(s3_weights(s3_endpoint, prefix), config)
    manifests = [publisher.publish(trainer.step()) for _ in range(3)]
    pointer = f"arn:aws:s3:::whetstone/{prefix}/latest.json"
    with s3_user(s3_endpoint, monkeypatch, [allow(["s3:*"]), deny(["s3:GetObject"], pointer)]):
        with pytest.raises(AccessDeniedError, match=f"s3://whetstone/{prefix}/latest.json"):
            s3_weights(s3_endpoint, prefix).point_forward(Head(1, manifests[1].digest))
    assert s3_weights(s3_endpoint, prefix).head() == Head(2, manifests[2].digest)
