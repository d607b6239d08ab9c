"""Rated responses -> the RL trainer's batch: reward mapping, what is dropped and why, advantages."""

from __future__ import annotations

import pytest
import torch

from tests.inference.inference_fixtures import tiny_config
from whetstone.errors import WhetstoneError
from whetstone.inference.protocol import encode_routes
from whetstone.online.config import OnlineConfig, RewardMapping
from whetstone.online.samples import feedback_batch
from whetstone.store.feedback import RatedResponse, ResponseRecord


def rated(seq: int, rating: str = "thumbs_up", score: float | None = None, versions=(5, 5), **changes) -> RatedResponse:
    prompt, completion = [1, 2, 3], [4, 5]
    fields = dict(
        response_id=f"chatcmpl-{seq}",
        choice=0,
        model="m",
        priority="interactive",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        finish_reason="stop",
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-0.5, -1.5],
        versions=list(versions),
        routes=encode_routes(torch.arange(16).reshape(4, 2, 2) % 4),
    )
    return RatedResponse(seq, rating, score, 100.0 + seq, ResponseRecord(**(fields | changes)))


def test_ratings_map_to_bounded_rewards():
    rewards = RewardMapping()
    assert rewards.reward("thumbs_up", None) == 0.75 and rewards.reward("edit_reverted", None) == -0.25
    assert rewards.reward("score", 0.0) == -0.25 and rewards.reward("score", 1.0) == 0.75
    assert rewards.reward("score", 0.5) == pytest.approx(0.25)


@pytest.mark.parametrize(
    "rating, score, problem",
    [
        ("regenerate", None, "rating 'regenerate' is not one of thumbs_up, thumbs_down"),
        ("model_config", None, "rating 'model_config' is not one of"),
        ("score", None, "rating 'score' needs a score from 0 to 1, not None"),
        ("score", 7.0, "needs a score from 0 to 1, not 7.0"),
        ("score", float("nan"), "needs a score from 0 to 1, not nan"),
    ],
)
def test_an_event_the_servers_would_refuse_has_no_reward(rating, score, problem):
    with pytest.raises(WhetstoneError, match=problem):
        RewardMapping().reward(rating, score)


def test_an_event_the_servers_would_refuse_is_dropped_not_the_update(caplog):
    # the store takes any writer's rating: one of another whetstone's, or a score out of [0, 1]
    events = [rated(1), rated(2, "thumbs_down"), rated(3, "regenerate"), rated(4, "score"), rated(5, "score", 7.0)]
    built = feedback_batch(events, OnlineConfig(), version=5)
    assert built.counts["dropped_malformed"] == 3 and built.counts["kept"] == 2
    assert built.reward_mean == pytest.approx(0.25)  # 0.75 and -0.25: the bounded rewards only
    assert "feedback event 3 dropped: rating 'regenerate' is not one of" in caplog.text


def test_a_record_of_sampling_parameters_the_servers_refuse_is_dropped_not_the_update(caplog):
    # another writer of the store: a NaN temperature would fail the collate of the whole update
    odd = [rated(3, temperature=float("nan")), rated(4, temperature=500.0), rated(5, top_p=float("nan"))]
    built = feedback_batch([rated(1), rated(2, "thumbs_down"), *odd], OnlineConfig(), version=5)
    assert built.counts["dropped_malformed"] == 3 and built.counts["kept"] == 2 and built.batch is not None
    assert "feedback event 3 dropped: temperature must be in [0, 100], got nan" in caplog.text
    assert "feedback event 5 dropped: top_p must be in (0, 1], got nan" in caplog.text


def test_a_record_that_does_not_fit_the_model_is_dropped_not_the_update(caplog):
    # a server of another model writing to the same store: its trainer forward would fail
    model = tiny_config()  # a vocabulary of 512, 2 MoE layers of 4 experts, 2 per token: rated()'s routes fit
    foreign = [
        rated(3, completion_ids=[4, 600]),
        rated(4, routes=encode_routes(torch.arange(16).reshape(4, 2, 2) % 4 + 4)),
        rated(5, routes=encode_routes(torch.zeros(4, 3, 2, dtype=torch.long))),
    ]
    built = feedback_batch([rated(1), rated(2, "thumbs_down"), *foreign], OnlineConfig(), version=5, model=model)
    assert built.counts["dropped_malformed"] == 3 and built.counts["kept"] == 2 and built.batch is not None
    assert "token ids in [1, 600], outside the model's vocabulary (0..511)" in caplog.text
    assert "routes hold expert ids in [4, 7], expected 0..3" in caplog.text
    assert "routes of [moe_layers, top_k] [3, 2], the model's are [2, 2]" in caplog.text


