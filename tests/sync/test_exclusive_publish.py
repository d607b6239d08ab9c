"""A version is published once: two publishers racing for one version number (a rollback and the
online loop, two trainers) cannot both publish it, nor spoil each other's chunks; the loser gets
a clear error, leaves nothing behind, and can continue after the winner.

Publishers racing at the same instant are tested on the local store only: moto's conditional
write is not atomic under concurrent requests (real S3's is); tests/store/test_put_if_absent.py."""

import threading
import uuid

import pytest

from tests.sync.conftest import FakeTrainer, bit_identical, published
from whetstone.sync import Publisher, Subscriber, SyncConfig, WeightStore
from whetstone.sync.weight_store import VersionExistsError


@pytest.fixture(params=["local", "s3"])
def store_config(request, tmp_path, config) -> SyncConfig:
    """The tests' sync config, on a local directory or on S3 (moto)."""
    if request.param == "local":
        return config.model_copy(update={"store": str(tmp_path / "weights")})
    endpoint = request.getfixturevalue("s3_endpoint")
    return config.model_copy(update={"store": f"s3://whetstone/{uuid.uuid4().hex}", "endpoint_url": endpoint})


def two_publishers_at_version_0(store_config):
    weights = WeightStore.open(store_config)
    Publisher(weights, store_config).publish(FakeTrainer(seed=0).step())
    first, second = Publisher(weights, store_config), Publisher(weights, store_config)
    assert first.resume() == second.resume() == 0  # both will publish version 1 next
    return weights, first, second


def test_the_second_publisher_of_a_version_is_refused_and_leaves_nothing(store_config, monkeypatch):
    weights, first, second = two_publishers_at_version_0(store_config)
    winner, loser = FakeTrainer(seed=1), FakeTrainer(seed=2)
    publish, won = weights.publish, []

    def winner_first(manifest):  # the winner's version lands between the loser's chunks and its manifest
        monkeypatch.setattr(weights, "publish", publish)
        won.append(first.publish(winner.step()))
        publish(manifest)

    monkeypatch.setattr(weights, "publish", winner_first)
    with pytest.raises(VersionExistsError, match="version 1 already exists .* another publisher created it first"):
        second.publish(loser.step(), full=True)
    [manifest] = won
    assert weights.latest() == 1 and weights.versions() == [0, 1]
    assert weights.objects.list("versions/0000000001/") == sorted(
        [c.key for c in manifest.chunks] + ["versions/0000000001/manifest.json"]
    )  # the loser's chunks are gone
    reader = Subscriber(WeightStore.open(store_config), store_config)
    assert reader.poll() == 1 and bit_identical(reader.state, published(winner.state))

    assert second.resume() == 1  # the loser continues after the winner
    assert second.publish(loser.step()).version == 2


def test_of_publishers_racing_at_once_exactly_one_wins_with_intact_chunks(tmp_path, config):
    store_config = config.model_copy(update={"store": str(tmp_path / "weights")})
    weights, first, second = two_publishers_at_version_0(store_config)
    trainers = {first: FakeTrainer(seed=1), second: FakeTrainer(seed=2)}
    start, outcomes = threading.Barrier(2), {}

    def publish(publisher):
        start.wait()
        try:
            outcomes[publisher] = publisher.publish(trainers[publisher].step(), full=True)
        except VersionExistsError as err:
            outcomes[publisher] = err

    threads = [threading.Thread(target=publish, args=(p,)) for p in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    [winner] = [p for p, outcome in outcomes.items() if not isinstance(outcome, Exception)]
    assert sum(isinstance(outcome, VersionExistsError) for outcome in outcomes.values()) == 1
    reader = Subscriber(WeightStore.open(store_config), store_config)
    assert reader.poll() == 1 and not reader.rejected  # every chunk of the manifest verifies
    assert bit_identical(reader.state, published(trainers[winner].state))
