"""A version whose objects stay missing (a chunk deleted for good, a partial copy) is retried at
every poll and, once it has been unavailable for `unavailable_after` seconds, reported by
`blocked()` as a rejected version is; the report clears once the version is taken."""

from __future__ import annotations

from tests.inference.inference_fixtures import wait_until
from tests.sync.conftest import bit_identical, published
from whetstone.sync import Publisher, Subscriber
from whetstone.sync.manifest import manifest_key
from whetstone.utils.atomic import atomic_write_bytes

TIMEOUT_S = 60  # the machine is shared: the conditions are awaited, not slept on


def test_a_version_missing_a_chunk_for_good_is_reported_after_a_while_and_clears_once_restored(
    weights, config, trainer
):
    config = config.model_copy(update={"unavailable_after": 0.3})
    publisher = Publisher(weights, config)
    publisher.publish(trainer.step())
    subscriber = Subscriber(weights, config)
    assert subscriber.poll() == 0
    manifest = publisher.publish(trainer.step())  # version 1, a delta
    chunk = weights.objects.root / manifest.chunks[-1].key
    saved = chunk.read_bytes()
    chunk.unlink()

    assert subscriber.poll() == 0  # once missing is a hiccup, not yet a report
    assert subscriber.blocked() is None and subscriber.unavailable[1].attempts == 1
    with subscriber:  # polls every 10 ms
        wait_until(lambda: subscriber.blocked() is not None, TIMEOUT_S)
        first = subscriber.unavailable[1]
        assert first.attempts >= 2 and first.last - first.since >= 0.3
        problem = subscriber.blocked()
        assert problem.startswith("cannot take weight version 1: version 1 has been unavailable for 0.3 s or more")
        assert manifest.chunks[-1].key in problem
        assert subscriber.version == 0 and not subscriber.rejected and subscriber.rejections == 0
        attempts = first.attempts
        wait_until(lambda: subscriber.unavailable[1].attempts > attempts, TIMEOUT_S)  # still retried

        atomic_write_bytes(chunk, saved)  # copied back (a mirror catching up; whole, as stores write)
        assert subscriber.wait_for(1, TIMEOUT_S)
    assert subscriber.blocked() is None and subscriber.unavailable == {}
    assert bit_identical(subscriber.state, published(trainer.state))


def test_a_version_reported_unavailable_clears_when_published_again(weights, config, trainer):
    config = config.model_copy(update={"unavailable_after": 0.0})  # reported at the first miss
    publisher = Publisher(weights, config)
    publisher.publish(trainer.step())
    subscriber = Subscriber(weights, config)
    subscriber.poll()
    manifest = publisher.publish(trainer.step())
    (weights.objects.root / manifest.chunks[0].key).unlink()
    for _ in range(2):
        assert subscriber.poll() == 0 and "version 1 has been unavailable" in subscriber.blocked()

    weights.withdraw(1)  # the repair: withdrawn, then a keyframe in its place
    assert subscriber.poll() == 0 and subscriber.blocked() is None  # nothing newer to take
    publisher = Publisher(weights, config)
    assert publisher.publish(trainer.step()).version == 1
    assert subscriber.poll() == 1 and subscriber.blocked() is None and subscriber.unavailable == {}
    assert bit_identical(subscriber.state, published(trainer.state))


def test_a_pointer_copied_without_its_manifest_is_an_unavailable_version(weights, config, trainer):
    config = config.model_copy(update={"unavailable_after": 0.0})
    publisher = Publisher(weights, config)
    publisher.publish(trainer.step())
    subscriber = Subscriber(weights, config)
    subscriber.poll()
    publisher.publish(trainer.step())
    saved = weights.objects.get(manifest_key(1))
    weights.objects.delete(manifest_key(1))  # latest.json names version 1, whose manifest is not there
    assert subscriber.poll() == 0
    assert "version 1 has been unavailable" in subscriber.blocked() and manifest_key(1) in subscriber.blocked()
    weights.objects.put(manifest_key(1), saved)
    assert subscriber.poll() == 1 and subscriber.blocked() is None
