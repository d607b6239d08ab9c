"""The online loop against a real server (real HTTP) and real stores: feedback on the deployed
version becomes a gated update that the server hot-swaps; a regressing candidate is discarded
and forgotten; rollback serves an earlier version again and the loop adopts it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.online.online_fixtures import NO_GATE, wait_for_version
from tests.utils.tracking_support import assert_tracked
from whetstone.envs.tasks.synth import SynthConfig, generate
from whetstone.online.loop import OnlineLoop
from whetstone.online.preferences import MatchesPattern
from whetstone.online.weights import load_version, rollback
from whetstone.store.feedback import FeedbackStore
from whetstone.sync import WeightStore
from whetstone.utils.device import resolve_device
from whetstone.utils.metrics import read_metrics


@pytest.mark.parametrize(
    "world", [NO_GATE, pytest.param({**NO_GATE, "device": "cuda"}, marks=pytest.mark.gpu)], indirect=True
)
def test_feedback_becomes_a_version_the_server_swaps_in(world):
    device = resolve_device(world.config.device)  # the policy trains there, the gate's engine runs there
    assert next(world.loop.model.parameters()).device == world.loop.gate.engine.device == device
    assert not world.loop.due()
    world.feedback(16)
    assert world.loop.due()  # trigger.every_events = 16
    record = world.loop.update()
    assert record["decision"] == "published" and record["version"] == 1 and record["version_before"] == 0
    assert record["events"] == record["kept"] == 16 and record["staleness_0"] == 16
    assert record["loss"] == record["loss"] and record["tokens"] > 0 and record["last_rated_at"] > 0
    wait_for_version(world.url, 1)
    assert set(world.greedy()["weight_versions"]) == {1}  # the server answers with the new weights
    assert not world.loop.due()  # that feedback is consumed


def test_the_gate_allows_a_drop_of_exactly_its_threshold():
    from types import SimpleNamespace

    from whetstone.online.config import GateConfig
    from whetstone.online.gate import Gate

    gate = SimpleNamespace(config=GateConfig(max_regression=0.05, max_total_regression=0.1))
    assert Gate.verdict(gate, 7 / 20, 8 / 20, 8 / 20).publish  # 8 of 20 answers liked, then 7
    assert not Gate.verdict(gate, 0.45, 0.55, 0.55).publish
    assert not Gate.verdict(gate, 0.45, 0.45, 0.6).publish


@pytest.mark.parametrize(
    "world",
    [
        {
            "rewards": {"thumbs_up": -1.0, "thumbs_down": 1.0},
            "logit_scale_lr": 0.05,
            "optimizer": {"lr": 1e-2, "warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay": 0.0},
        }
    ],
    indirect=True,
)
def test_a_regressing_candidate_is_discarded_and_forgotten(world):
    # A mis-specified reward (thumbs up punished) pushes away from what the held-out metric likes.
    world.feedback(32)
    record = world.loop.update()
    assert record["decision"] == "discarded" and "max_regression" in record["reason"]
    assert record["gate_score"] < record["deployed_score"] - 0.05
    assert WeightStore.open(world.config.sync).latest() == 0 and record["version"] == 0
    deployed = load_version(WeightStore.open(world.config.sync), world.config.sync, 0)
    policy = world.loop.model.state_dict()
    assert all(torch.equal(policy[name], deployed[name]) for name in deployed)  # back to the deployed weights
    assert world.loop.optimizer.state_dict()["state"] == {}  # and to the optimizer before the step
    assert world.loop.logit_scale.steps == 0 and world.loop.logit_scale.log_scale == 0.0  # and its scale


@pytest.mark.parametrize(
    "world", [NO_GATE | {"trigger": {"every_events": 8, "min_events": 8, "max_events": 8}}], indirect=True
)
def test_a_backlog_of_feedback_gone_stale_is_read_past_to_the_fresh_events(world):
    # Users rate faster than updates land: 24 events on version 0, 8 per update.
    world.feedback(24)
    assert world.loop.update()["version"] == 1  # events 0-7
    second = world.loop.update()  # events 8-15: one version behind, within the bound (1)
    assert second["version"] == 2 and second["staleness_1"] == 8 and second["passed_stale"] == 0
    wait_for_version(world.url, 2)
    world.feedback(8)  # on version 2, behind events 16-23 (version 0: two behind, never trainable)
    third = world.loop.update()
    assert third["passed_stale"] == 8 and third["dropped_stale"] == 0
    assert third["decision"] == "published" and third["events"] == third["staleness_0"] == 8  # the fresh ones
    assert not world.loop.due() and world.loop.read_feedback() == ([], 0)  # every event read exactly once


def test_nothing_to_learn_is_skipped_with_the_reason(world):
    world.users.temperature = 0.0  # greedy replies: a point mass, no policy to take a gradient of
    world.feedback(16)
    record = world.loop.update()
    assert record["decision"] == "skipped" and record["dropped_truncated"] == 16
    assert "no usable feedback" in record["reason"]
    world.users.temperature = 1.0
    world.users.preference = MatchesPattern(".")  # every reply liked: no reward variance
    world.feedback(16)
    record = world.loop.update()
    assert record["decision"] == "skipped" and "no reward variance" in record["reason"]


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_rollback_serves_an_earlier_version_and_the_loop_adopts_it(world):
    before = world.greedy()
    world.feedback(16)
    assert world.loop.update()["version"] == 1
    wait_for_version(world.url, 1)

    manifest = rollback(world.config.sync, 0)
    assert manifest.version == 2 and manifest.kind == "full"
    wait_for_version(world.url, 2)
    again = world.greedy()
    assert again["token_ids"] == before["token_ids"] and set(again["weight_versions"]) == {2}

    world.feedback(16)
    record = world.loop.update()
    assert record["adopted"] == 2 and record["version_before"] == 2
    assert record["dropped_stale"] == 0  # this feedback was given on version 2


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_after_a_rollback_staleness_counts_updates_between_the_weights(world):
    # v0 -> v1 (an update) -> v2 = a rollback to v0: replies sampled by v0 are sampled by the
    # deployed weights exactly; replies of the rolled-back v1 are one update away from them
    tasks = generate(SynthConfig(count=12, split="train", seed=3))
    on_v0 = [world.users.ask(task, give_feedback=False) for task in tasks[:8]]
    rate(world, on_v0[:4])
    assert world.loop.update()["version"] == 1
    wait_for_version(world.url, 1)
    on_v1 = [world.users.ask(task, give_feedback=False) for task in tasks[8:]]
    assert rollback(world.config.sync, 0).republishes == 0
    wait_for_version(world.url, 2)
    rate(world, on_v0[4:] + on_v1)
    record = world.loop.update()
    assert record["adopted"] == 2 and record["events"] == 8 and record["passed_stale"] == 0
    assert record["staleness_0"] == 4 and record["staleness_1"] == 4  # v0's replies on-policy, v1's one away


@pytest.mark.parametrize("world", [NO_GATE | {"sync": {"keyframe_interval": 1, "keep_keyframes": 10}}], indirect=True)
def test_a_restarted_loop_knows_a_rollback_whose_manifest_was_collected_while_it_was_stopped(world):
    # v0 -> v1 (an update) -> v2 = a rollback to v0 -> v3 (the loop's update of v2); the loop stops
    # and the store collects every version but v3, the rollback's manifest with them
    tasks = generate(SynthConfig(count=8, split="train", seed=3))
    world.feedback(16)
    assert world.loop.update()["version"] == 1
    wait_for_version(world.url, 1)
    on_v1 = [world.users.ask(task, give_feedback=False) for task in tasks[:4]]
    assert rollback(world.config.sync, 0).republishes == 0
    wait_for_version(world.url, 2)
    on_v2 = [world.users.ask(task, give_feedback=False) for task in tasks[4:]]
    world.feedback(16)  # rated replies of v2
    record = world.loop.update()
    assert record["adopted"] == 2 and record["staleness_0"] == 16 and record["version"] == 3
    assert WeightStore.open(world.config.sync).collect_garbage(keep_keyframes=1) == [0, 1, 2]

    path = Path(world.config.output_dir) / "state.json"
    state = json.loads(path.read_text())
    assert state["lineage"] == {"newest_read": 3, "weights": {"0": 0, "1": 1, "2": 0, "3": 3}}
    path.write_text(json.dumps({key: value for key, value in state.items() if key != "lineage"}))
    assert OnlineLoop(world.config).behind([2]) == 2  # a state.json without it loads; v2 is unknown then
    path.write_text(json.dumps(state))
    restarted = OnlineLoop(world.config)
    rate(world, on_v1 + on_v2)
    record = restarted.update()
    # v2's replies: one update from v3 (v0's weights, then v3), within the bound of 1; the
    # rolled-back v1's: two (v1, v0, v3), beyond it
    assert record["passed_stale"] == 4 and record["events"] == record["staleness_1"] == 4


def rate(world, exchanges) -> None:
    """Post each exchange's rating (a thumbs up if the user liked the reply)."""
    for exchange in exchanges:
        answer = world.users.client.post(
            f"{world.url}/feedback",
            json={"id": exchange.response_id, "rating": "thumbs_up" if exchange.liked else "thumbs_down"},
        )
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_a_rollback_that_lands_during_an_update_wins_the_version(world, monkeypatch):
    world.feedback(16)
    assert world.loop.update()["version"] == 1
    score = world.loop.gate.score

    def score_during_a_rollback(weights, version):  # the operator rolls back while the gate runs
        result = score(weights, version)
        if version == 2:
            rollback(world.config.sync, 0)
        return result

    monkeypatch.setattr(world.loop.gate, "score", score_during_a_rollback)
    before = {name: tensor.clone() for name, tensor in world.loop.model.state_dict().items()}
    world.feedback(16)
    record = world.loop.update()
    assert (
        record["decision"] == "discarded"
        and "the weight store moved past version 1 during the update" in record["reason"]
    )
    weights = WeightStore.open(world.config.sync)
    assert weights.latest() == 2 and weights.manifest(2).kind == "full"  # the rollback's version 2
    assert all(torch.equal(tensor, before[name]) for name, tensor in world.loop.model.state_dict().items())
    world.feedback(16)
    assert world.loop.update()["adopted"] == 2


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_feedback_on_replies_sampled_at_temperature_0_7_is_trained_at_that_temperature(world):
    world.users.temperature = 0.7
    world.feedback(16)
    record = world.loop.update()
    assert record["kept"] == 16 and record["dropped_truncated"] == 0 and record["decision"] == "published"
    # The trainer's logprobs are of logits / 0.7, as the server's were (same weights, fast numerics).
    assert record["logprob_diff_max"] < 1e-4 and record["clip_fraction"] == 0.0


