"""Hugging Face checkpoints: transformers' own Qwen3 / Qwen3-MoE against ours, both directions."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from whetstone.errors import CheckpointError
from whetstone.model import Transformer
from whetstone.model.hf import load_hf, save_hf

transformers = pytest.importorskip("transformers")

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def hf_moe(**overrides):
    fields = dict(SHAPE, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    fields.update(overrides)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields)).eval()


def hf_dense(**overrides):
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**dict(SHAPE, **overrides))).eval()


IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "reference",
    [
        lambda: hf_moe(norm_topk_prob=True, mlp_only_layers=[0]),
        lambda: hf_moe(norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True),
        lambda: hf_dense(tie_word_embeddings=False),
        lambda: hf_dense(tie_word_embeddings=True),
    ],
    ids=["moe-norm-topk-mlp-only", "moe-sparse-step-tied", "dense-untied", "dense-tied"],
)
@torch.no_grad()
def test_transformers_checkpoint_loads_with_equal_logits(reference, tmp_path):
    hf_model = reference()
    hf_model.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    expected = hf_model(IDS, output_router_logits=ours.cfg.num_experts > 0)
    got = ours(IDS)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    if ours.cfg.num_experts:
        torch.testing.assert_close(got.aux_loss, expected.aux_loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("max_shard_bytes", [2**30, 20_000], ids=["one-file", "sharded"])
@torch.no_grad()
def test_saved_folder_loads_in_transformers_with_equal_logits(max_shard_bytes, tmp_path, make_config):
    cfg = make_config(vocab_size=64, norm_topk_prob=True, tie_word_embeddings=False)
    ours = Transformer(cfg).eval()
    save_hf(ours, tmp_path / "ckpt", max_shard_bytes=max_shard_bytes)
    sharded = (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_bytes < 2**30)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    torch.testing.assert_close(theirs(IDS).logits, ours(IDS).logits, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_shared_expert_model_round_trips_through_a_folder(tmp_path, make_config):
    # transformers' Qwen3-MoE has no shared expert, so this folder is for whetstone only.
    ours = Transformer(make_config(shared_expert_intermediate_size=8)).eval()
    save_hf(ours, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    back = load_hf(tmp_path)
    assert back.cfg == ours.cfg
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor.to(torch.bfloat16).float()), name


@torch.no_grad()
def test_fused_expert_tensors_are_read_too(tmp_path):
    hf_moe().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(3):
        prefix = f"model.layers.{layer}.mlp.experts"
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [
                torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"]])
                for e in range(4)
            ]
        )
        fused[f"{prefix}.down_proj"] = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(4)])
    reference = load_hf(tmp_path)
    save_file(fused, tmp_path / "model.safetensors", metadata={"format": "pt"})
    fused_model = load_hf(tmp_path)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(fused_model.state_dict()[name], tensor), name


def test_tokenizer_files_are_copied(tmp_path, make_config):
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    save_hf(Transformer(make_config()), tmp_path / "ckpt", tokenizer_dir=tokenizer)
    assert (tmp_path / "ckpt" / "tokenizer.json").read_text() == "{}"
    with pytest.raises(CheckpointError, match="no tokenizer files"):
        save_hf(Transformer(make_config()), tmp_path / "other", tokenizer_dir=tmp_path / "ckpt" / "missing")


def test_a_failed_save_leaves_the_previous_folder_intact(tmp_path, make_config, monkeypatch):
    save_hf(Transformer(make_config()), tmp_path / "ckpt")
    before = (tmp_path / "ckpt" / "model.safetensors").read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("whetstone.model.hf.save_file", disk_full)
    with pytest.raises(
        CheckpointError, match=r"cannot write the model folder .*ckpt: disk full\. It is left as it was"
    ):
        save_hf(Transformer(make_config()), tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


# --- bad input: every error names the file, tensor or field -------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    hf_moe(mlp_only_layers=[0]).save_pretrained(tmp_path)
    return tmp_path


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _edit_tensors(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_folder_names_config_json(tmp_path):
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        load_hf(tmp_path / "nowhere")


def test_corrupt_config_json(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_hf(checkpoint)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(architectures=["LlamaForCausalLM"]), "architecture 'LlamaForCausalLM' is not supported"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "rope type = 'yarn'"),
        (dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
    ],
)
def test_unsupported_configs_are_named(checkpoint, changes, message):
    _edit_config(checkpoint, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_hf(checkpoint)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(rope_scaling="linear"), "rope_scaling must be a JSON object .* not a string 'linear'"),
        (dict(rope_parameters=[1e6]), r"rope_parameters must be a JSON object .* not an array \[1000000.0\]"),
        (dict(architectures="Qwen3MoeForCausalLM"), "architectures must be a JSON array of class names"),
        (dict(model_type=["qwen3_moe"]), r"model_type must be a string, not an array \['qwen3_moe'\]"),
    ],
    ids=["rope-scaling-string", "rope-parameters-list", "architectures-string", "model-type-list"],
)
def test_a_config_key_of_the_wrong_json_type_is_named(checkpoint, changes, message):
    _edit_config(checkpoint, **changes)
    with pytest.raises(CheckpointError, match=f"config.json: {message}"):
        load_hf(checkpoint)


@pytest.mark.parametrize(
    "config, message",
    [
        ("[]", "config.json: expected a JSON object of config keys, not an array"),
        ("null", "config.json: expected a JSON object of config keys, not null"),
        ("dir", "config.json is a directory, not a JSON file"),
    ],
)
def test_a_config_json_that_is_no_object_is_named(checkpoint, config, message):
    (checkpoint / "config.json").unlink()
    if config == "dir":
        (checkpoint / "config.json").mkdir()
    else:
        (checkpoint / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match=message):
        load_hf(checkpoint)


def test_a_model_path_that_is_a_file_is_named(tmp_path):
    (tmp_path / "model").write_text("x")
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'model'} is a file, not a Hugging Face checkpoint folder"):
        load_hf(tmp_path / "model")


def test_a_model_path_with_home_and_variables_is_expanded(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(checkpoint.parent))
    monkeypatch.setenv("WHETSTONE_TEST_MODEL", checkpoint.name)
    monkeypatch.chdir(tmp_path)
    assert load_hf(f"~/{checkpoint.name}").cfg == load_hf(checkpoint).cfg
    assert load_hf("~/${WHETSTONE_TEST_MODEL}").cfg.num_experts == 4


def test_missing_weights_file(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_hf(checkpoint)


def test_corrupt_weights_file(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        load_hf(checkpoint)


def test_shape_mismatch_names_tensor_and_both_shapes(checkpoint):
    _edit_tensors(checkpoint, lambda t: t.update({"model.layers.2.self_attn.q_norm.weight": torch.ones(15)}))
    with pytest.raises(CheckpointError, match=r"q_norm.weight has shape \(15,\), the config expects \(16,\)"):
        load_hf(checkpoint)


def test_config_that_does_not_fit_the_weights(checkpoint):
    _edit_config(checkpoint, hidden_size=40)
    with pytest.raises(CheckpointError, match=r"has shape \(.*32\), the config expects \(.*40\)"):
        load_hf(checkpoint)


def test_missing_tensor_is_named(checkpoint):
    _edit_tensors(checkpoint, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensor model.layers.1.mlp.experts.3.up_proj.weight"):
        load_hf(checkpoint)


def test_unexpected_tensor_is_named(checkpoint):
    _edit_tensors(checkpoint, lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="model.layers.9.extra.weight"):
        load_hf(checkpoint)


def test_index_pointing_at_a_missing_shard(checkpoint):
    (checkpoint / "model.safetensors").rename(checkpoint / "model-00001-of-00002.safetensors")
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-1.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-1.safetensors is listed in the index but does not exist"):
        load_hf(checkpoint)


@pytest.mark.parametrize("weight_map", [["model.safetensors"], {"x": 3}])
def test_an_index_whose_weight_map_is_not_names_to_files_is_named(checkpoint, weight_map):
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="weight_map must map tensor names to file names"):
        load_hf(checkpoint)


def test_an_index_that_cannot_be_read_is_named(checkpoint):
    (checkpoint / "model.safetensors.index.json").mkdir()
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json cannot be read: Is a directory"):
        load_hf(checkpoint)


@pytest.mark.parametrize(
    "first, then", [("20KB", "1GB"), ("1GB", "20KB")], ids=["sharded-then-one", "one-then-sharded"]
)
@torch.no_grad()
def test_a_folder_holding_both_a_single_file_and_an_index_to_other_files_is_refused(first, then, tmp_path):
    # save_pretrained into a folder that held the other form leaves the stale file behind;
    # transformers then reads model.safetensors, vLLM the files the index names
    hf_dense().save_pretrained(tmp_path, max_shard_size=first)
    hf_dense(rms_norm_eps=1e-5).save_pretrained(tmp_path, max_shard_size=then)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "model.safetensors.index.json").exists()
    with pytest.raises(CheckpointError, match="holds both model.safetensors and model.safetensors.index.json"):
        load_hf(tmp_path)


def test_an_index_naming_only_model_safetensors_is_read_with_it(checkpoint):
    names = load_file(checkpoint / "model.safetensors")
    weight_map = {name: "model.safetensors" for name in names}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert load_hf(checkpoint).cfg.num_experts == 4


@torch.no_grad()
def test_a_tied_checkpoint_may_store_a_copy_of_the_embedding_as_the_head(tmp_path):
    hf_dense(tie_word_embeddings=True).save_pretrained(tmp_path)
    _edit_tensors(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model = load_hf(tmp_path)
    assert model.lm_head.weight is model.embed_tokens.weight


@torch.no_grad()
def test_a_tied_checkpoint_storing_a_different_head_is_refused(tmp_path):
    hf_dense(tie_word_embeddings=True).save_pretrained(tmp_path)
    _edit_tensors(tmp_path, lambda t: t.update({"lm_head.weight": torch.randn(64, 32)}))
    # transformers unties such a folder and uses the stored head: a different model than the tied one
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not torch.equal(theirs.lm_head.weight, theirs.model.embed_tokens.weight)
    with pytest.raises(
        CheckpointError, match="tie_word_embeddings to true, but the checkpoint's lm_head.weight differs"
    ):
        load_hf(tmp_path)
