"""Checkpoints: a full round trip, the newest complete one wins, and every bad file is named."""

import base64
import errno
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tests.training.conftest import TINY
from whetstone.errors import CheckpointError, ConfigError
from whetstone.model import ModelConfig, Transformer
from whetstone.training import checkpoint as ckpt
from whetstone.training.checkpoint import (
    TOKENIZER_KEY,
    DamagedCheckpoint,
    TrainState,
    check_tokenizer,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    naming_older_checkpoints,
    remove_stale_temporaries,
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


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
    ],
)
def test_a_failed_save_leaves_nothing_behind_and_names_the_intact_checkpoint(tmp_path, monkeypatch, error):
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=1)

    def disk_full(*args, **kwargs):
        raise error

    monkeypatch.setattr(ckpt, "save_file", disk_full)
    with pytest.raises(
        CheckpointError,
        match=r"cannot write checkpoint .*step_00000002 in .*: .*No space left on device.*"
        r"Nothing of it was kept; the newest checkpoint, .*step_00000001, is intact",
    ):
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


def snapshot(model, optimizer):
    """Copies of everything a load replaces: weights, optimizer state, the three RNGs."""
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        repr(optimizer.state_dict()["state"]),
        torch.get_rng_state().clone(),
        random.getstate(),
        repr(np.random.get_state()),
    )


def assert_untouched(before, model, optimizer):
    weights, moments, torch_rng, python_rng, numpy_rng = before
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert repr(optimizer.state_dict()["state"]) == moments
    assert torch.equal(torch.get_rng_state(), torch_rng)
    assert random.getstate() == python_rng and repr(np.random.get_state()) == numpy_rng


def edit_state(path, edit):
    record = json.loads((path / "state.json").read_text())
    edit(record)
    (path / "state.json").write_text(json.dumps(record))


def restore_digests(path):
    """state.json's sha256 recomputed for the tensor files as they are now (an edit, not damage)."""
    edit_state(path, lambda r: r["sha256"].update({n: ckpt._sha256(path / n) for n in r["sha256"]}))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.update(sha256=[r["sha256"]]), r"'sha256' must map"),
        (lambda r: r.update(sha256={}), r"'sha256' must map"),  # no digest to check: refused, not skipped
        (lambda r: r.update(step="2"), r"'step' is '2', not a count"),
        (lambda r: r.update(step=3), r"'step' is 3, but the folder is step_00000002"),
        (lambda r: r.update(tokens=-1), r"'tokens' is -1, not a count"),
        (lambda r: r.update(data=[r["data"]]), r"'data' is list, not an object"),
        (lambda r: r["data"].update(next_batch=-4), r"data.next_batch is -4, not a count"),
        (lambda r: r.update(rng=[]), r"'rng' is list"),
        (lambda r: r.update(optimizer_param_groups={}), r"'optimizer_param_groups' is not a list"),
        (lambda r: r.update(config=[]), r"'config' is not an object"),
    ],
)
def test_state_json_fields_of_the_wrong_type_are_named_before_anything_is_loaded(tmp_path, edit, message):
    path = save(tmp_path, *trained())
    edit_state(path, edit)
    model, optimizer = make(seed=7)
    before = snapshot(model, optimizer)
    with pytest.raises(DamagedCheckpoint, match=r"state\.json is corrupt: " + message):
        load_checkpoint(path, model, optimizer)
    assert_untouched(before, model, optimizer)


@pytest.mark.parametrize(
    "edit",
    [
        lambda rng: rng.update(torch=base64.b64encode(b"abc").decode()),  # 3 bytes, not the generator's 5056
        lambda rng: rng["python"].__setitem__(1, rng["python"][1][:10]),
        lambda rng: rng["numpy"].__setitem__(1, rng["numpy"][1][:10]),
        lambda rng: rng.update(numpy=["MT19937"]),
    ],
)
def test_rng_states_of_the_wrong_size_are_refused_before_anything_is_loaded(tmp_path, edit):
    path = save(tmp_path, *trained())
    edit_state(path, lambda record: edit(record["rng"]))
    model, optimizer = trained(steps=1)  # with optimizer state of its own, to see it kept
    before = snapshot(model, optimizer)
    with pytest.raises(DamagedCheckpoint, match=r"state\.json is corrupt: bad RNG state"):
        load_checkpoint(path, model, optimizer)
    assert_untouched(before, model, optimizer)


def test_files_that_cannot_be_read_are_named(tmp_path, monkeypatch):
    path = save(tmp_path, *trained())
    model_file = path / "model.safetensors"
    moved = tmp_path / "moved.safetensors"
    model_file.rename(moved)
    model_file.mkdir()
    with pytest.raises(DamagedCheckpoint, match=r"model\.safetensors cannot be read: Is a directory"):
        load_checkpoint(path, *make())
    model_file.rmdir()
    moved.rename(model_file)
    load_checkpoint(path, *make())

    real_open, real_read_text = open, Path.read_text

    def refused(file, *args, **kwargs):
        if Path(file).name in ("model.safetensors", "state.json"):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(ckpt, "open", refused, raising=False)  # what _sha256 opens
    with pytest.raises(CheckpointError, match=r"model\.safetensors cannot be read: permission denied") as caught:
        load_checkpoint(path, *make())
    assert not isinstance(caught.value, DamagedCheckpoint)  # the file is fine: this user may not read it
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: refused(self) and real_read_text(self, *a, **k))
    with pytest.raises(CheckpointError, match=r"state\.json cannot be read: permission denied"):
        load_checkpoint(path, *make())


