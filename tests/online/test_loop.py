"""The online loop against a real server (real HTTP) and real stores: feedback on the deployed
version becomes a gated update that the server hot-swaps; a regressing candidate is discarded
and forgotten; rollback serves an earlier version again and the loop adopts it."""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from tests.online.online_fixtures import (
    API_KEY, HELDOUT_TASKS, PREFERS_CODE, USER_TASKS, online_config, running_server, wait_for_version,
)
from whetstone.envs.tasks.synth import SynthConfig, generate
from whetstone.inference.config import EngineConfig, ServeConfig
from whetstone.inference.launch import build_app
from whetstone.online.config import OnlineConfig
from whetstone.online.loop import OnlineLoop
from whetstone.online.preferences import MatchesPattern, task_messages
from whetstone.online.simulator import UserSimulator
from whetstone.online.store import FeedbackStore
from whetstone.online.weights import load_version, rollback
from whetstone.sync import WeightStore
from whetstone.utils.metrics import read_metrics


@dataclass
class World:
    """One server following the weight store and keeping feedback, the loop, and its users."""

    config: OnlineConfig
    url: str
    loop: OnlineLoop
    users: UserSimulator

    def feedback(self, requests: int = 16, **ask) -> None:
        self.users.run(generate(USER_TASKS), users=2, requests=requests, **ask)

    def greedy(self) -> list[str]:
        body = {"model": "two-style", "messages": task_messages(generate(USER_TASKS)[0]), "max_tokens": 12,
                "temperature": 0, "return_token_ids": True}
        answer = self.users.client.post(f"{self.url}/chat/completions", json=body).json()
        return answer["choices"][0]


@pytest.fixture
def world(tmp_path, two_style_dir, request):
    changes = getattr(request, "param", {})
    config = online_config(tmp_path, two_style_dir, **changes)
    serve = ServeConfig(model_path=str(two_style_dir), threads=1, default_max_tokens=12, auth_token=API_KEY,
                        sync=config.sync, feedback={"store": config.feedback_store},
                        engine=EngineConfig(max_batch=8, context_limit=512))  # fmt: skip
    loop = OnlineLoop(config)  # publishes version 0 into the empty store
    with ExitStack() as stack:
        url = stack.enter_context(running_server(build_app(serve)))
        users = UserSimulator([url], "two-style", API_KEY, MatchesPattern(PREFERS_CODE), max_tokens=12, seed=0)
        stack.callback(users.close)
        yield World(config, url, loop, users)


NO_GATE = {"gate": {"tasks": {"synth": HELDOUT_TASKS.model_dump()}, "max_tokens": 12, "max_regression": 1.0,
                    "max_total_regression": 1.0, "metric": {"kind": "regex", "pattern": PREFERS_CODE}}}


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_feedback_becomes_a_version_the_server_swaps_in(world):
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


@pytest.mark.parametrize("world", [{"rewards": {"thumbs_up": -1.0, "thumbs_down": 1.0},
                                    "optimizer": {"lr": 1e-2, "warmup_steps": 0, "min_lr_ratio": 1.0,
                                                  "weight_decay": 0.0}}], indirect=True)  # fmt: skip
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


def test_nothing_to_learn_is_skipped_with_the_reason(world):
    world.users.temperature = 0.7  # behavior logprobs of a tempered distribution: not trainable
    world.feedback(16)
    record = world.loop.update()
    assert record["decision"] == "skipped" and record["dropped_tempered"] == 16
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
def test_a_restarted_loop_continues_from_the_store_and_its_cursor(world):
    world.feedback(16)
    world.loop.update()
    again = OnlineLoop(world.config)
    assert again.version == 1 and again.state == {"cursor": 16, "updates": 1}
    assert not again.due()
    state = json.loads((Path(world.config.output_dir) / "state.json").read_text())
    assert state == again.state


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
    world.feedback(16)
    summary = OnlineLoop(world.config.model_copy(update={"max_updates": 1})).run()
    assert summary["updates"] == 1
    [record] = read_metrics(Path(world.config.output_dir) / "metrics.jsonl")
    assert record["decision"] in ("published", "discarded") and record["reason"]
    assert httpx.get(world.url.removesuffix("/v1") + "/health").status_code == 200
