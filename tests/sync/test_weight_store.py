"""Publishing: atomic versions, keyframes by interval and by chain size, garbage collection."""

import json

import pytest

from tests.sync.conftest import FakeTrainer, bit_identical, published
from whetstone.store import LocalStore
from whetstone.sync import Publisher, Subscriber, SyncConfig, WeightStore
from whetstone.sync.weight_store import Head


class RecordingStore(LocalStore):
    """A real local store that remembers the order of its writes."""

    def __init__(self, root):
        super().__init__(root)
        self.puts = []

    def put(self, key, data):
        self.puts.append(key)
        super().put(key, data)

    def put_if_absent(self, key, data):
        self.puts.append(key)
        super().put_if_absent(key, data)


def test_manifest_is_written_after_its_chunks_and_latest_after_the_manifest(tmp_path, config, trainer):
    objects = RecordingStore(tmp_path)
    manifest = Publisher(WeightStore(objects), config).publish(trainer.step())
    chunk_keys = [c.key for c in manifest.chunks]
    assert len(chunk_keys) > 1
    assert sorted(objects.puts[:-2]) == sorted(chunk_keys)
    assert objects.puts[-2:] == ["versions/0000000000/manifest.json", "latest.json"]
    assert json.loads(objects.get("latest.json")) == {"version": 0, "manifest": manifest.digest}


def test_keyframe_every_interval_and_deltas_in_between(weights, config, trainer):
    publisher = Publisher(weights, config.model_copy(update={"keep_keyframes": 10}))
    manifests = [publisher.publish(trainer.step()) for _ in range(12)]
    assert [m.kind for m in manifests] == ["full"] + ["delta"] * 4 + ["full"] + ["delta"] * 4 + ["full", "delta"]
    assert [m.keyframe for m in manifests] == [0] * 5 + [5] * 5 + [10] * 2
    assert all(m.base == m.version - 1 for m in manifests if m.kind == "delta")
    assert all(m.encoded_bytes < manifests[0].encoded_bytes / 2 for m in manifests if m.kind == "delta")
    assert manifests[3].chain_bytes == sum(m.encoded_bytes for m in manifests[1:4])


def test_keyframe_when_the_chain_outgrows_its_budget(weights):
    trainer = FakeTrainer(lr=1e-3)
    config = SyncConfig(keyframe_interval=100, chain_budget=0.5)
    publisher = Publisher(weights, config)
    kinds = [publisher.publish(trainer.step()).kind for _ in range(8)]
    # lr 1e-3 changes most bf16 values of this small model: deltas cost ~1/3 of a keyframe.
    assert kinds[0] == "full" and "full" in kinds[2:] and kinds.count("full") < len(kinds)


def test_garbage_collection_keeps_the_newest_keyframes_and_what_follows(weights, config, trainer):
    publisher = Publisher(weights, config)  # keyframe every 5, keep 2 keyframes
    for _ in range(13):
        publisher.publish(trainer.step())
    assert weights.versions() == list(range(5, 13))
    assert weights.objects.list("versions/0000000004/") == []


def test_garbage_collection_removes_chunks_of_a_crashed_publish(weights, config, trainer):
    publisher = Publisher(weights, config)
    for _ in range(3):
        publisher.publish(trainer.step())
    weights.objects.put("versions/0000000001/chunk-00099.bin", b"orphan")  # never listed anywhere
    for _ in range(8):
        publisher.publish(trainer.step())
    assert not weights.objects.exists("versions/0000000001/chunk-00099.bin")


def test_a_garbage_collection_that_fails_is_logged_and_the_publish_goes_on_to_the_mirrors(
    tmp_path, config, trainer, caplog
):
    class DeleteOutage(LocalStore):
        fail = False

        def delete(self, key):
            if self.fail:
                raise OSError("the store failed")
            super().delete(key)

    objects = DeleteOutage(tmp_path / "weights")
    publisher = Publisher(WeightStore(objects), config.model_copy(update={"mirrors": [str(tmp_path / "mirror")]}))
    for _ in range(10):
        publisher.publish(trainer.step())
    objects.fail = True
    assert publisher.publish(trainer.step()).version == 10  # keyframe 10: versions 0..4 are due
    assert f"garbage collection in {publisher.store!r} failed" in caplog.text and "the store failed" in caplog.text
    assert publisher.store.versions() == list(range(11)) and publisher.mirrors[0].latest() == 10
    objects.fail = False
    assert publisher.publish_later(trainer.step()).result().manifest.version == 11
    publisher.close()
    assert publisher.store.versions() == publisher.mirrors[0].versions() == list(range(5, 12))


