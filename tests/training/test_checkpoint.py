"""Checkpoints: a full round trip, the newest complete one wins, and every bad file is named."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.training.conftest import TINY
from whetstone.errors import CheckpointError
from whetstone.model import ModelConfig, Transformer
from whetstone.training import checkpoint as ckpt
from whetstone.training.checkpoint import (
    TrainState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from whetstone.training.optim import build_optimizer


def make(config: ModelConfig = TINY, seed: int = 0):
    torch.manual_seed(seed)
    model = Transformer(config)
    optimizer = build_optimizer(model, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return model, optimizer


def trained(steps: int = 2):
    model, optimizer = make()
    for _ in range(steps):
        out = model(torch.randint(0, 50, (2, 8)))
        (out.logits.float().square().mean() + out.aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def save(root, model, optimizer, step=2, keep=3):
    state = TrainState(step=step, tokens=32 * step, data={"next_batch": step})
    return save_checkpoint(root, model, optimizer, state, {"note": "config"}, keep=keep)


def test_round_trip_restores_weights_optimizer_rng_and_state(tmp_path):
    model, optimizer = trained()
    torch.manual_seed(123)
    random.seed(5)
    path = save(tmp_path, model, optimizer)
    expected_draws = (torch.rand(3), random.random())

    fresh_model, fresh_optimizer = make(seed=99)
    state = load_checkpoint(path, fresh_model, fresh_optimizer)

    assert (state.step, state.tokens, state.data) == (2, 64, {"next_batch": 2})
    for (name, a), b in zip(model.state_dict().items(), fresh_model.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh_model.lm_head.weight is fresh_model.embed_tokens.weight  # still tied
    saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for index, moments in saved["state"].items():
        for key, tensor in moments.items():
            assert torch.equal(tensor, loaded["state"][index][key]), (index, key)
    assert torch.equal(torch.rand(3), expected_draws[0]) and random.random() == expected_draws[1]


def test_latest_is_the_newest_complete_directory_and_old_ones_are_pruned(tmp_path):
    model, optimizer = trained()
    for step in (1, 2, 3):
        save(tmp_path, model, optimizer, step=step, keep=2)
    (tmp_path / ".step_00000009.abc.tmp").mkdir()  # a save that crashed midway
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_a_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=1)

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt, "save_file", disk_full)
    with pytest.raises(OSError):
        save(tmp_path, model, optimizer, step=2)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]


def test_missing_checkpoint_and_missing_files_are_named(tmp_path):
    model, optimizer = make()
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "step_00000007", model, optimizer)
    path = save(tmp_path, *trained())
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(CheckpointError, match="optimizer.safetensors is missing"):
        load_checkpoint(path, model, optimizer)
    (path / "state.json").unlink()
    with pytest.raises(CheckpointError, match="state.json is missing"):
        load_checkpoint(path, model, optimizer)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_tensor_file_is_named_and_nothing_is_loaded(tmp_path, damage):
    path = save(tmp_path, *trained())
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-5] ^= 0x01  # one bit of one weight
    file.write_bytes(bytes(data))
    model, optimizer = make(seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt"):
        load_checkpoint(path, model, optimizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_corrupt_state_json_is_named(tmp_path):
    path = save(tmp_path, *trained())
    record = json.loads((path / "state.json").read_text())
    (path / "state.json").write_text(json.dumps({**record, "rng": {"torch": "not base64!"}}))
    model, optimizer = make(seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"state\.json is corrupt: bad RNG state"):
        load_checkpoint(path, model, optimizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    (path / "state.json").write_text('{"step": 2, "tok')
    with pytest.raises(CheckpointError, match=r"state\.json is corrupt"):
        load_checkpoint(path, *make())


def test_shapes_that_do_not_fit_the_config_name_the_tensor(tmp_path):
    path = save(tmp_path, *trained())
    wider = TINY.model_copy(update={"moe_intermediate_size": 12})
    with pytest.raises(
        CheckpointError, match=r"'layers\.0\.mlp\.experts\.down_proj' has shape \[4, 16, 8\].*expects \[4, 16, 12\]"
    ):
        load_checkpoint(path, *make(wider))


def test_tensor_names_that_do_not_fit_the_config_are_named(tmp_path):
    path = save(tmp_path, *trained())
    deeper = TINY.model_copy(update={"num_hidden_layers": 3})
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.2\..*' is missing"):
        load_checkpoint(path, *make(deeper))
    dense = TINY.model_copy(update={"num_experts": 0, "intermediate_size": 8})
    with pytest.raises(CheckpointError, match=r"'layers\.0\.mlp\.(router|experts)\..*' is not in the model"):
        load_checkpoint(path, *make(dense))


def test_tying_that_does_not_fit_the_config_is_named(tmp_path):
    untied = TINY.model_copy(update={"tie_word_embeddings": False})
    path = save(tmp_path / "untied", *make(untied))
    with pytest.raises(CheckpointError, match=r"'embed_tokens.weight' and 'lm_head.weight' are stored apart"):
        load_checkpoint(path, *make())
    path = save(tmp_path / "tied", *make())
    with pytest.raises(CheckpointError, match=r"tensor 'lm_head.weight' is missing"):
        load_checkpoint(path, *make(untied))


def test_optimizer_moments_that_do_not_fit_are_named(tmp_path):
    path = save(tmp_path, *trained())
    moments = load_file(str(path / "optimizer.safetensors"))
    moments["norm.weight.exp_avg"] = torch.zeros(3)
    save_file(moments, str(path / "optimizer.safetensors"))
    record = json.loads((path / "state.json").read_text())
    record["sha256"]["optimizer.safetensors"] = ckpt._sha256(path / "optimizer.safetensors")
    (path / "state.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=r"'norm\.weight\.exp_avg' has shape \[3\]"):
        load_checkpoint(path, *make())


def test_changed_lr_multipliers_are_named_instead_of_mixing_up_the_groups(tmp_path):
    path = save(tmp_path, *trained())
    torch.manual_seed(0)
    model = Transformer(TINY)
    optimizer = build_optimizer(
        model, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, lr_multipliers={"norm.weight": 10.0}
    )
    with pytest.raises(
        CheckpointError, match=r"learning-rate factors \[1\.0, 1\.0\].*\[1\.0, 1\.0, 10\.0\].*lr_multipliers"
    ):
        load_checkpoint(path, model, optimizer)


def test_a_resumed_optimizer_keeps_the_configs_hyperparameters_and_takes_only_its_state(tmp_path):
    model, optimizer = trained()
    path = save(tmp_path, model, optimizer)
    torch.manual_seed(0)
    fresh = Transformer(TINY)
    changed = build_optimizer(fresh, lr=1e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)
    load_checkpoint(path, fresh, changed)

    assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in changed.param_groups] == [
        (1e-3, (0.8, 0.99), 1e-6, 0.0)
    ] * 2
    saved, loaded = optimizer.state_dict()["state"], changed.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for index, moments in saved.items():  # moments and step counts from the checkpoint
        for key, tensor in moments.items():
            assert torch.equal(tensor, loaded[index][key]), (index, key)
