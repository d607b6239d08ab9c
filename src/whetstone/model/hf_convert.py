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
    """ModelConfig from a config.json dict; unsupported features are named, not ignored."""
    architectures = config.get("architectures") or [config.get("model_type")]
    architecture = architectures[0]
    if architecture not in ARCHITECTURES and architecture not in ARCHITECTURES.values():
        raise CheckpointError(
            f"{source}: architecture {architecture!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )

    def unsupported(field: str, value: Any) -> CheckpointError:
        return CheckpointError(f"{source}: {field} = {value!r} is not supported by whetstone's model")

    if config.get("hidden_act", "silu") != "silu":
        raise unsupported("hidden_act", config["hidden_act"])
    if config.get("attention_bias", False):
        raise unsupported("attention_bias", True)
    if config.get("use_sliding_window", False):
        raise unsupported("use_sliding_window", True)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise unsupported("rope type", rope_type)
    num_experts = config.get("num_experts", config.get("num_local_experts", 0))
    is_moe = ARCHITECTURES.get(architecture, architecture) == "qwen3_moe"
    try:
        fields = dict(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            head_dim=config.get("head_dim") or config["hidden_size"] // max(1, config["num_attention_heads"]),
            intermediate_size=config["intermediate_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            initializer_range=config.get("initializer_range", 0.02),
            num_experts=num_experts if is_moe else 0,
        )
        if is_moe:
            fields.update(
                num_experts_per_tok=config["num_experts_per_tok"],
                moe_intermediate_size=config["moe_intermediate_size"],
                norm_topk_prob=config.get("norm_topk_prob", False),
                shared_expert_intermediate_size=config.get("shared_expert_intermediate_size", 0),
                decoder_sparse_step=config.get("decoder_sparse_step", 1),
                mlp_only_layers=config.get("mlp_only_layers") or [],
                router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
            )
    except KeyError as err:
        raise CheckpointError(f"{source}: missing field {err.args[0]!r}") from None
    try:
        return ModelConfig(**fields)
    except ValueError as err:
        raise CheckpointError(f"{source}: {err}") from None
