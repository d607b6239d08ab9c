"""The trainer loop's step options: PPO-style mini-batches (one batch, several optimizer steps,
one published version) and invariant numerics."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_loop import subscribe
from tests.trainer.trainer_fixtures import make_batches, put_batches, trainer_config
from whetstone.errors import WhetstoneError
from whetstone.rl.batch import batch_from_bytes, batch_to_bytes, collate, shuffled_parts
from whetstone.rl.samples import Sample
from whetstone.trainer.loop import merge_part_metrics, run_trainer, step_once
from whetstone.trainer.setup import open_trainer
from whetstone.trainer.step import micro_batches
from whetstone.utils.metrics import read_metrics


def test_parts_cover_every_row_once_in_a_seeded_order(batches):
    batch = batches[0]
    parts = shuffled_parts(batch, 3, seed=5)

    def rows(b):
        return sorted(tuple(ids[ids != 0].tolist()) for ids in b.input_ids)

    assert rows(batch) == sorted(r for part in parts for r in rows(part))
    assert len(batch) >= 4  # enough rows for three non-empty parts
    assert [len(part) for part in parts] == [len(range(i, len(batch), 3)) for i in range(3)]  # near-equal
    assert sum(part.num_loss_tokens for part in parts) == batch.num_loss_tokens
    again = shuffled_parts(batch, 3, seed=5)
    assert all(a.input_ids.equal(b.input_ids) for a, b in zip(parts, again, strict=True))
    assert any(rows(a) != rows(b) for a, b in zip(parts, shuffled_parts(batch, 3, seed=6), strict=True))
    assert len(shuffled_parts(batch, 100, seed=0)) == len(batch)  # never an empty part


def test_mismatch_comes_from_the_first_part_and_the_rest_is_averaged():
    first = {"loss": 1.0, "tokens": 10, "mismatch_kl_k3": 0.0, "routing_disagreement": 0.0, "clip_fraction": 0.0}
    second = {"loss": 3.0, "tokens": 30, "mismatch_kl_k3": 0.5, "routing_disagreement": 0.2, "clip_fraction": 0.4}
    merged = merge_part_metrics([first, second])
    assert merged == {
        "optimizer_steps": 2,
        "loss": 2.0,
        "tokens": 40,
        "mismatch_kl_k3": 0.0,
        "routing_disagreement": 0.0,
        "clip_fraction": 0.2,
    }
    assert merge_part_metrics([first]) is first


def test_each_batch_takes_several_optimizer_steps_and_publishes_one_version(tmp_path, tiny_moe, batches):
    weights = {}
    for steps in (1, 2):
        root = tmp_path / f"steps{steps}"
        put_batches(root / "batches", batches[:2])
        assert run_trainer(trainer_config(root, tiny_moe, optimizer_steps_per_batch=steps))["version"] == 2
        records = read_metrics(root / "trainer" / "metrics.jsonl")
        assert sum(r["tokens"] for r in records) == sum(b.num_loss_tokens for b in batches[:2])
        weights[steps] = subscribe(root).state
    assert [r["optimizer_steps"] for r in records] == [2, 2]  # one version per batch, two Adam steps each
    assert any(not weights[1][name].equal(weights[2][name]) for name in weights[1])


def test_a_row_without_trained_tokens_is_no_mini_batch_of_its_own(tmp_path, tiny_moe, batches):
    # one mini-batch per row: the untrained row alone would be a mini-batch without trained tokens
    untrained = batch_from_bytes(batch_to_bytes(batches[1]))
    untrained.loss_mask[0], untrained.versions[0], untrained.behavior_logprobs[0] = False, -1, 0.0
    untrained.rows[0]["oldest_version"] = None
    put_batches(tmp_path / "batches", [batches[0], untrained])
    config = trainer_config(tmp_path, tiny_moe, optimizer_steps_per_batch=len(untrained))
    assert run_trainer(config)["version"] == 2
    records = read_metrics(tmp_path / "trainer" / "metrics.jsonl")
    assert [(r["optimizer_steps"], r["rows"]) for r in records] == [
        (len(batches[0]), len(batches[0])),
        (len(untrained) - 1, len(untrained)),
    ]
    assert records[1]["tokens"] == untrained.num_loss_tokens


def an_expert_past_the_model(batch):
    # in a row of the second mini-batch of step 0: the first would have moved the weights already
    second = torch.randperm(len(batch), generator=torch.Generator().manual_seed(0)).tolist()[1::2]
    batch.routes[second[-1], 0, 0, 0] = 9  # the tiny MoE has 4 experts


def routes_of_one_moe_layer(batch):
    batch.routes = batch.routes[:, :, :1].contiguous()  # the tiny MoE has two


@pytest.mark.parametrize(
    ("spoil", "error"),
    [
        (an_expert_past_the_model, r"routes hold expert ids in \[0, 9\], expected 0..3"),
        (
            routes_of_one_moe_layer,
            r"routes have shape \((\d+), (\d+), 1, 2\), expected \(\1, \2, 2, 2\) \[B, T, moe_layers, top_k\]",
        ),
    ],
)
def test_a_batch_whose_routes_do_not_fit_the_model_is_refused_whole_naming_it(
    tmp_path, tiny_moe, batches, spoil, error
):
    session = open_trainer(trainer_config(tmp_path, tiny_moe, optimizer_steps_per_batch=2))
    bad = batch_from_bytes(batch_to_bytes(batches[0]))
    spoil(bad)
    weights = {name: value.clone() for name, value in session.model.state_dict().items()}
    with pytest.raises(
        WhetstoneError, match=rf"0000000000.batch in LocalStore\(.*\): {error}: the batch was sampled by another model"
    ):
        step_once(session, bad)
    assert all(torch.equal(weights[name], value) for name, value in session.model.state_dict().items())
    assert not session.optimizer.state and session.state.step == 0


@pytest.mark.parametrize(
    ("device", "dtype"),
    [
        ("cpu", "float32"),
        ("cpu", "bfloat16"),
        pytest.param("cuda", "float32", marks=pytest.mark.gpu),
        pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu),
    ],
)
def test_an_invariant_trainer_sees_exactly_the_engines_logprobs(tmp_path, tiny_moe, device, dtype):
    # Batches sampled by an invariant engine; the trainer process on the same numerics, device and
    # dtype: its first step (weights still the sampler's) measures no mismatch at all, so every
    # ratio is exactly 1, and the replayed routes are the ones its own router picks.
    put_batches(tmp_path / "batches", make_batches(tiny_moe, 1, numerics="invariant", device=device, dtype=dtype))
    run_trainer(trainer_config(tmp_path, tiny_moe, numerics="invariant", device=device, dtype=dtype))
    (record,) = read_metrics(tmp_path / "trainer" / "metrics.jsonl")
    assert record["logprob_diff_max"] == 0.0 and record["mismatch_kl_k3"] == 0.0
    assert record["routing_disagreement"] == 0.0


def test_micro_batches_take_rows_in_order_of_length_so_each_is_cut_short():
    def sample(positions: int) -> Sample:
        return Sample(
            input_ids=list(range(1, positions + 2)),
            loss_mask=[1] * positions,
            behavior_logprobs=[-1.0] * positions,
            versions=[0] * positions,
            routes=None,
            reward=1.0,
            advantage=1.0,
        )

    batch = collate([sample(n) for n in (9, 2, 8, 3, 7, 1)])
    micro = micro_batches(batch, 2)
    assert [m.input_ids.shape[1] for m in micro] == [2, 7, 9]  # shortest pairs first, each cut to its longest
    assert [int(m.loss_mask.sum()) for m in micro] == [3, 10, 17]
