"""What goes into batch n: fresh samples only, and the meta of the contract."""

import asyncio

import pytest

from whetstone.orchestrator.batches import Group, Window, build_batch, drop_stale, flat_metrics
from whetstone.rl.samples import NOT_GENERATED, Sample
from whetstone.rl.staleness import StalenessConfig


def sample(version: int, advantage: float = 1.0) -> Sample:
    """Three tokens: a prompt token, then two sampled under `version`."""
    return Sample(
        input_ids=[5, 6, 7],
        loss_mask=[1, 1],
        behavior_logprobs=[-0.5, -0.25],
        versions=[version, version],
        routes=None,
        reward=advantage,
        task_id="t",
        group_id=f"g{version}",
        advantage=advantage,
    )


def test_samples_older_than_the_bound_are_dropped_and_counted():
    window = Window()
    old, mixed, fresh = Group([sample(1), sample(1)], 2), Group([sample(2), sample(4)], 2), Group([sample(4)], 1)
    kept = drop_stale([old, mixed, fresh], index=4, config=StalenessConfig(max_off_policy_steps=2), window=window)
    assert kept == [mixed, fresh] and [s.versions[0] for s in mixed.samples] == [2, 4]
    assert window.dropped_stale == 2  # the two samples of version 1: 4 - 1 = 3 steps behind


def test_a_group_partly_dropped_counts_only_the_rollouts_it_keeps():
    # rollout 0 made two samples (its context restarted once), rollout 1 one, which is stale
    group = Group([sample(4), sample(4), sample(1)], 2, rollout_of=[0, 0, 1])
    drop_stale([group], index=4, config=StalenessConfig(max_off_policy_steps=2), window=Window())
    assert len(group.samples) == 2 and group.rollouts == 1


def test_a_rollout_with_stale_segments_dropped_still_weighs_once():
    from whetstone.envs.trajectory import ModelCall, Segment, Trajectory
    from whetstone.rl.loss import step_normalizer
    from whetstone.rl.samples import trajectory_samples

    def call(tokens: int, version: int) -> ModelCall:
        return ModelCall(
            prompt_ids=[1] * 3,
            completion_ids=[2] * tokens,
            logprobs=[-1.0] * tokens,
            versions=[version] * tokens,
            loss_mask=[1] * tokens,
        )

    # rollout 0 was summarized twice: its first segment (6 tokens, version 1) is stale for batch 5,
    # its others (2 tokens each, version 4) are not; rollout 1 is short and fresh
    segments = [Segment(calls=[call(6, 1)]), Segment(calls=[call(2, 4)]), Segment(calls=[call(2, 4)])]
    long = trajectory_samples(Trajectory(task_id="t", segments=segments, reward=0.0), -1.0)
    short = trajectory_samples(Trajectory(task_id="t", segments=[Segment(calls=[call(2, 4)])], reward=1.0), 1.0)
    group = Group(long + short, 2, rollout_of=[0, 0, 0, 1])
    config = StalenessConfig(max_off_policy_steps=2)
    batch = build_batch(5, drop_stale([group], 5, config, Window()), Window(), config, 4)
    assert batch.rollout_shares.tolist() == [0.5, 0.5, 1.0] and batch.meta["rollouts"] == 2
    assert float(step_normalizer(batch.loss_mask, "sequence", batch.rollout_shares)) == 2.0


def test_a_nonfinite_reward_stays_out_of_the_reward_mean():
    from whetstone.envs.trajectory import Trajectory

    window = Window()
    rewards = [1.0, float("nan"), 0.0, float("inf")]
    window.add([Trajectory(task_id="t", reward=r) for r in rewards], {"dropped_nonfinite_reward": 2})
    meta = build_batch(5, [Group([sample(5)], 1)], window, StalenessConfig(), weight_version=4).meta
    assert meta["reward_mean"] == 0.5


def test_a_batch_of_samples_with_and_without_routes_is_trained_without_replay(caplog):
    import dataclasses

    import torch

    routed = dataclasses.replace(sample(5), routes=torch.zeros(2, 1, 2, dtype=torch.int64))
    with caplog.at_level("WARNING", logger="whetstone.orchestrator"):
        batch = build_batch(5, [Group([routed, sample(5)], 2)], Window(), StalenessConfig(), weight_version=4)
    assert batch.routes is None and len(batch) == 2 and "1 of its 2 samples came without routes" in caplog.text


def test_a_batch_carries_the_contract_meta():
    window = Window(dropped_stale=3)
    window.add([], {"groups": 3, "kept_groups": 2, "rollouts": 6, "kept_rollouts": 4, "dropped_no_variance": 2})
    window.rewards = [1.0, 0.0, 0.5]
    groups = [Group([sample(5, 1.0), sample(4, -1.0)], 2), Group([sample(5, 0.5), sample(5, -0.5)], 2)]
    batch = build_batch(5, groups, window, StalenessConfig(), weight_version=4)
    meta = batch.meta
    assert meta["index"] == meta["trainer_step"] == 5 and meta["weight_version"] == 4
    assert meta["staleness_histogram"] == {"staleness_0": 3, "staleness_1": 1, "dropped_stale": 3}
    assert meta["groups"]["dropped_no_variance"] == 2 and meta["reward_mean"] == 0.5
    assert meta["samples"] == 4 and meta["rollouts"] == 4 and meta["loss_tokens"] == 8
    assert batch.advantages[:, 0].tolist() == [1.0, -1.0, 0.5, -0.5]
    assert NOT_GENERATED not in batch.versions[batch.loss_mask].tolist()
    flat = flat_metrics(meta)
    assert flat["groups.kept_groups"] == 2 and flat["staleness_1"] == 1 and flat["index"] == 5
    assert batch.temperatures is None  # temperature 1: the trainer's logits as they are


def test_a_batch_sampled_at_another_temperature_carries_it_for_every_row():
    groups = [Group([sample(5, 1.0), sample(4, -1.0)], 2)]
    batch = build_batch(5, groups, Window(), StalenessConfig(), weight_version=4, temperature=0.7)
    assert batch.temperatures.tolist() == pytest.approx([0.7, 0.7])


def test_dropping_stale_groups_wakes_the_producer_waiting_for_room(tmp_path):
    """The buffer was full of groups that the new version made stale: dropping them makes room,
    and the producer, waiting for room, must hear of it (it waited forever before)."""
    from whetstone.orchestrator import Orchestrator, OrchestratorConfig

    config = OrchestratorConfig(
        batch_store=str(tmp_path / "batches"),
        weight_store=str(tmp_path / "weights"),
        groups_per_batch=1,
        staleness=StalenessConfig(max_off_policy_steps=0),
    )
    orchestrator = Orchestrator(config, tasks=[])
    orchestrator._buffer = [Group([sample(0), sample(0)], 2)]  # sampled by version 0

    async def scenario() -> bool:
        async def producer() -> None:
            async with orchestrator._changed:
                await orchestrator._changed.wait_for(orchestrator._has_room)

        waiting = asyncio.create_task(producer())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # no room: one group is buffered
        batch = asyncio.create_task(orchestrator._take_groups(1))  # batch 1 needs version 1
        try:
            await asyncio.wait_for(waiting, 5)
            return orchestrator.buffered_groups == 0
        finally:
            batch.cancel()

    assert asyncio.run(scenario())
