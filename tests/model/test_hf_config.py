"""config.json to ModelConfig: a key the file leaves out means what it means to transformers, so a
folder loads to the model transformers' AutoConfig (and so vLLM) builds from it."""

import json
import re

import pytest
import torch

from whetstone.errors import CheckpointError
from whetstone.model.hf import load_hf, read_hf_config

transformers = pytest.importorskip("transformers")
StrictDataclassFieldValidationError = pytest.importorskip("huggingface_hub.errors").StrictDataclassFieldValidationError

# Every value differs from transformers' default, so leaving any one out is visible.
FULL = {
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=64,
        hidden_size=256,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=64,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=5e5,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        max_position_embeddings=99,
        tie_word_embeddings=True,
        initializer_range=0.05,
    ),
}
FULL["qwen3_moe"] = dict(
    FULL["qwen3"],
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    norm_topk_prob=True,
    decoder_sparse_step=2,
    mlp_only_layers=[0],
    router_aux_loss_coef=0.01,
)
DROPS = [(kind, key) for kind, config in FULL.items() for key in config if key != "model_type"]
DROPS += [(kind, ("rope_theta", "rope_parameters")) for kind in FULL]


def as_transformers_builds(folder):
    """The ModelConfig fields of the model transformers builds from `folder`."""
    hf = transformers.AutoConfig.from_pretrained(folder)
    moe = hf.model_type == "qwen3_moe"
    fields = dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        # What Qwen3Attention / Qwen3MoeAttention read.
        head_dim=getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads),
        intermediate_size=hf.intermediate_size,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=hf.rope_parameters["rope_theta"],
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=hf.tie_word_embeddings,
        initializer_range=hf.initializer_range,
        num_experts=hf.num_experts if moe else 0,
    )
    if moe:
        fields.update(
            {
                key: getattr(hf, key)
                for key in (
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                    "norm_topk_prob",
                    "decoder_sparse_step",
                    "mlp_only_layers",
                    "router_aux_loss_coef",
                )
            }
        )
    return fields


def write(folder, config):
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def loaded(folder, fields):
    cfg = read_hf_config(folder)
    return {key: getattr(cfg, key) for key in fields}


@pytest.mark.parametrize("kind, dropped", DROPS, ids=[f"{kind}-{key}" for kind, key in DROPS])
def test_a_missing_key_takes_transformers_default(kind, dropped, tmp_path):
    dropped = dropped if isinstance(dropped, tuple) else (dropped,)
    folder = write(tmp_path, {key: value for key, value in FULL[kind].items() if key not in dropped})
    expected = as_transformers_builds(folder)
    assert loaded(folder, expected) == expected


@pytest.mark.parametrize(
    "kind, changes",
    [
        ("qwen3", dict(num_key_value_heads=None)),  # Qwen3Config: null means num_attention_heads
        ("qwen3_moe", dict(mlp_only_layers=None)),
        ("qwen3_moe", dict(num_local_experts=6)),  # transformers' name wins over num_experts
        ("qwen3_moe", dict(rope_scaling={"rope_type": "default", "rope_theta": 3.0})),  # wins over rope_parameters
        ("qwen3_moe", dict(architectures=None)),  # model_type alone is enough
    ],
    ids=[
        "qwen3-null-kv-heads",
        "moe-null-mlp-only-layers",
        "moe-num-local-experts",
        "rope-scaling",
        "no-architectures",
    ],
)
def test_keys_transformers_reads_specially(kind, changes, tmp_path):
    folder = write(tmp_path, dict(FULL[kind], **changes))
    expected = as_transformers_builds(folder)
    assert loaded(folder, expected) == expected


@pytest.mark.parametrize(
    "kind, changes, message",
    [
        ("qwen3", dict(head_dim=None), "head_dim is null"),
        ("qwen3_moe", dict(num_key_value_heads=None), "num_key_value_heads is null"),
        ("qwen3_moe", dict(tie_word_embeddings=None), "tie_word_embeddings is null"),
        ("qwen3", dict(model_type="qwen3_moe"), "'Qwen3ForCausalLM' and model_type 'qwen3_moe' disagree"),
        ("qwen3", dict(model_type="llama"), "model_type 'llama' is not supported"),
        ("qwen3", dict(model_type=None, architectures=None), "neither architectures nor model_type"),
    ],
)
def test_configs_transformers_would_not_build_are_named(kind, changes, message, tmp_path):
    write(tmp_path, dict(FULL[kind], **changes))
    with pytest.raises(CheckpointError, match=message):
        read_hf_config(tmp_path)


def test_an_invalid_model_from_defaults_names_the_defaults_taken(tmp_path):
    config = dict(FULL["qwen3"], num_attention_heads=4)
    del config["num_key_value_heads"]  # Qwen3Config's default is 32, which 4 heads cannot share
    write(tmp_path, config)
    with pytest.raises(
        CheckpointError, match=r"(?s)multiple of num_key_value_heads \(32\).*lacks: num_key_value_heads=32"
    ):
        read_hf_config(tmp_path)


@torch.no_grad()
def test_a_qwen3_checkpoint_without_head_dim_loads_with_equal_logits(tmp_path):
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    reference = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_key_value_heads=2, **shape)).eval()
    assert reference.config.head_dim == 128 != 32 // 4
    reference.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["head_dim"]
    write(tmp_path, config)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(load_hf(tmp_path)(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(tie_word_embeddings="false"), "tie_word_embeddings: Input should be a valid boolean (got 'false')"),
        (dict(norm_topk_prob=1), "norm_topk_prob: Input should be a valid boolean (got 1)"),
        (dict(hidden_size="256"), "hidden_size: Input should be a valid integer (got '256')"),
        (dict(num_experts=16.0), "num_experts: Input should be a valid integer (got 16.0)"),
        (dict(mlp_only_layers=["0"]), "mlp_only_layers.0: Input should be a valid integer (got '0')"),
        (dict(rms_norm_eps="1e-5"), "rms_norm_eps: Input should be a valid number (got '1e-5')"),
        (dict(attention_bias="false"), "attention_bias = 'false' is not supported"),
    ],
    ids=["bool-string", "bool-number", "int-string", "int-float", "list-of-strings", "float-string", "bias-string"],
)
def test_a_value_of_the_wrong_json_type_is_refused_as_transformers_refuses_it(changes, message, tmp_path):
    # read leniently, "false" would be False here, but true to any reader that tests its truth
    write(tmp_path, dict(FULL["qwen3_moe"], **changes))
    with pytest.raises(StrictDataclassFieldValidationError):
        transformers.AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        read_hf_config(tmp_path)