def test_stray_names_under_versions_are_left_alone_and_logged_once(weights, config, trainer, caplog):
    strays = ["versions/README", "versions/tmp/manifest.json", "versions/3/manifest.json"]
    for key in strays:
        weights.objects.put(key, b"put there by hand")
    publisher = Publisher(weights, config)
    for _ in range(13):
        publisher.publish(trainer.step())
    assert weights.versions() == list(range(5, 13)) and all(weights.objects.exists(key) for key in strays)
    for name in ["versions/README", "versions/tmp/", "versions/3/"]:
        assert caplog.text.count(f"{name} in {weights.objects!r} is not a version") == 1


def test_a_collected_version_goes_with_the_temporary_files_of_writes_killed_in_it(weights, config, trainer):
    publisher = Publisher(weights, config)
    manifests = [publisher.publish(trainer.step()) for _ in range(7)]
    root = weights.objects.root
    left = [
        root / manifests[1].chunks[0].key.rpartition("/")[0] / ".chunk-00099.bin.k1ll3d.tmp",  # a chunk's
        root / "versions/0000000001/.manifest.json.k1ll3d.tmp",  # a manifest's (put_if_absent)
        root / "versions/0000000006/.manifest.json.w0rk1n.tmp",  # a version kept: not touched
    ]
    for path in left:
        path.write_bytes(b"x" * 1000)
    for _ in range(6):
        publisher.publish(trainer.step())
    assert weights.versions() == list(range(5, 13))
    assert sorted(p.name for p in (root / "versions").iterdir()) == [f"{v:010d}" for v in range(5, 13)]
    assert left[2].exists()


def test_a_collected_version_whose_folder_holds_only_temporary_files_goes_and_a_publish_in_progress_stays(
    weights, config, trainer
):
    # A publisher that died writing the first chunk of a version that no other publish has
    # objects in (a stale publisher, behind the keyframes kept), and one writing the next version
    # now: neither has an object to list.
    publisher = Publisher(weights, config)
    for _ in range(13):
        publisher.publish(trainer.step())
    assert weights.versions() == list(range(5, 13))
    root = weights.objects.root
    dead = root / "versions/0000000003/0123456789ab/.chunk-00000.bin.k1ll3d.tmp"
    live = root / "versions/0000000013/ba9876543210/.chunk-00000.bin.w0rk1n.tmp"
    for path in (dead, live):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x" * 1000)
    assert weights.collect_garbage(config.keep_keyframes) == [3]
    assert sorted(p.name for p in (root / "versions").iterdir()) == [f"{v:010d}" for v in range(5, 14)]
    assert live.exists() and weights.versions() == list(range(5, 13))
    subscriber = Subscriber(weights, config)
    assert subscriber.poll() == 12 and bit_identical(subscriber.state, published(trainer.state))


def test_a_restarted_publisher_continues_the_chain(weights, config, trainer):
    first = Publisher(weights, config)
    for _ in range(2):
        first.publish(trainer.step())
    again = Publisher(weights, config)
    assert again.resume() == 1
    manifest = again.publish(trainer.step())
    assert (manifest.version, manifest.kind, manifest.base) == (2, "delta", 1)
    fresh = Publisher(weights, config).publish(trainer.step())  # no resume: starts a new keyframe
    assert (fresh.version, fresh.kind) == (3, "full")


