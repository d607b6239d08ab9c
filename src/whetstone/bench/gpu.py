"""`whetstone bench gpu`: whetstone on one accelerator against transformers on the same model, in
one run that prints one JSON object. Sizes default to the GPU figures of docs/benchmarks.md: the
380M Qwen3-MoE (`GPU_MODEL`), bf16 autocast over fp32 weights. `--model tiny` runs every section
on a few-M model so that a CPU can run the whole command in seconds (the tests do).

- `train`: whetstone's model and transformers' `Qwen3MoeForCausalLM` converted from it
  (`model.hf`: the same weights), each on the device in turn with only its own weights and
  optimizer there, the same batches (8 x 1024), bf16 autocast, fused AdamW, transformers with its
  default experts and attention implementations (grouped_mm and SDPA in transformers 5): tokens/s,
  `speedup_vs_hf`, peak memory of each (torch.cuda.max_memory_allocated; none on a CPU).
  About 40 s on an H100: the conversion, 2 warm-up and 8 timed steps each.
- `inference`: the engine's offline `generate` against transformers' `generate` (bf16 weights,
  greedy, EOS ignored) with its default cache and with `cache_implementation="static"`, which
  transformers compiles on CUDA; 64-token prompts, 128 new tokens, at batch 16 and 64. For each:
  the first call's seconds (CUDA-graph capture, compilation) and the best of the timed calls
  after it. Then the swap pause: RL-like weight versions published by a trainer process reach an
  engine decoding a full batch through weight sync (`bench.inference.swap_pauses`); the median
  pause against the decode step. About 2-3 minutes on an H100, most of it transformers' default
  cache (~6 s a call at batch 64) and its compilation (~20 s per batch size). `engine_profile`:
  one more engine call at the largest batch under torch's profiler, showing where its time goes
  (device busy against wall time, the kernels and host ops that cost the most).
- `rl`: the RL stage of `whetstone run` (`bench.pipeline`: one `whetstone serve`, the trainer and
  the orchestrator as processes, all on the device) on coin tasks, asynchronous, bf16, fast
  numerics, router replay: samples/s and the trainer's busy fraction, and the trainer-vs-engine
  logprob mismatch the trainer logs (k3 KL, max |Δ|) over the steps trained on-policy
  (staleness 0), where it is numerics alone. About 1-2 minutes on an H100, most of it the roles'
  start and the publishing of each version. `--rl-synchronous` runs it on-policy (the
  orchestrator's synchronous mode: each batch sampled with the weights it trains), so every step's
  mismatch is numerics alone: with `--rl-numerics invariant`, 0 in every step.

A section that fails reports `{"error": ...}` and the others still run.

    whetstone bench gpu --json
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from whetstone.bench.options import check_at_least
from whetstone.errors import WhetstoneError
from whetstone.model import ModelConfig, Transformer
from whetstone.utils.device import autocast, resolve_device, synchronize
from whetstone.utils.runtime import configure_process

GPU_MODEL = ModelConfig(
    vocab_size=32768,
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=384,
    tie_word_embeddings=False,
)
"""380M parameters (the figures of docs/benchmarks.md were taken on it with transformers)."""

SECTIONS = ("train", "inference", "rl", "consistency")
DTYPE = "bfloat16"
SYNC_WORKERS = 8
"""Weight-sync threads of the RL section's trainer and server on a GPU machine (16 cores on the
H200 one): with one, publishing the 380M model took 6-8 s of every ~7 s step."""
LOAD_ROUNDS = 8
"""Full batches queued for the swap measurement, so the engine still decodes a full batch when
the last version arrives, on a device where a step takes milliseconds."""


def model_config(name: str) -> ModelConfig:
    """`gpu`: `GPU_MODEL`; `tiny`: the embedded default run's 1.9M MoE."""
    from whetstone.midtrain.config import MidtrainModelConfig

    models = {"gpu": GPU_MODEL, "tiny": MidtrainModelConfig()}
    if name not in models:
        raise WhetstoneError(f"model must be one of {', '.join(models)}, got {name!r}")
    return models[name]


