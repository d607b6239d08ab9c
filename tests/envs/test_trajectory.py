import math

import pytest

from whetstone.envs.trajectory import ModelCall, Segment, Trajectory, load_trajectories, save_trajectories
from whetstone.errors import WhetstoneError


def make_call(versions, logprobs=(-0.1, -2.5e-8)):
    return ModelCall(
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5],
        logprobs=list(logprobs),
        versions=list(versions),
        loss_mask=[1, 1],
        routes={"shape": [3, 1, 1], "dtype": "uint8", "data": "AAEC"},
    )


def test_round_trip_is_lossless(tmp_path):
    # float32 logprobs with awkward bit patterns survive the JSON round trip exactly
    odd = [float.fromhex("-0x1.fffffep-2"), -math.ulp(0.0)]
    trajectory = Trajectory(
        task_id="synth/train/1",
        group_id="g0",
        segments=[Segment(calls=[make_call([3, 3], odd)], summary="did x"), Segment(calls=[make_call([4, 5])])],
        reward=1.0,
        reward_breakdown={"tests": 1.0},
    )
    path = tmp_path / "t.jsonl"
    save_trajectories(path, [trajectory, trajectory])
    loaded = load_trajectories(path)
    assert loaded == [trajectory, trajectory]
    assert loaded[0].segments[0].calls[0].logprobs == odd
    assert loaded[0].oldest_version == 3 and loaded[0].completion_tokens == 4


def test_a_dropped_rollouts_non_finite_logprobs_round_trip(tmp_path):
    # a rollout dropped for a -inf or NaN logprob is still saved with the evaluation's trajectories
    trajectory = Trajectory(
        task_id="synth/heldout/1",
        group_id="g0",
        segments=[Segment(calls=[make_call([0, 0], (float("-inf"), float("nan")))])],
        reward=0.0,
    )
    path = tmp_path / "t.jsonl"
    save_trajectories(path, [trajectory])
    (logprobs,) = [call.logprobs for call in load_trajectories(path)[0].segments[0].calls]
    assert logprobs[0] == float("-inf") and math.isnan(logprobs[1])


def test_misaligned_call_is_rejected():
    with pytest.raises(ValueError, match="logprobs has 1 entries for 2 completion tokens"):
        ModelCall(prompt_ids=[1], completion_ids=[4, 5], logprobs=[0.0], versions=[0, 0], loss_mask=[1, 1])


def test_corrupt_file_names_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(Trajectory(task_id="a").model_dump_json() + "\n{not json\n")
    with pytest.raises(WhetstoneError, match=r"t.jsonl:2"):
        load_trajectories(path)


def test_text_holding_unicode_line_separators_round_trips(tmp_path):
    trajectory = Trajectory(task_id="a", error="line\u2028separator\u2029paragraph\x85next")
    path = tmp_path / "t.jsonl"
    save_trajectories(path, [trajectory])
    assert load_trajectories(path) == [trajectory]
