"""`whetstone bench gpu`: the whole command at tiny scale on the CPU (its JSON's structure and
figures), a section that cannot run, its options, and the `gpu` marker's skip where CUDA is
absent. On a GPU machine `pytest -m gpu` runs the command on CUDA."""

import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from whetstone.bench.gpu import run
from whetstone.errors import WhetstoneError

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    *("--model", "tiny", "--threads", "1"),
    *("--train-batch", "2", "--train-seq-len", "32", "--train-steps", "2", "--train-warmup", "1"),
    *("--prompt-tokens", "8", "--new-tokens", "8"),
    *("--rl-steps", "2", "--group-size", "2", "--groups-per-batch", "1", "--rl-max-tokens", "8", "--rl-tasks", "2"),
    *("--consistency-requests", "3", "--consistency-tokens", "8"),
]

BATCHES = ["--batch", "2", "--batch", "4"]


def bench(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """`python -m whetstone bench gpu --json ARGS`, after `prelude` (Python) where one is given."""
    command = [sys.executable, "-m", "whetstone", "bench", "gpu", "--json", *args]
    if prelude:
        code = f"import sys\n{prelude}\nfrom whetstone.cli import main\nsys.argv[0] = 'whetstone'\nmain()"
        command = [sys.executable, "-c", code, "bench", "gpu", "--json", *args]
    pythonpath = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def numbers(value, path=""):
    """Every number in a JSON value, with where it is."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from numbers(item, f"{path}[{index}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


def check_common(result: dict, sections: list[str]) -> None:
    assert result["failed"] == [] and set(result["seconds"]) == set(sections)
    assert result["device"]["type"] == "cpu" and result["device"]["name"]
    assert result["torch_version"] == torch.__version__ and result["transformers_version"]
    assert result["model"] == "tiny" and result["parameters"] > 1_000_000
    for where, value in numbers(result):
        assert math.isfinite(value) and value >= 0, where


def check_train(train: dict) -> None:
    for key in ("whetstone_tokens_per_s", "hf_tokens_per_s", "speedup_vs_hf"):
        assert train[key] > 0, key
    assert train["speedup_vs_hf"] == pytest.approx(train["whetstone_tokens_per_s"] / train["hf_tokens_per_s"], rel=1e-2)
    # the same weights and the same first batch: the same loss, to bf16 rounding
    assert train["first_loss"]["whetstone"] == pytest.approx(train["first_loss"]["hf"], rel=1e-2)
    assert train["whetstone_peak_memory_gb"] is None and train["hf_peak_memory_gb"] is None  # a CPU keeps no peak
    assert (train["batch_size"], train["seq_len"], train["dtype"]) == (2, 32, "bfloat16")


def check_inference(inference: dict, swaps: int) -> None:
    for batch in ("batch_2", "batch_4"):
        figures = inference[batch]
        assert figures["errors"] == {}
        for name in ("whetstone", "hf", "hf_static"):
            assert figures[f"{name}_tokens_per_s"] > 0 and figures["call_s"][name] > 0
            assert figures["first_call_s"][name] > 0 and figures["capture_or_compile_s"][name] >= 0
        assert figures["speedup_vs_hf"] == pytest.approx(
            figures["whetstone_tokens_per_s"] / figures["hf_tokens_per_s"], rel=1e-2
        )
        assert figures["speedup_vs_hf_static"] > 0 and 0 <= figures["tokens_match_hf"] <= 1
        assert figures["speedup_vs_one_step"] is None  # a CPU engine never runs a step ahead
    if swaps:
        assert (
            inference["swaps"] == swaps and inference["swap_pause_ms"] > 0 and inference["decode_step_ms_batch_16"] > 0
        )
        assert inference["swap_pause_over_decode_step"] == pytest.approx(
            inference["swap_pause_ms"] / inference["decode_step_ms_batch_16"], rel=2e-2
        )
    else:
        assert "swap_pause_ms" not in inference
    assert inference["hf_static_compiled"] is False  # transformers compiles its static cache on CUDA only
    assert inference["engine_config"]["dtype"] == "bfloat16"
    assert inference["engine_graph_captures"] == 0 and inference["engine_replays_graphs"] is False  # CUDA's
    profile = inference["engine_profile"]  # the largest batch's call, profiled: a CPU has no device time
    # the whole batch prefilled at once (`prefill_tokens_per_step`), then one decode step a token
    assert inference["engine_config"]["prefill_tokens_per_step"] == 4 * 8
    assert profile["batch"] == 4 and profile["wall_s"] > 0 and profile["decode_steps"] == 8
    assert profile["device_busy_s"] is None and profile["top_device_kernels"] == []
    names = [op["name"] for op in profile["top_host_ops"]]
    assert len(names) == 10 and all(op["ms"] >= 0 and op["count"] > 0 for op in profile["top_host_ops"])


def test_the_train_and_inference_sections_report_every_figure():
    out = bench(*TINY, *BATCHES, "--sections", "train,inference", "--swaps", "0")  # the swap pause: in the slow test
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # progress goes to stderr: stdout is the JSON alone
    assert "[bench gpu" in out.stderr and "train: whetstone" in out.stderr
    check_common(result, ["train", "inference"])
    assert "rl" not in result
    check_train(result["train"])
    check_inference(result["inference"], swaps=0)


def check_consistency(consistency: dict) -> None:
    invariant, fast = consistency["invariant"], consistency["fast"]
    # invariant numerics: the engine's bits are the trainer's, on every token and router choice
    assert invariant["max_abs_logprob_diff"] == 0.0 and invariant["k3_kl"] == 0.0
    assert invariant["bitwise_equal_fraction"] == 1.0 and invariant["routing_disagreement"] == 0.0
    assert invariant["tokens"] == fast["tokens"] > 0
    assert invariant["overhead_engine"] > 0 and invariant["overhead_trainer"] > 0
    assert fast["overhead_engine"] == fast["overhead_trainer"] == 1.0
    assert (consistency["dtype"], consistency["device"], consistency["requests"]) == ("bfloat16", "cpu", 3)


def test_the_consistency_section_compares_fast_and_invariant_numerics():
    out = bench(*TINY, "--sections", "consistency")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    check_common(result, ["consistency"])
    check_consistency(result["consistency"])


@pytest.mark.slow  # ~60 s on 2 cores: the RL section starts a server, the trainer and the orchestrator
def test_the_whole_command_runs_end_to_end_on_the_cpu(tmp_path):
    out = bench(
        *TINY, *BATCHES, "--swaps", "2", "--rl-numerics", "invariant", "--rl-synchronous", "--output-dir", str(tmp_path)
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    check_common(result, ["train", "inference", "rl", "consistency"])
    check_train(result["train"])
    check_inference(result["inference"], swaps=2)
    check_consistency(result["consistency"])
    rl = result["rl"]
    assert rl["samples"] == 4 and rl["samples_per_s"] > 0 and 0 <= rl["trainer_busy"] <= 1
    # invariant numerics, on-policy: no mismatch in any step, and the replayed routes are the trainer's own
    assert rl["synchronous"] and rl["on_policy_steps"] == rl["steps"] == 2
    assert rl["mismatch_kl_k3"] == 0 and rl["max_abs_logprob_diff"] == 0
    assert rl["max_abs_logprob_diff_per_step"] == [0.0] * rl["on_policy_steps"]
    assert rl["routing_disagreement_max"] == 0
    assert (rl["numerics"], rl["dtype"], rl["router_replay"]) == ("invariant", "bfloat16", True)
    assert (
        rl["train_s_mean"] > 0
        and rl["publish_s_mean"] > 0
        and rl["publish_total_s_mean"] > 0
        and rl["sync_workers"] == 1
    )  # 8 on CUDA
    roles = tmp_path / "rl" / "roles"  # the roles ran in the bench's dtype and numerics
    trainer, serve = (tomllib.loads((roles / name).read_text()) for name in ("trainer.toml", "serve-0.toml"))
    assert (trainer["dtype"], trainer["numerics"]) == ("bfloat16", "invariant")
    assert trainer["sync"]["publish_dtype"] == "autocast"  # what a bf16 trainer computes with: 0 mismatch
    assert (serve["engine"]["dtype"], serve["engine"]["numerics"]) == ("bfloat16", "invariant")


def test_a_section_that_cannot_run_says_why_and_the_others_still_run():
    out = bench(
        *TINY,
        *BATCHES,
        "--sections",
        "train,inference",
        "--swaps",
        "0",
        prelude="sys.modules['transformers'] = None  # not installed",
    )
    assert out.returncode == 1  # after the JSON
    result = json.loads(out.stdout)
    assert result["failed"] == ["train"] and result["transformers_version"] is None
    assert "needs transformers" in result["train"]["error"]
    figures = result["inference"]["batch_4"]  # the engine's figures, the baselines say why they are missing
    assert figures["whetstone_tokens_per_s"] > 0 and figures["hf_tokens_per_s"] is None
    assert figures["speedup_vs_hf"] is None and figures["tokens_match_hf"] is None
    assert set(figures["errors"]) == {"hf", "hf_static"} and "needs transformers" in figures["errors"]["hf_static"]


def test_bad_options_are_named_before_anything_runs():
    with pytest.raises(WhetstoneError, match="model must be one of gpu, tiny, got 'huge'"):
        run(model="huge")
    with pytest.raises(
        WhetstoneError, match="sections must be some of train, inference, rl, consistency, got train, bogus"
    ):
        run(sections=["train", "bogus"])
    with pytest.raises(WhetstoneError, match="rl_steps must be >= 2, got 1"):
        run(model="tiny", rl_steps=1)
    with pytest.raises(WhetstoneError, match="batch sizes must be >= 1, got 0"):
        run(model="tiny", batches=[0, 16])
    with pytest.raises(WhetstoneError, match=r"must be at most the model's 2048 positions"):
        run(model="tiny", prompt_tokens=2000, new_tokens=128)
    with pytest.raises(
        WhetstoneError, match=r"consistency_tokens \(600\) must be at most a quarter of the model's 2048"
    ):
        run(model="tiny", consistency_tokens=600)
    with pytest.raises(WhetstoneError, match="rl_numerics must be 'fast' or 'invariant', got 'exact'"):
        run(model="tiny", rl_numerics="exact")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_asking_for_cuda_without_one_is_a_clean_error():
    from typer.testing import CliRunner

    from whetstone.bench.cli import app

    outcome = CliRunner().invoke(app, ["gpu", "--device", "cuda", "--model", "tiny"])
    assert isinstance(outcome.exception, WhetstoneError) and "sees no CUDA device" in str(outcome.exception)


@pytest.mark.gpu
@pytest.mark.timeout(240)  # a subprocess that also compiles transformers' static cache: over gpu-check's 90 s per test
def test_the_benchmark_runs_on_cuda():
    out = bench(*TINY, "--device", "cuda", "--batch", "4", "--sections", "train,inference", "--swaps", "0")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["device"]["type"] == "cuda" and result["failed"] == []
    train, inference = result["train"], result["inference"]
    assert train["whetstone_peak_memory_gb"] > 0 and train["hf_peak_memory_gb"] > 0
    assert train["first_loss"]["whetstone"] == pytest.approx(train["first_loss"]["hf"], rel=1e-2)
    assert inference["hf_static_compiled"] is True and inference["batch_4"]["errors"] == {}
    assert inference["batch_4"]["speedup_vs_hf_static"] > 0 and inference["engine_config"]["device"].startswith("cuda")
    assert inference["engine_replays_graphs"] is True and inference["engine_graph_captures"] > 0
    # the engine runs a step ahead on CUDA, and the one-step-at-a-time engine is timed beside it
    assert inference["engine_config"]["overlap_steps"] is True and inference["batch_4"]["speedup_vs_one_step"] > 0
    assert inference["engine_profile"]["device_busy_s"] > 0 and inference["engine_profile"]["device_kernels"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip where CUDA is absent")
def test_gpu_marked_tests_are_skipped_where_cuda_is_absent():
    node = f"{Path(__file__).relative_to(ROOT)}::test_the_benchmark_runs_on_cuda"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", node, "-m", "gpu", "-rs", "-p", "no:cacheprovider"]
        + ["-W", "error::pytest.PytestUnknownMarkWarning"],  # the marker is registered
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT / "src"), os.environ.get("PYTHONPATH")))),
        },
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 skipped" in out.stdout and "needs a CUDA device" in out.stdout


def test_the_rl_sides_roles_run_in_the_asked_dtype_and_device(tmp_path):
    from whetstone.bench.pipeline import pipeline_config

    settings = dict(steps=2, group_size=2, groups_per_batch=1, max_tokens=8, synchronous=False)
    config = pipeline_config(tmp_path, "rl", tmp_path / "tasks.jsonl", dtype="bfloat16", device="cpu", **settings)
    trainer, serve = config.rl.trainer, config.servers.serve
    assert trainer.dtype == serve.engine.dtype == "bfloat16"
    # the run places its roles (where its placement has device fields; without them they compute on the CPU)
    placement = config.placement.model_dump()
    assert placement.get("trainer_device", "cpu") == "cpu" and placement.get("server_devices", ["cpu"]) == ["cpu"]
    assert config.resolved().rl.trainer.model_dump().get("device", "cpu") == "cpu"
    assert serve.threads == 1 and serve.engine.max_batch == 16  # the rest stay the run's servers'
    plain = pipeline_config(tmp_path, "rl", tmp_path / "tasks.jsonl", **settings)
    assert plain.rl.trainer.dtype == plain.servers.serve.engine.dtype == "float32"  # the CPU benches' default


def test_the_random_model_takes_an_architecture_with_the_tokenizers_vocabulary(tmp_path):
    from whetstone.bench.pipeline import coin_tasks, random_model
    from whetstone.model import ModelConfig
    from whetstone.model.hf import read_hf_config
    from whetstone.tokenizer import Tokenizer

    small = ModelConfig(vocab_size=32768, hidden_size=64, num_experts=4, moe_intermediate_size=32)
    folder = random_model(tmp_path, coin_tasks(2), config=small)
    read = read_hf_config(folder)
    assert (read.hidden_size, read.num_experts, read.moe_intermediate_size) == (64, 4, 32)
    assert read.vocab_size == Tokenizer.load(folder).vocab_size < 32768


def test_the_torch_requirement_accepts_a_gpu_machines_build_and_ci_installs_the_cpu_wheel_first():
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_requirement = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch")
    for build in ("2.11.0+cu130", "2.13.0+cpu", "2.13.0"):  # a GPU machine's, and the CPU wheel CI installs
        assert torch_requirement.specifier.contains(build), build
    # an unpinned torch would be the newest, a CUDA build: CI installs the CPU wheel before the package
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("pip install torch==2.13.0\n") < ci.index("pip install -e '.[test]'")
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 && pip install -e ." in readme and "## On a GPU" in readme