def test_a_pointer_left_behind_its_newest_manifest_heals_and_only_moves_forward(weights, config, trainer):
    publisher = Publisher(weights, config)
    manifests = [publisher.publish(trainer.step()) for _ in range(3)]
    behind = Head(manifests[1].version, manifests[1].digest)
    weights.objects.put("latest.json", json.dumps({"version": 1, "manifest": behind.digest}).encode())
    # as a publisher that died between version 2's manifest and the pointer leaves the store:
    # readers follow the pointer, and the restarted publisher moves it forward
    assert weights.head() == behind and weights.latest() == 1
    subscriber = Subscriber(weights, config)
    assert subscriber.poll() == 1
    restarted = Publisher(weights, config)
    assert restarted.resume() == 2 and weights.head() == Head(2, manifests[2].digest)
    assert subscriber.poll() == 2 and bit_identical(subscriber.state, published(trainer.state))
    assert restarted.publish(trainer.step()).version == 3
    weights.point_forward(behind)  # a publisher slow to write the pointer does not move it back
    assert weights.head().version == 3 and subscriber.poll() == 3


def test_a_version_whose_pointer_cannot_be_written_is_published_all_the_same(tmp_path, config, trainer):
    class PointerOutage(LocalStore):
        def put(self, key, data):
            if key == "latest.json":
                raise OSError("the store failed")
            super().put(key, data)

    objects = PointerOutage(tmp_path)
    weights = WeightStore(objects)
    publisher = Publisher(weights, config)
    assert [publisher.publish(trainer.step()).version for _ in range(2)] == [0, 1]
    assert weights.head() is None and weights.versions() == [0, 1]
    objects.put = super(PointerOutage, objects).put  # the outage ends: a restarted publisher heals
    assert Publisher(weights, config).resume() == 1 and weights.latest() == 1


def test_a_failed_upload_leaves_none_of_its_chunks(tmp_path, config, trainer):
    class FailingUpload(LocalStore):
        fail = False

        def put(self, key, data):
            if self.fail and key.endswith("chunk-00001.bin"):
                raise OSError("the store failed")
            super().put(key, data)

    objects = FailingUpload(tmp_path)
    publisher = Publisher(WeightStore(objects), config)
    publisher.publish(trainer.step())
    objects.fail = True
    with pytest.raises(OSError, match="the store failed"):
        publisher.publish(trainer.step())  # the other chunks were uploaded by then
    assert objects.list("versions/0000000001/") == []
    objects.fail = False
    assert publisher.publish(trainer.step()).version == 1


def test_unsupported_dtypes_are_named(weights):
    import torch

    from whetstone.errors import WhetstoneError

    with pytest.raises(WhetstoneError, match="complex64"):
        Publisher(weights).publish({"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(WhetstoneError, match="'x' is a list"):
        Publisher(weights).publish({"x": [1, 2]})


def test_fake_trainer_changes_few_values_at_small_lr():
    trainer = FakeTrainer(lr=1e-6)
    before = {k: v.bfloat16() for k, v in trainer.state.items() if v.is_floating_point()}
    after = {k: v.bfloat16() for k, v in trainer.step().items() if v.is_floating_point()}
    changed = sum((before[k] != after[k]).sum().item() for k in before)
    assert changed < 0.1 * sum(v.numel() for v in before.values())


class CountingStore(LocalStore):
    """A local store that counts its reads; a missing key reads as S3 answers it to credentials
    with GetObject but not ListBucket (an inference cluster's read-only role): access denied."""

    def __init__(self, root, create=True):
        super().__init__(root, create=create)
        self.gets = []

    def get(self, key):
        self.gets.append(key)
        if not self.exists(key):
            raise PermissionError(f"AccessDenied: GetObject {key}")
        return super().get(key)


def test_an_idle_poll_reads_the_pointer_alone_and_no_key_that_is_absent(tmp_path, config, trainer):
    publisher = Publisher(WeightStore(LocalStore(tmp_path)), config)
    for _ in range(3):
        publisher.publish(trainer.step())
    objects = CountingStore(tmp_path, create=False)
    weights = WeightStore(objects)
    subscriber = Subscriber(weights, config)
    assert subscriber.poll() == 2
    objects.gets.clear()
    assert subscriber.poll() == 2 and subscriber.poll() == 2 and weights.latest() == 2
    assert objects.gets == ["latest.json"] * 3
    publisher.publish(trainer.step())
    assert subscriber.poll() == 3 and bit_identical(subscriber.state, published(trainer.state))
