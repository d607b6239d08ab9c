"""Trajectories become training samples: position t predicts token t + 1."""

from __future__ import annotations

import pytest
import torch

from tests.rl.conftest import call, fake_routes, trajectory
from whetstone.errors import WhetstoneError
from whetstone.rl.samples import NOT_GENERATED, is_prefix_consistent, trajectory_samples

# A two-call segment: prompt [1 2 3], completion [4 5]; then a tool result [6] and completion [7 8 9].
FIRST = call([1, 2, 3], [4, 5], logprobs=[-0.5, -0.6], versions=[3, 3])
SECOND = call([1, 2, 3, 4, 5, 6], [7, 8, 9], logprobs=[-0.7, -0.8, -0.9], versions=[4, 4, 5], routes=fake_routes(8))


def test_prefix_consistent_segment_merges_into_one_sequence():
    (sample,) = trajectory_samples(trajectory([FIRST, SECOND], reward=0.75), advantage=0.5)
    assert sample.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # Position 2 (token 3) predicts token 4, ...; position 5 (the tool token 6) predicts 7.
    assert sample.loss_mask == [0, 0, 1, 1, 0, 1, 1, 1]
    assert sample.behavior_logprobs == [0.0, 0.0, -0.5, -0.6, 0.0, -0.7, -0.8, -0.9]
    assert sample.versions == [NOT_GENERATED, NOT_GENERATED, 3, 3, NOT_GENERATED, 4, 4, 5]
    assert sample.oldest_version == 3
    assert (sample.reward, sample.advantage, sample.task_id, sample.group_id) == (0.75, 0.5, "t", "g")


def test_merged_routes_are_the_last_calls_which_cover_every_fed_token():
    (sample,) = trajectory_samples(trajectory([FIRST, SECOND]))
    assert torch.equal(sample.routes, fake_routes(8))
    assert sample.routes.shape[0] == sample.num_positions == 8


def test_routes_of_the_wrong_length_are_rejected_naming_the_segment():
    bad = call(SECOND.prompt_ids, SECOND.completion_ids, routes=fake_routes(9))
    with pytest.raises(WhetstoneError, match=r"task 't', segment 0: routes have shape \(9, 2, 2\), expected \[8"):
        trajectory_samples(trajectory([FIRST, bad]))


def test_a_call_without_routes_leaves_the_sample_without_replay():
    (sample,) = trajectory_samples(trajectory([FIRST, call(SECOND.prompt_ids, [7])]))
    assert sample.routes is None


def test_inconsistent_segment_yields_one_sample_per_call():
    rewritten = call([1, 2, 9, 4, 5, 6], [7, 8], routes=fake_routes(7))  # the context was re-rendered
    segment = [call([1, 2, 3], [4, 5], routes=fake_routes(4)), rewritten]
    assert not is_prefix_consistent(trajectory(segment).segments[0])
    first, second = trajectory_samples(trajectory(segment))
    assert first.input_ids == [1, 2, 3, 4, 5] and first.loss_mask == [0, 0, 1, 1]
    assert second.input_ids == [1, 2, 9, 4, 5, 6, 7, 8] and second.loss_mask == [0, 0, 0, 0, 0, 1, 1]
    assert torch.equal(second.routes, fake_routes(7))


def test_reward_and_advantage_are_credited_to_every_segment():
    summary = call([1, 2], [3, 4], is_summary=True)
    after = call([1, 5], [6])
    samples = trajectory_samples(trajectory([summary], [after], reward=1.0), advantage=-0.25)
    assert [s.input_ids for s in samples] == [[1, 2, 3, 4], [1, 5, 6]]
    assert all(s.reward == 1.0 and s.advantage == -0.25 for s in samples)


def test_masked_out_tokens_stay_in_context_but_not_in_the_loss():
    cut_off = call([1, 2], [3, 4], mask=[0, 0], versions=[1, 1], finish_reason="length")
    retry = call([1, 2, 3, 4, 7], [8], versions=[2])
    (sample,) = trajectory_samples(trajectory([cut_off, retry]))
    assert sample.loss_mask == [0, 0, 0, 0, 1]
    assert sample.oldest_version == 1  # staleness counts every sampled token


def test_segments_with_nothing_to_train_on_are_left_out():
    assert trajectory_samples(trajectory([call([1, 2], [3], mask=[0])], [])) == []


def test_a_call_with_an_empty_prompt_is_an_error():
    with pytest.raises(WhetstoneError, match="segment 0.*empty prompt"):
        trajectory_samples(trajectory([call([], [1, 2])]))
