"""Versions a subscriber must not take, whose chunks pass their checksums: each is rejected with
a reason naming what is wrong, the subscriber's weights stay exactly the version it holds, and
`blocked()` reports it."""

import json
import struct

import pytest

from tests.sync.conftest import bit_identical, published
from whetstone.sync import Publisher, Subscriber
from whetstone.sync.chunks import MAGIC, checksum, read_header
from whetstone.sync.manifest import manifest_key


def edit_manifest(weights, version: int, edit) -> None:
    manifest = json.loads(weights.objects.get(manifest_key(version)))
    edit(manifest)
    weights.objects.put(manifest_key(version), json.dumps(manifest).encode())


def held_after(publisher, subscriber, trainer, versions: int) -> dict:
    for _ in range(versions):
        publisher.publish(trainer.step())
    subscriber.poll()
    return {k: v.clone() for k, v in subscriber.state.items()}


@pytest.mark.parametrize("shape", [[16, 32], [-32, -16]])
def test_a_delta_whose_manifest_gives_a_tensor_another_shape_is_rejected_whole(weights, config, trainer, shape):
    """The delta decodes (the values are all there), but it does not fit the weights held: none of
    it is written, not even the tensors before that one."""
    publisher, subscriber = Publisher(weights, config), Subscriber(weights, config)
    held = held_after(publisher, subscriber, trainer, 1)
    publisher.publish(trainer.step())

    def reshape(manifest):
        next(t for t in manifest["tensors"] if t["name"] == "layer.0.mlp.weight")["shape"] = shape

    edit_manifest(weights, 1, reshape)
    assert subscriber.poll() == 0
    assert "'layer.0.mlp.weight' of shape" in subscriber.rejected[1]
    assert bit_identical(subscriber.state, held)
    assert subscriber.poll() == 0 and bit_identical(subscriber.state, held)  # not applied again on the next poll


def test_a_manifest_listing_the_chunks_of_another_version_is_rejected(weights, config, trainer):
    publisher, subscriber = Publisher(weights, config), Subscriber(weights, config)
    held = held_after(publisher, subscriber, trainer, 2)
    publisher.publish(trainer.step())
    chunks_of_1 = json.loads(weights.objects.get(manifest_key(1)))["chunks"]  # intact, checksums and all
    edit_manifest(weights, 2, lambda manifest: manifest.update(chunks=chunks_of_1))
    assert subscriber.poll() == 1
    assert f"lists chunk {chunks_of_1[0]['key']}, which is not one of its own" in subscriber.rejected[2]
    assert bit_identical(subscriber.state, held)


def test_a_manifest_listing_a_tensor_twice_is_rejected_saying_so(weights, config, trainer):
    publisher, subscriber = Publisher(weights, config), Subscriber(weights, config)
    held = held_after(publisher, subscriber, trainer, 1)
    publisher.publish(trainer.step())
    edit_manifest(weights, 1, lambda manifest: manifest["tensors"].append(dict(manifest["tensors"][0])))
    assert subscriber.poll() == 0
    assert "manifest of version 1 lists tensor 'embed.weight' twice" in subscriber.rejected[1]
    assert bit_identical(subscriber.state, held)


def test_a_manifest_missing_a_field_is_rejected_naming_it(weights, config, trainer):
    publisher, subscriber = Publisher(weights, config), Subscriber(weights, config)
    held = held_after(publisher, subscriber, trainer, 1)
    publisher.publish(trainer.step())
    edit_manifest(weights, 1, lambda manifest: manifest["tensors"][0].pop("shape"))
    assert subscriber.poll() == 0
    assert "manifest of version 1 is invalid: tensors.0.shape: Field required" in subscriber.rejected[1]
    assert bit_identical(subscriber.state, held)


@pytest.mark.parametrize("keyframe", [-1, 2])
def test_a_manifest_whose_keyframe_is_no_version_up_to_its_own_is_rejected(weights, config, trainer, keyframe):
    """Not a version to wait for (a negative one is not in any store), nor one past it to start from
    (nothing would be taken, and nothing said)."""
    publisher = Publisher(weights, config)
    for _ in range(2):
        publisher.publish(trainer.step())
    edit_manifest(weights, 1, lambda manifest: manifest.update(keyframe=keyframe))
    subscriber = Subscriber(weights, config)
    assert subscriber.poll() is None and subscriber.unavailable == {}
    assert (
        f"manifest of version 1 gives keyframe {keyframe}, which is not a version from 0 to 1" in subscriber.rejected[1]
    )
    assert "version 1 was rejected" in subscriber.blocked()


