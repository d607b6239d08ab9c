"""A stored batch whose tensors or rows do not fit together is refused when read, naming it and
what is wrong, instead of failing somewhere in the trainer's step with a traceback."""

from __future__ import annotations

import pytest
import torch

from tests.rl.test_batch import two_samples
from whetstone.errors import WhetstoneError
from whetstone.rl.batch import TENSOR_FIELDS, batch_from_bytes, batch_to_bytes, collate


def no_rows(batch):
    for name in TENSOR_FIELDS:
        setattr(batch, name, getattr(batch, name)[:0])
    batch.routes, batch.rows = batch.routes[:0], []


def short_mask(batch):
    batch.loss_mask = batch.loss_mask[:, :-1]


def short_advantages(batch):
    batch.advantages = batch.advantages[:1]


def integer_mask(batch):
    batch.loss_mask = batch.loss_mask.to(torch.uint8)


def float_ids(batch):
    batch.input_ids = batch.input_ids.float()


def flat_routes(batch):
    batch.routes = batch.routes[:, :, 0, 0]


def routes_of_fewer_rows(batch):
    batch.routes = batch.routes[:1]


def zero_temperature(batch):
    batch.temperatures = torch.tensor([1.0, 0.0])


def negative_temperature(batch):
    batch.temperatures = torch.tensor([-0.7, 1.0])


def temperatures_of_another_count(batch):
    batch.temperatures = torch.ones(3)


def nan_share(batch):
    batch.rollout_shares = torch.tensor([1.0, float("nan")])


def a_row_record_missing(batch):
    batch.rows = batch.rows[:1]


def a_row_record_not_an_object(batch):
    batch.rows[1] = 3


def no_num_positions(batch):
    del batch.rows[0]["num_positions"]


def num_positions_short_of_the_trained_tokens(batch):
    batch.rows[0]["num_positions"] = 2  # row 0 trains positions 2 and 3


def num_positions_past_the_tensors(batch):
    batch.rows[1]["num_positions"] = 9


def oldest_version_not_a_number(batch):
    batch.rows[0]["oldest_version"] = "7"


@pytest.mark.parametrize(
    ("spoil", "error"),
    [
        (no_rows, r"has input_ids of shape \(0, 4\)"),
        (short_mask, r"has loss_mask of shape \(2, 3\), but input_ids of shape \(2, 4\)"),
        (short_advantages, r"has advantages of shape \(1, 4\), but input_ids of shape \(2, 4\)"),
        (integer_mask, r"has loss_mask of dtype torch.uint8, expected bool"),
        (float_ids, r"has input_ids of dtype torch.float32, expected an integer dtype"),
        (flat_routes, r"has routes of shape \(2, 4\), expected \(2, 4, moe_layers, top_k\)"),
        (routes_of_fewer_rows, r"has routes of shape \(1, 4, 2, 2\), expected \(2, 4, moe_layers, top_k\)"),
        (zero_temperature, r"has temperatures \[1.0, 0.0\]: each row's must be finite and > 0"),
        (negative_temperature, r"has temperatures \[-0\.6[0-9]*, 1\.0\]: each row's must be finite and > 0"),
        (temperatures_of_another_count, r"has temperatures of shape \(3,\), expected \(2,\)"),
        (nan_share, r"has rollout_shares \[1.0, nan\]: each row's must be finite and > 0"),
        (a_row_record_missing, r"has 1 row records for 2 rows"),
        (a_row_record_not_an_object, r"row 1's record is not an object: 3"),
        (no_num_positions, r"row 0's num_positions is None, expected an integer in 1..4"),
        (num_positions_past_the_tensors, r"row 1's num_positions is 9, expected an integer in 1..4"),
        (num_positions_short_of_the_trained_tokens, r"row 0 trains positions past its num_positions \(2\)"),
        (oldest_version_not_a_number, r"row 0's oldest_version is '7', expected an integer or null"),
    ],
)
def test_a_batch_whose_parts_do_not_fit_together_is_refused_naming_it(spoil, error):
    batch = collate(two_samples(), temperatures=[1.0, 1.0])
    batch.rollout_shares = torch.ones(2)
    spoil(batch)
    with pytest.raises(WhetstoneError, match=rf"^key batches/x:? {error}"):
        batch_from_bytes(batch_to_bytes(batch), source="key batches/x")


def test_a_batch_without_row_records_or_optional_tensors_is_read():
    batch = collate(two_samples(with_routes=False))
    batch.rows = []
    read = batch_from_bytes(batch_to_bytes(batch))
    assert read.rows == [] and read.routes is None and torch.equal(read.loss_mask, batch.loss_mask)
