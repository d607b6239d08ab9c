"""Engine vs trainer numerics: how far the trainer's logprobs and router choices are from the
rollout's, and what batch-invariant numerics cost, `fast` and `invariant` side by side.

For each mode, on the same random MoE (big enough that matmuls, not Python, set the pace):

- the inference engine generates rollouts with continuous batching (more requests than slots,
  prompts and completions of different lengths, chunked prefill, KV cache), temperature 1;
- the rollouts go the orchestrator's way (`ModelCall` -> `trajectory_samples` -> `collate`),
  into one batch in another order, and the trainer's `forward_logprobs` computes the logprobs
  of the completion tokens and its own router choices (no replay) for every token fed;
- mismatch: max |Δ|, k3 KL (as the RL loss logs it), the fraction of tokens whose logprob is
  bit-for-bit the rollout's, and the fraction of (token, MoE layer) router choices whose
  expert set differs;
- cost: the engine's generated tokens/s and the trainer's tokens/s (RL `train_step`: forward,
  backward, AdamW), each mode timed in interleaved rounds (alternating who goes first) so load
  from other processes hits both alike. overhead = fast throughput / invariant throughput, over
  all rounds; the median of the per-round ratios is reported beside it (steadier when other
  processes share the cores). One thread each by default: on 2 cores the engine and the
  trainer each own one.

    whetstone bench consistency --json
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time

import torch

from whetstone.bench.options import check_at_least
from whetstone.envs.trajectory import ModelCall, Segment, Trajectory
from whetstone.errors import WhetstoneError
from whetstone.inference.config import EngineConfig
from whetstone.inference.engine import Engine
from whetstone.inference.sampling import SamplingParams
from whetstone.inference.sequence import Sequence
from whetstone.model import ModelConfig, Transformer
from whetstone.rl.batch import Batch, collate
from whetstone.rl.loss import k3
from whetstone.rl.samples import trajectory_samples
from whetstone.trainer.step import Learner, StepSettings, forward_logprobs, train_step
from whetstone.utils.device import resolve_device, synchronize
from whetstone.utils.runtime import configure_process

MODES = ("fast", "invariant")
BENCH_MODEL = ModelConfig(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    max_position_embeddings=512,
)
"""46.7M parameters, 18.4M active: the matmuls dominate a step, as in a real model."""


def rollout_batch(seqs: list[Sequence], order: list[int] | None = None) -> Batch:
    """The engine's finished sequences as the trainer gets them: one single-call trajectory each,
    turned into samples and collated (right-padded) in `order` (default: as given)."""
    samples = []
    for index in order if order is not None else range(len(seqs)):
        seq = seqs[index]
        call = ModelCall.from_sequence(seq)
        trajectory = Trajectory(
            task_id=seq.request_id, group_id=seq.request_id, reward=0.0, segments=[Segment(calls=[call])]
        )
        samples.extend(trajectory_samples(trajectory))
    return collate(samples)


def mismatch(model: Transformer, batch: Batch, dtype: str, numerics: str) -> dict:
    """The trainer's forward on `batch` (no replay) against the rollout's logprobs and routes."""
    model.train()
    logprobs = forward_logprobs(model, batch, replay=False, dtype=dtype, numerics=numerics).logprobs
    trained = batch.loss_mask
    ours, theirs = logprobs.detach()[trained], batch.behavior_logprobs[trained]
    # Router choices of every token fed (prompt and completion): the same forward, counted at
    # every real position instead of the trained ones.
    every_token = dataclasses.replace(batch, loss_mask=batch.target_ids >= 0)
    with torch.no_grad():
        routing = forward_logprobs(model, every_token, replay=False, dtype=dtype, numerics=numerics).routing
    return {
        "max_abs_logprob_diff": float((ours - theirs).abs().max()),
        "k3_kl": float(k3(theirs.double(), ours.double()).mean()),  # fp32 would round it to 0
        "bitwise_equal_fraction": float((ours == theirs).float().mean()),
        "routing_disagreement": routing.metrics()["routing_disagreement"],
        "tokens": int(trained.sum()),
        "router_choices": int(routing.choices),
    }


def _requests(count: int, vocab: int, prompt_tokens: int, new_tokens: int, seed: int):
    """Prompts and completions of different lengths (so sequences join and leave the batch)."""
    generator = torch.Generator().manual_seed(seed)
    prompts, params = [], []
    for i in range(count):
        length = prompt_tokens // 2 + int(torch.randint(0, prompt_tokens, (), generator=generator))
        prompts.append(torch.randint(0, vocab, (length,), generator=generator).tolist())
        max_tokens = new_tokens // 2 + int(torch.randint(0, new_tokens, (), generator=generator))
        params.append(SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=seed + i))
    return prompts, params


def run(
    threads: int = 1,
    dtype: str = "float32",
    requests: int = 16,
    max_batch: int = 6,
    prompt_tokens: int = 64,
    new_tokens: int = 64,
    train_steps: int = 2,
    rounds: int = 5,
    seed: int = 0,
    config: ModelConfig | None = None,
    device: str = "cpu",
) -> dict:
    """Measure both modes (see the module docstring) on `device` (the engines and the trainers);
    `config` replaces BENCH_MODEL (tests, the GPU bench)."""
    if dtype not in ("float32", "bfloat16"):
        raise WhetstoneError(f"dtype {dtype!r} is not float32 or bfloat16")
    check_at_least(
        ("threads", threads, 0),  # 0: every core
        ("rounds", rounds, 1),
        ("train_steps", train_steps, 1),
        ("requests", requests, 1),
    )
    configure_process(threads)
    target = resolve_device(device)
    cfg = config or BENCH_MODEL
    torch.manual_seed(seed)
    model = Transformer(cfg).to(target)
    trainers = {mode: copy.deepcopy(model) for mode in MODES}  # these take optimizer steps
    optimizers = {mode: torch.optim.AdamW(trainers[mode].parameters(), lr=1e-6) for mode in MODES}
    context = 2 * prompt_tokens + 2 * new_tokens
    engines = {
        mode: Engine(
            copy.deepcopy(model),  # its own: a fast CPU engine stores its weights column-major in place
            EngineConfig(
                max_batch=max_batch,
                context_limit=context,
                prefill_chunk=32,
                numerics=mode,
                dtype=dtype,
                device=str(target),
            ),
        )
        for mode in MODES
    }
    prompts, params = _requests(requests, cfg.vocab_size, prompt_tokens, new_tokens, seed)
    order = list(range(requests))[::-1]  # the trainer's batch is not the engine's

    def generate(mode: str) -> tuple[float, list[Sequence]]:
        start = time.perf_counter()
        seqs = engines[mode].generate(prompts, params)
        return time.perf_counter() - start, seqs

    def train(mode: str, batch: Batch) -> float:
        start = time.perf_counter()
        for _ in range(train_steps):
            train_step(
                Learner(trainers[mode], optimizers[mode]),
                batch,
                StepSettings(grad_clip=1.0, micro_batch_size=8, dtype=dtype, numerics=mode),
                lr=1e-6,
            )
        synchronize(target)
        return time.perf_counter() - start

    results, batches = {}, {}
    for mode in MODES:  # warm-up (not timed), and the mismatch figures
        _, seqs = generate(mode)
        batches[mode] = rollout_batch(seqs, order).to(target)
        results[mode] = mismatch(model, batches[mode], dtype, mode)
        train(mode, batches[mode])
    generate_s = {mode: [] for mode in MODES}
    train_s = {mode: [] for mode in MODES}
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            generate_s[mode].append(generate(mode)[0])
            train_s[mode].append(train(mode, batches[mode]))

    generated = sum(p.max_tokens for p in params)
    trained = train_steps * sum(row["num_positions"] for row in batches["fast"].rows)
    engine_rate = {mode: generated * rounds / sum(generate_s[mode]) for mode in MODES}
    trainer_rate = {mode: trained * rounds / sum(train_s[mode]) for mode in MODES}
    for mode in MODES:
        results[mode]["overhead_engine"] = round(engine_rate["fast"] / engine_rate[mode], 3)
        results[mode]["overhead_trainer"] = round(trainer_rate["fast"] / trainer_rate[mode], 3)
    engine_rounds = [i / f for f, i in zip(generate_s["fast"], generate_s["invariant"])]
    trainer_rounds = [i / f for f, i in zip(train_s["fast"], train_s["invariant"])]
    return {
        **results,
        "engine_tokens_per_s": {mode: round(rate, 1) for mode, rate in engine_rate.items()},
        # CUDA graphs replayed by each engine's decode (False off CUDA, or after a failed capture)
        "engine_replays_graphs": {mode: engines[mode].decoder.graphs for mode in MODES},
        "trainer_tokens_per_s": {mode: round(rate, 1) for mode, rate in trainer_rate.items()},
        "overhead_engine_per_round": [round(x, 3) for x in engine_rounds],
        "overhead_trainer_per_round": [round(x, 3) for x in trainer_rounds],
        "overhead_engine_median_of_rounds": round(statistics.median(engine_rounds), 3),
        "overhead_trainer_median_of_rounds": round(statistics.median(trainer_rounds), 3),
        "threads": threads,
        "device": str(target),
        "dtype": dtype,
        "requests": requests,
        "max_batch": max_batch,
        "generated_tokens": generated,
        "trained_tokens_per_step": trained // train_steps,
        "rounds": rounds,
        "parameters": model.num_parameters(),
        "active_parameters": model.num_parameters(active=True),
        "model": cfg.model_dump(),
    }


if __name__ == "__main__":  # `whetstone bench consistency`, options included
    from whetstone.bench.cli import run_as_module

    run_as_module("consistency")
