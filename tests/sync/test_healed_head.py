"""`WeightStore.healed_head`: the head `heal` leaves, read without writing anything, in every state a
crash leaves a store in (a pointer behind its newest manifest or gone, a withdrawal dead at any
step, a withdrawn number published again since)."""

import json
import shutil

import pytest

from tests.sync.test_repair import Dying
from whetstone.store import LocalStore
from whetstone.sync import Publisher, WeightStore
from whetstone.sync.weight_store import Head


def snapshot(root) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None) under `root`: a store byte for byte."""
    return {str(path.relative_to(root)): path.read_bytes() if path.is_file() else None for path in root.rglob("*")}


def assert_read_then_healed(weights: WeightStore, expected: int | None) -> None:
    """`healed_head` names `expected`, changes nothing, and is what `heal` then leaves."""
    before = snapshot(weights.objects.root)
    seen = weights.healed_head()
    assert snapshot(weights.objects.root) == before
    assert (None if seen is None else seen.version) == expected
    assert weights.heal() == seen and weights.head() == seen and weights.withdrawal() is None


@pytest.fixture
def five(tmp_path, config, trainer) -> LocalStore:
    """A store of versions 0..4 (a keyframe and deltas), to copy for each state."""
    publisher = Publisher(WeightStore(LocalStore(tmp_path / "five")), config)
    for _ in range(5):
        publisher.publish(trainer.step())
    return LocalStore(tmp_path / "five")


def copy_of(store: LocalStore, root, cls=LocalStore) -> WeightStore:
    shutil.copytree(store.root, root)
    return WeightStore(cls(root))


def test_an_empty_store_has_no_head(weights):
    assert_read_then_healed(weights, None)


def test_a_store_as_published_has_its_pointer_as_head(five, tmp_path):
    assert_read_then_healed(copy_of(five, tmp_path / "copy"), 4)


@pytest.mark.parametrize("pointer", [{"version": 1}, "with its digest", None])
def test_a_pointer_behind_its_newest_manifest_or_gone_is_read_as_moved_forward(five, tmp_path, pointer):
    weights = copy_of(five, tmp_path / "copy")
    if pointer is None:  # every pointer write failed
        weights.objects.delete("latest.json")
    else:
        pointer = {"version": 1, "manifest": weights.manifest_digest(1)} if isinstance(pointer, str) else pointer
        weights.objects.put("latest.json", json.dumps(pointer).encode())
    assert_read_then_healed(weights, 4)


def test_a_withdrawal_dead_at_any_step_is_read_as_finished(five, tmp_path):
    died_at = 0
    while True:  # the withdraw dies at its 1st write or delete, then at its 2nd, ... until it completes
        died_at += 1
        weights = copy_of(five, tmp_path / str(died_at), Dying)
        weights.objects.dies_at = died_at
        try:
            weights.withdraw(2)
        except RuntimeError:
            pass
        else:
            break
        assert weights.withdrawal() == 2 or died_at == 1  # its record is its first write
        assert_read_then_healed(weights, 4 if died_at == 1 else 1)
    assert died_at > 5


def test_a_withdrawal_record_without_its_versions_withdraws_those_stored(five, tmp_path):
    weights = copy_of(five, tmp_path / "copy")
    weights.objects.put("withdrawal.json", json.dumps({"from": 3}).encode())  # the pointer still names 4
    assert_read_then_healed(weights, 2)


@pytest.mark.parametrize("pointer_behind", [False, True])
def test_a_withdrawn_number_published_again_since_stays_the_head(five, tmp_path, config, trainer, pointer_behind):
    """A late finisher's record lists the withdrawn publish of version 2; the repair's publish of
    2 (another manifest) is published, and the head, also where its publisher died before the pointer."""
    weights = copy_of(five, tmp_path / "copy", Dying)
    weights.objects.dies_at = 3  # after the record and the pointer
    with pytest.raises(RuntimeError):
        weights.withdraw(2)
    record = weights.objects.get("withdrawal.json")
    weights.withdraw(2)
    repair = Publisher(weights, config)
    assert repair.resume() == 1
    manifest = repair.publish(trainer.step(), full=True)
    weights.objects.put("withdrawal.json", record)
    if pointer_behind:
        weights.objects.put("latest.json", json.dumps({"version": 1, "manifest": weights.manifest_digest(1)}).encode())
    assert weights.healed_head() == Head(2, manifest.digest)
    assert_read_then_healed(weights, 2)
    assert weights.manifest_digest(2) == manifest.digest and weights.verify() == {}
