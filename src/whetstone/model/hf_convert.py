"""Conversion between whetstone and Hugging Face Qwen3 / Qwen3-MoE: config.json fields and tensor
names (torchtitan style: an explicit table, no guessing). No file I/O here; see hf.py.

Tensor names, `{i}` a layer and `{e}` an expert:

    whetstone                                  Hugging Face
    embed_tokens.weight                        model.embed_tokens.weight
    norm.weight                                model.norm.weight
    lm_head.weight                             lm_head.weight (absent when tied)
    layers.{i}.<LAYER_NAMES key>               model.layers.{i}.<LAYER_NAMES value>
    layers.{i}.mlp.experts.gate_up_proj        model.layers.{i}.mlp.experts.{e}.gate_proj.weight  (rows :I)
        [E, 2I, H]                             model.layers.{i}.mlp.experts.{e}.up_proj.weight    (rows I:)
    layers.{i}.mlp.experts.down_proj [E, H, I] model.layers.{i}.mlp.experts.{e}.down_proj.weight

transformers >= 5 keeps experts fused in memory but still saves them per expert, as the hub's
checkpoints are; a fused file (`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, same
layout as ours) is read too.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from whetstone.config import format_validation_error
from whetstone.errors import CheckpointError
from whetstone.model.config import ModelConfig

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}

LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attn.q_proj.weight": "self_attn.q_proj.weight",
    "self_attn.k_proj.weight": "self_attn.k_proj.weight",
    "self_attn.v_proj.weight": "self_attn.v_proj.weight",
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "self_attn.q_norm.weight": "self_attn.q_norm.weight",
    "self_attn.k_norm.weight": "self_attn.k_norm.weight",
    # dense layers
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    # MoE layers (experts are handled separately: one of ours is many of theirs)
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_expert.gate_proj.weight": "mlp.shared_expert.gate_proj.weight",
    "mlp.shared_expert.up_proj.weight": "mlp.shared_expert.up_proj.weight",
    "mlp.shared_expert.down_proj.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
}
TOP_NAMES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# transformers' defaults (Qwen3Config, Qwen3MoeConfig) for the keys read from config.json: a key the
# file leaves out means these. Qwen3-MoE has no head_dim default (see model_config_from_hf).
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        initializer_range=0.02,
    ),
    "qwen3_moe": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        initializer_range=0.02,
        num_experts=128,
        num_local_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
    ),
}
DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
# Tensors some writers add that carry no weights (older transformers saved RoPE's inv_freq).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_name(name: str) -> str:
    """The HF name of a whetstone tensor (experts excluded: see expert_names)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{LAYER_NAMES[rest]}"


def expert_names(layer: int, expert: int) -> dict[str, str]:
    """Per-expert HF names, keyed by projection."""
    prefix = f"model.layers.{layer}.mlp.experts.{expert}"
    return {proj: f"{prefix}.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")}


