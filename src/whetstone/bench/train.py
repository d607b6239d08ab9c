"""Training throughput: whetstone's model against transformers' Qwen3MoeForCausalLM, side by side.

Both train the same tiny MoE (the embedded default `ModelConfig`) from the same initial weights
(converted with whetstone's own HF converter), on the same batches, with the same threads, dtype
and optimizer (AdamW, forward + backward + step). Each does what its library does by default:
transformers with its standard loss (`labels=`, router aux loss included) and its default
experts and attention implementations; whetstone with its target-logprob head and aux loss.
Rounds interleave the two (alternating who goes first) so that load from other processes on
shared cores hits both alike; warm-up steps are excluded. `speedup_ceiling` is transformers'
step time over the time whetstone's step spends in matmuls and fused attention (`kernels.py`):
both run the same products, so no change to whetstone's other code could reach past it.

    whetstone bench train --json
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from whetstone.bench.kernels import dense_kernel_seconds
from whetstone.errors import WhetstoneError
from whetstone.model import ModelConfig, Transformer, ops
from whetstone.model.hf import save_hf
from whetstone.utils.runtime import configure_process, resolve_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _whetstone_step(model: Transformer, optimizer, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    with ops.training_kernels():  # as mid-training runs
        out = model(inputs, targets=targets)
    loss = -out.logprobs.mean() + model.cfg.router_aux_loss_coef * out.aux_loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def _hf_step(model, optimizer, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    # transformers shifts `labels` itself; `shift_labels` gives it exactly our targets.
    out = model(inputs, labels=inputs, shift_labels=targets, output_router_logits=True)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    optimizer.step()
    return out.loss.item()


def _hf_model(model: Transformer, experts_implementation: str | None):
    try:
        from transformers import Qwen3MoeForCausalLM
    except ImportError:
        raise WhetstoneError("the train benchmark needs transformers: pip install 'whetstone[bench]'") from None
    with tempfile.TemporaryDirectory() as folder:
        save_hf(model, Path(folder) / "model")
        kwargs = {"experts_implementation": experts_implementation} if experts_implementation else {}
        return Qwen3MoeForCausalLM.from_pretrained(Path(folder) / "model", dtype=torch.float32, **kwargs)


def run(
    steps: int = 24,
    batch_size: int = 8,
    seq_len: int = 256,
    threads: int = 2,
    dtype: str = "auto",
    warmup: int = 2,
    rounds: int = 6,
    lr: float = 1e-3,
    seed: int = 0,
    hf_experts_implementation: str | None = None,
    config: ModelConfig | None = None,
) -> dict:
    """Train both for `steps` measured steps each (in `rounds` interleaved blocks) and compare.

    `hf_experts_implementation` picks transformers' MoE kernel (None = its default, which on
    this version is "grouped_mm"; "eager" is the per-expert mask loop of older releases).
    `config` replaces the embedded default model (tests use a smaller one). `dtype` "auto" is
    mid-training's default: bfloat16 where the CPU multiplies it natively, else float32.
    """
    dtype = resolve_dtype(dtype)
    if dtype not in DTYPES:
        raise WhetstoneError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    if steps < rounds or rounds < 1:
        raise WhetstoneError(f"steps ({steps}) must be >= rounds ({rounds}) >= 1")
    if threads < 0:
        raise WhetstoneError(f"threads must be >= 0 (0: every core), got {threads}")
    configure_process(threads)
    cfg = config or ModelConfig()
    if not cfg.num_experts:
        raise WhetstoneError("the train benchmark compares MoE models: config.num_experts must be > 0")
    torch.manual_seed(seed)
    ours = Transformer(cfg)
    theirs = _hf_model(ours, hf_experts_implementation)
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1), generator=generator) for _ in range(8)]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]

    contenders: dict[str, tuple[Callable, torch.nn.Module]] = {
        "whetstone": (_whetstone_step, ours),
        "hf": (_hf_step, theirs),
    }
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=lr, fused=True) for name, (_, m) in contenders.items()}

    def autocast():  # entered once per step: autocast keeps its bf16 copies of the weights until
        # its block exits, so a block around several steps would train on stale copies
        return torch.autocast("cpu", dtype=DTYPES[dtype], enabled=dtype != "float32")

    losses: dict[str, list[float]] = {name: [] for name in contenders}
    wall: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}

    def train(name: str, count: int, offset: int) -> tuple[float, float]:
        step, model = contenders[name]
        start, start_cpu = time.perf_counter(), time.process_time()
        for i in range(count):
            inputs, targets = batches[(offset + i) % len(batches)]
            with autocast():
                losses[name].append(step(model, optimizers[name], inputs, targets))
        return time.perf_counter() - start, time.process_time() - start_cpu

    for name in contenders:
        train(name, warmup, 0)
    per_round = [steps // rounds + (r < steps % rounds) for r in range(rounds)]
    done = 0
    for r, count in enumerate(per_round):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            seconds, cpu_seconds = train(name, count, warmup + done)
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)
        done += count

    def whetstone_step() -> None:
        with autocast():
            _whetstone_step(ours, optimizers["whetstone"], *batches[0])

    profiled_start = time.perf_counter()
    dense_s = dense_kernel_seconds(whetstone_step, calls=2)
    profiled_step_s = (time.perf_counter() - profiled_start) / 2
    tokens = batch_size * seq_len
    rate = {name: tokens * steps / sum(wall[name]) for name in contenders}
    round_ratios = [h / w for w, h in zip(wall["whetstone"], wall["hf"])]
    import transformers

    return {
        "whetstone_tokens_per_s": round(rate["whetstone"], 1),
        "hf_tokens_per_s": round(rate["hf"], 1),
        "speedup_vs_hf": round(rate["whetstone"] / rate["hf"], 3),
        "speedup_median_of_rounds": round(statistics.median(round_ratios), 3),
        "speedup_per_round": [round(x, 3) for x in round_ratios],
        # CPU seconds of this process per step: steadier than wall time when other processes
        # share the cores (with threads > 1 it also counts OpenMP spin-waiting).
        "whetstone_cpu_s_per_step": round(sum(cpu["whetstone"]) / steps, 4),
        "hf_cpu_s_per_step": round(sum(cpu["hf"]) / steps, 4),
        "speedup_cpu_time": round(sum(cpu["hf"]) / sum(cpu["whetstone"]), 3),
        # Matmuls and fused attention of one whetstone step, and the speedup if all else were free.
        # The share is of the profiled steps' own wall time, so load between measurements cannot
        # push it past 1.
        "whetstone_dense_kernel_s_per_step": round(dense_s, 4),
        "dense_kernel_share": round(dense_s / profiled_step_s, 3),
        "speedup_ceiling": round(tokens / rate["hf"] / dense_s, 3),
        "first_loss": {name: round(values[0], 5) for name, values in losses.items()},
        "last_loss": {name: round(values[-1], 5) for name, values in losses.items()},
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "threads": threads,
        "dtype": dtype,
        "lr": lr,
        "parameters": ours.num_parameters(),
        "active_parameters": ours.num_parameters(active=True),
        "model": cfg.model_dump(),
        "transformers_version": transformers.__version__,
        "hf_experts_implementation": theirs.config._experts_implementation,
        "hf_attn_implementation": theirs.config._attn_implementation,
    }


if __name__ == "__main__":  # `whetstone bench train`, options included
    from whetstone.bench.cli import run_as_module

    run_as_module("train")
