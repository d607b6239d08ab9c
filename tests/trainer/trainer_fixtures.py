"""A tiny real world for the trainer tests: an HF folder of a tiny random MoE, and batches made
the way the orchestrator makes them (the inference engine samples groups of rollouts with
logprobs and routes; a reward scores them; `rl` turns them into samples and batches).

A plain module, not a conftest: conftest names clash across test folders."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.model.conftest import tiny_config
from whetstone.envs.trajectory import ModelCall, Segment, Trajectory
from whetstone.inference.config import EngineConfig
from whetstone.inference.engine import Engine
from whetstone.inference.sampling import SamplingParams
from whetstone.model import Transformer
from whetstone.model.hf import load_hf, save_hf
from whetstone.rl.advantages import AdvantageConfig
from whetstone.rl.advantages.groups import score_groups
from whetstone.rl.batch import Batch, collate
from whetstone.rl.batch_store import put_batch
from whetstone.rl.samples import trajectory_samples
from whetstone.store import LocalStore, ObjectStore
from whetstone.tokenizer import Tokenizer, render_chat
from whetstone.trainer.config import TrainerConfig

TINY_MOE = tiny_config(vocab_size=64, num_hidden_layers=2, mlp_only_layers=[])
PROMPTS = ([1, 2, 3, 4], [5, 6, 7])
GROUP_SIZE, COMPLETION_TOKENS = 4, 6
TRANSCRIPTS = [
    [{"role": "user", "content": "add one"}, {"role": "assistant", "content": "return x + 1"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "double it"},
        {"role": "assistant", "content": "return x * 2"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "done"},
    ],
    [{"role": "user", "content": "negate"}, {"role": "assistant", "content": "return -x"}],
]
"""Demonstrations for the behaviour-cloning anchor (`rl.demos`)."""


def save_tiny_moe(folder: Path, seed: int = 0, tokenizer_dir: Path | None = None, **changes) -> Path:
    """`changes` of the config, e.g. num_experts=0 for a dense model."""
    torch.manual_seed(seed)
    return save_hf(Transformer(TINY_MOE.model_copy(update=changes)), folder, tokenizer_dir=tokenizer_dir)


def save_chat_moe(folder: Path, tokenizer_dir: Path) -> Path:
    """The tiny MoE with a real chat tokenizer in its folder (the trainer reads demonstrations
    with the policy's tokenizer): TINY_MOE at the tokenizer's vocabulary size."""
    tokenizer = Tokenizer.train([render_chat(t) for t in TRANSCRIPTS] * 20, vocab_size=512)
    tokenizer.save(tokenizer_dir)
    return save_tiny_moe(folder, tokenizer_dir=tokenizer_dir, vocab_size=tokenizer.vocab_size)


def low_token_reward(completion: list[int]) -> float:
    """The task the tests teach: emit tokens from the lower half of the vocabulary."""
    return sum(token < TINY_MOE.vocab_size // 2 for token in completion) / len(completion)


def make_batches(
    model_dir: Path, count: int, seed: int = 0, numerics: str = "fast", device: str = "cpu", dtype: str = "float32"
) -> list[Batch]:
    """`count` batches, each of len(PROMPTS) groups of GROUP_SIZE rollouts sampled by the engine
    (on `device`, computing in `dtype`)."""
    config = EngineConfig(max_batch=8, context_limit=32, numerics=numerics, device=device, dtype=dtype)
    engine = Engine(load_hf(model_dir), config)
    batches = []
    for index in range(count):
        prompts = [prompt for prompt in PROMPTS for _ in range(GROUP_SIZE)]
        params = [
            SamplingParams(max_tokens=COMPLETION_TOKENS, ignore_eos=True, seed=seed * 1000 + index * 100 + i)
            for i in range(len(prompts))
        ]
        trajectories = []
        for i, seq in enumerate(engine.generate(prompts, params)):
            call = ModelCall.from_sequence(seq)
            trajectories.append(
                Trajectory(
                    task_id=f"p{i // GROUP_SIZE}",
                    group_id=f"b{index}g{i // GROUP_SIZE}",
                    reward=low_token_reward(seq.output_ids),
                    segments=[Segment(calls=[call])],
                )
            )
        if engine.device.type == "cuda":  # sampled through the decode graphs, not eager steps after a failed capture
            assert engine.stats.graph_captures_total > 0 and engine.decoder.graphs
        kept, report = score_groups(trajectories, AdvantageConfig())
        samples = [s for trajectory, advantage in kept for s in trajectory_samples(trajectory, advantage)]
        rewards = [t.reward for t in trajectories]
        meta = {
            "index": index,
            "trainer_step": index,
            "staleness_histogram": {"0": len(samples)},
            "groups": report.metrics(),
            "reward_mean": sum(rewards) / len(rewards),
            "samples": len(samples),
            "rollouts": len(trajectories),
        }
        batches.append(collate(samples, meta=meta))
    return batches


def put_batches(store: Path | ObjectStore, batches: list[Batch], first: int = 0) -> None:
    store = store if isinstance(store, ObjectStore) else LocalStore(store)
    for offset, batch in enumerate(batches):
        put_batch(store, first + offset, batch)


def trainer_config(root: Path, model_dir: Path, **changes) -> TrainerConfig:
    """A trainer over `root/batches`, publishing fp32 to `root/weights`, writing `root/trainer`."""
    fields = dict(
        model_path=str(model_dir),
        batch_store=str(root / "batches"),
        output_dir=str(root / "trainer"),
        sync={"store": str(root / "weights"), "publish_dtype": "float32"},
        micro_batch_size=3,
        optimizer={"lr": 1e-2, "warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay": 0.0},
        poll_interval=0.02,
        idle_timeout=0.3,
        checkpoint_interval=3,
    )
    return TrainerConfig(**(fields | changes))
