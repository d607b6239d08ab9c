"""training.distributed's sharded checkpoints and frozen models, and the trainer's step figures
over ranks, in a real 2-rank torchrun job (gloo on the CPU; tests/training/ranks_job.py); and
2-rank mid-training and RL trainer runs resumed from their checkpoints, which train bit for bit
what they train straight through (tests/training/resume_ranks_job.py)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.midtrain.midtrain_support import TINY, write_corpus
from tests.torchrun_support import torchrun
from tests.trainer.trainer_fixtures import (
    TRANSCRIPTS,
    make_batches,
    put_batches,
    save_chat_moe,
    save_tiny_moe,
    trainer_config,
)
from whetstone.config import dump_toml, load_config
from whetstone.midtrain.config import MidtrainConfig
from whetstone.rl.demos import write_demos
from whetstone.training.checkpoint import latest_checkpoint

JOB = Path(__file__).with_name("ranks_job.py")


def test_two_ranks_resume_shard_a_frozen_model_and_sum_up_a_step(tmp_path):
    torchrun([str(JOB), str(tmp_path)])
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for rank in ranks:
        # rank 0 read the checkpoint into a plain copy whose AdamW is torch's default; every
        # rank's optimizer keeps its fused one (on CUDA, the one the trainer asked for)
        assert rank["fused"] == [True] * len(rank["fused"]), rank
        # the reference model's embeddings and final norm are shards again after a forward
        assert rank["frozen_whole_after_forward"] == [], rank
        # the step's figures: shares summed, |delta|'s p99 and max those of both ranks' rows
        step, whole = rank["step"], rank["whole"]
        assert step["loss"] == 3.0 and step["grad_norm"] == 3.0
        assert step["diff_p99"] == whole["diff_p99"] and step["diff_max"] == whole["diff_max"]
        assert step["diff_over_ln2"] == whole["diff_over_ln2"] > 0
        assert step["diff_mean"] == pytest.approx(whole["diff_mean"], rel=1e-12)


FAILING_JOB = JOB.with_name("failing_ranks_job.py")


@pytest.mark.slow  # a real 2-process torchrun job, ~15 s on 2 shared cores
def test_every_rank_raises_what_rank_0_met_reading_or_writing_a_checkpoint(tmp_path):
    # Rank 0 alone writes and reads checkpoint files. Its failure is every rank's: the others
    # raise the same error at once, rather than going on into a collective rank 0 never joins
    # (and waiting there the process group's hour, or being killed without a word of why).
    torchrun([str(FAILING_JOB), str(tmp_path)], timeout_s=120)
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    blocked, model_file = tmp_path / "blocked", tmp_path / "checkpoints" / "step_00000001" / "model.safetensors"
    for rank in ranks:
        assert rank["save"].startswith(f"CheckpointError: cannot write checkpoint {blocked / 'step_00000002'}"), rank
        # with the older complete checkpoints named (none here), as rank 0 found them
        assert rank["load"].startswith(f"DamagedCheckpoint: checkpoint file {model_file} is corrupt (sha256 mismatch)")
    assert ranks[0]["load"] == ranks[1]["load"]


RESUME_JOB = JOB.with_name("resume_ranks_job.py")


def run_plan(plan: list[dict], folder: Path) -> list[dict]:
    """`resume_ranks_job.py` on 2 ranks over `plan`: each rank's record (its runs' summaries and
    the generators' fingerprints around every step)."""
    folder.mkdir()
    (folder / "plan.json").write_text(json.dumps(plan))
    torchrun([str(RESUME_JOB), str(folder / "plan.json"), str(folder)], timeout_s=600)
    return [json.loads((folder / f"rank-{rank}.json").read_text()) for rank in range(2)]


def assert_same_checkpoint(expected: Path, actual: Path) -> None:
    """Two checkpoints of the same step hold the same weights and AdamW state, bit for bit."""
    assert expected.name == actual.name
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(str(expected / name)), load_file(str(actual / name))
        assert a.keys() == b.keys(), name
        different = [key for key in a if not torch.equal(a[key], b[key])]
        assert not different, f"{actual / name} differs from the straight run's in {different}"
    a, b = (json.loads((path / "state.json").read_text()) for path in (expected, actual))
    assert (a["tokens"], a["data"]) == (b["tokens"], b["data"])  # the logit scale's state among the data


