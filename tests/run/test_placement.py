"""Where the roles of a run compute: each role's device passed to its config, a shared GPU's
memory split between the roles on it, devices this machine lacks refused before the run, and
the GPU preset (configs/gpu.toml) loading and passing the preflight on any machine."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.run.run_support import tiny_run
from whetstone.cli import app
from whetstone.config import load_config
from whetstone.errors import ConfigError
from whetstone.model import Transformer
from whetstone.run.config import PipelineConfig, PlacementConfig
from whetstone.run.pipeline import Pipeline, run_pipeline
from whetstone.run.placement import gpu_memory_shares, role_device, split_gpu_memory
from whetstone.utils.processes import memory_cap

GPU_PRESET = Path(__file__).parents[2] / "configs" / "gpu.toml"
CUDA0, CUDA1, CPU = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")


def test_roles_sharing_a_gpu_split_its_memory_and_roles_alone_keep_all_of_it():
    assert split_gpu_memory(CUDA0, [CUDA0], 0.4) == {"trainer": (CUDA0, 0.4), "serve-0": (CUDA0, 0.6)}
    assert split_gpu_memory(CUDA0, [CUDA0, CUDA0], 0.5) == {
        "trainer": (CUDA0, 0.5),
        "serve-0": (CUDA0, 0.25),
        "serve-1": (CUDA0, 0.25),
    }
    assert split_gpu_memory(CUDA0, [CUDA1], 0.5) == {}  # one GPU each
    assert split_gpu_memory(CPU, [CUDA1, CUDA1], 0.5) == {"serve-0": (CUDA1, 0.5), "serve-1": (CUDA1, 0.5)}
    assert split_gpu_memory(CPU, [CPU, CPU], 0.5) == {}


def test_each_role_gets_its_device_from_the_placement(tmp_path):
    pipeline = Pipeline(
        tiny_run(tmp_path, 'placement.trainer_device="cpu"', 'placement.server_devices=["cpu", "auto"]')
    )
    assert pipeline.trainer_config().device == "cpu"
    assert [pipeline.serve_config(8000 + i, i).engine.device for i in range(3)] == ["cpu", "auto", "cpu"]
    if not torch.cuda.is_available():  # every role on the CPU: no GPU memory to split
        assert pipeline.role_environment("trainer") == pipeline.role_environment("serve-0") == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_device_this_machine_lacks_stops_the_run_before_mid_training(tmp_path):
    config = tiny_run(tmp_path, 'placement.trainer_device="cuda"', 'placement.server_devices=["cpu", "cuda:1"]')
    with pytest.raises(ConfigError) as refused:
        run_pipeline(config)
    message = str(refused.value)
    assert "placement.trainer_device: device = 'cuda', but torch sees no CUDA device here" in message
    assert "placement.server_devices[1]: device = 'cuda:1', but torch sees no CUDA device here" in message
    assert not (tmp_path / "runs" / "tiny").exists()


def test_the_gpu_preset_loads_and_passes_the_preflight_here(tmp_path):
    result = CliRunner().invoke(app, ["run", str(GPU_PRESET), "--dry-run", f'--set=output_dir="{tmp_path}"'])
    assert result.exit_code == 0, result.output
    printed = PipelineConfig.model_validate(tomllib.loads(result.stdout))
    model = printed.midtrain.model
    assert (model.vocab_size, model.hidden_size, model.num_hidden_layers, model.head_dim) == (32768, 1024, 4, 64)
    assert (model.num_attention_heads, model.num_key_value_heads) == (16, 4)
    assert (model.num_experts, model.num_experts_per_tok, model.moe_intermediate_size) == (64, 8, 384)
    with torch.device("meta"):  # sizes only: nothing allocated
        assert 370e6 < Transformer(model).num_parameters() < 390e6
    assert printed.rl.trainer.dtype == printed.servers.serve.engine.dtype == "bfloat16"
    assert printed.rl.trainer.device == printed.placement.trainer_device == "auto"
    assert not (tmp_path / "gpu").exists()


def test_the_gpu_preset_differs_from_the_default_run_only_where_it_says():
    """The preset names only its differences; every other field is the default run's."""

    def flat(data, prefix=""):
        for key, value in data.items():
            if isinstance(value, dict) and value:
                yield from flat(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    preset = dict(flat(load_config(PipelineConfig, GPU_PRESET).model_dump(mode="json")))
    default = dict(flat(PipelineConfig().model_dump(mode="json")))
    changed = {key for key in default if preset.get(key) != default[key]}
    model = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    model += ("num_experts", "moe_intermediate_size", "head_dim", "num_experts_per_tok")
    assert preset.keys() == default.keys()
    assert changed == {
        "name",
        *(f"midtrain.model.{field}" for field in model),
        "midtrain.optimizer.lr",
        "midtrain.optimizer.warmup_steps",
        *(f"midtrain.run.{field}" for field in ("threads", "steps", "batch_size", "eval_interval")),
        "midtrain.run.checkpoint_interval",
        "midtrain.run.keep_checkpoints",
        "midtrain.run.max_wall_time",
        "servers.count",
        "servers.serve.threads",
        "servers.serve.engine.max_batch",
        "servers.serve.engine.dtype",
        "servers.serve.engine.prefill_tokens_per_step",
        "rl.max_wall_time",
        "rl.trainer.dtype",
        "rl.trainer.micro_batch_size",
        "rl.trainer.threads",
        "rl.trainer.checkpoint_interval",
        "rl.trainer.optimizer.lr",
        "rl.trainer.sync.workers",
        "rl.orchestrator.rollout.concurrency",
        "eval.rollout.concurrency",
        "eval.tasks.validation_workers",
        "eval.tasks.synth.count",
    }


def test_a_roles_cap_leaves_its_cuda_context_outside_its_share():
    h100 = 80 * 2**30
    assert memory_cap(0.5, h100) == pytest.approx(0.5 - 1 / 80)  # a GiB for contexts and what torch does not hold
    assert memory_cap(0.5, h100) + memory_cap(0.25, h100) * 2 == pytest.approx(1 - 3 / 80)
    assert memory_cap(0.1, 8 * 2**30) == pytest.approx(0.05)  # a small GPU: never below half the share


@pytest.mark.gpu
def test_a_role_is_held_to_its_share_of_the_gpu(tmp_path):
    """What a role's process does with `GPU_MEMORY_ENV`: an allocation past its share fails."""
    script = (
        "import torch\n"
        "from whetstone.utils.processes import limit_gpu_memory\n"
        "limit_gpu_memory('cuda:0=0.05')\n"
        "total = torch.cuda.get_device_properties(0).total_memory\n"
        "torch.empty(int(total * 0.02), dtype=torch.uint8, device='cuda:0')\n"
        "try:\n"
        "    torch.empty(int(total * 0.1), dtype=torch.uint8, device='cuda:0')\n"
        "except torch.OutOfMemoryError:\n"
        "    print('held')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "held"


def test_a_server_device_that_means_nothing_is_refused_by_its_field():
    with pytest.raises(ConfigError, match=r"placement.server_devices: .*device must be .* got 'gpu'"):
        load_config(PipelineConfig, overrides=['placement.server_devices=["cpu", "gpu"]'])


@pytest.mark.parametrize("name", ["cuda:01", "cuda:128", "cuda:300"])
def test_a_device_index_torch_reads_otherwise_is_refused_when_the_config_loads(name):
    # torch refuses "cuda:01" with a RuntimeError (a traceback from the preflight), and reads an
    # index past 127 as another GPU's ("cuda:300" is cuda:44)
    with pytest.raises(ConfigError, match=rf"placement.trainer_device.*got '{name}'"):
        load_config(PipelineConfig, overrides=[f'placement.trainer_device="{name}"'])
    with pytest.raises(ConfigError, match=rf"placement.server_devices: .*got '{name}'"):
        load_config(PipelineConfig, overrides=[f'placement.server_devices=["cpu", "{name}"]'])


def test_shares_are_of_the_gpu_the_roles_compute_on_not_this_processs_current_one(monkeypatch):
    # mid-training in the run's process on cuda:1 leaves cuda:1 its current device; a role's new
    # process resolves "auto" and "cuda" to cuda:0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    placement = PlacementConfig(trainer_device="auto", server_devices=["cuda", "cuda:1"])
    assert gpu_memory_shares(placement, 3) == {
        "trainer": (CUDA0, 0.5),
        "serve-0": (CUDA0, 0.25),
        "serve-2": (CUDA0, 0.25),
    }
    assert role_device("cuda:1") == CUDA1 and role_device("cpu") == CPU