@pytest.mark.parametrize("base", [None, -1, 1, 2])
def test_a_delta_whose_base_is_no_version_before_its_own_is_rejected(weights, config, trainer, base):
    """A delta decodes onto its base's weights: without a base before it, onto whatever the
    subscriber holds (nothing, or weights it forgot)."""
    publisher = Publisher(weights, config)
    for _ in range(2):
        publisher.publish(trainer.step())
    edit_manifest(weights, 1, lambda manifest: manifest.update(base=base, base_manifest=None))
    subscriber = Subscriber(weights, config)
    subscriber.poll()
    assert (
        f"manifest of version 1 is a delta of base {base}, which is not a version from 0 to 0" in subscriber.rejected[1]
    )


def test_an_unreadable_latest_manifest_is_a_rejection_reported_once_and_retried_when_replaced(weights, config, trainer):
    """A manifest of a newer format (a newer publisher), say: the subscriber cannot even tell where
    the chain starts, and says so through `rejected` and `blocked()` rather than failing each poll."""
    publisher, subscriber = Publisher(weights, config), Subscriber(weights, config)
    held_after(publisher, subscriber, trainer, 1)
    publisher.publish(trainer.step())
    original = weights.objects.get(manifest_key(1))
    edit_manifest(weights, 1, lambda manifest: manifest.update(format=2))
    for _ in range(2):
        assert subscriber.poll() == 0
    assert "has format 2" in subscriber.rejected[1] and subscriber.rejections == 1
    assert "version 1 was rejected (manifest of version 1 has format 2" in subscriber.blocked()
    weights.objects.put(manifest_key(1), original)
    assert subscriber.poll() == 1 and subscriber.blocked() is None
    assert bit_identical(subscriber.state, published(trainer.state))


def replace_chunk(weights, version: int, index: int, blob: bytes) -> str:
    """Put `blob` in place of a chunk, with the manifest's size and checksum to match."""
    manifest = json.loads(weights.objects.get(manifest_key(version)))
    entry = manifest["chunks"][index]
    weights.objects.put(entry["key"], blob)
    entry.update(size=len(blob), checksum=checksum(blob))
    weights.objects.put(manifest_key(version), json.dumps(manifest).encode())
    return entry["key"]


def test_a_chunk_that_does_not_decode_is_rejected_naming_the_chunk_and_its_tensors(weights, config, trainer):
    publisher, subscriber = Publisher(weights, config), Subscriber(weights, config)
    held = held_after(publisher, subscriber, trainer, 1)
    manifest = publisher.publish(trainer.step())
    blob = weights.objects.get(manifest.chunks[0].key)
    blocks, offset = read_header(blob)
    garbled = blob[:offset] + bytes(len(blob) - offset)  # the header as it was, zeros for payloads
    key = replace_chunk(weights, 1, 0, garbled)
    assert subscriber.poll() == 0
    reason = subscriber.rejected[1]
    assert reason.startswith(f"chunk {key}: block of tensor") and repr(blocks[0]["segments"][0][0]) in reason
    assert "zstd frame does not decode" in reason
    assert bit_identical(subscriber.state, held)


BLOCKS_NOT_A_LIST = {"blocks": 5}
A_FIELD_NOT_A_NUMBER = {
    "blocks": [
        {
            "segments": [["embed.weight", 0, 1]],
            "encoding": "sparse",
            "count": 1,
            "length": 0,
            "distance_bytes": "x",
            "step_bytes": 1,
            "distance_length": 0,
        }
    ]
}


@pytest.mark.parametrize("header", [BLOCKS_NOT_A_LIST, A_FIELD_NOT_A_NUMBER], ids=["blocks", "field"])
def test_a_chunk_header_of_the_wrong_types_is_a_rejection_not_a_crash(weights, config, trainer, header):
    publisher, subscriber = Publisher(weights, config), Subscriber(weights, config)
    held_after(publisher, subscriber, trainer, 1)
    publisher.publish(trainer.step())
    head = json.dumps(header).encode()
    key = replace_chunk(weights, 1, 0, MAGIC + struct.pack("<I", len(head)) + head)
    assert subscriber.poll() == 0
    assert subscriber.rejected[1].startswith(f"chunk {key}: ")