@pytest.mark.parametrize("opened", [True, False])
def test_a_checkpoint_pruned_while_it_is_read_is_named(tmp_path, monkeypatch, opened):
    path = save(tmp_path, *trained())
    real_load_file = ckpt.load_file

    def pruned_meanwhile(file):
        shutil.rmtree(path)  # a run saving into the folder pruned it after the digests were checked
        if opened:  # safetensors had opened it already: its mmap of the file fails
            raise RuntimeError(f"unable to open file <{file}> in read-only mode: No such file or directory (2)")
        return real_load_file(file)

    monkeypatch.setattr(ckpt, "load_file", pruned_meanwhile)
    with pytest.raises(CheckpointError, match=r"step_00000002 was removed while it was read: is a run writing to"):
        load_checkpoint(path, *make())


def test_a_tensor_of_another_dtype_is_named(tmp_path):
    path = save(tmp_path, *trained())
    weights = load_file(str(path / "model.safetensors"))
    save_file({n: t.to(torch.int8) for n, t in weights.items()}, str(path / "model.safetensors"))
    restore_digests(path)
    with pytest.raises(DamagedCheckpoint, match=r"model\.safetensors: tensor '.*' is int8, .* float32 master weights"):
        load_checkpoint(path, *make())
    save_file(weights, str(path / "model.safetensors"))
    moments = load_file(str(path / "optimizer.safetensors"))
    save_file({n: t.to(torch.bfloat16) for n, t in moments.items()}, str(path / "optimizer.safetensors"))
    restore_digests(path)
    with pytest.raises(DamagedCheckpoint, match=r"optimizer\.safetensors: tensor '.*' is bfloat16, .* are float32"):
        load_checkpoint(path, *make())


def test_a_damaged_newest_checkpoint_names_the_older_complete_ones(tmp_path):
    model, optimizer = trained()
    for step in (2, 4, 5):
        save(tmp_path, model, optimizer, step=step, keep=5)
    newest = tmp_path / "step_00000005"
    for file in newest.iterdir():
        file.unlink()  # an empty folder
    with pytest.raises(
        DamagedCheckpoint,
        match=r"step_00000005/state\.json is missing\. step_00000005 is the run's newest checkpoint\. "
        r"Older complete checkpoints in .*: step_00000004, step_00000002\. The run does not fall back by itself "
        r".*move .*step_00000005 out of .* to resume from step_00000004",
    ):
        with naming_older_checkpoints(newest):
            load_checkpoint(newest, *make())
    (tmp_path / "step_00000004" / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(DamagedCheckpoint, match=r"Older complete checkpoints in .*: step_00000002\. "):
        with naming_older_checkpoints(newest):
            load_checkpoint(newest, *make())
    shutil.rmtree(tmp_path / "step_00000002")
    with pytest.raises(DamagedCheckpoint, match=r"There is no older complete checkpoint in .*: move .* out of it"):
        with naming_older_checkpoints(newest):
            load_checkpoint(newest, *make())
    other = save(tmp_path / "other", model, optimizer, step=2)
    with pytest.raises(CheckpointError, match="has shape") as caught:  # not damaged: an older one would not fit either
        with naming_older_checkpoints(other):
            load_checkpoint(other, *make(TINY.model_copy(update={"hidden_size": 24})))
    assert "Older" not in str(caught.value)


def test_stale_temporary_folders_are_removed_and_nothing_else(tmp_path):
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    stale = tmp_path / ".step_00000004.k2j_x8.tmp"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "notes.tmp").mkdir()
    assert remove_stale_temporaries(tmp_path) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp", "step_00000002"]
    assert remove_stale_temporaries(tmp_path / "absent") == []


def test_a_tokenizer_other_than_the_checkpoints_is_refused(tmp_path):
    check_tokenizer(tmp_path, {TOKENIZER_KEY: "a" * 64}, "a" * 64, "corpus tokenizer", "advice")
    check_tokenizer(tmp_path, {}, "b" * 64, "corpus tokenizer", "advice")  # not recorded: not checked
    check_tokenizer(tmp_path, {TOKENIZER_KEY: "a" * 64}, None, "model_path m", "advice")  # m has no tokenizer.json
    with pytest.raises(
        ConfigError,
        match=r"another tokenizer \(tokenizer.json sha256 a{16}\) than this run's corpus "
        r"tokenizer \(tokenizer.json sha256 b{16}\).*other token ids\. Do this",
    ):
        check_tokenizer(tmp_path, {TOKENIZER_KEY: "a" * 64}, "b" * 64, "corpus tokenizer", "Do this")
