"""Weight stores mirrored per inference cluster (`sync.mirrors`): one publisher, several stores,
each a whole weight store its cluster's servers follow."""

import shutil
import uuid

import pytest

from tests.sync.conftest import FakeTrainer, bit_identical, published
from whetstone.store import LocalStore
from whetstone.store.s3 import S3Store
from whetstone.sync import Publisher, Subscriber, WeightStore


def held(store: WeightStore) -> dict[int, str]:
    return {version: store.manifest_digest(version) for version in store.versions()}


def test_every_publish_lands_in_every_mirror_and_their_subscribers_end_bit_identical(tmp_path, config, trainer):
    config = config.model_copy(update={"mirrors": [str(tmp_path / "eu"), str(tmp_path / "us")]})
    publisher = Publisher(WeightStore(LocalStore(tmp_path / "weights")), config)
    eu, us = publisher.mirrors
    subscribers = [Subscriber(mirror, config, name=f"server-{i}") for i, mirror in enumerate(publisher.mirrors)]
    for _ in range(12):  # keyframes 0, 5 and 10; garbage collection drops versions before 5
        expected = published(trainer.step())
        publisher.publish(trainer.state)
        for subscriber in subscribers:
            subscriber.poll()
            assert bit_identical(subscriber.state, expected)
    assert held(eu) == held(us) == held(publisher.store) and eu.versions() == list(range(5, 12))
    assert eu.head() == us.head() == publisher.store.head()
    assert eu.verify() == {}


def test_a_mirror_added_late_or_left_behind_catches_up_and_drops_withdrawn_versions(tmp_path, config, trainer):
    store = WeightStore(LocalStore(tmp_path / "weights"))
    alone = Publisher(store, config)
    for _ in range(3):
        alone.publish(trainer.step())
    publisher = Publisher(store, config.model_copy(update={"mirrors": [str(tmp_path / "late")]}))
    publisher.resume()  # a restarted trainer with a new cluster's store
    (late,) = publisher.mirrors
    store.withdraw(2)  # a repair on the main store: the next publish takes version 2 again
    late.objects.put("versions/0000000002/manifest.json", store.objects.get("versions/0000000001/manifest.json"))
    publisher.publish(trainer.step())  # a stray version 2 in the mirror goes, the whole chain comes
    assert held(late) == held(store) and late.latest() == 2
    follower = Subscriber(late, config)
    follower.poll()
    assert follower.version == 2 and bit_identical(follower.state, published(trainer.state))


def test_a_mirror_on_s3_and_one_out_for_a_while_which_catches_up(tmp_path, config, trainer, s3_endpoint, caplog):
    prefix, flaky = f"mirror-{uuid.uuid4().hex}", tmp_path / "flaky"
    config = config.model_copy(
        update={"mirrors": [f"s3://whetstone/{prefix}", str(flaky)], "endpoint_url": s3_endpoint}
    )
    publisher = Publisher(WeightStore(LocalStore(tmp_path / "weights")), config)
    s3, local = publisher.mirrors
    publisher.publish(trainer.step())
    shutil.rmtree(flaky)
    flaky.write_text("not a directory: every write to the mirror fails")  # its cluster's store is out
    publisher.publish(trainer.step())  # published all the same, in the main store and on S3
    assert "could not update the weight mirror" in caplog.text and s3.latest() == 1
    flaky.unlink()  # back, empty
    publisher.publish(trainer.step())
    assert held(s3) == held(local) == held(publisher.store) and local.latest() == 2
    assert isinstance(s3.objects, S3Store) and local.verify() == {}


def test_a_mirror_replaces_its_oldest_version_when_the_source_published_it_again(tmp_path, config, trainer):
    config = config.model_copy(update={"mirrors": [str(tmp_path / "eu")]})
    store = WeightStore(LocalStore(tmp_path / "weights"))
    publisher = Publisher(store, config)
    for _ in range(2):
        publisher.publish(trainer.step())
    store.withdraw(0)  # the repair of a store whose every version is bad: version 0 again, a keyframe
    fixed, repaired = FakeTrainer(seed=5), Publisher(store, config)
    repaired.publish(fixed.step(), full=True)
    (eu,) = repaired.mirrors
    assert held(eu) == held(store) and eu.head() == store.head()
    follower = Subscriber(eu, config)
    assert follower.poll() == 0 and bit_identical(follower.state, published(fixed.state))


def test_a_mirror_follows_what_readers_of_the_source_see_while_a_withdraw_stands(tmp_path, config, trainer):
    class Dying(LocalStore):
        dies = False

        def delete(self, key):
            if self.dies:
                raise RuntimeError("killed")
            super().delete(key)

    config = config.model_copy(update={"mirrors": [str(tmp_path / "eu")]})
    objects = Dying(tmp_path / "weights")
    store = WeightStore(objects)
    publisher = Publisher(store, config)
    for _ in range(5):
        publisher.publish(trainer.step())
    (eu,) = publisher.mirrors
    follower = Subscriber(eu, config)
    assert follower.poll() == 4
    objects.dies = True
    with pytest.raises(RuntimeError):
        store.withdraw(2)  # dies after moving the pointer back: versions 2..4 are still stored
    assert store.head().version == 1 and store.versions() == [0, 1, 2, 3, 4]
    publisher.update_mirrors()
    assert eu.head() == store.head() and eu.versions() == [0, 1] and follower.poll() == 1
    objects.dies = False
    manifest = publisher.publish(trainer.step())  # finishes the withdrawal: a keyframe at 2
    assert (manifest.version, manifest.kind) == (2, "full") and held(eu) == held(store)
    assert eu.head() == store.head() and follower.poll() == 2
    assert bit_identical(follower.state, published(trainer.state))


def test_a_withdrawal_in_the_source_while_mirroring_leaves_the_mirror_pointing_at_a_version_it_holds(
    tmp_path, config, trainer, monkeypatch
):
    source = WeightStore(LocalStore(tmp_path / "weights"))
    eu = WeightStore(LocalStore(tmp_path / "eu"))
    publisher = Publisher(source, config)
    for _ in range(4):
        publisher.publish(trainer.step())
    eu.mirror(source)
    follower = Subscriber(eu, config)
    assert follower.poll() == 3
    publisher.publish(trainer.step())  # version 4, not mirrored yet
    versions = source.versions

    def withdrawn_first():  # `sync withdraw --from 4` lands between the mirror's reads of the source
        monkeypatch.setattr(source, "versions", versions)
        source.withdraw(4)
        return versions()

    monkeypatch.setattr(source, "versions", withdrawn_first)
    eu.mirror(source)
    assert source.head().version == 3 and eu.head() == source.head() and held(eu) == held(source)
    assert follower.poll() == 3 and not follower.rejected
    manifest = publisher.publish(trainer.step())  # a keyframe at 4 again
    assert eu.mirror(source) == [4]
    assert eu.head() == source.head() == (4, manifest.digest) and follower.poll() == 4
    assert bit_identical(follower.state, published(trainer.state))
