"""Trainer and inference servers together: every subscriber ends bit-identical to the trainer,
through keyframes, deltas, late starts and injected faults."""

import json
import logging
import threading

import pytest
import torch

from tests.sync.conftest import bit_identical, published
from whetstone.errors import WhetstoneError
from whetstone.online.weights import load_version
from whetstone.sync import Publisher, Subscriber, SyncConfig, WeightStore, apply_update
from whetstone.sync.manifest import manifest_key
from whetstone.sync.publisher import prepare_state


def test_several_subscribers_with_their_own_engines_end_bit_identical(weights, config, trainer):
    publisher = Publisher(weights, config)
    subscribers = [Subscriber(weights, config, name=f"server{i}").start() for i in range(3)]
    engines = [{} for _ in subscribers]
    try:
        for step in range(12):
            manifest = publisher.publish(trainer.step())
            for i, (subscriber, engine) in enumerate(zip(subscribers, engines)):
                assert subscriber.wait_for(manifest.version, timeout=20)
                if step % (i + 1) == 0:  # engines take updates at their own pace
                    update = subscriber.take_update()
                    if update is not None:
                        apply_update(engine, update)
    finally:
        for subscriber in subscribers:
            subscriber.stop()
    expected = published(trainer.state)
    for subscriber, engine in zip(subscribers, engines):
        update = subscriber.take_update()
        if update is not None:
            apply_update(engine, update)
        assert subscriber.version == 11 and not subscriber.rejected
        assert bit_identical(subscriber.state, expected)
        assert bit_identical(engine, expected)


def test_a_late_subscriber_catches_up_from_the_newest_keyframe(weights, config, trainer):
    publisher = Publisher(weights, config)  # keyframes at 0, 5
    for _ in range(8):
        publisher.publish(trainer.step())
    late = Subscriber(weights, config)
    late.poll()
    update = late.take_update()
    assert late.version == 7 and update.base is None  # one merged update starting from keyframe 5
    assert all(change.indices is None for change in update.tensors.values())
    assert bit_identical(late.state, published(trainer.state))


def test_a_subscriber_that_falls_behind_the_chain_jumps_to_the_keyframe(weights, config, trainer):
    publisher = Publisher(weights, config)
    subscriber = Subscriber(weights, config)
    publisher.publish(trainer.step())
    subscriber.poll()
    for _ in range(11):  # keyframes 5 and 10 go by; GC deletes versions before 5
        publisher.publish(trainer.step())
    assert subscriber.poll() == 11
    assert bit_identical(subscriber.state, published(trainer.state))


