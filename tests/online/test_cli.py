"""`whetstone online [CONFIG]` and `whetstone online rollback VERSION`, and the configs they read."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from typer.testing import CliRunner

from tests.online.online_fixtures import API_KEY, USER_TASKS, online_config, running_server
from whetstone.config import dump_toml
from whetstone.envs.tasks.synth import generate
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.inference.config import EngineConfig, ServeConfig
from whetstone.inference.launch import build_app
from whetstone.online.cli import app
from whetstone.online.config import OnlineConfig
from whetstone.online.preferences import MatchesPattern
from whetstone.online.simulator import UserSimulator
from whetstone.online.weights import Lineage, load_version, rollback
from whetstone.sync import Publisher, SyncConfig, WeightStore


def weights_with_versions(tmp_path, count: int) -> SyncConfig:
    sync = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="float32")
    publisher = Publisher(WeightStore.open(sync), sync)
    for version in range(count):
        publisher.publish({"w": torch.full((4, 4), float(version)), "b": torch.arange(3)})
    return sync


def test_rollback_republishes_an_earlier_version_as_the_newest(tmp_path):
    sync = weights_with_versions(tmp_path, 3)
    result = CliRunner().invoke(app, ["rollback", "1", "--set", f"sync.store={sync.store}"])
    assert result.exit_code == 0, result.output
    assert "version 1 republished as version 3" in result.stdout
    store = WeightStore.open(sync)
    assert store.latest() == 3 and store.manifest(3).kind == "full"
    assert torch.equal(load_version(store, sync, 3)["w"], torch.full((4, 4), 1.0))


def test_rollback_republishes_a_version_with_its_bits_whatever_the_publish_dtype(tmp_path):
    # an embedding table published in fp32 beside bf16 matrices (publish_dtype = "autocast"):
    # republished as it is, not rounded by the dtype the store is configured with
    sync = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="autocast")
    publisher = Publisher(WeightStore.open(sync), sync, tables=frozenset({"embed_tokens.weight"}))
    table = torch.randn(8, 4)
    for version in range(2):
        publisher.publish({"embed_tokens.weight": table + version, "proj.weight": torch.randn(4, 4)})
    rollback(sync, 0)
    store = WeightStore.open(sync)
    again, first = load_version(store, sync, 2), load_version(store, sync, 0)
    assert again["embed_tokens.weight"].dtype == torch.float32 and torch.equal(again["embed_tokens.weight"], table)
    assert all(torch.equal(again[name], first[name]) and again[name].dtype == first[name].dtype for name in first)


def test_rollback_refuses_what_it_cannot_do(tmp_path):
    sync = weights_with_versions(tmp_path, 2)
    missing = CliRunner().invoke(app, ["rollback", "7", "--set", f"sync.store={sync.store}"])
    assert isinstance(missing.exception, WhetstoneError)
    assert str(missing.exception) == f"version 7 is newer than the latest (1) in the weight store {sync.store}"
    newest = CliRunner().invoke(app, ["rollback", "1", "--set", f"sync.store={sync.store}"])
    assert str(newest.exception) == f"version 1 is already the newest in the weight store {sync.store}"
    negative = CliRunner().invoke(app, ["rollback", "--set", f"sync.store={sync.store}", "--", "-1"])
    assert str(negative.exception) == "there is no version -1: versions are numbered from 0"
    (tmp_path / "empty").mkdir()
    empty = CliRunner().invoke(app, ["rollback", "0", "--set", f"sync.store={tmp_path / 'empty'}"])
    assert "is empty" in str(empty.exception)


def test_a_rollback_names_the_weights_it_republishes_and_staleness_follows_them(tmp_path):
    sync = weights_with_versions(tmp_path, 4)  # v0 -> v1 -> v2 -> v3, each an update of the one before
    sync = sync.model_copy(update={"keep_keyframes": 10})  # every rollback is a keyframe: keep them all
    assert rollback(sync, 1).republishes == 1  # v4: v1's weights
    store = WeightStore.open(sync)
    Publisher(store, sync).publish({"w": torch.zeros(4, 4), "b": torch.arange(3)})  # v5: an update of v4
    assert rollback(sync, 4).republishes == 1  # v6: v4's weights, which are v1's
    assert store.manifest(5).republishes is None
    assert b"republishes" not in (tmp_path / "weights" / "versions" / "0000000005" / "manifest.json").read_bytes()
    lineage = Lineage(store)
    # updates between the weights (version numbers would say 6 5 4 3 2 1 0, and 5 4 3 2 1 0)
    assert [lineage.behind(6, [v], limit=4) for v in range(7)] == [1, 0, 1, 2, 0, 1, 0]
    assert [lineage.behind(5, [v], limit=4) for v in range(6)] == [2, 1, 2, 3, 1, 0]
    assert lineage.behind(6, [3], limit=1) == 2  # beyond the bound: limit + 1
    assert lineage.behind(6, [1, 1, 3], limit=4) == 2  # a reply across versions: its farthest
    assert lineage.behind(3, [0], limit=4) == 3 and lineage.behind(3, [], limit=0) == 0


def test_a_rollback_collected_before_it_was_read_leaves_replies_across_it_unknown_not_fresh(tmp_path, caplog):
    # v0 -> ... -> v9, v10 = a rollback to v1, v11 = an update of v10 whose publish collects v0..v10
    sync = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="float32", keep_keyframes=20)
    publisher = Publisher(WeightStore.open(sync), sync)
    for version in range(10):
        publisher.publish({"w": torch.full((4, 4), float(version)), "b": torch.arange(3)})
    store, lineage = WeightStore.open(sync), Lineage(WeightStore.open(sync))
    assert lineage.behind(9, [9, 8], limit=2) == 1  # the loop deployed v9, and read its manifests
    assert rollback(sync, 1).republishes == 1
    collecting = sync.model_copy(update={"keyframe_interval": 1, "keep_keyframes": 1})
    Publisher(store, collecting).publish({"w": torch.zeros(4, 4), "b": torch.arange(3)})
    assert store.versions() == [11]
    assert lineage.weights_of(11) == 11  # the loop adopts v11; v10's manifest, the rollback's, is gone
    # a reply of the rolled-back v9 is 9 updates from v11 (v9 -> v1 -> v11), not 2 (v9 -> v10 -> v11)
    with caplog.at_level(logging.WARNING, logger="whetstone.online"):
        assert lineage.behind(11, [9], limit=2) == 3  # beyond the bound
        assert lineage.behind(11, [10], limit=2) == 3  # unknown: counted beyond it too
    assert "version 10's manifest is gone from the weight store" in caplog.text
    assert lineage.behind(11, [11], limit=2) == 0


def test_a_lineage_restored_from_its_state_knows_rollbacks_whose_manifests_were_collected(tmp_path):
    # v0 -> v1 -> v2 -> v3, v4 = a rollback to v1, v5 = an update of v4; every version a keyframe
    sync = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="float32", keyframe_interval=1, keep_keyframes=10)
    store = WeightStore.open(sync)
    publisher = Publisher(store, sync)
    for version in range(4):
        publisher.publish({"w": torch.full((4, 4), float(version))})
    assert rollback(sync, 1).republishes == 1
    Publisher(store, sync).publish({"w": torch.zeros(4, 4)})
    lineage = Lineage(store)
    assert [lineage.behind(5, [v], limit=2) for v in range(6)] == [2, 1, 2, 3, 1, 0]
    # bounded: v0 is 2 updates from v5's weights, past the bound of 1, so no reply counted within it asks about v0
    state = json.loads(json.dumps(lineage.state(5, limit=1)))  # as state.json holds it
    assert state == {"newest_read": 5, "weights": {"1": 1, "2": 2, "3": 3, "4": 1, "5": 5}}
    assert store.collect_garbage(keep_keyframes=1) == [0, 1, 2, 3, 4]

    assert Lineage(store).behind(5, [4], limit=1) == 2  # read anew: the rollback v4 is unknown
    restarted = Lineage(store)
    restarted.restore(state)
    assert [restarted.behind(5, [v], limit=1) for v in range(6)] == [2, 1, 2, 2, 1, 0]
    assert restarted.state(5, limit=1) == state  # saved again, as it was

    # a store that does not answer as the state is saved (v6 published since, not read yet)
    Publisher(store, sync).publish({"w": torch.ones(4, 4)})

    def down(version):
        raise OSError("the weight store's disk is not mounted")

    restarted.store.manifest = down
    assert restarted.state(6, limit=1)["weights"] == state["weights"]  # all kept: the next save prunes


def test_rollback_to_a_collected_version_says_so(tmp_path):
    sync = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="float32", keyframe_interval=1, keep_keyframes=1)
    publisher = Publisher(WeightStore.open(sync), sync)
    for version in range(3):
        publisher.publish({"w": torch.full((4, 4), float(version))})
    assert WeightStore.open(sync).versions() == [2]
    with pytest.raises(WhetstoneError) as gone:
        rollback(sync, 0)
    assert str(gone.value) == (
        f"version 0 is not in the weight store {sync.store} (stored versions: 2..2; "
        "older ones were garbage-collected, see sync.keep_keyframes)"
    )


def test_rollback_to_a_version_missing_a_chunk_names_it(tmp_path):
    sync = weights_with_versions(tmp_path, 3)
    (chunk,) = (tmp_path / "weights" / "versions" / "0000000001").glob("*/chunk-*.bin")
    chunk.unlink()
    with pytest.raises(WhetstoneError) as missing:
        load_version(WeightStore.open(sync), sync, 1)
    assert "version 1 cannot be rebuilt" in str(missing.value) and chunk.name in str(missing.value)


def test_rollback_refuses_a_store_that_does_not_exist(tmp_path):
    missing = tmp_path / "wieghts"
    result = CliRunner().invoke(app, ["rollback", "0", "--set", f"sync.store={missing}"])
    assert isinstance(result.exception, WhetstoneError)
    assert f"no store at {missing}: the directory does not exist" in str(result.exception)
    assert not missing.exists()


def test_the_loop_runs_without_a_subcommand(tmp_path, two_style_dir):
    config = online_config(tmp_path, two_style_dir)
    config_file = tmp_path / "online.toml"
    config_file.write_text(dump_toml(config))
    serve = ServeConfig(
        model_path=str(two_style_dir),
        threads=1,
        default_max_tokens=8,
        auth_token=API_KEY,
        feedback={"store": config.feedback_store},
        engine=EngineConfig(max_batch=4, context_limit=512),
    )
    with running_server(build_app(serve)) as url:
        users = UserSimulator([url], "two-style", API_KEY, MatchesPattern("^def"), max_tokens=8, seed=0)
        users.run(generate(USER_TASKS), requests=16)
    result = CliRunner().invoke(app, [str(config_file), "--set", "max_updates=1", "--set", "nice=0", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["updates"] == 1 and summary["published"] + summary["discarded"] == 1


def test_a_model_that_does_not_load_leaves_no_folder_behind(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output_dir and stores are under runs/default
    result = CliRunner().invoke(app, ["--set", "model_path=no-model", "--set", "nice=0"])
    assert isinstance(result.exception, WhetstoneError) and "no-model/config.json does not exist" in str(
        result.exception
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "override, named",
    [
        ("trigger.every_events=0", "every_events"),
        ("trigger.min_events=64", "min_events"),
        ("gate.metric.kind=regex", "needs a pattern"),
        ("gate.metric.pattern=(", "not a regular expression"),
        ("baseline=median", "baseline"),
    ],
)
def test_bad_config_values_are_named(override, named):
    result = CliRunner().invoke(
        app, ["--set", override] + (["--set", "gate.metric.kind=regex"] if "pattern" in override else [])
    )
    assert isinstance(result.exception, ConfigError) and named in str(result.exception)


def test_defaults_are_the_embedded_default_run():
    config = OnlineConfig()
    assert config.sync.store == "runs/default/weights" and config.feedback_store == "runs/default/feedback.db"
    assert config.gate.tasks.synth.split == "heldout"
