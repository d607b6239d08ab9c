"""The trainer process: batches 0..N from a store in, weight versions 1..N+1 out, checkpoints,
and a kill -9 followed by a restart that neither loses nor repeats a batch."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.trainer_fixtures import make_batches, put_batches, save_tiny_moe, trainer_config
from tests.utils.tracking_support import event_scalars, jsonl_scalars
from whetstone.config import dump_toml
from whetstone.errors import CheckpointError, ConfigError, WhetstoneError
from whetstone.model.hf import load_hf
from whetstone.rl.batch import batch_from_bytes, batch_to_bytes
from whetstone.rl.batch_store import batch_key
from whetstone.store import LocalStore
from whetstone.sync import Subscriber, SyncConfig, WeightStore
from whetstone.tokenizer import Tokenizer
from whetstone.trainer import loop
from whetstone.trainer.loop import read_batch_rank_0_read, run_trainer, wait_for_batch
from whetstone.training.checkpoint import latest_checkpoint
from whetstone.utils.metrics import read_metrics


def checkpoint_weights(root) -> dict[str, torch.Tensor]:
    return load_file(str(latest_checkpoint(root / "trainer" / "checkpoints") / "model.safetensors"))


def subscribe(root) -> Subscriber:
    subscriber = Subscriber(WeightStore.open(SyncConfig(store=str(root / "weights"))), SyncConfig())
    subscriber.poll()
    return subscriber


def test_the_loop_trains_on_each_batch_in_order_and_publishes_every_step(tmp_path, tiny_moe, batches):
    # No batch yet: the trainer publishes the initial weights as version 0 and, idle, stops.
    assert run_trainer(trainer_config(tmp_path, tiny_moe))["version"] == 0
    initial, version0 = load_hf(tiny_moe).state_dict(), subscribe(tmp_path)
    assert version0.version == 0 and all(torch.equal(initial[name], version0.state[name]) for name in initial)

    put_batches(tmp_path / "batches", batches[:3])
    summary = run_trainer(trainer_config(tmp_path, tiny_moe))  # stops when no batch 3 comes (idle_timeout)
    assert summary["step"] == 3 and summary["version"] == 3

    store = WeightStore.open(SyncConfig(store=str(tmp_path / "weights")))
    assert store.versions() == [0, 1, 2, 3] and store.manifest(0).kind == "full"
    # (fp32 at lr 1e-2 changes every value: the publisher may well choose full versions; either way)
    assert all(m.kind == "full" or m.base == m.version - 1 for m in map(store.manifest, (1, 2, 3)))
    # A server following the store holds, bit for bit, what the trainer checkpointed at the end.
    latest, trained = subscribe(tmp_path), checkpoint_weights(tmp_path)
    assert latest.version == 3 and all(torch.equal(trained[name], latest.state[name]) for name in trained)

    records = read_metrics(tmp_path / "trainer" / "metrics.jsonl")
    assert [(r["step"], r["version"], r["replayed"]) for r in records] == [(0, 1, False), (1, 2, False), (2, 3, False)]
    assert records[0]["reward_mean"] == batches[0].meta["reward_mean"] and records[0]["mismatch_kl_k3"] < 1e-9
    assert all(r["delta_bytes"] > 0 and 0 <= r["busy"] <= 1 for r in records)
    assert latest_checkpoint(tmp_path / "trainer" / "checkpoints").name == "step_00000003"


def test_a_steps_version_is_published_while_the_next_step_trains(tmp_path, tiny_moe, batches, monkeypatch):
    # Each background publish but the last is held until the next step's training has begun: a
    # trainer that published inline could never let that happen (each wait would time out).
    from whetstone.sync import Publisher
    from whetstone.trainer import loop

    put_batches(tmp_path / "batches", batches[:3])
    began = [threading.Event() for _ in range(3)]  # training of step 0, 1, 2 began
    saw_next_step: dict[int, bool] = {}
    real_train_step, real_publish = loop.train_step, Publisher._publish_prepared
    calls = iter(range(3))

    def train_step(*args, **kwargs):
        began[next(calls)].set()
        return real_train_step(*args, **kwargs)

    def publish(self, new, full, started, *rest):
        version = self._previous_manifest.version + 1 if self._previous_manifest else 0
        if 1 <= version <= 2:  # version n + 1 comes from step n: wait for step n + 1
            saw_next_step[version] = began[version].wait(timeout=60)
        return real_publish(self, new, full, started, *rest)

    monkeypatch.setattr(loop, "train_step", train_step)
    monkeypatch.setattr(Publisher, "_publish_prepared", publish)
    summary = run_trainer(trainer_config(tmp_path, tiny_moe))
    assert saw_next_step == {1: True, 2: True} and summary["version"] == 3

    records = read_metrics(tmp_path / "trainer" / "metrics.jsonl")
    assert [(r["step"], r["version"]) for r in records] == [(0, 1), (1, 2), (2, 3)]
    assert all(0 <= r["publish_s"] and 0 < r["publish_total_s"] and 0 <= r["busy"] <= 1 for r in records)
    latest, trained = subscribe(tmp_path), checkpoint_weights(tmp_path)
    assert latest.version == 3 and all(torch.equal(trained[name], latest.state[name]) for name in trained)


def test_publishing_inline_gives_the_same_versions(tmp_path, tiny_moe, batches):
    put_batches(tmp_path / "batches", batches[:2])
    assert run_trainer(trainer_config(tmp_path, tiny_moe, publish_in_background=False))["version"] == 2
    records = read_metrics(tmp_path / "trainer" / "metrics.jsonl")
    assert [(r["step"], r["version"]) for r in records] == [(0, 1), (1, 2)]
    assert all(r["publish_s"] >= r["publish_total_s"] > 0 for r in records)
    latest, trained = subscribe(tmp_path), checkpoint_weights(tmp_path)
    assert all(torch.equal(trained[name], latest.state[name]) for name in trained)


def test_a_failed_background_publish_fails_the_trainer_and_still_records_the_steps_before(
    tmp_path, tiny_moe, batches, monkeypatch
):
    from whetstone.sync import Publisher

    put_batches(tmp_path / "batches", batches[:3])
    real_publish = Publisher._publish_prepared

    def publish(self, new, full, started, *rest):
        if self._previous_manifest is not None and self._previous_manifest.version == 1:
            raise OSError("the weight store's disk is full")
        return real_publish(self, new, full, started, *rest)

    monkeypatch.setattr(Publisher, "_publish_prepared", publish)
    with pytest.raises(OSError, match="disk is full"):
        run_trainer(trainer_config(tmp_path, tiny_moe))
    records = read_metrics(tmp_path / "trainer" / "metrics.jsonl")
    assert [(r["step"], r["version"]) for r in records] == [(0, 1)]
    assert WeightStore.open(SyncConfig(store=str(tmp_path / "weights"))).latest() == 1


REPORTED = ["reward_mean", "mismatch_kl_k3", "routing_disagreement", "logprob_diff_max", "version", "delta_bytes"]
"""Trainer metrics the report plots or tabulates (run/report.py)."""


def test_the_report_and_tensorboard_show_the_same_trainer_metrics(tmp_path, tiny_moe, batches):
    from whetstone.run.report import load_run

    put_batches(tmp_path / "batches", batches[:2])
    run_trainer(trainer_config(tmp_path, tiny_moe))
    reported = load_run(tmp_path).trainer  # what the report reads: trainer/metrics.jsonl
    events = event_scalars(tmp_path / "trainer" / "tensorboard" / "trainer")
    assert [r["step"] for r in reported] == [0, 1]
    for key in REPORTED:
        assert events[key] == jsonl_scalars(reported, key), key
    for bucket, count in reported[0]["staleness_histogram"].items():
        assert events[f"staleness_histogram/{bucket}"][0][:2] == (0, count)


TRAINER_PROCESS = "from whetstone.trainer.cli import app; app(['trainer', {path!r}])"


def wait_until(condition, process, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the trainer exited early: {process.stderr.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, "timed out waiting for the trainer"
        time.sleep(0.05)


def test_a_killed_trainer_resumes_without_losing_or_repeating_a_batch(tmp_path, tiny_moe, batches):
    # The uninterrupted run: 7 batches, 7 steps.
    put_batches(tmp_path / "straight" / "batches", batches)
    run_trainer(trainer_config(tmp_path / "straight", tiny_moe, max_steps=7))

    # The interrupted one, in its own process: 5 batches are there; it checkpoints after step 3,
    # publishes versions up to 5, then waits for batch 5 and is killed (-9) while it waits.
    root = tmp_path / "killed"
    put_batches(root / "batches", batches[:5])
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(trainer_config(root, tiny_moe, max_steps=7, idle_timeout=0)))
    process = subprocess.Popen(
        [sys.executable, "-c", TRAINER_PROCESS.format(path=str(config_file))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        metrics = root / "trainer" / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and len(read_metrics(metrics)) == 5, process)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
    assert latest_checkpoint(root / "trainer" / "checkpoints").name == "step_00000003"

    # The restart: back to step 3, replays batches 3 and 4 (already published), then trains 5 and 6.
    put_batches(root / "batches", batches[5:], first=5)
    summary = run_trainer(trainer_config(root, tiny_moe, max_steps=7))
    assert summary["replayed"] == 2 and summary["step"] == 7 and summary["version"] == 7

    records = read_metrics(root / "trainer" / "metrics.jsonl")
    trained = [r["step"] for r in records if not r["replayed"]]
    published = [r["version"] for r in records if not r["replayed"]]
    assert trained == list(range(7)) and published == list(range(1, 8))
    assert [r["step"] for r in records if r["replayed"]] == [3, 4]
    assert records[-3]["replay_matches_store"] is True  # the replay rebuilt exactly what servers hold

    # Same weights as the uninterrupted run, in the checkpoint and in the store.
    straight, resumed = checkpoint_weights(tmp_path / "straight"), checkpoint_weights(root)
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
    followed = subscribe(root)
    assert followed.version == 7 and all(torch.equal(resumed[name], followed.state[name]) for name in resumed)


def another_vocabulary(batch):
    batch.input_ids[0, 1] = 100  # the tiny MoE has 64 tokens


def a_nan_behavior_logprob(batch):
    batch.behavior_logprobs[2, batch.loss_mask[2].nonzero()[0, 0]] = float("nan")


def a_shorter_loss_mask(batch):
    batch.loss_mask = batch.loss_mask[:, :-1]


def no_rows(batch):
    for name in ("input_ids", "target_ids", "loss_mask", "behavior_logprobs", "versions", "advantages", "routes"):
        setattr(batch, name, getattr(batch, name)[:0])
    batch.rows = []


@pytest.mark.parametrize(
    ("spoil", "error"),
    [
        (
            another_vocabulary,
            r"0000000001.batch in LocalStore\(.*\) holds token ids in \[0, 100\], but the model's "
            r"vocabulary is 0..63: the batch was made with another tokenizer or model",
        ),
        (
            a_nan_behavior_logprob,
            r"0000000001.batch in LocalStore\(.*\) has behavior_logprobs that are not finite at "
            r"trained positions of rows \[2\] \(tasks 'p0'\)",
        ),
        (
            a_shorter_loss_mask,
            r"0000000001.batch in LocalStore\(.*\) has loss_mask of shape \(\d+, \d+\), but input_ids",
        ),
        (no_rows, r"0000000001.batch in LocalStore\(.*\) has input_ids of shape \(0, \d+\)"),
    ],
)
def test_a_batch_the_model_cannot_train_on_is_refused_naming_it_before_the_weights_move(
    tmp_path, tiny_moe, batches, spoil, error
):
    bad = batch_from_bytes(batch_to_bytes(batches[1]))
    spoil(bad)
    put_batches(tmp_path / "batches", [batches[0], bad])
    with pytest.raises(WhetstoneError, match=error):
        run_trainer(trainer_config(tmp_path, tiny_moe))
    assert [r["step"] for r in read_metrics(tmp_path / "trainer" / "metrics.jsonl")] == [0]
    assert WeightStore.open(SyncConfig(store=str(tmp_path / "weights"))).latest() == 1


def test_a_batch_row_with_no_sampled_token_is_no_staleness_and_no_failure(tmp_path, tiny_moe, batches):
    # a row whose tokens no sampler gave (oldest_version None): the step's staleness_max is the other rows'
    unsampled = batch_from_bytes(batch_to_bytes(batches[1]))
    unsampled.loss_mask[0], unsampled.versions[0], unsampled.behavior_logprobs[0] = False, -1, 0.0
    unsampled.rows[0]["oldest_version"] = None
    put_batches(tmp_path / "batches", [batches[0], unsampled])
    assert run_trainer(trainer_config(tmp_path, tiny_moe))["step"] == 2
    records = read_metrics(tmp_path / "trainer" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert records[1]["staleness_max"] == max(1 - row["oldest_version"] for row in unsampled.rows[1:]) == 1


def test_a_replayed_batch_of_an_older_orchestrator_with_a_minus_inf_logprob_drops_those_rows(
    tmp_path, tiny_moe, batches, caplog
):
    # versions 1..3 published, then a restart from the checkpoint of step 1 replays batches 1 and 2;
    # batch 2 holds a -inf behavior logprob, as an orchestrator that did not drop such rollouts wrote it
    put_batches(tmp_path / "batches", batches[:3])
    config = trainer_config(tmp_path, tiny_moe, checkpoint_interval=1, keep_checkpoints=3)
    assert run_trainer(config)["version"] == 3
    for step in (2, 3):
        shutil.rmtree(tmp_path / "trainer" / "checkpoints" / f"step_{step:08d}")
    older = batch_from_bytes(batch_to_bytes(batches[2]))
    older.behavior_logprobs[2, older.loss_mask[2].nonzero()[0, 0]] = float("-inf")
    LocalStore(tmp_path / "batches").put(batch_key(2), batch_to_bytes(older))

    with caplog.at_level(logging.WARNING, logger="whetstone.trainer"):
        summary = run_trainer(config)
    assert summary["replayed"] == 2 and summary["step"] == 3 and summary["version"] == 3
    assert f"{batch_key(2)} in LocalStore(" in caplog.text
    assert f"dropped rows [2] (tasks 'p0') of {len(older)}, whose behavior logprob is -inf" in caplog.text
    replayed = [r for r in read_metrics(tmp_path / "trainer" / "metrics.jsonl") if r["replayed"]]
    assert [r["step"] for r in replayed] == [1, 2] and replayed[-1]["rows"] == len(older) - 1


def test_a_refused_batch_names_its_rows_as_stored_after_dropping_rows(tmp_path, tiny_moe, batches):
    # row 0 has a -inf behavior logprob (dropped), row 2 a NaN one (refused): the error names row 2
    damaged = batch_from_bytes(batch_to_bytes(batches[0]))
    for row, value in ((0, float("-inf")), (2, float("nan"))):
        damaged.behavior_logprobs[row, damaged.loss_mask[row].nonzero()[0, 0]] = value
    put_batches(tmp_path / "batches", [damaged])
    task = repr(damaged.rows[2]["task_id"])
    with pytest.raises(WhetstoneError, match=rf"not finite at trained positions of rows \[2\] \(tasks {task}\)"):
        run_trainer(trainer_config(tmp_path, tiny_moe))


def test_a_checkpoint_is_not_resumed_against_an_empty_or_missing_weight_store(tmp_path, tiny_moe, batches):
    put_batches(tmp_path / "batches", batches[:1])
    run_trainer(trainer_config(tmp_path, tiny_moe))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="weight store .* is empty"):
        run_trainer(trainer_config(tmp_path, tiny_moe, sync={"store": str(tmp_path / "empty")}))
    # a mistyped path is refused as missing, and not created
    with pytest.raises(CheckpointError, match=r"at step 1, but its weight store: no store at .*typo.* does not exist"):
        run_trainer(trainer_config(tmp_path, tiny_moe, sync={"store": str(tmp_path / "typo")}))
    assert not (tmp_path / "typo").exists()


def test_max_steps_below_the_checkpoint_or_the_weight_store_is_refused(tmp_path, tiny_moe, batches):
    put_batches(tmp_path / "batches", batches[:4])
    assert run_trainer(trainer_config(tmp_path, tiny_moe, max_steps=4, checkpoint_interval=2))["step"] == 4
    with pytest.raises(ConfigError, match=r"max_steps = 2, but the checkpoint .*step_00000004 is already at step 4"):
        run_trainer(trainer_config(tmp_path, tiny_moe, max_steps=2, checkpoint_interval=2))
    # the newest checkpoint lost (a crash): the store's version 4 is still past max_steps 3
    shutil.rmtree(latest_checkpoint(tmp_path / "trainer" / "checkpoints"))
    with pytest.raises(ConfigError, match=r"max_steps = 3, but the weight store .* already holds version 4"):
        run_trainer(trainer_config(tmp_path, tiny_moe, max_steps=3, checkpoint_interval=2))
    assert run_trainer(trainer_config(tmp_path, tiny_moe, max_steps=4, checkpoint_interval=2))["step"] == 4


def test_batches_and_weights_can_live_in_an_s3_bucket(tmp_path, tiny_moe, batches):
    from whetstone.store.moto import local_s3
    from whetstone.store.s3 import S3Store

    with local_s3("rl-test") as endpoint:
        put_batches(S3Store("rl-test", "run/batches", endpoint_url=endpoint), batches[:2])
        sync = {"store": "s3://rl-test/run/weights", "endpoint_url": endpoint, "publish_dtype": "float32"}
        config = trainer_config(
            tmp_path, tiny_moe, batch_store="s3://rl-test/run/batches", batch_store_endpoint_url=endpoint, sync=sync
        )
        assert run_trainer(config)["version"] == 2
        followed = Subscriber(WeightStore.open(config.sync), config.sync)
        followed.poll()
        trained = checkpoint_weights(tmp_path)
        assert followed.version == 2 and all(torch.equal(trained[name], followed.state[name]) for name in trained)


def test_a_dense_model_trains_without_routes(tmp_path):
    dense = save_tiny_moe(tmp_path / "dense", num_experts=0)
    put_batches(tmp_path / "batches", make_batches(dense, 1))
    summary = run_trainer(trainer_config(tmp_path, dense))
    record = read_metrics(tmp_path / "trainer" / "metrics.jsonl")[0]
    assert summary["version"] == 1 and record["routing_disagreement"] == 0.0 and record["mismatch_kl_k3"] < 1e-9


@pytest.mark.slow  # a second trainer process: ~5 s idle, far more on a loaded machine
def test_sigterm_stops_the_trainer_cleanly_with_a_checkpoint(tmp_path, tiny_moe, batches):
    put_batches(tmp_path / "batches", batches[:2])
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(trainer_config(tmp_path, tiny_moe, idle_timeout=0, checkpoint_interval=10)))
    process = subprocess.Popen(
        [sys.executable, "-c", TRAINER_PROCESS.format(path=str(config_file))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        metrics = tmp_path / "trainer" / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and len(read_metrics(metrics)) == 2, process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
    # It checkpointed on the way out, so a restart has nothing to replay.
    assert latest_checkpoint(tmp_path / "trainer" / "checkpoints").name == "step_00000002"
    put_batches(tmp_path / "batches", batches[2:3], first=2)
    summary = run_trainer(trainer_config(tmp_path, tiny_moe))
    assert summary["replayed"] == 0 and summary["step"] == 3 and summary["version"] == 3


def test_a_rank_waits_for_a_batch_rank_0_read_to_show_up_in_its_view_of_the_store(tmp_path, batches):
    # a shared filesystem may show another machine a new file seconds late
    store = LocalStore(tmp_path / "batches")
    session = SimpleNamespace(batches=store, rank=1)
    late = threading.Timer(0.3, put_batches, (store, batches[:1]))
    late.start()
    assert read_batch_rank_0_read(session, 0, within=10.0).meta["index"] == 0
    with pytest.raises(WhetstoneError, match=r"rank 1 cannot read .*0000000001.* which rank 0 read 0.2 s ago"):
        read_batch_rank_0_read(session, 1, within=0.2)


def test_a_trainer_on_an_empty_batch_store_says_where_at_the_start(tmp_path, tiny_moe, batches, caplog):
    """A mistyped batch_store is a new, empty store no orchestrator writes: the trainer names it."""
    config = trainer_config(tmp_path, tiny_moe, batch_store=str(tmp_path / "batchez"))
    with caplog.at_level(logging.WARNING, logger="whetstone.trainer"):
        assert run_trainer(config)["step"] == 0  # idle_timeout 0.3 s
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"the batch store LocalStore('{tmp_path / 'batchez'}') holds no batches" in warning
    assert "waits for batch 0 there until idle_timeout (0.3 s) passes" in warning
    caplog.clear()
    put_batches(tmp_path / "batches", batches[:1])
    with caplog.at_level(logging.WARNING, logger="whetstone.trainer"):
        run_trainer(trainer_config(tmp_path / "b", tiny_moe, batch_store=str(tmp_path / "batches")))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # a store holding batches: no word


def test_a_trainer_waiting_on_an_empty_batch_store_says_so_again_while_idle(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(loop, "IDLE_REPORT_S", 0.1)
    config = SimpleNamespace(idle_timeout=0.45, poll_interval=0.02)
    session = SimpleNamespace(batches=LocalStore(tmp_path / "batchez"), rank=0, config=config)
    with caplog.at_level(logging.WARNING, logger="whetstone.trainer"):
        assert wait_for_batch(session, 0, threading.Event()) is None
    reports = [r.getMessage() for r in caplog.records]
    assert len(reports) >= 2, reports
    assert all(m.startswith("still waiting for batch 0 after ") and "batchez" in m for m in reports)


def test_a_trainer_waiting_for_a_batch_missing_before_later_ones_says_so(tmp_path, monkeypatch, caplog):
    """A batch deleted or lost: the orchestrator only appends, so the trainer would wait for ever."""
    monkeypatch.setattr(loop, "IDLE_REPORT_S", 0.1)
    store = LocalStore(tmp_path / "batches")
    store.put(batch_key(0), b"x"), store.put(batch_key(2), b"x")
    session = SimpleNamespace(batches=store, rank=0, config=SimpleNamespace(idle_timeout=0.45, poll_interval=0.02))
    with caplog.at_level(logging.WARNING, logger="whetstone.trainer"):
        loop.report_waiting(session, 1)  # at the start
        assert wait_for_batch(session, 1, threading.Event()) is None
    start, *waiting = [r.getMessage() for r in caplog.records]
    assert start.startswith(f"batches/0000000001.batch is missing from the batch store {store!r}, which holds later ")
    assert "batches (up to 2): it was deleted or lost" in start and "put the batch back" in start
    assert waiting and all(
        m.startswith("still waiting for batch 1 after ") and "0000000001.batch is missing" in m for m in waiting
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="whetstone.trainer"):
        loop.report_waiting(session, 3)  # the next batch to come: no warning
    assert not caplog.records


def test_a_checkpoints_path_that_is_a_file_is_refused_before_any_step(tmp_path, tiny_moe, batches):
    put_batches(tmp_path / "batches", batches[:1])
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "checkpoints").write_text("a file")
    with pytest.raises(
        ConfigError,
        match=r"trainer/checkpoints is a file, not a folder: the trainer writes its checkpoints and metrics into "
        r"output_dir .*trainer",
    ):
        run_trainer(trainer_config(tmp_path, tiny_moe))
    assert sorted(p.name for p in (tmp_path / "trainer").iterdir()) == ["checkpoints"]
    assert not (tmp_path / "weights").exists()  # refused before the store got a version 0


def test_a_model_path_with_another_tokenizer_is_refused_on_resume(tmp_path, batches):
    texts = [json.dumps(batch.meta) for batch in batches] * 20
    first, second = tmp_path / "first", tmp_path / "second"
    for folder, vocab_size in ((first, 300), (second, 290)):
        save_tiny_moe(folder, vocab_size=300)  # every id of either tokenizer has an embedding row
        Tokenizer.train(texts, vocab_size=vocab_size).save(folder)
    put_batches(tmp_path / "batches", batches[:1])
    run_trainer(trainer_config(tmp_path, first))
    with pytest.raises(
        ConfigError,
        match=r"step_00000001 was trained with another tokenizer \(tokenizer.json sha256 \w{16}\) than this run's "
        r"model_path .*second \(tokenizer.json sha256 \w{16}\): its weights would go on training on other token "
        r"ids\. Point model_path at the model the run started from \(the checkpoint's: .*first\)",
    ):
        run_trainer(trainer_config(tmp_path, second))
    shutil.copytree(first, tmp_path / "copy")  # the same tokenizer elsewhere resumes
    put_batches(tmp_path / "batches", batches[1:2], first=1)
    assert run_trainer(trainer_config(tmp_path, tmp_path / "copy"))["step"] == 2


def test_a_model_path_whose_tokenizer_has_more_ids_than_the_model_is_refused_before_training(tmp_path, batches):
    """An id past the embedding would fail mid-run (a demonstration, a server's sample): refused at start."""
    folder = save_tiny_moe(tmp_path / "model")  # 64 embedding rows
    Tokenizer.train([json.dumps(batch.meta) for batch in batches] * 20, vocab_size=300).save(folder)
    ids = Tokenizer.load(folder).vocab_size
    put_batches(tmp_path / "batches", batches[:1])
    with pytest.raises(ConfigError) as refused:
        run_trainer(trainer_config(tmp_path, folder))
    assert str(refused.value).startswith(
        f"the tokenizer {folder / 'tokenizer.json'} has {ids} token ids, "
        f"but the model's vocab_size ({folder / 'config.json'}) is only 64"
    )
    assert not (tmp_path / "weights").exists()  # refused before the store got a version 0


def test_a_damaged_newest_checkpoint_is_refused_naming_the_older_one(tmp_path, tiny_moe, batches):
    put_batches(tmp_path / "batches", batches[:2])
    run_trainer(trainer_config(tmp_path, tiny_moe, checkpoint_interval=1))
    checkpoints = tmp_path / "trainer" / "checkpoints"
    (checkpoints / "step_00000002" / "state.json").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"step_00000002/state.json is missing\. step_00000002 is the run's newest checkpoint\. Older complete "
        r"checkpoints in .*: step_00000001\. .*move .*step_00000002 out of .* to resume from step_00000001",
    ):
        run_trainer(trainer_config(tmp_path, tiny_moe, checkpoint_interval=1))