def corrupt(weights: WeightStore, key: str, how: str) -> None:
    data = weights.objects.get(key)
    if how == "flip":
        data = data[:100] + bytes([data[100] ^ 0x01]) + data[101:]
    elif how == "truncate":
        data = data[: len(data) // 2]
    weights.objects.put(key, data)


@pytest.mark.parametrize("how, reason", [("flip", "checksum"), ("truncate", "truncated")])
def test_a_corrupt_delta_is_rejected_and_the_subscriber_recovers_at_the_next_keyframe(
    weights, config, trainer, caplog, how, reason
):
    publisher = Publisher(weights, config)
    subscriber = Subscriber(weights, config)
    for _ in range(2):
        publisher.publish(trainer.step())
    subscriber.poll()
    held = {k: v.clone() for k, v in subscriber.state.items()}
    bad = publisher.publish(trainer.step())  # version 2
    corrupt(weights, bad.chunks[0].key, how)
    publisher.publish(trainer.step())  # version 3, a delta on the version it could not take
    with caplog.at_level(logging.WARNING, logger="whetstone.sync"):
        assert subscriber.poll() == 1
    assert reason in subscriber.rejected[2] and "rejected version 2" in caplog.text
    assert bit_identical(subscriber.state, held)  # untouched: still exactly version 1
    for _ in range(2):
        publisher.publish(trainer.step())  # version 5 is a keyframe
    assert subscriber.poll() == 5
    assert bit_identical(subscriber.state, published(trainer.state))


def test_a_delta_on_the_wrong_base_is_rejected(weights, config, trainer):
    publisher = Publisher(weights, config)
    subscriber = Subscriber(weights, config)
    for _ in range(2):
        publisher.publish(trainer.step())
    subscriber.poll()
    publisher.publish(trainer.step())
    manifest = json.loads(weights.objects.get(manifest_key(2)))
    manifest["base"] = 0  # e.g. a second trainer coding against a stale copy
    weights.objects.put(manifest_key(2), json.dumps(manifest).encode())
    assert subscriber.poll() == 1
    assert "delta on version 0, but this subscriber holds 1" in subscriber.rejected[2]


def test_a_tensor_whose_dtype_changes_at_its_shape_is_taken_exactly(weights, config, trainer):
    Publisher(weights, config).publish(trainer.step())  # bf16
    subscriber = Subscriber(weights, config)
    subscriber.poll()
    engine = {k: v.clone() for k, v in subscriber.state.items()}  # a bf16 engine
    as_float32 = config.model_copy(update={"publish_dtype": "float32"})
    restarted = Publisher(weights, as_float32)  # a trainer restarted with another publish_dtype
    assert restarted.resume() == 0
    for _ in range(3):  # a delta coding every float whole in fp32, then sparse fp32 deltas
        manifest = restarted.publish(trainer.step())
        assert manifest.kind == "delta"
        assert subscriber.poll() == manifest.version and not subscriber.rejected
        apply_update(engine, subscriber.take_update())
        assert bit_identical(subscriber.state, {k: v.clone() for k, v in trainer.state.items()})
    assert engine["embed.weight"].dtype == torch.bfloat16  # the engine's tensors convert on write
    assert torch.equal(engine["embed.weight"], trainer.state["embed.weight"].bfloat16())


def test_a_missing_chunk_is_retried_not_blacklisted(weights, config, trainer):
    publisher = Publisher(weights, config)
    subscriber = Subscriber(weights, config)
    publisher.publish(trainer.step())
    subscriber.poll()
    manifest = publisher.publish(trainer.step())
    key = manifest.chunks[-1].key
    saved = weights.objects.get(key)
    weights.objects.delete(key)  # a store hiccup, or a replica not yet in sync
    assert subscriber.poll() == 0 and not subscriber.rejected
    weights.objects.put(key, saved)
    assert subscriber.poll() == 1
    assert bit_identical(subscriber.state, published(trainer.state))


def test_sync_through_s3_with_faults(s3_endpoint, trainer, tmp_path):
    config = SyncConfig(
        store="s3://whetstone/e2e",
        endpoint_url=s3_endpoint,
        chunk_elements=700,
        keyframe_interval=4,
        poll_interval=0.01,
        workers=2,
    )
    weights = WeightStore.open(config)
    publisher = Publisher(weights, config)
    subscribers = [Subscriber(WeightStore.open(config), config, name=f"s3-{i}") for i in range(2)]
    for step in range(9):
        manifest = publisher.publish(trainer.step())
        if step == 5:
            corrupt(weights, manifest.chunks[1].key, "flip")
        for subscriber in subscribers:
            subscriber.poll()
    assert all(5 in s.rejected for s in subscribers)
    for subscriber in subscribers:
        assert subscriber.version == 8
        assert bit_identical(subscriber.state, published(trainer.state))


@pytest.mark.gpu
def test_weights_on_a_gpu_publish_the_bits_of_their_host_copy():
    """A GPU's tensors are cast on the device, then copied into pinned memory: the same bits as
    casting on the host."""
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(300, 70, generator=g), "ids": torch.arange(5), "t": torch.randn(40, 6, generator=g).T}
    on_gpu = {name: t.cuda() for name, t in state.items()}
    for dtype in ("bfloat16", "float16", "float32", "keep"):
        from_gpu = prepare_state(on_gpu, dtype)
        assert all(t.device.type == "cpu" and t.is_contiguous() and t.is_pinned() for t in from_gpu.values())
        assert bit_identical(from_gpu, prepare_state(state, dtype))


def test_publish_later_publishes_the_weights_as_handed_over_in_order(weights, config, trainer, monkeypatch):
    # The trainer moves its weights in place while earlier versions are still being encoded (the
    # worker is held back until every version has been handed over): each version must be the
    # weights at hand-over, and versions must come out in order.
    publisher = Publisher(weights, config)
    handed_over = threading.Event()
    coded = Publisher._publish_prepared

    def held_back(self, *args):
        assert handed_over.wait(timeout=30)
        return coded(self, *args)

    monkeypatch.setattr(Publisher, "_publish_prepared", held_back)
    expected, publishes = [], []
    for _ in range(4):
        state = trainer.step()
        expected.append(published(state))
        publishes.append(publisher.publish_later(state))
    assert not any(publish.done() for publish in publishes)
    handed_over.set()
    assert [publish.result(timeout=60).manifest.version for publish in publishes] == [0, 1, 2, 3]
    publisher.close()
    assert [weights.manifest(v).kind for v in range(4)] == ["full", "delta", "delta", "delta"]
    for version in range(4):
        assert bit_identical(load_version(weights, config, version), expected[version])


def test_publish_later_refuses_bad_input_at_once_and_reports_a_store_failure_through_its_future(
    weights, config, trainer, monkeypatch
):
    publisher = Publisher(weights, config)
    with pytest.raises(WhetstoneError, match="state dict entry 'x' is a int"):
        publisher.publish_later({"x": 3})

    def disk_full(*_):
        raise OSError("disk full")

    monkeypatch.setattr(weights, "put_chunk", disk_full)
    with pytest.raises(OSError, match="disk full"):
        publisher.publish_later(trainer.step()).result(timeout=30)
    monkeypatch.undo()
    # nothing of the failed publish is in the store: the next one is version 0
    assert publisher.publish_later(trainer.step()).result(timeout=30).manifest.version == 0
    publisher.close()
    assert bit_identical(load_version(weights, config, 0), published(trainer.state))