@pytest.mark.parametrize("world", [NO_GATE | {"numerics": "invariant"}], indirect=True)
def test_the_gate_and_the_train_step_use_the_configured_numerics(world):
    assert world.loop.gate.engine.config.numerics == "invariant"
    world.feedback(16)
    record = world.loop.update()
    # A server on invariant numerics too: the train step's logprobs are the served ones, bit for bit.
    assert record["kept"] == 16 and record["logprob_diff_max"] == 0.0 and record["mismatch_kl_k3"] == 0.0


@pytest.mark.parametrize("world", [NO_GATE | {"retention_days": 1e-6}], indirect=True)  # 0.0864 s
def test_responses_the_loop_has_read_are_pruned_once_old(world):
    world.feedback(16)
    time.sleep(0.1)
    record = world.loop.update()
    assert record["kept"] == 16  # read before pruning
    assert record["pruned_responses"] == record["pruned_feedback"] == 15  # the newest event stays
    store = FeedbackStore.open(world.config.feedback_store)
    assert store.count_after(0) == 1
    world.feedback(16)  # new events are numbered after the cursor, and the loop reads all of them
    assert world.loop.due() and world.loop.update()["events"] == 16


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_a_restarted_loop_continues_from_the_store_and_its_cursor(world):
    world.feedback(16)
    world.loop.update()
    again = OnlineLoop(world.config)
    store_id = FeedbackStore.open(world.config.feedback_store).marks().store_id
    assert again.version == 1 and again.state == {"cursor": 16, "updates": 1, "store": store_id}
    assert not again.due()
    state = json.loads((Path(world.config.output_dir) / "state.json").read_text())
    assert state.pop("lineage") == {"newest_read": 1, "weights": {"0": 0, "1": 1}}
    digest = WeightStore.open(world.config.sync).manifest_digest(1)
    where = str(Path(world.config.sync.store).resolve())
    assert state.pop("weight_store") == {"store": where, "version": 1, "manifest": digest} and state == again.state


