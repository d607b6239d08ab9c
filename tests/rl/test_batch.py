"""Batches: right-padded collation, and a lossless, atomic file / object-store form."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save as safetensors_save

from tests.rl.conftest import call, fake_routes, trajectory
from whetstone.errors import WhetstoneError
from whetstone.rl.batch import (
    TENSOR_FIELDS,
    batch_from_bytes,
    batch_to_bytes,
    check_batch,
    collate,
    drop_impossible_rows,
    load_batch,
    save_batch,
)
from whetstone.rl.samples import trajectory_samples
from whetstone.store.local import LocalStore


def two_samples(with_routes=True):
    routes = fake_routes(4) if with_routes else None
    long = trajectory([call([1, 2, 3], [4, 5], versions=[7, 8], routes=routes)], task_id="a", reward=1.0)
    routes = fake_routes(1, offset=5) if with_routes else None
    short = trajectory([call([9], [10], logprobs=[-1.0 / 3.0], routes=routes)], task_id="b", reward=0.0)
    return trajectory_samples(long, advantage=0.5) + trajectory_samples(short, advantage=-0.5)


def test_collate_right_pads_with_masks_off():
    batch = collate(two_samples(), pad_id=0, meta={"step": 3})
    assert batch.input_ids.tolist() == [[1, 2, 3, 4], [9, 0, 0, 0]]
    assert batch.target_ids.tolist() == [[2, 3, 4, 5], [10, -1, -1, -1]]
    assert batch.loss_mask.tolist() == [[False, False, True, True], [True, False, False, False]]
    assert batch.versions.tolist() == [[-1, -1, 7, 8], [0, -1, -1, -1]]
    assert batch.advantages.tolist() == [[0.5] * 4, [-0.5, 0.0, 0.0, 0.0]]
    assert batch.behavior_logprobs[1, 0] == torch.tensor(-1.0 / 3.0, dtype=torch.float32)
    assert torch.equal(batch.routes[0], fake_routes(4))
    assert torch.equal(batch.routes[1, :1], fake_routes(1, offset=5)) and not batch.routes[1, 1:].any()
    assert batch.num_loss_tokens == 3 and len(batch) == 2
    assert batch.rows[1] == {
        "task_id": "b",
        "group_id": "g",
        "reward": 0.0,
        "advantage": -0.5,
        "oldest_version": 0,
        "num_positions": 1,
    }


def test_select_takes_rows_and_trims_the_padding():
    batch = collate(two_samples())
    short = batch.select([1])
    assert short.input_ids.tolist() == [[9]] and short.routes.shape == (1, 1, 2, 2)
    assert short.rows == batch.rows[1:] and short.num_loss_tokens == 1
    assert torch.equal(batch.select(range(2)).behavior_logprobs, batch.behavior_logprobs)


def test_mixing_samples_with_and_without_routes_is_an_error():
    mixed = two_samples(with_routes=True)[:1] + two_samples(with_routes=False)[1:]
    with pytest.raises(WhetstoneError, match="1 of 2 samples have no routes"):
        collate(mixed)


def assert_same(a, b):
    for name in ("input_ids", "target_ids", "loss_mask", "behavior_logprobs", "versions", "advantages", "routes"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), name
    assert a.rows == b.rows and a.meta == b.meta


@pytest.mark.parametrize("with_routes", [True, False])
def test_save_and_load_are_lossless(tmp_path, with_routes):
    batch = collate(two_samples(with_routes), meta={"step": 3, "dropped": {"no_variance": 8}})
    save_batch(tmp_path / "b.safetensors", batch)
    assert_same(load_batch(tmp_path / "b.safetensors"), batch)
    assert os.listdir(tmp_path) == ["b.safetensors"]  # no temporary file left behind


def test_a_batch_travels_through_an_object_store_as_one_blob(tmp_path):
    store, batch = LocalStore(tmp_path), collate(two_samples())
    store.put("batches/000001.safetensors", batch_to_bytes(batch))
    assert_same(batch_from_bytes(store.get("batches/000001.safetensors")), batch)


def test_corrupt_or_missing_files_get_a_clear_error(tmp_path):
    (tmp_path / "bad").write_bytes(b"not a batch at all")
    with pytest.raises(WhetstoneError, match="is not a whetstone batch"):
        load_batch(tmp_path / "bad")
    with pytest.raises(WhetstoneError, match="does not exist"):
        load_batch(tmp_path / "missing")
    truncated = batch_to_bytes(collate(two_samples()))[:-10]
    with pytest.raises(WhetstoneError, match="key batches/x is not a whetstone batch"):
        batch_from_bytes(truncated, source="key batches/x")


@pytest.mark.parametrize(
    "header",
    ['{"format_version": 1, "rows": []}', '{"format_version": 1, "meta": {}}', "[1]", '"batch"'],
)
def test_a_damaged_header_is_refused_naming_the_key(header):
    tensors = {name: getattr(collate(two_samples(False)), name) for name in TENSOR_FIELDS}
    data = safetensors_save(tensors, metadata={"whetstone_batch": header})
    with pytest.raises(WhetstoneError, match="key batches/x is not a whetstone batch: its header"):
        batch_from_bytes(data, source="key batches/x")


def test_a_batch_of_another_vocabulary_is_refused_naming_it():
    batch = collate(two_samples())
    check_batch(batch, vocab_size=11)  # token ids 1..10, padding 0
    with pytest.raises(
        WhetstoneError, match=r"key x holds token ids in \[0, 10\], but the model's vocabulary is 0\.\.9"
    ):
        check_batch(batch, vocab_size=10, source="key x")
    batch.input_ids[1, 0] = -3
    with pytest.raises(WhetstoneError, match=r"token ids in \[-3, 10\]"):
        check_batch(batch, vocab_size=11)


@pytest.mark.parametrize("field", ["behavior_logprobs", "advantages"])
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_values_that_are_not_finite_are_refused_at_trained_positions_only(field, bad):
    batch = collate(two_samples())
    getattr(batch, field)[0, 0] = bad  # a prompt position of row 0: not trained, never read
    check_batch(batch, vocab_size=11)
    getattr(batch, field)[1, 0] = bad  # row 1's one trained position
    with pytest.raises(
        WhetstoneError, match=rf"batch has {field} that are not finite at trained positions of rows \[1\] \(tasks 'b'\)"
    ):
        check_batch(batch, vocab_size=11)


def test_rows_with_a_minus_inf_logprob_at_a_trained_position_are_dropped_and_no_others():
    batch = collate(two_samples())
    batch.behavior_logprobs[0, 0] = float("-inf")  # a prompt position of row 0: not trained
    kept, dropped = drop_impossible_rows(batch)
    assert kept is batch and dropped == []
    batch.behavior_logprobs[0, 2] = float("-inf")  # a trained position of row 0
    kept, dropped = drop_impossible_rows(batch)
    assert dropped == [0] and [row["task_id"] for row in kept.rows] == ["b"]
    assert kept.input_ids.shape == (1, 1)  # cut to the row left
    check_batch(kept, vocab_size=11)
    batch.behavior_logprobs[1, 0] = float("nan")  # row 1's one trained position; NaN is no logprob: refused
    kept, dropped = drop_impossible_rows(batch)
    assert dropped == [0]
    with pytest.raises(WhetstoneError, match=r"behavior_logprobs that are not finite .* rows \[0\] \(tasks 'b'\)"):
        check_batch(kept, vocab_size=11)
    with pytest.raises(WhetstoneError, match=r"rows \[1\] \(tasks 'b'\)"):  # its number in the stored batch
        check_batch(kept, vocab_size=11, row_numbers=[1])
    batch.behavior_logprobs[1, 0] = float("-inf")  # every row: the batch whole, which check_batch refuses
    kept, dropped = drop_impossible_rows(batch)
    assert kept is batch and dropped == []
