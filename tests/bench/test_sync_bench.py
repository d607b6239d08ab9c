"""The sync benchmark's RL-run case: consecutive versions of a weight store that the real trainer
wrote (a tiny MoE trained on engine-sampled batches, published as bf16 at the RL lr 3e-4), read
back by a subscriber and measured as the other cases are. A missing or too-short store is a
skipped case, not an error."""

import statistics

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import load_file

from tests.trainer.trainer_fixtures import make_batches, put_batches, save_tiny_moe, trainer_config
from whetstone.bench.sync import consecutive_pairs, delta_case, read_versions, rl_store_case, run, xor_zstd
from whetstone.errors import WhetstoneError
from whetstone.model.hf import load_hf
from whetstone.store import LocalStore
from whetstone.sync import Publisher, SyncConfig, WeightStore, apply_update
from whetstone.sync.bits import dtype_name, int_view
from whetstone.sync.chunks import decode_chunk, encode_chunk, plan_chunks
from whetstone.sync.manifest import Manifest, TensorInfo
from whetstone.sync.update import build_update
from whetstone.trainer.loop import run_trainer
from whetstone.training.checkpoint import latest_checkpoint

# What the issue asks of every case.
FIGURES = [
    "changed_fraction",
    "ratio",
    "xor_zstd_ratio",
    "full_zstd_ratio",
    "entropy_bound_ratio",
    "encode_gb_s_per_core",
    "decode_gb_s_per_core",
]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory):
    """runs/<name>/ of a real RL trainer: versions 0 (the initial weights) to 3, one per step."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("rl-run")
    model = save_tiny_moe(root / "model")
    put_batches(root / "batches", make_batches(model, 3))
    config = trainer_config(
        root,
        model,
        sync={"store": str(root / "weights"), "publish_dtype": "bfloat16"},
        optimizer={"lr": 3e-4, "warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay": 0.0},
    )
    assert run_trainer(config)["version"] == 3
    return root


def bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and (int_view(a[k]) == int_view(b[k])).all() for k in a
    )


def test_versions_read_back_are_what_the_trainer_published(rl_run):
    store = WeightStore(LocalStore(rl_run / "weights"))
    assert consecutive_pairs(store, 5) == [(0, 1), (1, 2), (2, 3)]
    assert consecutive_pairs(store, 2) == [(1, 2), (2, 3)]
    versions = dict(read_versions(store, [0, 1, 2, 3]))

    def bf16(state):
        return {k: v.bfloat16() if v.is_floating_point() else v for k, v in state.items()}

    # Version 0 is the initial model; version 3 the masters the trainer checkpointed after step 3.
    assert bit_identical(versions[0], bf16(load_hf(rl_run / "model").state_dict()))
    masters = load_file(str(latest_checkpoint(rl_run / "trainer" / "checkpoints") / "model.safetensors"))
    masters["lm_head.weight"] = masters["embed_tokens.weight"]  # tied: the checkpoint keeps one copy
    assert bit_identical(versions[3], bf16(masters))
    assert not bit_identical(versions[2], versions[3])  # each version is read, not the last one 4 times


def test_a_pair_round_trips_bit_for_bit_through_the_codec(rl_run):
    (_, old), (_, new) = read_versions(WeightStore(LocalStore(rl_run / "weights")), [2, 3])
    config = SyncConfig(chunk_elements=5000)  # tensors span chunks, chunks hold several tensors
    plan = plan_chunks([(k, t.numel()) for k, t in new.items()], config.chunk_elements)
    blobs = [encode_chunk(chunk, new, old, config.zstd_level)[0] for chunk in plan]
    tensors = [TensorInfo(name=k, dtype=dtype_name(t.dtype), shape=list(t.shape)) for k, t in new.items()]
    manifest = Manifest(
        version=3,
        kind="delta",
        base=2,
        keyframe=0,
        created=0.0,
        tensors=tensors,
        chunks=[],
        raw_bytes=0,
        encoded_bytes=0,
        changed=0,
        chain_bytes=0,
    )
    dtypes = {k: t.dtype for k, t in new.items()}
    update = build_update(manifest, [p for blob in blobs for p in decode_chunk(blob, old, dtypes)], old)
    live = {k: v.clone() for k, v in old.items()}
    apply_update(live, update)
    assert bit_identical(live, new) and not bit_identical(old, new)


def test_the_case_measures_consecutive_versions_like_the_other_cases(rl_run):
    store = WeightStore(LocalStore(rl_run / "weights"))
    case = rl_store_case(str(rl_run / "weights"), SyncConfig(), repeats=1)
    assert case["name"] == f"whetstone-rl-{rl_run.name}" and "skipped" not in case
    assert case["dtypes"] == ["bfloat16"]
    assert [p["versions"] for p in case["pairs"]] == [[0, 1], [1, 2], [2, 3]]
    for pair in case["pairs"]:
        assert all(pair[key] > 0 for key in FIGURES)
        assert 0 < pair["changed_fraction"] <= 1 and pair["ratio"] > 1
        assert pair["ratio"] > pair["full_zstd_ratio"]  # a delta beats compressing the whole snapshot
        manifest = store.manifest(pair["versions"][1])
        assert pair["stored_as"] == manifest.kind
        if manifest.kind == "delta":  # the publisher counted the same changes when it coded this step
            assert pair["changed_fraction"] == manifest.changed / manifest.elements
    for key in FIGURES:  # each figure is the median over the pairs
        assert case[key] == statistics.median(p[key] for p in case["pairs"])


def test_without_a_store_the_case_is_skipped_and_says_how_to_get_one(tmp_path):
    case = rl_store_case(str(tmp_path / "default" / "weights"), SyncConfig(), repeats=1)
    assert case["name"] == "whetstone-rl-default" and "whetstone run" in case["skipped"]
    assert not (tmp_path / "default").exists()  # reading a store never creates one
    assert not any(key in case for key in FIGURES)


def test_a_store_without_two_consecutive_versions_is_skipped(tmp_path):
    store = WeightStore(LocalStore(tmp_path / "weights"))
    Publisher(store).publish({"w": torch.randn(8)})
    case = rl_store_case(str(tmp_path / "weights"), SyncConfig(), repeats=1)
    assert case["skipped"] == f"{tmp_path / 'weights'} holds versions [0]: no two consecutive ones to compare"


def test_the_xor_zstd_baseline_is_timed_over_its_whole_encoding(rl_run):
    """The baseline's timed work is `xor_zstd`: the XOR of the old and new bits and their
    compression, as whetstone's encode computes its delta too; its frame holds the whole delta."""
    (_, old), (_, new) = read_versions(WeightStore(LocalStore(rl_run / "weights")), [2, 3])
    config = SyncConfig()
    frame = xor_zstd(new, old, zstandard.ZstdCompressor(level=config.zstd_level))
    xor = zstandard.ZstdDecompressor().decompress(frame)
    offset = 0
    for key, tensor in new.items():
        size = tensor.numel() * tensor.element_size()
        bits = int_view(old[key]) ^ np.frombuffer(xor[offset : offset + size], dtype=int_view(old[key]).dtype)
        assert (bits == int_view(tensor)).all()
        offset += size
    assert offset == len(xor)
    case = delta_case("pair", old, new, config.model_copy(update={"publish_dtype": "keep"}), repeats=1)
    raw = sum(t.numel() * t.element_size() for t in new.values())
    assert case["xor_zstd_ratio"] == raw / len(frame) and case["xor_zstd_encode_gb_s_per_core"] > 0


