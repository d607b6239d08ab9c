"""Inference benchmark: throughput against transformers, user latency under rollout load, and
the decode pause of hot weight swaps.

All on whetstone's default model (random weights: speed does not depend on them), fp32, with
the same torch thread count for every side.

- Throughput: the engine's offline `generate` and transformers' `generate` (its KV cache,
  greedy) on the same model exported with `save_hf`, the same prompts, the same number of new
  tokens (EOS ignored), at batch 1 and 16; best of `repeats`. The engine's tokens are checked
  against transformers' (`tokens_match_hf`: they must agree, it is the same model).
- Latency: a real `whetstone serve` process; `interactive` completion requests one after the
  other, first on an idle server, then while client threads keep it saturated with `batch`
  requests (more than it has slots). p99 of the request wall time seen by the client.
- Swap pause: the engine decoding a full batch while a trainer process publishes RL-like
  versions (one AdamW step at lr 1e-6 each, bf16 deltas) that reach it through the weight-sync
  `Subscriber`; median pause over those swaps (and over whole-state swaps), next to the decode
  step time of the same run.

    whetstone bench inference --json
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from whetstone.bench.kernels import dense_kernel_seconds
from whetstone.bench.options import check_at_least
from whetstone.inference.config import EngineConfig
from whetstone.inference.engine import Engine
from whetstone.inference.sampling import SamplingParams
from whetstone.inference.sequence import Sequence
from whetstone.model import ModelConfig, Transformer
from whetstone.utils.processes import serving
from whetstone.utils.runtime import configure_process


def _prompts(count: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(seed))


def hf_generate(hf, prompts: torch.Tensor, new_tokens: int, cache_implementation: str | None) -> list[list[int]]:
    """transformers' greedy `generate` of exactly `new_tokens` per prompt (with `cache_implementation`,
    e.g. "static"; None: its default cache): the new tokens."""
    extra = {"cache_implementation": cache_implementation} if cache_implementation else {}
    with torch.inference_mode():
        out = hf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            **extra,
        )
    return out[:, prompts.shape[1] :].tolist()


def throughput(model: Transformer, hf_dir: Path, batch: int, prompt_tokens: int, new_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompts = _prompts(batch, prompt_tokens, model.cfg.vocab_size, seed=batch)
    engine = Engine(model, EngineConfig(max_batch=max(batch, 1), context_limit=prompt_tokens + new_tokens))
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def ours():
        return [s.output_ids for s in engine.generate(prompts.tolist(), greedy)]

    def theirs():
        return hf_generate(hf, prompts, new_tokens, None)

    best, tokens = {"ours": float("inf"), "hf": float("inf")}, {}
    for round_ in range(repeats + 1):  # round 0 warms both up and is not timed
        for name, fn in (("ours", ours), ("hf", theirs)):
            started = time.perf_counter()
            tokens[name] = fn()
            if round_:
                best[name] = min(best[name], time.perf_counter() - started)
    agree = sum(a == b for x, y in zip(tokens["ours"], tokens["hf"]) for a, b in zip(x, y)) / (batch * new_tokens)
    dense = dense_kernel_seconds(ours)
    return {
        "whetstone": batch * new_tokens / best["ours"],
        "hf": batch * new_tokens / best["hf"],
        "agree": agree,
        "dense_share": dense / best["ours"],
        "ceiling": best["hf"] / dense,
    }


@contextmanager
def served(model_dir: Path, threads: int, max_batch: int):
    """A `whetstone serve` process on a free port; yields its base URL."""
    overrides = [f"model_path={model_dir}", f"threads={threads}", f"engine.max_batch={max_batch}"]
    with (
        tempfile.TemporaryDirectory() as logs,
        serving([a for o in overrides for a in ("--set", o)], Path(logs) / "serve.log", threads=threads) as url,
    ):
        yield url


def latency(model_dir: Path, threads: int, vocab: int, requests: int, prompt_tokens: int) -> dict:
    """p99 ms of interactive requests (16 new tokens), idle and under saturating batch load."""
    import httpx

    def complete(client, prompt, max_tokens, priority):
        body = {
            "model": "model",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
            "priority": priority,
        }
        started = time.perf_counter()
        client.post("/v1/completions", json=body, timeout=600).raise_for_status()
        return (time.perf_counter() - started) * 1000

    prompts = _prompts(requests, prompt_tokens, vocab, seed=7).tolist()
    max_batch = 16
    with served(model_dir, threads, max_batch) as url, httpx.Client(base_url=url) as client:
        complete(client, prompts[0], 16, "interactive")  # warm-up
        idle = [complete(client, p, 16, "interactive") for p in prompts]
        stop = threading.Event()

        def rollouts(seed):
            with httpx.Client(base_url=url) as own:
                for prompt in _prompts(1000, prompt_tokens, vocab, seed=seed).tolist():
                    if stop.is_set():
                        return
                    complete(own, prompt, 64, "batch")

        loaders = [threading.Thread(target=rollouts, args=(100 + i,)) for i in range(max_batch + 4)]
        for thread in loaders:
            thread.start()
        _wait(lambda: _metric(client.get("/metrics").text, "whetstone_running_sequences") == max_batch, interval=0.2)
        loaded = [complete(client, p, 16, "interactive") for p in prompts]
        metrics = client.get("/metrics").text
        stop.set()
        for thread in loaders:
            thread.join()
    preemptions = _metric(metrics, "whetstone_preemptions_total")
    return {
        "idle": float(np.percentile(idle, 99)),
        "loaded": float(np.percentile(loaded, 99)),
        "idle_p50": statistics.median(idle),
        "loaded_p50": statistics.median(loaded),
        "preemptions": preemptions,
    }


def _trainer(store_dir: str, swaps: int, seed: int, config: ModelConfig) -> None:
    """The trainer side, in its own process: publish a keyframe, then one RL-like step per version."""
    from whetstone.bench.sync import adamw_step
    from whetstone.sync import Publisher, SyncConfig, WeightStore

    configure_process(1)
    torch.manual_seed(seed)
    masters = {k: v.detach().clone() for k, v in Transformer(config).state_dict().items()}
    config = SyncConfig(store=store_dir)
    publisher = Publisher(WeightStore.open(config), config)
    publisher.publish(masters)
    for step in range(1, swaps + 1):
        time.sleep(0.3)
        masters = adamw_step(masters, lr=1e-6, seed=step)
        publisher.publish(masters)


def swap_pauses(
    model: Transformer,
    swaps: int,
    prompt_tokens: int,
    seed: int,
    engine_config: EngineConfig | None = None,
    load_rounds: int = 1,
) -> dict:
    """Median decode pause of RL-like delta versions arriving through weight sync while the
    engine decodes a full batch, and of whole-state swaps, against the decode step time.

    The load is `load_rounds` full batches of sequences as long as the context allows, queued
    at once, so a fast device keeps decoding a full batch until the last version arrives."""
    import multiprocessing

    from whetstone.inference.swap import WeightFollower, full_update
    from whetstone.sync import Subscriber, SyncConfig, WeightStore

    engine_config = engine_config or EngineConfig(max_batch=16, context_limit=2048)
    engine = Engine(model, engine_config)
    load = SamplingParams(max_tokens=engine.context_limit - prompt_tokens, ignore_eos=True)
    count = engine_config.max_batch * load_rounds
    for i, prompt in enumerate(_prompts(count, prompt_tokens, model.cfg.vocab_size, seed=3).tolist()):
        engine.add(Sequence(f"load{i}", prompt, load, "batch"))
    with tempfile.TemporaryDirectory() as store_dir:
        config = SyncConfig(store=store_dir, poll_interval=0.05)
        trainer = multiprocessing.get_context("spawn").Process(
            target=_trainer, args=(store_dir, swaps, seed, model.cfg)
        )
        trainer.start()
        engine.start()
        follower = WeightFollower(Subscriber(WeightStore.open(config), config), engine, poll_seconds=0.05).start()
        try:
            _wait(lambda: engine.stats.swaps_total >= 1)  # the keyframe
            steps_before, started = engine.stats.decode_steps_total, time.perf_counter()
            _wait(lambda: engine.version == swaps)
            step_ms = (time.perf_counter() - started) * 1000 / max(1, engine.stats.decode_steps_total - steps_before)
            delta_pauses = list(engine.stats.swap_pauses)[1:]
            state = {k: v.clone() for k, v in model.state_dict().items()}
            for version in range(swaps + 1, swaps + 4):
                engine.update_weights(full_update(state, version))
                _wait(lambda version=version: engine.version == version)
            full_pauses = list(engine.stats.swap_pauses)[-3:]
        finally:
            follower.stop()
            engine.stop()
            trainer.join()
    return {
        "delta_ms": statistics.median(delta_pauses) * 1000,
        "full_ms": statistics.median(full_pauses) * 1000,
        "decode_step_ms": step_ms,
        "deltas": len(delta_pauses),
    }


def _metric(text: str, name: str) -> float:
    """The value of an unlabelled-but-for-model Prometheus sample."""
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def _wait(condition, timeout: float = 300.0, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark step did not complete")
        time.sleep(interval)


def run(
    threads: int = 1,
    prompt_tokens: int = 64,
    new_tokens: int = 128,
    repeats: int = 2,
    latency_requests: int = 30,
    swaps: int = 8,
    seed: int = 0,
) -> dict:
    from whetstone.model.hf import save_hf
    from whetstone.tokenizer import Tokenizer

    check_at_least(
        ("threads", threads, 0),  # 0: every core
        ("prompt_tokens", prompt_tokens, 1),
        ("new_tokens", new_tokens, 1),
        ("repeats", repeats, 1),
        ("latency_requests", latency_requests, 1),
        ("swaps", swaps, 1),
    )
    configure_process(threads)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig()).eval()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        Tokenizer.train([Path(np.__file__).read_text()], vocab_size=512).save(tokenizer_dir)
        model_dir = save_hf(model, Path(tmp) / "model", tokenizer_dir=tokenizer_dir)
        speed = {b: throughput(model, model_dir, b, prompt_tokens, new_tokens, repeats) for b in (1, 16)}
        users = latency(model_dir, threads, model.cfg.vocab_size, latency_requests, prompt_tokens)
    swap = swap_pauses(model, swaps, prompt_tokens, seed)
    return {
        "model": "whetstone default (ModelConfig()), fp32, random weights",
        "threads": threads,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "whetstone_tokens_per_s": {
            "batch_1": round(speed[1]["whetstone"], 1),
            "batch_16": round(speed[16]["whetstone"], 1),
        },
        "hf_tokens_per_s": {"batch_1": round(speed[1]["hf"], 1), "batch_16": round(speed[16]["hf"], 1)},
        "speedup_vs_hf": round(speed[16]["whetstone"] / speed[16]["hf"], 2),
        "speedup_vs_hf_batch_1": round(speed[1]["whetstone"] / speed[1]["hf"], 2),
        # Share of whetstone's batch-16 generation spent in matmuls and fused attention, and the
        # speedup if all else took no time (bench/kernels.py): transformers runs the same products.
        "dense_kernel_share_batch_16": round(speed[16]["dense_share"], 3),
        "speedup_ceiling": round(speed[16]["ceiling"], 2),
        "tokens_match_hf": round(min(speed[1]["agree"], speed[16]["agree"]), 4),
        "interactive_p99_ms_idle": round(users["idle"], 1),
        "interactive_p99_ms_loaded": round(users["loaded"], 1),
        "interactive_p50_ms_idle": round(users["idle_p50"], 1),
        "interactive_p50_ms_loaded": round(users["loaded_p50"], 1),
        "loaded_over_idle_p99": round(users["loaded"] / users["idle"], 2),
        "preemptions_during_load": users["preemptions"],
        "swap_pause_ms": round(swap["delta_ms"], 3),
        "swap_pause_ms_full_state": round(swap["full_ms"], 3),
        "decode_step_ms_batch_16": round(swap["decode_step_ms"], 2),
    }


if __name__ == "__main__":  # `whetstone bench inference`, options included
    from whetstone.bench.cli import run_as_module

    run_as_module("inference")
