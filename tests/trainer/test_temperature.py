"""Rows sampled at a temperature other than 1: the engine records logprobs of logits / T, and the
trainer, told each row's temperature (`Batch.temperatures`), computes the same ones."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.trainer_fixtures import PROMPTS
from whetstone.envs.trajectory import ModelCall, Segment, Trajectory
from whetstone.errors import WhetstoneError
from whetstone.inference.config import EngineConfig
from whetstone.inference.engine import Engine
from whetstone.inference.sampling import SamplingParams
from whetstone.model.hf import load_hf
from whetstone.rl.batch import batch_from_bytes, batch_to_bytes, collate
from whetstone.rl.samples import trajectory_samples
from whetstone.trainer.step import Learner, StepSettings, forward_logprobs, train_step
from whetstone.training.optim import build_optimizer


def sampled_batch(model_dir, temperatures: list[float], tell_trainer: bool = True):
    """One row per temperature, sampled by the real engine (with routes), collated as RL does."""
    engine = Engine(load_hf(model_dir), EngineConfig(max_batch=8, context_limit=32))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(temperatures))]
    params = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=t, seed=i) for i, t in enumerate(temperatures)]
    samples = []
    for i, seq in enumerate(engine.generate(prompts, params)):
        call = ModelCall.from_sequence(seq)
        samples += trajectory_samples(
            Trajectory(task_id=f"r{i}", segments=[Segment(calls=[call])], reward=float(i % 2)),
            advantage=float(i % 2) - 0.5,
        )
    return collate(samples, temperatures=temperatures if tell_trainer else None)


@torch.no_grad()
def mismatch(model, batch) -> torch.Tensor:
    """|trainer logprob - behavior logprob| per row, over the trained positions (max)."""
    logprobs = forward_logprobs(model, batch, replay=True, dtype="float32").logprobs
    return ((logprobs - batch.behavior_logprobs).abs() * batch.loss_mask).amax(dim=1)


def test_the_trainer_reproduces_logprobs_sampled_at_temperature_0_7(tiny_moe):
    model = load_hf(tiny_moe)
    told = sampled_batch(tiny_moe, [0.7, 0.7, 1.0, 1.3])
    assert mismatch(model, told).max() < 1e-5  # every row, each at its own temperature (fast numerics)

    untold = sampled_batch(tiny_moe, [0.7, 0.7, 1.0, 1.3], tell_trainer=False)
    off = mismatch(model, untold)
    assert off[2] < 1e-5  # the row sampled at 1 needs no temperature
    assert (off[[0, 1, 3]] > 1e-2).all()  # the others are of another distribution without it


def test_a_step_on_tempered_rows_is_on_policy(tiny_moe):
    model = load_hf(tiny_moe)
    optimizer = build_optimizer(model, lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    batch = sampled_batch(tiny_moe, [0.7] * 4)
    record = train_step(Learner(model, optimizer), batch, StepSettings(grad_clip=1.0, micro_batch_size=3), lr=1e-2)
    assert record["mismatch_kl_k3"] < 1e-9 and record["clip_fraction"] == 0.0 and record["grad_norm"] > 0
    assert mismatch(model, batch).max() > 1e-4  # the step moved the tempered policy


def test_temperatures_survive_select_and_the_file_form(tiny_moe):
    batch = sampled_batch(tiny_moe, [0.5, 1.0, 0.7])
    assert batch.select([2, 0]).temperatures.tolist() == pytest.approx([0.7, 0.5])
    again = batch_from_bytes(batch_to_bytes(batch))
    assert torch.equal(again.temperatures, batch.temperatures)
    plain = sampled_batch(tiny_moe, [1.0, 1.0], tell_trainer=False)
    assert batch_from_bytes(batch_to_bytes(plain)).temperatures is None  # as batches written before the field


def test_temperatures_must_be_one_positive_value_per_row():
    samples = trajectory_samples(
        Trajectory(
            task_id="t",
            reward=0.0,
            segments=[
                Segment(
                    calls=[
                        ModelCall(prompt_ids=[1, 2], completion_ids=[3], logprobs=[-1.0], versions=[0], loss_mask=[1])
                    ]
                )
            ],
        )
    )
    with pytest.raises(WhetstoneError, match="one temperature > 0 per sample"):
        collate(samples, temperatures=[0.0])
    with pytest.raises(WhetstoneError, match="got 2 for 1 samples"):
        collate(samples, temperatures=[1.0, 1.0])