@pytest.mark.slow  # about 8 s on an idle machine, 15+ s when the cores are shared
def test_preference_rises_on_held_out_prompts_with_the_gate_on(world):
    """The demo: users like replies that start with code; after three gated updates on their
    feedback, held-out prompts (never rated) get such replies more often."""
    held_out = generate(SynthConfig(count=16, split="heldout", seed=5))
    before = world.users.preference_rate(held_out, samples=2)
    decisions = []
    for _ in range(3):
        world.feedback(24)
        record = world.loop.update()
        decisions.append(record["decision"])
        wait_for_version(world.url, world.loop.version)
    after = world.users.preference_rate(held_out, samples=2)
    assert decisions.count("published") >= 2
    assert after >= before + 0.15, (before, after, decisions)
    assert FeedbackStore.open(world.config.feedback_store).count_after(0) == 3 * 24  # measuring gave no feedback


def test_run_writes_a_metrics_record_per_update(world):
    import os
    import stat

    world.feedback(16)
    umask = os.umask(0o022)
    try:
        summary = OnlineLoop(world.config.model_copy(update={"max_updates": 1})).run()
    finally:
        os.umask(umask)
    assert summary["updates"] == 1
    written = Path(world.config.output_dir) / "config.toml"  # the feedback store's password, if any, as given
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    [record] = read_metrics(Path(world.config.output_dir) / "metrics.jsonl")
    assert record["decision"] in ("published", "discarded") and record["reason"]
    assert_tracked(Path(world.config.output_dir) / "tensorboard" / "online", [record], step_key="update")
    assert httpx.get(world.url.removesuffix("/v1") + "/health").status_code == 200