def say(message: str) -> None:
    """A progress line on stderr (stdout is for the JSON)."""
    print(f"[bench gpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free(device: torch.device) -> None:
    """Give what the last section left back to the device (the next one measures its own peak)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 1e9, 3) if device.type == "cuda" else None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# -- train ------------------------------------------------------------------------------------------


def train(cfg: ModelConfig, device: torch.device, batch_size: int, seq_len: int, steps: int, warmup: int, seed: int):
    """Tokens/s and peak memory of whetstone and transformers training the same model."""
    from whetstone.bench.train import _hf_model, _hf_step, _whetstone_step

    torch.manual_seed(seed)
    ours = Transformer(cfg)
    theirs = _hf_model(ours, None)  # transformers' default experts and attention implementations
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1), generator=generator) for _ in range(4)]
    batches = [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in tokens]
    sides = {}
    for name, step, model in (("whetstone", _whetstone_step, ours), ("hf", _hf_step, theirs)):
        say(f"train: {name}, {warmup} warm-up and {steps} timed steps of {batch_size} x {seq_len}")
        sides[name] = _train_side(step, model, batches, device, steps, warmup)
        free(device)
    rate = {name: batch_size * seq_len * steps / side.pop("seconds") for name, side in sides.items()}
    return {
        "whetstone_tokens_per_s": round(rate["whetstone"], 1),
        "hf_tokens_per_s": round(rate["hf"], 1),
        "speedup_vs_hf": round(rate["whetstone"] / rate["hf"], 3),
        "whetstone_peak_memory_gb": sides["whetstone"]["peak_memory_gb"],
        "hf_peak_memory_gb": sides["hf"]["peak_memory_gb"],
        "first_loss": {name: side["first_loss"] for name, side in sides.items()},
        "last_loss": {name: side["last_loss"] for name, side in sides.items()},
        "batch_size": batch_size,
        "seq_len": seq_len,
        "steps": steps,
        "warmup": warmup,
        "dtype": DTYPE,
        "optimizer": "AdamW (fused)",
        "hf_experts_implementation": theirs.config._experts_implementation,
        "hf_attn_implementation": theirs.config._attn_implementation,
    }


def _train_side(step: Callable, model: torch.nn.Module, batches: list, device: torch.device, steps: int, warmup: int):
    """Train `model` alone on the device; it goes back to the CPU after, with its optimizer freed."""
    reset_peak_memory(device)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    losses = []

    def block(count: int, offset: int) -> float:
        synchronize(device)
        started = time.perf_counter()
        for i in range(count):
            with autocast(DTYPE, device):  # entered per step: autocast's bf16 weight copies live as long as it
                losses.append(step(model, optimizer, *batches[(offset + i) % len(batches)]))
        synchronize(device)
        return time.perf_counter() - started

    block(warmup, 0)
    seconds = block(steps, warmup)
    model.to("cpu")  # the optimizer's state goes with this call's frame; the caller frees the device
    return {
        "seconds": seconds,
        "peak_memory_gb": peak_memory_gb(device),
        "first_loss": round(losses[0], 5),
        "last_loss": round(losses[-1], 5),
    }


# -- inference --------------------------------------------------------------------------------------


def inference(
    cfg: ModelConfig,
    device: torch.device,
    batches: list[int],
    prompt_tokens: int,
    new_tokens: int,
    repeats: int,
    swaps: int,
    seed: int,
) -> dict:
    """Generation tokens/s of the engine and of transformers' two caches, and the swap pause
    (`swaps` = 0: not measured)."""
    from whetstone.inference.config import EngineConfig
    from whetstone.inference.engine import Engine

    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    hf: Any = None
    try:
        hf = _hf_generator(model, device)
    except Exception as err:  # the engine's figures still come; the baselines say why they are missing
        traceback.print_exc(file=sys.stderr)
        hf = f"{type(err).__name__}: {err}"
    model.to(device)
    config = EngineConfig(
        max_batch=max(batches),
        context_limit=prompt_tokens + new_tokens,
        # a whole batch's prompts in one prefill, as transformers' generate does (the default
        # budget, 512 tokens between decode steps, bounds the stall of running sequences)
        prefill_tokens_per_step=max(batches) * prompt_tokens,
        dtype=DTYPE,
        device=str(device),
    )
    engine = Engine(model, config)
    # where the engine runs a step ahead (CUDA), the same engine one step at a time beside it
    one_step = Engine(model, config.model_copy(update={"overlap_steps": False})) if engine.overlap else None
    result: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "dtype": DTYPE,
        "engine_config": engine.config.model_dump(),
        "hf_static_compiled": device.type == "cuda",  # transformers compiles the static cache on CUDA only
    }
    for batch in batches:
        say(f"inference: batch {batch}, {prompt_tokens}-token prompts, {new_tokens} new tokens")
        result[f"batch_{batch}"] = _generation(
            engine, one_step, hf, device, batch, prompt_tokens, new_tokens, repeats, seed
        )
        # each part's figures into the log as they come: a section stopped by its time bound
        # prints no JSON, and these are left
        say(f"inference: batch_{batch} = {json.dumps(result[f'batch_{batch}'])}")
    say(f"inference: profiling one engine call at batch {max(batches)}")
    try:  # the profiler's CUDA side never decides the section: its figures above stand
        result["engine_profile"] = engine_profile(engine, device, max(batches), prompt_tokens, new_tokens, seed)
    except Exception as err:  # reported in the section, with the error's type
        result["engine_profile"] = {"error": f"{type(err).__name__}: {err}"}
    say(f"inference: engine_profile = {json.dumps(result['engine_profile'])}")
    # whether the engine's decode steps replayed CUDA graphs (a capture that fails falls back to
    # eager steps, with a warning in the log, and the figures above are those of eager decoding)
    result["engine_graph_captures"] = engine.stats.graph_captures_total
    result["engine_replays_graphs"] = engine.decoder.graphs
    del hf, engine, one_step
    free(device)
    if swaps:
        result.update(_swap(model, device, swaps, prompt_tokens, seed))
    del model
    free(device)
    return result


def engine_profile(engine, device: torch.device, batch: int, prompt_tokens: int, new_tokens: int, seed: int) -> dict:
    """Where one `generate` call's time goes, under torch's profiler (which slows the host: a
    diagnosis, not a figure to compare): its wall time against the time the device was busy
    (kernels and copies; none on a CPU), the decode steps it took, and the ops that took the most
    host time and the kernels that took the most device time, with their counts. A device busy
    for much less than the wall time means the steps wait on the host."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from whetstone.bench.inference import _prompts
    from whetstone.inference.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    prompts = _prompts(batch, prompt_tokens, engine.vocab_size, seed=seed * 1000 + batch + 999).tolist()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    steps = engine.stats.decode_steps_total
    with profile(activities=activities) as profiler:
        started = time.perf_counter()
        engine.generate(prompts, greedy)
        synchronize(device)
        wall = time.perf_counter() - started
    steps = engine.stats.decode_steps_total - steps
    kernels: dict[str, list[float]] = {}
    for event in profiler.events():
        if event.device_type != DeviceType.CPU:
            total = kernels.setdefault(event.name[:100], [0.0, 0])
            total[0] += event.time_range.elapsed_us()
            total[1] += 1
    busy_us = sum(total for total, _ in kernels.values())
    host = sorted(profiler.key_averages(), key=lambda a: -a.self_cpu_time_total)[:10]
    return {
        "batch": batch,
        "wall_s": round(wall, 4),
        "decode_steps": steps,
        "wall_ms_per_decode_step": round(wall * 1e3 / max(steps, 1), 3),
        "device_busy_s": round(busy_us / 1e6, 4) if kernels else None,
        "device_busy_fraction": round(busy_us / 1e6 / wall, 3) if kernels else None,
        "device_kernels": sum(count for _, count in kernels.values()) if kernels else None,
        "top_device_kernels": [
            {"name": name, "ms": round(total / 1e3, 3), "count": count}
            for name, (total, count) in sorted(kernels.items(), key=lambda item: -item[1][0])[:12]
        ],
        "top_host_ops": [{"name": a.key, "ms": round(a.self_cpu_time_total / 1e3, 3), "count": a.count} for a in host],
    }


def _swap(model: Transformer, device: torch.device, swaps: int, prompt_tokens: int, seed: int) -> dict:
    """The median pause of `swaps` RL-like versions against the decode step of a full batch of 16."""
    from whetstone.bench.inference import swap_pauses
    from whetstone.inference.config import EngineConfig

    say(f"inference: swap pause of {swaps} weight versions while decoding a full batch")
    config = EngineConfig(
        max_batch=16,
        context_limit=model.cfg.max_position_embeddings,
        dtype=DTYPE,
        device=str(device),
    )
    swap = swap_pauses(model, swaps, prompt_tokens, seed, config, load_rounds=LOAD_ROUNDS)
    return {
        "swap_pause_ms": round(swap["delta_ms"], 3),
        "swap_pause_ms_full_state": round(swap["full_ms"], 3),
        "decode_step_ms_batch_16": round(swap["decode_step_ms"], 3),
        "swap_pause_over_decode_step": round(swap["delta_ms"] / swap["decode_step_ms"], 3),
        "swaps": swap["deltas"],
    }


def _hf_generator(model: Transformer, device: torch.device):
    """transformers' Qwen3-MoE with `model`'s weights in bf16 on `device` (how it generates on a GPU)."""
    from whetstone.model.hf import save_hf

    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise WhetstoneError("the transformers baseline needs transformers: pip install 'whetstone[bench]'") from None
    with tempfile.TemporaryDirectory() as folder:
        hf_dir = save_hf(model, Path(folder) / "model")
        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to(device).eval()


def _generation(
    engine,
    one_step,
    hf,
    device: torch.device,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    repeats: int,
    seed: int,
):
    """One batch size: each contender's first call (capture, compilation), then `repeats` timed
    calls, the same prompts for all in each round (new ones every round). `one_step` is the
    engine one decode step at a time, where `engine` runs one ahead (else None); `hf` is the
    transformers model, or why there is none; a baseline that fails is reported in `errors`."""
    from whetstone.bench.inference import _prompts, hf_generate
    from whetstone.inference.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    contenders = {
        "whetstone": lambda prompts: [s.output_ids for s in engine.generate(prompts.tolist(), greedy)],
        "whetstone_one_step": lambda prompts: [s.output_ids for s in one_step.generate(prompts.tolist(), greedy)],
        "hf": lambda prompts: hf_generate(hf, prompts.to(device), new_tokens, None),
        "hf_static": lambda prompts: hf_generate(hf, prompts.to(device), new_tokens, "static"),
    }
    if one_step is None:
        del contenders["whetstone_one_step"]
    calls: dict[str, list[float]] = {}
    outputs: dict[str, list[list[int]]] = {}
    errors: dict[str, str] = {}
    for name, generate in contenders.items():
        if name.startswith("hf") and isinstance(hf, str):
            errors[name] = hf
            continue
        try:
            calls[name] = []
            for round_ in range(repeats + 1):
                prompts = _prompts(batch, prompt_tokens, engine.vocab_size, seed=seed * 1000 + batch + round_)
                synchronize(device)
                started = time.perf_counter()
                outputs[name] = generate(prompts)
                synchronize(device)
                calls[name].append(time.perf_counter() - started)
        except Exception as err:
            if name.startswith("whetstone"):
                raise
            traceback.print_exc(file=sys.stderr)
            errors[name] = f"{type(err).__name__}: {err}"
            del calls[name]
    best = {name: min(times[1:]) for name, times in calls.items()}
    rate = {name: batch * new_tokens / seconds for name, seconds in best.items()}

    def speedup(baseline: str) -> float | None:
        return round(rate["whetstone"] / rate[baseline], 3) if baseline in rate else None

    matching = None
    if "hf" in outputs:  # greedy bf16 on both sides: equal until rounding flips a near-tie, then rows diverge
        same = sum(a == b for x, y in zip(outputs["whetstone"], outputs["hf"]) for a, b in zip(x, y))
        matching = round(same / (batch * new_tokens), 4)
    return {
        **{f"{name}_tokens_per_s": round(rate[name], 1) if name in rate else None for name in contenders},
        "speedup_vs_hf": speedup("hf"),
        "speedup_vs_hf_static": speedup("hf_static"),
        # running a decode step ahead against one step at a time (CUDA only)
        "speedup_vs_one_step": speedup("whetstone_one_step"),
        "first_call_s": {name: round(times[0], 3) for name, times in calls.items()},
        "call_s": {name: round(seconds, 4) for name, seconds in best.items()},
        # what the first call cost beyond a timed one: CUDA-graph capture, compilation, warm-up
        "capture_or_compile_s": {name: round(max(0.0, calls[name][0] - best[name]), 3) for name in calls},
        "tokens_match_hf": matching,
        "errors": errors,
    }


# -- rl ---------------------------------------------------------------------------------------------


def rl(
    cfg: ModelConfig,
    device: torch.device,
    steps: int,
    group_size: int,
    groups_per_batch: int,
    max_tokens: int,
    task_count: int,
    seed: int,
    output_dir: str | None,
    numerics: str = "fast",
    synchronous: bool = False,
) -> dict:
    """A short RL run with one server and the trainer on `device`, both in `numerics` (see the
    module docstring); asynchronous, or on-policy in every step when `synchronous`."""
    import contextlib

    from whetstone.bench.pipeline import coin_tasks, fresh_output_dir, pipeline_config, random_model, whetstone_side
    from whetstone.envs.tasks import write_tasks
    from whetstone.model.hf import read_hf_config
    from whetstone.utils.metrics import read_metrics

    with contextlib.ExitStack() as stack:
        work = fresh_output_dir(output_dir) if output_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        tasks = coin_tasks(task_count, seed)
        tasks_file = work / "coin-tasks.jsonl"
        write_tasks(tasks, tasks_file)
        model_dir = random_model(work / "bench-model", tasks, seed, config=cfg)
        config = pipeline_config(
            work,
            "rl",
            tasks_file,
            steps=steps,
            group_size=group_size,
            groups_per_batch=groups_per_batch,
            max_tokens=max_tokens,
            synchronous=synchronous,
            placement="shared",
            servers=1,
            dtype=DTYPE,
            device=str(device),
            numerics=numerics,
            sync_workers=SYNC_WORKERS if device.type == "cuda" else 1,
        )
        say(f"rl: {steps} steps of {group_size * groups_per_batch} samples, one server and the trainer on {device}")
        side = whetstone_side(config, model_dir)
        records = read_metrics(Path(side["run_dir"]) / "trainer" / "metrics.jsonl")
        with torch.device("meta"):  # shapes only
            parameters = Transformer(read_hf_config(model_dir)).num_parameters()
    # Steps trained on samples of the weights they were sampled with: the mismatch is numerics alone.
    on_policy = [r for r in records if r.get("staleness_max", 0) == 0 and "mismatch_kl_k3" in r]
    return {
        "samples_per_s": round(side["samples_per_s"], 3),
        "trainer_busy": _round(side["trainer_busy"]),
        "inference_busy": _round(side["inference_busy"]),
        "mismatch_kl_k3": _round(statistics.mean(r["mismatch_kl_k3"] for r in on_policy)) if on_policy else None,
        "max_abs_logprob_diff": _round(max(r["logprob_diff_max"] for r in on_policy)) if on_policy else None,
        "on_policy_steps": len(on_policy),
        "synchronous": synchronous,
        # Under invariant numerics: 0 in every on-policy step, and replay changes no expert.
        "max_abs_logprob_diff_per_step": [r["logprob_diff_max"] for r in on_policy],
        "routing_disagreement_max": _round(max((r.get("routing_disagreement", 0.0) for r in on_policy), default=None)),
        # the trainer's step: training, the time publishing held it up, and the whole publish
        # (encoded on the CPU while the next step trains)
        "train_s_mean": _round(statistics.mean(r["train_s"] for r in records)) if records else None,
        "publish_s_mean": _round(statistics.mean(r.get("publish_s", 0.0) for r in records)) if records else None,
        "publish_total_s_mean": _round(statistics.mean(r.get("publish_total_s", 0.0) for r in records))
        if records
        else None,
        "sync_workers": config.rl.trainer.sync.workers,
        "samples": side["samples"],
        "wall_s": round(side["wall_s"], 2),
        "steps": steps,
        "samples_per_step": group_size * groups_per_batch,
        "max_tokens": max_tokens,
        "staleness_max": side["staleness_max"],
        "numerics": config.rl.trainer.numerics,
        "router_replay": config.rl.trainer.router_replay,
        "dtype": DTYPE,
        "model_parameters": parameters,
    }


def consistency(cfg: ModelConfig, device: torch.device, requests: int, tokens: int, seed: int) -> dict:
    """The engine against the trainer in bf16, fast and invariant numerics side by side
    (`bench.consistency`): `requests` sequences of about `tokens` prompt and `tokens` generated
    tokens, all in one batch."""
    from whetstone.bench import consistency as bench

    say(f"consistency: {requests} sequences of ~{2 * tokens} tokens, fast and invariant numerics on {device}")
    result = bench.run(
        dtype=DTYPE,
        requests=requests,
        max_batch=requests,
        prompt_tokens=tokens,
        new_tokens=tokens,
        # a bf16 step of 16 x 256 tokens of the 380M model takes ~80 ms: five to a round and seven
        # rounds keep one stall from moving the trainer's ratio (three rounds of two ranged
        # 1.20-1.68 on an H200), for ~10 s more
        train_steps=5,
        rounds=7,
        seed=seed,
        config=cfg,
        device=str(device),
    )
    result.pop("model")  # the run's model_config already says it
    return result


def _round(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.4g}")


# -- the benchmark ----------------------------------------------------------------------------------


def device_info(device: torch.device) -> dict:
    """What the figures were measured on."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": props.name,
            "memory_gb": round(props.total_memory / 1e9, 1),
            "cuda": torch.version.cuda,
        }
    return {"type": device.type, "name": _cpu_name(), "cores": len(os.sched_getaffinity(0))}


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def run(
    device: str = "auto",
    model: str = "gpu",
    sections: tuple[str, ...] | list[str] = SECTIONS,
    threads: int = 0,
    train_batch: int = 8,
    train_seq_len: int = 1024,
    train_steps: int = 8,
    train_warmup: int = 2,
    batches: tuple[int, ...] | list[int] = (16, 64),
    prompt_tokens: int = 64,
    new_tokens: int = 128,
    repeats: int = 1,
    swaps: int = 3,
    rl_steps: int = 6,
    group_size: int = 4,
    groups_per_batch: int = 2,
    rl_max_tokens: int = 64,
    rl_tasks: int = 8,
    rl_numerics: str = "fast",
    rl_synchronous: bool = False,
    consistency_requests: int = 16,
    consistency_tokens: int = 128,
    output_dir: str | None = None,
    seed: int = 0,
) -> dict:
    """Every section of `sections` on `device` with `model` (`gpu` or `tiny`); see the module docstring.
    `output_dir` keeps the RL run's roles' configs, logs and metrics (default: a temporary folder)."""
    cfg = model_config(model)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        raise WhetstoneError(f"sections must be some of {', '.join(SECTIONS)}, got {', '.join(sections) or 'none'}")
    check_at_least(
        ("threads", threads, 0),  # 0: every core
        ("train_batch", train_batch, 1),
        ("train_seq_len", train_seq_len, 1),
        ("train_steps", train_steps, 1),
        ("train_warmup", train_warmup, 0),
        ("prompt_tokens", prompt_tokens, 1),
        ("new_tokens", new_tokens, 1),
        ("repeats", repeats, 1),
        ("swaps", swaps, 0),
        ("rl_steps", rl_steps, 2),
        ("group_size", group_size, 2),
        ("groups_per_batch", groups_per_batch, 1),
        ("rl_max_tokens", rl_max_tokens, 1),
        ("rl_tasks", rl_tasks, 1),
        ("consistency_requests", consistency_requests, 1),
        ("consistency_tokens", consistency_tokens, 2),
        ("batch sizes", min(batches, default=0), 1),
    )
    if rl_numerics not in ("fast", "invariant"):
        raise WhetstoneError(f"rl_numerics must be 'fast' or 'invariant', got {rl_numerics!r}")
    limit = cfg.max_position_embeddings
    if train_seq_len > limit or prompt_tokens + new_tokens > limit:
        raise WhetstoneError(
            f"train_seq_len ({train_seq_len}) and prompt_tokens + new_tokens ({prompt_tokens + new_tokens}) "
            f"must be at most the model's {limit} positions"
        )
    if 4 * consistency_tokens > limit:  # the consistency engines' context: up to twice each, prompt and completion
        raise WhetstoneError(
            f"consistency_tokens ({consistency_tokens}) must be at most a quarter of the model's {limit} positions"
        )
    target = resolve_device(device)
    configure_process(threads)
    with torch.device("meta"):
        shapes = Transformer(cfg)
    result: dict[str, Any] = {
        "device": device_info(target),
        "torch_version": torch.__version__,
        "transformers_version": _transformers_version(),
        "model": model,
        "parameters": shapes.num_parameters(),
        "active_parameters": shapes.num_parameters(active=True),
        "model_config": cfg.model_dump(),
    }
    runners = {
        "train": lambda: train(cfg, target, train_batch, train_seq_len, train_steps, train_warmup, seed),
        "inference": lambda: inference(cfg, target, list(batches), prompt_tokens, new_tokens, repeats, swaps, seed),
        "rl": lambda: rl(
            cfg,
            target,
            rl_steps,
            group_size,
            groups_per_batch,
            rl_max_tokens,
            rl_tasks,
            seed,
            output_dir,
            rl_numerics,
            rl_synchronous,
        ),
        "consistency": lambda: consistency(cfg, target, consistency_requests, consistency_tokens, seed),
    }
    seconds, failed = {}, []
    for section in SECTIONS:
        if section not in sections:
            continue
        started = time.perf_counter()
        say(f"{section}: starting on {target} ({model} model)")
        try:
            result[section] = runners[section]()
        except Exception as err:  # one section's failure is reported, the others still run
            traceback.print_exc(file=sys.stderr)
            result[section] = {"error": f"{type(err).__name__}: {err}"}
            failed.append(section)
        free(target)
        seconds[section] = round(time.perf_counter() - started, 1)
        say(f"{section}: {'failed' if section in failed else 'done'} in {seconds[section]} s")
    return {**result, "seconds": seconds, "failed": failed}


if __name__ == "__main__":  # `whetstone bench gpu`, options included
    from whetstone.bench.cli import run_as_module

    run_as_module("gpu")
