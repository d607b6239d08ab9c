"""Two publishers on one store, one of them behind: the store's pointer is past the version the
stale one would publish next, whose number may be free again (collected). The stale publisher is
refused with `StalePublisherError` (a `VersionExistsError`), before it uploads anything or, when
the other went past during its upload, with its manifest removed again; it leaves nothing in the
store, readers follow the other publisher undisturbed, and `resume()` continues after it."""

import pytest

from tests.sync.conftest import FakeTrainer, bit_identical, published
from whetstone.store import LocalStore
from whetstone.sync import Publisher, StalePublisherError, Subscriber, VersionExistsError, WeightStore
from whetstone.sync.manifest import manifest_key, version_prefix


class HookedStore(LocalStore):
    """A real local store that runs `hook` once, right before the first write whose key starts
    with `prefix` (`before`) or right after it (not `before`)."""

    def __init__(self, root):
        super().__init__(root)
        self.prefix, self.hook, self.before = None, None, True

    def _maybe_hook(self, key, before):
        if self.hook is not None and before == self.before and key.startswith(self.prefix):
            hook, self.hook = self.hook, None
            hook()

    def put(self, key, data):
        self._maybe_hook(key, True)
        super().put(key, data)
        self._maybe_hook(key, False)

    def put_if_absent(self, key, data):
        self._maybe_hook(key, True)
        super().put_if_absent(key, data)
        self._maybe_hook(key, False)


def keyframes(publisher, trainer, count):
    """`count` full versions: with keep_keyframes 2, every version before the last two goes."""
    return [publisher.publish(trainer.step(), full=True) for _ in range(count)]


def assert_readers_follow(weights, config, reader, state, version):
    assert weights.verify() == {}
    for subscriber in (reader, Subscriber(weights, config, name="new")):
        assert subscriber.poll() == version and not subscriber.rejected
        assert bit_identical(subscriber.state, published(state))


@pytest.mark.parametrize("collected", [True, False])
def test_a_publisher_behind_the_store_is_refused_before_it_uploads(tmp_path, config, trainer, collected):
    objects = HookedStore(tmp_path / "weights")
    weights = WeightStore(objects)
    stale = Publisher(weights, config)
    for _ in range(3):
        stale.publish(trainer.step())  # versions 0..2, its last is 2
    other, ahead = Publisher(weights, config), FakeTrainer(seed=1)
    assert other.resume() == 2
    keyframes(other, ahead, 3 if collected else 1)  # 3..5, collecting 0..3 (its last among them); or 3
    reader = Subscriber(weights, config, name="reader")
    latest = weights.latest()
    assert reader.poll() == latest
    before = sorted(objects.list())

    def uploaded():
        raise AssertionError("the stale publisher uploaded a chunk")

    objects.prefix, objects.hook = version_prefix(3), uploaded
    with pytest.raises(
        StalePublisherError,
        match=rf"version 3 was not published in .*: the store's latest version is {latest}, another publisher's, "
        rf"past version 2 that this one published last .* a restarted trainer or loop goes on after version {latest}",
    ) as refused:
        stale.publish(trainer.step())
    assert isinstance(refused.value, VersionExistsError)  # callers' handling of a lost race applies
    assert sorted(objects.list()) == before  # nothing written, nothing removed
    assert_readers_follow(weights, config, reader, ahead.state, latest)

    objects.hook = None
    assert stale.resume() == latest
    assert stale.publish(trainer.step()).version == latest + 1


@pytest.mark.parametrize(
    "when, full",
    [
        ("before its first chunk", False),  # its base collected: refused before the manifest
        ("before its first chunk", True),  # a keyframe: its manifest created on the free number
        ("between its chunks and its manifest", False),  # created on the free number, its chunks collected
    ],
)
def test_a_publisher_passed_during_its_upload_leaves_nothing_and_is_refused(tmp_path, config, trainer, when, full):
    objects = HookedStore(tmp_path / "weights")
    weights = WeightStore(objects)
    one_worker = config.model_copy(update={"workers": 1})  # the hook runs between two uploads of one thread
    stale = Publisher(weights, one_worker)
    for _ in range(3):
        stale.publish(trainer.step())  # versions 0..2
    reader = Subscriber(weights, config, name="reader")
    assert reader.poll() == 2
    ahead = FakeTrainer(seed=1)

    def pass_it():  # another publisher takes the store to 5 and collects 0..3: number 3 is free
        other = Publisher(WeightStore(LocalStore(tmp_path / "weights")), config)
        assert other.resume() == 2
        keyframes(other, ahead, 3)
        assert weights.versions() == [4, 5]

    objects.prefix = version_prefix(3) if when == "before its first chunk" else manifest_key(3)
    objects.hook = pass_it
    with pytest.raises(
        StalePublisherError,
        match=r"version 3 was not published.*another publisher.*a restarted trainer or loop goes on after version 5",
    ):
        stale.publish(trainer.step(), full=full)
    assert objects.hook is None  # the race happened
    assert objects.list(version_prefix(3)) == [] and weights.versions() == [4, 5] and weights.latest() == 5
    assert_readers_follow(weights, config, reader, ahead.state, 5)

    assert stale.resume() == 5
    assert stale.publish(trainer.step()).version == 6


def test_a_version_another_publisher_built_on_the_moment_it_was_created_stays(tmp_path, config, trainer):
    objects = HookedStore(tmp_path / "weights")
    weights = WeightStore(objects)
    first = Publisher(weights, config)
    for _ in range(3):
        first.publish(trainer.step())  # versions 0..2
    ahead = FakeTrainer(seed=1)

    def build_on_it():  # before `first` moves the pointer: another publisher heals onto 3 and goes on
        other = Publisher(WeightStore(LocalStore(tmp_path / "weights")), config)
        assert other.resume() == 3
        assert other.publish(ahead.step()).kind == "delta"

    objects.prefix, objects.hook, objects.before = manifest_key(3), build_on_it, False
    manifest = first.publish(trainer.step())
    assert objects.hook is None and manifest.version == 3
    assert weights.versions() == [0, 1, 2, 3, 4] and weights.manifest(4).base_manifest == manifest.digest
    assert_readers_follow(weights, config, Subscriber(weights, config, name="reader"), ahead.state, 4)
    with pytest.raises(
        StalePublisherError, match="the store's latest version is 4, another publisher's, past version 3"
    ):
        first.publish(trainer.step())
