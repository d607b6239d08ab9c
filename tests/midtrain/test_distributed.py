"""Mid-training under `torchrun` with FSDP2 (gloo on CPU): a run handed from 1 rank to 2 and back
through its checkpoints trains what one rank trains straight through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.gpus import TWO_GPUS
from tests.torchrun_support import torchrun
from whetstone.config import dump_toml
from whetstone.errors import ConfigError
from whetstone.midtrain.loop import train
from whetstone.model.hf import load_hf
from whetstone.utils.metrics import read_metrics
from whetstone.utils.processes import free_port

# fp32, a constant learning rate after warm-up (so a run cut at any step keeps the straight run's
# schedule), no load-balancing loss (taken over each rank's rows, it is not a sum over tokens)
SETTINGS = (
    "run.dtype=float32",
    "run.grad_accum=2",
    "run.checkpoint_interval=100",
    "optimizer.lr=0.001",
    "optimizer.min_lr_ratio=1.0",
    "model.router_aux_loss_coef=0.0",
)


def torchrun_midtrain(config, tmp_path, nproc=2, succeeds=True):
    """The documented command line as a real job: `torchrun --standalone --nproc_per_node 2 -m
    whetstone.cli midtrain CONFIG` (gloo on CPU; `tests.torchrun_support.torchrun`)."""
    config_file = tmp_path / "midtrain.toml"
    config_file.write_text(dump_toml(config))
    return torchrun(["-m", "whetstone.cli", "midtrain", str(config_file), "--json"], nproc, succeeds)


def weights(summary) -> dict[str, torch.Tensor]:
    return load_file(f"{summary['run_dir']}/checkpoints/step_{summary['step']:08d}/model.safetensors")


@pytest.mark.parametrize(
    ("device", "tolerance"),
    [
        pytest.param("cpu", 1e-4, marks=pytest.mark.slow),  # a real 2-process torchrun job: ~20 s on 2 cores
        # over NCCL, a rank per GPU: cuBLAS picks its kernels by the rows each rank has
        pytest.param("cuda", 1e-3, marks=[pytest.mark.gpu, TWO_GPUS]),
    ],
)
def test_a_run_moved_from_one_rank_to_two_and_back_trains_what_one_rank_does(make_config, tmp_path, device, tolerance):
    def make_config_on(*settings):
        return make_config(*settings, f"run.device={device}")

    straight = train(make_config_on(*SETTINGS, "run.name=straight", "run.steps=8"))
    expected = {r["step"]: r for r in read_metrics(f"{straight['run_dir']}/metrics.jsonl") if "loss" in r}

    # One rank trains steps 1-3, two ranks continue from its checkpoint to step 6, and one rank
    # finishes from theirs.
    train(make_config_on(*SETTINGS, "run.name=moved", "run.steps=3"))
    done = torchrun_midtrain(make_config_on(*SETTINGS, "run.name=moved", "run.steps=6"), tmp_path)
    summaries = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(s["step"], s["rank"], s["world_size"]) for s in summaries] == [(6, 0, 2)]  # rank 0 speaks for the job
    moved = train(make_config_on(*SETTINGS, "run.name=moved", "run.steps=8"))
    assert moved["resumed_from"].endswith("step_00000006")

    records = [r for r in read_metrics(f"{moved['run_dir']}/metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9))  # rank 0 alone wrote steps 4-6
    for record in records:
        straight_record = expected[record["step"]]
        assert record["tokens"] == straight_record["tokens"]  # the ranks' shares add up to the batch
        assert record["loss"] == pytest.approx(straight_record["loss"], rel=tolerance / 10)
        assert record["grad_norm"] == pytest.approx(straight_record["grad_norm"], rel=tolerance)
    assert moved["val_loss"] == pytest.approx(straight["val_loss"], rel=tolerance / 10)
    a, b = weights(straight), weights(moved)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=tolerance, atol=tolerance / 100, msg=name)
    # the 2-rank stage exported a whole model too (gathered on rank 0), which loads
    exported = load_hf(f"{moved['run_dir']}/model")
    assert exported.num_parameters() == moved["parameters"]


def test_a_batch_the_ranks_cannot_share_equally_is_refused(make_config, monkeypatch):
    monkeypatch.setattr("whetstone.midtrain.setup.world", lambda: (0, 3))
    with pytest.raises(ConfigError, match=r"run.batch_size \(4\) must be a multiple of the 3 ranks"):
        train(make_config())


def test_two_machines_sharing_a_corpus_cache_build_it_once(make_config, tmp_path):
    # two ranks, each its machine's first (LOCAL_RANK 0), and one cache folder: rank 0 builds,
    # the other machine's first rank finds it there instead of building into it at the same time
    cache = tmp_path / "cache"  # empty: the session's shared cache may hold this corpus already
    config = make_config(f'data.cache_dir="{cache}"')
    config_file = tmp_path / "midtrain.toml"
    config_file.write_text(dump_toml(config))
    job = Path(__file__).with_name("two_machines_job.py")
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env["MASTER_PORT"] = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, str(job), str(config_file), str(tmp_path)],
            env={**env, "RANK": str(rank)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for rank in ranks:
        assert rank.wait(timeout=300) == 0, rank.stderr.read()[-3000:]
    counts = {rank: tmp_path / f"builds-{rank}" for rank in range(2)}
    assert {rank: path.read_text().count("1") for rank, path in counts.items() if path.exists()} == {0: 1}
    assert (tmp_path / "tokens-0").read_text() == (tmp_path / "tokens-1").read_text() != "0"
    assert [entry.name for entry in cache.iterdir() if entry.name.startswith(".")] == []  # no build left half-way


@pytest.mark.slow  # a real 2-process torchrun job: ~20 s on 2 cores
def test_a_summary_rank_0_cannot_write_at_the_end_fails_every_rank(make_config, tmp_path):
    # rank 0 alone writes the run's results; its failure (here a folder where summary.json goes)
    # is every rank's error, rather than rank 0's while rank 1 waits in the last collective
    config = make_config(*SETTINGS, "run.name=blocked", "run.steps=3")
    summary = tmp_path / "runs" / "blocked" / "summary.json"
    (summary / "in the way").mkdir(parents=True)
    done = torchrun_midtrain(config, tmp_path, succeeds=False)
    assert done.stderr.count(f"cannot write {summary}") == 2, done.stderr[-4000:]  # each rank's error