def hf_config(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """config.json for `cfg`, loadable by transformers' Qwen3 / Qwen3-MoE classes."""
    out: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if cfg.num_experts else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if cfg.num_experts else "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,  # older transformers read this key
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "initializer_range": cfg.initializer_range,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if cfg.num_experts:
        out.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
            router_aux_loss_coef=cfg.router_aux_loss_coef,
        )
        if cfg.shared_expert_intermediate_size:
            # Not a Qwen3-MoE field: transformers' Qwen3MoeForCausalLM has no shared expert.
            out["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return out


def model_config_from_hf(config: dict[str, Any], source: str) -> ModelConfig:
    """ModelConfig from a config.json dict. A key the file leaves out takes transformers' default
    (HF_DEFAULTS), so a folder loads to the model transformers builds from it; a key set to null
    is refused unless transformers gives null a meaning; unsupported features are named; a value
    of the wrong JSON type (a string for a number or a boolean, a number for a boolean) is named
    with its key."""
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: expected a JSON object of config keys, not {_json_type(config)}")
    kind = _model_kind(config, source)
    defaults = HF_DEFAULTS[kind]
    nullable = {"num_key_value_heads"} if kind == "qwen3" else {"mlp_only_layers"}
    taken: list[str] = []  # defaults used, named if they make an invalid model

    def get(key: str, default: Any = None) -> Any:
        if key not in config:
            default = defaults[key] if default is None else default
            taken.append(f"{key}={default!r}")
            return default
        if config[key] is None and key not in nullable:
            raise CheckpointError(f"{source}: {key} is null (leave it out to take transformers' default)")
        return config[key]

    def unsupported(field: str, value: Any) -> CheckpointError:
        return CheckpointError(f"{source}: {field} = {value!r} is not supported by whetstone's model")

    if config.get("hidden_act", "silu") != "silu":
        raise unsupported("hidden_act", config["hidden_act"])
    for key in ("attention_bias", "use_sliding_window"):
        if config.get(key, False) is not False:
            raise unsupported(key, config[key])
    for key in ("rope_scaling", "rope_parameters"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise CheckpointError(
                f'{source}: {key} must be a JSON object (such as {{"rope_type": "default"}}) or null, '
                f"not {_json_type(config[key])} {config[key]!r}"
            )
    # transformers takes rope_scaling over rope_parameters, and a rope_theta inside over one beside.
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise unsupported("rope type", rope_type)
    rope_theta = rope["rope_theta"] if "rope_theta" in rope else get("rope_theta", DEFAULT_ROPE_THETA)
    if rope_theta is None:
        raise CheckpointError(f"{source}: rope_theta is null (leave it out to take transformers' default)")

    hidden, heads = get("hidden_size"), get("num_attention_heads")
    kv_heads = get("num_key_value_heads")
    if kv_heads is None:  # Qwen3Config: null means one key/value head per query head
        kv_heads = heads
    if kind == "qwen3_moe" and "head_dim" not in config:
        # Qwen3MoeConfig has no head_dim field; its attention then uses hidden_size // heads.
        head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None
        taken.append(f"head_dim=hidden_size // num_attention_heads = {head_dim}")
    else:
        head_dim = get("head_dim")
    fields = dict(
        vocab_size=get("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=get("intermediate_size"),
        rms_norm_eps=get("rms_norm_eps"),
        rope_theta=rope_theta,
        max_position_embeddings=get("max_position_embeddings"),
        tie_word_embeddings=get("tie_word_embeddings"),
        initializer_range=get("initializer_range"),
        num_experts=0,
    )
    if kind == "qwen3_moe":
        fields.update(
            # transformers maps num_experts onto num_local_experts; the latter wins when both are set.
            num_experts=get("num_local_experts" if "num_local_experts" in config else "num_experts"),
            num_experts_per_tok=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size"),
            norm_topk_prob=get("norm_topk_prob"),
            decoder_sparse_step=get("decoder_sparse_step"),
            mlp_only_layers=get("mlp_only_layers") or [],
            router_aux_loss_coef=get("router_aux_loss_coef"),
            # Not a Qwen3-MoE field (whetstone's Qwen2-MoE style shared expert): absent means none.
            shared_expert_intermediate_size=config.get("shared_expert_intermediate_size") or 0,
        )
    try:
        # strict: a value of the wrong JSON type ("false", "32", 1 for true) is refused, as
        # transformers 5 refuses it, not read as whetstone's guess at what it means
        return ModelConfig.model_validate(fields, strict=True)
    except ValidationError as err:
        hint = f"\n  transformers' defaults taken for keys config.json lacks: {', '.join(taken)}" if taken else ""
        raise CheckpointError(format_validation_error(err, source) + hint) from None


def _model_kind(config: dict[str, Any], source: str) -> str:
    """qwen3 or qwen3_moe. transformers builds by model_type; architectures, when given, must agree."""
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise CheckpointError(
            f"{source}: architectures must be a JSON array of class names (such as "
            f'["Qwen3ForCausalLM"]), not {_json_type(architectures)} {architectures!r}'
        )
    if model_type is not None and not isinstance(model_type, str):
        raise CheckpointError(f"{source}: model_type must be a string, not {_json_type(model_type)} {model_type!r}")
    if architectures and architectures[0] not in ARCHITECTURES:
        raise CheckpointError(
            f"{source}: architecture {architectures[0]!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    if model_type is not None and model_type not in HF_DEFAULTS:
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not supported (supported: {', '.join(HF_DEFAULTS)})"
        )
    if not architectures and model_type is None:
        raise CheckpointError(f"{source}: names neither architectures nor model_type")
    if architectures and model_type is not None and ARCHITECTURES[architectures[0]] != model_type:
        raise CheckpointError(
            f"{source}: architecture {architectures[0]!r} and model_type {model_type!r} disagree "
            f"({architectures[0]} has model_type {ARCHITECTURES[architectures[0]]!r})"
        )
    return model_type if model_type is not None else ARCHITECTURES[architectures[0]]


def _json_type(value: Any) -> str:
    """What `value` is in JSON's words, for messages: an array, a string, a number..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value), type(value).__name__)
