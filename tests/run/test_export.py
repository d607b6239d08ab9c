"""The run's final policy: `runs/<name>/model`, a Hugging Face folder of the trainer's last
checkpoint that transformers and `whetstone serve` load, and RL's logit scale for summary.json.
The checkpoint is written by the trainer's own `save_checkpoint` from a tiny mid-trained model
sharpened by a real `LogitScale` step (what an RL stage leaves behind)."""

import math

import pytest
import torch
import transformers
from fastapi.testclient import TestClient

from tests.run.run_support import tiny_run
from whetstone.errors import WhetstoneError
from whetstone.inference.config import ServeConfig
from whetstone.inference.launch import build_app
from whetstone.model.hf import load_hf
from whetstone.rl.logit_scale import LogitScale
from whetstone.run.pipeline import Pipeline
from whetstone.trainer.setup import new_optimizer
from whetstone.training.checkpoint import TrainState, save_checkpoint

IDS = torch.tensor([[5, 17, 42, 99, 7, 3]])


@pytest.fixture
def midtrained(tmp_path):
    pipeline = Pipeline(tiny_run(tmp_path))
    pipeline.midtrain()
    return pipeline


def trainer_checkpoint(pipeline: Pipeline, step: int) -> tuple[torch.nn.Module, LogitScale]:
    """The trainer's checkpoint after `step` steps: the base with its logits sharpened."""
    policy = load_hf(pipeline.model_dir)
    scale = LogitScale(lr=0.1)
    scale.step(policy, grad=-1.0)
    trainer = pipeline.config.rl.trainer
    state = TrainState(step=step, data={"next_batch": step, "logit_scale": scale.state()})
    save_checkpoint(
        pipeline.run_dir / "trainer" / "checkpoints",
        policy,
        new_optimizer(trainer, policy),
        state,
        trainer.model_dump(mode="json"),
        keep=2,
    )
    return policy, scale


@torch.no_grad()
def test_the_final_policy_is_written_as_a_model_folder_that_loads_everywhere(midtrained):
    policy, scale = trainer_checkpoint(midtrained, step=midtrained.config.rl.steps)
    folder, final_scale = midtrained.export_policy(), midtrained.final_logit_scale()
    assert folder == midtrained.run_dir / "model" and (folder / "tokenizer.json").is_file()
    assert final_scale == pytest.approx(math.exp(scale.log_scale)) and final_scale > 1.0
    ours = load_hf(folder)
    for name, tensor in policy.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.testing.assert_close(theirs(IDS).logits, policy.eval()(IDS).logits, atol=1e-5, rtol=1e-5)
    serve = ServeConfig(model_path=str(folder), threads=1, default_max_tokens=4)
    with TestClient(build_app(serve)) as http:  # what `whetstone serve runs/<name>/model` runs
        body = http.post(
            "/v1/completions", json={"model": "model", "prompt": "def f(", "max_tokens": 4, "ignore_eos": True}
        ).json()
    assert body["usage"]["completion_tokens"] == 4


def test_a_trainer_that_stopped_short_is_not_exported_as_the_final_policy(midtrained):
    trainer_checkpoint(midtrained, step=midtrained.config.rl.steps - 1)
    with pytest.raises(WhetstoneError, match=r"no trainer checkpoint of step 2 to export \(newest: .*step_00000001\)"):
        midtrained.export_policy()
    assert not (midtrained.run_dir / "model").exists()


def test_without_rl_the_final_policy_is_the_mid_trained_model(midtrained):
    midtrained.config = midtrained.config.model_copy(update={"rl_enabled": False})
    folder, final_scale = midtrained.export_policy(), midtrained.final_logit_scale()
    assert final_scale is None
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in midtrained.model_dir.iterdir())
    assert (folder / "model.safetensors").read_bytes() == (midtrained.model_dir / "model.safetensors").read_bytes()


def test_a_model_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """Without RL the export copies the mid-trained model's folder: a full disk there is an error
    naming the folder and what to do (copytree gathers its files' errors into one), not a
    traceback, and no half-copied folder is left."""
    import errno
    import shutil

    pipeline = Pipeline(tiny_run(tmp_path))
    pipeline.model_dir.mkdir(parents=True)
    (pipeline.model_dir / "model.safetensors").write_bytes(b"mid-trained")
    pipeline.rl_steps = 0  # RL made no step: the final policy is the mid-trained model

    def full_disk(source, destination, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", full_disk)  # what copytree's copy2 writes each file with
    target = pipeline.run_dir / "model"
    message = f"^cannot write {target}: No space left on device: free space on its disk, then run the command again$"
    with pytest.raises(WhetstoneError, match=message):
        pipeline.export_policy()
    assert sorted(p.name for p in pipeline.run_dir.iterdir()) == ["midtrain"]