def test_bad_settings_are_named_before_anything_is_measured():
    from typer.testing import CliRunner

    from whetstone.bench.cli import app

    result = CliRunner().invoke(app, ["sync", "--json", "--repeats", "0"])
    assert isinstance(result.exception, WhetstoneError) and "repeats must be >= 1" in str(result.exception)
    with pytest.raises(WhetstoneError, match="rl_pairs must be >= 1, got 0"):
        run(rl_pairs=0)


@pytest.mark.slow  # the whole benchmark: MiniLM, the tiny model, fan-out over a local dir and moto S3
def test_the_command_reports_a_case_per_store(rl_run, tmp_path):
    import json

    from typer.testing import CliRunner

    from whetstone.bench.cli import app

    missing = str(tmp_path / "nothing" / "weights")
    result = CliRunner().invoke(
        app,
        [
            "sync",
            "--json",
            "--repeats",
            "1",
            "--rl-store",
            str(rl_run / "weights"),
            "--rl-store",
            missing,
            "--rl-pairs",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    cases = {case["name"]: case for case in json.loads(result.stdout)["cases"]}
    assert [p["versions"] for p in cases[f"whetstone-rl-{rl_run.name}"]["pairs"]] == [[1, 2], [2, 3]]
    assert "whetstone run" in cases["whetstone-rl-nothing"]["skipped"]
    # publishing what a bf16 trainer computes with (autocast) against its fp32 masters: smaller
    unrounded = cases["whetstone-tiny-rl-lr1e-06-float32"], cases["whetstone-tiny-rl-lr1e-06-autocast"]
    assert unrounded[1]["raw_mb"] < unrounded[0]["raw_mb"] and unrounded[1]["encoded_mb"] < unrounded[0]["encoded_mb"]


def test_two_identical_versions_have_no_ratio_to_an_entropy_bound_of_zero():
    state = {"w": torch.randn(64, 64)}
    case = delta_case("same", state, {k: v.clone() for k, v in state.items()}, SyncConfig(store="unused"), 1)
    assert case["changed_fraction"] == 0 and case["entropy_bound_ratio"] is None and case["ratio"] > 1
