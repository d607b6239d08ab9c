"""The trainer under `torchrun` with FSDP2 (gloo on CPU): 2 ranks train, publish and checkpoint
what 1 rank does, and a run moves between 1 and 2 ranks through its checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.gpus import TWO_GPUS
from tests.torchrun_support import torchrun
from tests.trainer.trainer_fixtures import TRANSCRIPTS, make_batches, put_batches, trainer_config
from whetstone.config import dump_toml
from whetstone.rl.batch_store import batch_key
from whetstone.rl.demos import write_demos
from whetstone.store import LocalStore
from whetstone.sync import Subscriber, SyncConfig, WeightStore
from whetstone.trainer.distributed import global_normalizer, rank_rows
from whetstone.trainer.loop import run_trainer
from whetstone.training.checkpoint import latest_checkpoint
from whetstone.utils.metrics import read_metrics


def test_each_rank_takes_every_world_th_row_padded_with_untrained_rows(batches):
    batch = batches[0]
    world = 3
    shards = [rank_rows(batch, rank, world) for rank in range(world)]
    # Same number of rows on every rank, so every rank runs the same micro-batches (FSDP's
    # collectives pair up one for one); together the shards train exactly the batch's tokens.
    assert {len(shard) for shard in shards} == {-(-len(batch) // world)}
    assert sum(shard.num_loss_tokens for shard in shards) == batch.num_loss_tokens
    for rank, shard in enumerate(shards):
        own = list(range(rank, len(batch), world))
        for i, row in enumerate(own):
            n = batch.rows[row]["num_positions"]
            assert torch.equal(shard.input_ids[i, :n], batch.input_ids[row, :n])
            assert torch.equal(shard.routes[i, :n], batch.routes[row, :n])  # routes travel with their row
            assert torch.equal(shard.loss_mask[i, :n], batch.loss_mask[row, :n])
        assert not shard.loss_mask[len(own) :].any()  # padding rows train nothing
    assert not batch.loss_mask.logical_not().all()  # the batch itself is untouched


def test_one_rank_takes_the_whole_batch_and_counts_its_own_tokens(batches):
    whole = rank_rows(batches[0], 0, 1)
    assert torch.equal(whole.input_ids, batches[0].input_ids) and torch.equal(whole.loss_mask, batches[0].loss_mask)
    assert global_normalizer(whole, "token") == batches[0].num_loss_tokens
    assert global_normalizer(whole, "sequence") == len(batches[0])


def without_baseline(batch):
    """The batch with each row's reward as its advantage. GRPO's mean-zero advantages make the
    loss a cancellation (~1e-4 here) whose float32 rounding (~1e-8) is the same however the
    batch is split, so a *relative* comparison of it would test nothing; same-signed terms do."""
    rewards = torch.tensor([row["reward"] for row in batch.rows]).unsqueeze(1)
    batch.advantages = torch.where(batch.loss_mask, rewards, torch.zeros_like(batch.advantages))
    return batch


def torchrun_trainer(config_file, nproc=2, succeeds=True) -> subprocess.CompletedProcess:
    """The documented command line, as a real job: `torchrun --standalone --nproc_per_node 2
    -m whetstone.cli trainer CONFIG` (`tests.torchrun_support.torchrun`)."""
    return torchrun(["-m", "whetstone.cli", "trainer", str(config_file)], nproc, succeeds)


def latest_weights(root) -> dict[str, torch.Tensor]:
    subscriber = Subscriber(WeightStore.open(SyncConfig(store=str(root / "weights"))), SyncConfig())
    subscriber.poll()
    return subscriber.state


def assert_weights_close(expected, actual):
    assert expected.keys() == actual.keys()
    for name in expected:
        relative = float((actual[name] - expected[name]).norm() / expected[name].norm())
        assert relative < 1e-5, f"{name}: relative difference {relative:.2e}"
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow  # a real 2-process torchrun job: ~20 s on 2 shared cores, most of it importing torch
@pytest.mark.parametrize("checkpointing", [False, True])  # the 2 ranks with activation checkpointing, or not
def test_two_ranks_train_publish_and_checkpoint_what_one_rank_does(tmp_path, tiny_moe, batches, checkpointing):
    # lr 1e-5, an RL-sized step: at 1e-2 Adam turns float noise on near-zero gradients into
    # updates of ~lr (its first step is ~lr * sign(g)), which no split of the batch can match.
    # Clipping (at 0.5), the KL term (a sharded reference model) and the learned logit scale
    # (its gradient summed over the ranks' rows; its state in the checkpoints) are on.
    data = [without_baseline(batch.select(range(len(batch)))) for batch in batches[:4]]
    settings = dict(
        optimizer={"lr": 1e-5, "warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay": 0.1, "grad_clip": 0.5},
        loss={"kl_coef": 0.1},
        logit_scale_lr=0.01,
    )

    # One rank, straight through batches 0..3.
    put_batches(tmp_path / "straight" / "batches", data)
    run_trainer(trainer_config(tmp_path / "straight", tiny_moe, max_steps=4, **settings))
    straight = {r["step"]: r for r in read_metrics(tmp_path / "straight" / "trainer" / "metrics.jsonl")}

    # The same run handed from 1 rank to 2 and back. One rank trains batches 0 and 1 and
    # "crashes" after publishing version 2 with only its step-1 checkpoint on disk ...
    root = tmp_path / "moved"
    put_batches(root / "batches", data)
    run_trainer(trainer_config(root, tiny_moe, max_steps=2, checkpoint_interval=1, **settings))
    shutil.rmtree(latest_checkpoint(root / "trainer" / "checkpoints"))
    # ... two ranks resume from that 1-rank checkpoint, replay batch 1 (already published),
    # train batch 2 and publish version 3 ...
    config_file = tmp_path / "trainer.toml"
    two_ranks = trainer_config(
        root, tiny_moe, max_steps=3, checkpoint_interval=1, activation_checkpointing=checkpointing, **settings
    )
    config_file.write_text(dump_toml(two_ranks))
    torchrun_trainer(config_file)
    assert latest_checkpoint(root / "trainer" / "checkpoints").name == "step_00000003"
    # ... and one rank resumes from the 2-rank checkpoint for batch 3.
    summary = run_trainer(trainer_config(root, tiny_moe, max_steps=4, **settings))
    assert summary["replayed"] == 0 and summary["version"] == 4

    records = read_metrics(root / "trainer" / "metrics.jsonl")
    assert [(r["step"], r["replayed"], r.get("version")) for r in records] == [
        (0, False, 1),
        (1, False, 2),
        (1, True, None),
        (2, False, 3),
        (3, False, 4),
    ]
    assert "replay_matches_store" in records[2]  # rank 0 compared its replayed weights with the store
    assert all(record["grad_norm"] > 0.5 for record in records)  # every step was clipped, by the global norm
    assert records[-1]["ref_kl_k3"] > 0
    assert records[-1]["logit_scale"] != 1.0  # the scale moved, and moved on across the hand-overs
    for record in records:
        expected = straight[record["step"]]
        assert record["tokens"] == expected["tokens"]  # the ranks' token counts add up to the batch's
        assert record["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert record["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)  # summed, not averaged
        assert record["routing_disagreement"] == pytest.approx(expected["routing_disagreement"], abs=1e-9)
        assert record["clip_fraction"] == expected["clip_fraction"]
        assert record["entropy"] == pytest.approx(expected["entropy"], rel=1e-5)  # every rank's tokens, not rank 0's
        # A sum whose terms cancel (advantages of both signs): ~1e-3 here, so compare absolutely.
        assert record["logit_scale_grad"] == pytest.approx(expected["logit_scale_grad"], abs=1e-6)
        assert record["logit_scale"] == pytest.approx(expected["logit_scale"], rel=1e-6)
        # ~1e-8 after steps of 1e-5, at float32's floor for k3 (exp(Δ) − Δ − 1 cancels): compare absolutely.
        assert record["ref_kl_k3"] == pytest.approx(expected["ref_kl_k3"], abs=1e-7)

    # The published weights, and the final checkpoint's AdamW moments, match the straight run's.
    assert_weights_close(latest_weights(tmp_path / "straight"), latest_weights(root))
    for name in ("model.safetensors", "optimizer.safetensors"):
        expected = load_file(str(latest_checkpoint(tmp_path / "straight" / "trainer" / "checkpoints") / name))
        actual = load_file(str(latest_checkpoint(root / "trainer" / "checkpoints") / name))
        assert all(torch.equal(expected[k], actual[k]) for k in expected if k.endswith(".step"))  # AdamW's counts
        assert_weights_close(
            {k: v for k, v in expected.items() if not k.endswith(".step")},
            {k: v for k, v in actual.items() if not k.endswith(".step")},
        )


@pytest.mark.slow  # another real 2-process torchrun job, ~20 s
def test_two_ranks_anchor_to_the_demonstrations_as_one_rank_does(tmp_path, chat_moe, batches):
    # Three demonstrations a step: rank 1 gets a padding row, and the anchor's mean is over
    # both ranks' tokens.
    demos = tmp_path / "demos.jsonl"
    write_demos(demos, TRANSCRIPTS * 3)
    settings = dict(
        optimizer={"lr": 1e-5, "warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay": 0.0},
        demo_coef=0.5,
        demos_path=str(demos),
        demo_rows=3,
        max_steps=2,
    )
    data = [without_baseline(batch.select(range(len(batch)))) for batch in batches[:2]]
    for run in ("one", "two"):
        put_batches(tmp_path / run / "batches", data)
    run_trainer(trainer_config(tmp_path / "one", chat_moe, **settings))
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(trainer_config(tmp_path / "two", chat_moe, **settings)))
    torchrun_trainer(config_file)
    one, two = (read_metrics(tmp_path / run / "trainer" / "metrics.jsonl") for run in ("one", "two"))
    assert len(one) == len(two) == 2
    for expected, record in zip(one, two):
        assert record["demo_nll"] == pytest.approx(expected["demo_nll"], rel=1e-5) and record["demo_nll"] > 0
        assert record["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert record["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert_weights_close(latest_weights(tmp_path / "one"), latest_weights(tmp_path / "two"))


@pytest.mark.parametrize(
    ("device", "dtype"),
    [
        pytest.param("cpu", "float32", marks=pytest.mark.slow),  # another real 2-process torchrun job, ~20 s
        pytest.param("cuda", "bfloat16", marks=[pytest.mark.gpu, TWO_GPUS]),
    ],
)
def test_invariant_ranks_see_exactly_the_engines_logprobs(tmp_path, tiny_moe, device, dtype):
    # FSDP2 gathers each layer's whole weights before its forward, so each rank's rows go through
    # the kernels a lone trainer's (and the engine's) do: no mismatch, no router disagreement.
    # On CUDA one rank per GPU over NCCL, against a CUDA engine in bf16.
    batches = make_batches(tiny_moe, 1, numerics="invariant", device=device, dtype=dtype)
    put_batches(tmp_path / "batches", batches)
    config_file = tmp_path / "trainer.toml"
    config = trainer_config(tmp_path, tiny_moe, numerics="invariant", router_replay=False, device=device, dtype=dtype)
    config_file.write_text(dump_toml(config))
    torchrun_trainer(config_file, nproc=2 if device == "cpu" else torch.cuda.device_count())
    (record,) = read_metrics(tmp_path / "trainer" / "metrics.jsonl")
    assert record["logprob_diff_max"] == 0.0 and record["mismatch_kl_k3"] == 0.0
    assert record["routing_disagreement"] == 0.0


@pytest.mark.gpu
@TWO_GPUS
def test_ranks_on_every_gpu_over_nccl_train_what_one_gpu_does_and_checkpoint_for_the_cpu(tmp_path, tiny_moe, batches):
    # The CPU tests' 2-rank job on CUDA: one rank per GPU over NCCL, against one process on one
    # GPU, from the same batches. Tolerances are looser than gloo's: each rank's matmuls see its
    # rows only, and cuBLAS picks its kernels by shape.
    from whetstone.model.hf import load_hf
    from whetstone.training.checkpoint import load_weights

    data = [without_baseline(batch.select(range(len(batch)))) for batch in batches[:4]]
    settings = dict(
        optimizer={"lr": 1e-5, "warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay": 0.1, "grad_clip": 0.5},
        loss={"kl_coef": 0.1},
        logit_scale_lr=0.01,
        device="cuda",
        max_steps=4,
        checkpoint_interval=2,
    )
    for run in ("one", "ranks"):
        put_batches(tmp_path / run / "batches", data)
    run_trainer(trainer_config(tmp_path / "one", tiny_moe, **settings))
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(trainer_config(tmp_path / "ranks", tiny_moe, **settings)))
    torchrun_trainer(config_file, nproc=torch.cuda.device_count())
    one, ranks = (read_metrics(tmp_path / run / "trainer" / "metrics.jsonl") for run in ("one", "ranks"))
    assert [r["step"] for r in ranks] == [r["step"] for r in one] == [0, 1, 2, 3]
    for expected, record in zip(one, ranks):
        assert record["tokens"] == expected["tokens"]
        assert record["loss"] == pytest.approx(expected["loss"], rel=1e-4)
        assert record["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    published = latest_weights(tmp_path / "ranks")
    for name, tensor in latest_weights(tmp_path / "one").items():
        relative = float((published[name] - tensor).norm() / tensor.norm())
        assert relative < 1e-4, f"{name}: relative difference {relative:.2e}"
    # the ranks' checkpoint (gathered from the GPUs) loads into a model on the CPU: the published weights
    model = load_hf(tiny_moe)
    load_weights(latest_checkpoint(tmp_path / "ranks" / "trainer" / "checkpoints"), model)
    for name, tensor in model.state_dict().items():
        assert tensor.device.type == "cpu" and torch.equal(tensor.float(), published[name].float()), name


@pytest.mark.slow  # a real 2-process torchrun job that stops at set-up, ~15 s
def test_every_rank_refuses_a_weight_store_that_is_not_the_runs(tmp_path, tiny_moe, batches):
    # A checkpoint at step 2 against an empty weight store: each rank raises the refusal itself
    # (rank 0 alone would leave rank 1 to be killed by torchrun, or waiting at a collective).
    put_batches(tmp_path / "batches", batches[:2])
    run_trainer(trainer_config(tmp_path, tiny_moe, max_steps=2, checkpoint_interval=1))
    config = trainer_config(tmp_path, tiny_moe, max_steps=3)
    config.sync.store = str(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()  # empty (a missing one is refused as missing: test_loop.py)
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(config))
    done = torchrun_trainer(config_file, succeeds=False)
    assert done.stderr.count("is at step 2, but the weight store") == 2, done.stderr[-4000:]
    assert list((tmp_path / "elsewhere").iterdir()) == []  # nothing published there


@pytest.mark.slow  # a real 2-process torchrun job that stops at its first batch, ~15 s
def test_every_rank_refuses_a_batch_rank_0_cannot_read(tmp_path, tiny_moe):
    # Rank 0 reads each batch first and tells the other ranks whether to train it: a batch it
    # refuses is refused by every rank, each with the same error, rather than rank 0 alone while
    # rank 1 waits in the collective for a decision that never comes.
    (tmp_path / "batches").mkdir()
    LocalStore(tmp_path / "batches").put_if_absent(batch_key(0), b"not a batch")
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(trainer_config(tmp_path, tiny_moe, max_steps=1)))
    done = torchrun_trainer(config_file, succeeds=False)
    assert done.stderr.count(f"{batch_key(0)} in ") >= 2, done.stderr[-4000:]
    assert done.stderr.count("is not a whetstone batch") == 2, done.stderr[-4000:]


@pytest.mark.slow  # a real 2-process torchrun job that stops at set-up, ~15 s
def test_every_rank_refuses_a_damaged_checkpoint_rank_0_reads(tmp_path, tiny_moe, batches):
    # Rank 0 alone reads the checkpoint's record before the ranks load it together: its refusal
    # is every rank's, rather than rank 0's while rank 1 waits in the load's collective.
    put_batches(tmp_path / "batches", batches[:2])
    run_trainer(trainer_config(tmp_path, tiny_moe, max_steps=1, checkpoint_interval=1))
    (latest_checkpoint(tmp_path / "trainer" / "checkpoints") / "state.json").write_text("{ damaged")
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(trainer_config(tmp_path, tiny_moe, max_steps=2)))
    done = torchrun_trainer(config_file, succeeds=False)
    assert done.stderr.count("state.json is corrupt") == 2, done.stderr[-4000:]


@pytest.mark.slow  # a real 2-process torchrun job that stops at set-up, ~15 s
def test_every_rank_refuses_a_checkpoint_whose_weights_rank_0_finds_damaged(tmp_path, tiny_moe, batches):
    # Rank 0 alone reads the checkpoint; the other ranks learn its error before they would wait
    # for its weights in a collective (an hour, or until torchrun ended them without a word).
    put_batches(tmp_path / "batches", batches[:2])
    run_trainer(trainer_config(tmp_path, tiny_moe, max_steps=2, checkpoint_interval=1))
    newest = latest_checkpoint(tmp_path / "trainer" / "checkpoints")
    with open(newest / "model.safetensors", "r+b") as handle:  # one byte flipped: its sha256 no longer matches
        handle.seek(-1, 2)
        last = handle.read(1)
        handle.seek(-1, 2)
        handle.write(bytes([last[0] ^ 0xFF]))
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(trainer_config(tmp_path, tiny_moe, max_steps=3)))
    stderr = torchrun_trainer(config_file, succeeds=False).stderr
    damaged = f"checkpoint file {newest / 'model.safetensors'} is corrupt (sha256 mismatch)"
    assert stderr.count(damaged) == 2, stderr[-4000:]
    assert stderr.count("Older complete checkpoints in") == 2  # each rank names step_00000001 to resume from


@pytest.mark.slow  # real 2-process torchrun jobs that stop at their first or second step, ~15 s each
@pytest.mark.parametrize(
    ("stored", "max_steps"),
    [
        pytest.param(2, 2, id="at-the-next-step"),
        pytest.param(1, 2, id="going-idle"),
        pytest.param(1, 1, id="before-the-checkpoint"),
    ],
)
def test_every_rank_raises_what_rank_0_met_publishing(tmp_path, tiny_moe, batches, stored, max_steps):
    # Rank 0 alone publishes, on a worker thread, and meets a failed publish where it next waits
    # for it: before the next step's publish, on going idle for want of a batch, or before a
    # checkpoint. Every rank raises it there, rather than rank 0 alone while the others go on
    # into the next decision's broadcast or the checkpoint's gather, which rank 0 never joins.
    put_batches(tmp_path / "batches", batches[:stored])
    (tmp_path / "weights" / "versions").mkdir(parents=True)
    (tmp_path / "weights" / "versions" / "0000000001").write_text("in the way of version 1\n")
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(trainer_config(tmp_path, tiny_moe, max_steps=max_steps)))
    stderr = torchrun_trainer(config_file, succeeds=False).stderr
    assert stderr.count("a file where its folder 'versions/0000000001' goes") == 2, stderr[-4000:]


@pytest.mark.slow  # a real 2-process torchrun job that stops before its first batch, ~15 s
def test_every_rank_raises_what_rank_0_met_opening_the_metrics(tmp_path, tiny_moe, batches):
    # Rank 0 alone writes config.toml and metrics.jsonl: a metrics file it cannot open fails
    # every rank, rather than rank 0 alone while the others wait for its word on batch 0.
    put_batches(tmp_path / "batches", batches[:1])
    (tmp_path / "trainer" / "metrics.jsonl").mkdir(parents=True)  # a folder in its place
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(trainer_config(tmp_path, tiny_moe, max_steps=1)))
    stderr = torchrun_trainer(config_file, succeeds=False).stderr
    assert stderr.count(f"cannot write {tmp_path / 'trainer' / 'metrics.jsonl'}: Is a directory") == 2, stderr[-4000:]


@pytest.mark.slow  # a real 2-process torchrun job that stops at its first batch, ~15 s
def test_every_rank_refuses_a_batch_another_rank_cannot_read(tmp_path, tiny_moe, batches):
    # Each rank reads the batch itself once rank 0 said to train it: a rank that cannot (here its
    # own store, $LOCAL_RANK in the path, holds a damaged batch 0) fails every rank there, rather
    # than alone while rank 0 goes on into the step's collectives.
    put_batches(tmp_path / "batches-0", batches[:1])
    (tmp_path / "batches-1").mkdir()
    LocalStore(tmp_path / "batches-1").put_if_absent(batch_key(0), b"not a batch")
    config = trainer_config(tmp_path, tiny_moe, max_steps=1, batch_store=str(tmp_path / "batches-$LOCAL_RANK"))
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(config))
    stderr = torchrun_trainer(config_file, succeeds=False).stderr
    assert stderr.count("is not a whetstone batch") == 1, stderr[-4000:]  # rank 1's own error
    assert stderr.count(f"rank 1 could not read {batch_key(0)}, which rank 0 read") == 1, stderr[-4000:]


FAILING_LIST_JOB = Path(__file__).with_name("failing_list_job.py")


@pytest.mark.slow  # a real 2-process torchrun job that stops while waiting for its first batch, ~15 s
def test_every_rank_raises_what_rank_0_met_listing_the_batch_store_while_waiting(tmp_path, tiny_moe):
    # Rank 0 alone lists the batch store to report a wait (fault injection: its second listing
    # fails); the other rank raises it too, rather than waiting for rank 0's next word on batch 0.
    (tmp_path / "batches").mkdir()
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(trainer_config(tmp_path, tiny_moe, max_steps=1, idle_timeout=30.0)))
    torchrun([str(FAILING_LIST_JOB), str(config_file)], timeout_s=120)
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text())["raised"] for rank in range(2)]
    assert ranks[0] == f"OSError: listing LocalStore('{tmp_path / 'batches'}') failed (injected)", ranks
    assert ranks[1] == (
        f"WhetstoneError: rank 0 could not list the batch store LocalStore('{tmp_path / 'batches'}'): "
        f"OSError: listing LocalStore('{tmp_path / 'batches'}') failed (injected)"
    ), ranks


@pytest.mark.slow  # real 2-process torchrun jobs that stop at set-up, ~15 s each
@pytest.mark.parametrize("blocked", ["weights", "weights/versions/0000000000"], ids=["the-store", "version-0"])
def test_every_rank_raises_what_rank_0_met_opening_the_weight_store(tmp_path, tiny_moe, batches, blocked):
    # Rank 0 alone makes the weight store and publishes version 0, the initial weights: a store
    # it cannot write fails every rank, rather than rank 0 alone while the others go on.
    put_batches(tmp_path / "batches", batches[:1])
    (tmp_path / blocked).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / blocked).write_text("a file in the way\n")
    config_file = tmp_path / "trainer.toml"
    config_file.write_text(dump_toml(trainer_config(tmp_path, tiny_moe, max_steps=1)))
    stderr = torchrun_trainer(config_file, succeeds=False).stderr
    refusal = "a file is in the way" if blocked == "weights" else "a file where its folder 'versions/0000000000' goes"
    assert stderr.count(refusal) == 2, stderr[-4000:]