def test_a_rated_response_becomes_one_trained_row():
    built = feedback_batch([rated(1), rated(2, "thumbs_down")], OnlineConfig(), version=5, meta={"index": 3})
    batch = built.batch
    assert built.counts["kept"] == 2 and built.reward_mean == pytest.approx(0.25)
    assert batch.input_ids[0].tolist() == [1, 2, 3, 4] and batch.target_ids[0].tolist() == [2, 3, 4, 5]
    assert batch.loss_mask[0].tolist() == [False, False, True, True]  # the completion tokens only
    assert batch.behavior_logprobs[0, 2:].tolist() == [-0.5, -1.5]
    assert batch.versions[0].tolist() == [-1, -1, 5, 5] and batch.routes.shape == (2, 4, 2, 2)
    assert batch.advantages[:, 2].tolist() == pytest.approx([0.5, -0.5])  # reward minus the batch mean
    assert batch.meta == {"index": 3}


def test_without_a_baseline_the_reward_is_the_advantage():
    built = feedback_batch([rated(1), rated(2, "thumbs_down")], OnlineConfig(baseline="none"), version=5)
    assert built.batch.advantages[:, 2].tolist() == pytest.approx([0.75, -0.25])


def test_truncated_stale_and_empty_responses_are_dropped_and_counted():
    config = OnlineConfig()  # max_off_policy_steps = 1
    events = [
        rated(1),
        rated(2, "thumbs_down"),
        rated(3, temperature=0.0),
        rated(4, top_p=0.9),
        rated(5, top_k=40),
        rated(6, versions=(3, 5)),
        rated(7, completion_ids=[], logprobs=[], versions=[]),
        rated(8, versions=(4, 4)),
        rated(9, routes=encode_routes(torch.zeros(9, 2, 2, dtype=torch.int64))),
        rated(10, temperature=1e-6),  # sampled greedily by the engine
    ]
    built = feedback_batch(events, config, version=5)
    assert built.counts == {
        "events": 10,
        "dropped_truncated": 4,
        "dropped_empty": 1,
        "dropped_malformed": 1,
        "dropped_nonfinite_logprobs": 0,
        "dropped_stale": 1,
        "staleness_0": 2,
        "staleness_1": 1,
        "kept": 3,
    }
    assert len(built.batch) == 3


def test_a_record_whose_lists_do_not_add_up_is_dropped_not_raised():
    events = [rated(1), rated(2, "thumbs_down"), rated(3, logprobs=[-0.5]), rated(4, versions=[5])]
    events.append(rated(5, routes=[1, 2]))
    built = feedback_batch(events, OnlineConfig(), version=5)
    assert built.counts["dropped_malformed"] == 3 and built.counts["kept"] == 2


def test_a_response_with_a_logprob_that_is_not_finite_is_dropped_not_the_update():
    # a server whose numerics failed (NaN logits): one such token would make the update's loss NaN
    events = [rated(1), rated(2, "thumbs_down"), rated(3, logprobs=[-0.5, float("nan")]), rated(4, "thumbs_down")]
    events.append(rated(5, logprobs=[float("-inf"), -1.0]))
    built = feedback_batch(events, OnlineConfig(), version=5)
    assert built.counts["dropped_nonfinite_logprobs"] == 2 and built.counts["kept"] == 3
    assert torch.isfinite(built.batch.behavior_logprobs).all()


def test_each_row_keeps_the_temperature_it_was_sampled_at():
    events = [rated(1, temperature=0.7), rated(2, "thumbs_down"), rated(3, versions=(0, 0)), rated(4, temperature=1.3)]
    built = feedback_batch(events, OnlineConfig(), version=5)  # event 3 is stale
    assert built.counts["kept"] == 3
    assert built.batch.temperatures.tolist() == pytest.approx([0.7, 1.0, 1.3])


def test_a_response_with_rows_dropped_as_stale_still_weighs_once(monkeypatch):
    import dataclasses

    from whetstone.online import samples

    def split(item, reward):
        """Response 1 as two rows of half its weight, as a summarized rollout makes; the first is stale."""
        (row,) = real(item, reward)
        if item.seq != 1:
            return [row]
        stale = dataclasses.replace(row, versions=[-1, -1, 0, 0], rollout_share=0.5)
        return [stale, dataclasses.replace(row, rollout_share=0.5)]

    real = samples.rated_sample
    monkeypatch.setattr(samples, "rated_sample", split)
    built = feedback_batch([rated(1), rated(2, "thumbs_down")], OnlineConfig(), version=5)
    assert built.counts["dropped_stale"] == 1 and built.counts["kept"] == 2
    assert built.batch.rollout_shares is None  # each row the whole of its response


def test_no_variance_or_nothing_usable_is_a_reason_not_a_batch():
    same = feedback_batch([rated(1), rated(2)], OnlineConfig(), version=5)
    assert same.batch is None and "no reward variance" in same.skip_reason
    stale = feedback_batch([rated(1, versions=(0, 0))], OnlineConfig(), version=5)
    assert stale.batch is None and "no usable feedback" in stale.skip_reason
    assert feedback_batch([], OnlineConfig(), version=0).skip_reason
