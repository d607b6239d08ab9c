"""The batch store contract: keys, the next index after a restart, one blob per batch."""

from __future__ import annotations

import pytest

from tests.rl.conftest import call, trajectory
from tests.rl.test_batch import assert_same
from whetstone.errors import WhetstoneError
from whetstone.rl.batch import collate
from whetstone.rl.batch_store import batch_key, get_batch, next_batch_index, put_batch
from whetstone.rl.samples import trajectory_samples
from whetstone.store import LocalStore


def test_batch_keys_and_the_next_index_after_a_restart(tmp_path):
    store = LocalStore(tmp_path)
    assert batch_key(7) == "batches/0000000007.batch" and next_batch_index(store) == 0
    store.put(batch_key(0), b"x"), store.put(batch_key(1), b"x"), store.put("batches/notes.txt", b"x")
    store.put("batches/copy of 0000000001.batch", b"x")  # not a batch's name: not counted
    store.put("batches/0007.batch", b"x")  # nor a number written otherwise: the trainer reads 0000000007.batch
    assert next_batch_index(store) == 2


def test_a_put_batch_comes_back_whole_and_a_missing_one_is_none(tmp_path):
    store = LocalStore(tmp_path)
    batch = collate(
        trajectory_samples(trajectory([call([1, 2], [3, 4])], task_id="a", reward=1.0), advantage=0.5),
        meta={"index": 3},
    )
    assert get_batch(store, 3) is None
    put_batch(store, 3, batch)
    assert store.list("batches/") == [batch_key(3)] and next_batch_index(store) == 4
    assert_same(get_batch(store, 3), batch)


def test_a_batch_is_created_once_and_never_replaced(tmp_path):
    store = LocalStore(tmp_path)
    samples = trajectory_samples(trajectory([call([1, 2], [3, 4])], task_id="a", reward=1.0), advantage=0.5)
    first, second = collate(samples, meta={"index": 0}), collate(samples, meta={"index": 0, "other": True})
    put_batch(store, 0, first)
    with pytest.raises(WhetstoneError, match="batches/0000000000.batch already exists .* another orchestrator"):
        put_batch(store, 0, second)
    assert_same(get_batch(store, 0), first)  # what the trainer may have read stays