@pytest.mark.slow  # two real 2-process torchrun jobs, ~100 s on 2 shared cores
def test_two_ranks_resumed_from_their_checkpoint_train_bit_for_bit_what_they_train_straight(tmp_path):
    # Only rank 0 saves and restores its random generators in a checkpoint; a rank > 0 resumes
    # with the states of its new process. That loses nothing as long as no training step draws
    # from the global generators on any rank: every random choice of a step (the mid-training
    # data order, the RL mini-batches' shuffle, the demonstrations drawn) is seeded by the step.
    # Each run starts with generators seeded apart on each rank, and the resumed runs in new
    # processes, as a resumed job's ranks do. The job also records the generators around every
    # step: none may move them, on rank 0 either (a checkpoint holds no CUDA generator state, and
    # a run moved to another number of ranks would draw other numbers).
    code_dir = write_corpus(tmp_path / "corpus")
    midtrain = [
        *TINY,
        f'data.directories=[{{path="{code_dir}"}}]',
        f'data.cache_dir="{tmp_path / "cache"}"',
        f'run.output_dir="{tmp_path / "runs"}"',
        "run.dtype=float32",
        "run.steps=4",
        "run.grad_accum=2",
    ]
    configs = {}
    for name in ("straight", "halves"):
        configs[f"midtrain-{name}"] = tmp_path / f"midtrain-{name}.toml"
        configs[f"midtrain-{name}"].write_text(
            dump_toml(load_config(MidtrainConfig, None, [*midtrain, f"run.name={name}"]))
        )

    # The RL trainer with everything a step randomises or carries: PPO mini-batches, the
    # demonstrations' anchor, the KL to a sharded reference, the learned logit scale, clipping,
    # activation checkpointing, and a learning rate that warms up and decays over max_steps.
    sampler = save_tiny_moe(tmp_path / "sampler")
    policy = save_chat_moe(tmp_path / "policy", tmp_path / "tokenizer")
    write_demos(tmp_path / "demos.jsonl", TRANSCRIPTS * 3)
    data = make_batches(sampler, 4)
    settings = dict(
        optimizer={"lr": 1e-3, "warmup_steps": 1, "min_lr_ratio": 0.1, "weight_decay": 0.1, "grad_clip": 0.5},
        loss={"kl_coef": 0.1},
        logit_scale_lr=0.01,
        demo_coef=0.5,
        demos_path=str(tmp_path / "demos.jsonl"),
        demo_rows=3,
        optimizer_steps_per_batch=2,
        activation_checkpointing=True,
        max_steps=4,
        checkpoint_interval=100,  # a checkpoint when the run stops: after batch 1 (then idle), or batch 3
    )
    put_batches(tmp_path / "straight" / "batches", data)
    put_batches(tmp_path / "cut" / "batches", data[:2])
    for name in ("straight", "cut"):
        configs[f"trainer-{name}"] = tmp_path / f"trainer-{name}.toml"
        configs[f"trainer-{name}"].write_text(dump_toml(trainer_config(tmp_path / name, policy, **settings)))

    def plan(*runs):
        return [{"kind": run.split("-")[0], "config": str(configs[run]), "stop_at_step": stop} for run, stop in runs]

    first = run_plan(
        plan(("midtrain-straight", None), ("midtrain-halves", 2), ("trainer-straight", None), ("trainer-cut", None)),
        tmp_path / "first",
    )
    assert [(run["step"], run["resumed_from"]) for run in first[0]["runs"]] == [(4, None), (2, None)] * 2
    put_batches(tmp_path / "cut" / "batches", data[2:], first=2)
    resumed = run_plan(plan(("midtrain-halves", None), ("trainer-cut", None)), tmp_path / "resumed")
    assert [(run["step"], run["resumed_from"]) for run in resumed[0]["runs"]] == [(4, "step_00000002")] * 2

    for rank in [*first, *resumed]:
        for run in rank["runs"]:  # no step moved any rank's global generators
            assert len(run["fingerprints"]) >= 4 and len(set(run["fingerprints"])) == 1, (rank["rank"], run["kind"])
    runs = tmp_path / "runs"
    assert_same_checkpoint(
        latest_checkpoint(runs / "straight" / "checkpoints"), latest_checkpoint(runs / "halves" / "checkpoints")
    )
    assert_same_checkpoint(
        latest_checkpoint(tmp_path / "straight" / "trainer" / "checkpoints"),
        latest_checkpoint(tmp_path / "cut" / "trainer" / "checkpoints"),
    )
