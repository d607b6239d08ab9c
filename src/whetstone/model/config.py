"""The model's shape: one config covers dense Qwen3 and sparse Qwen3-MoE (plus a Qwen2-MoE style
shared expert). Field names follow the Hugging Face config.json keys, so conversion is a copy.

The defaults are the embedded default model: a tiny MoE that trains on 2 CPU cores in minutes.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from whetstone.config import Config


class ModelConfig(Config):
    """A decoder-only transformer: RMSNorm, RoPE, grouped-query attention with q/k norm, and a
    dense SwiGLU MLP or a sparse mixture of SwiGLU experts in each layer."""

    vocab_size: int = Field(4096, ge=1)
    """Number of token ids (rows of the embedding and of the output head)."""
    hidden_size: int = Field(256, ge=1)
    """Width of the residual stream."""
    num_hidden_layers: int = Field(4, ge=1)
    """Number of transformer blocks."""
    num_attention_heads: int = Field(4, ge=1)
    """Query heads per attention layer."""
    num_key_value_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention); must divide `num_attention_heads`."""
    head_dim: int = Field(64, ge=2)
    """Width of one attention head (Qwen3 sets it explicitly, not hidden_size / heads)."""
    intermediate_size: int = Field(512, ge=1)
    """Hidden width of the dense SwiGLU MLP (used by dense layers only)."""
    num_experts: int = Field(8, ge=0)
    """Routed experts per MoE layer; 0 makes every layer dense (a Qwen3 model)."""
    num_experts_per_tok: int = 2
    """Experts each token is sent to (top-k)."""
    moe_intermediate_size: int = Field(256, ge=1)
    """Hidden width of one routed expert's SwiGLU MLP."""
    norm_topk_prob: bool = True
    """Renormalise the top-k gate weights to sum to 1 (Qwen3-MoE checkpoints use true)."""
    shared_expert_intermediate_size: int = Field(0, ge=0)
    """Hidden width of an always-on shared expert with a sigmoid gate (Qwen2-MoE style); 0 = none."""
    decoder_sparse_step: int = 1
    """Layer i is sparse when (i + 1) % decoder_sparse_step == 0 (and not in mlp_only_layers)."""
    mlp_only_layers: list[int] = []
    """Layer indices forced to be dense even in a MoE model."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss when training (the model returns it unweighted)."""
    rms_norm_eps: float = Field(1e-6, gt=0)
    """Epsilon of every RMSNorm."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency."""
    max_position_embeddings: int = Field(2048, ge=1)
    """Longest sequence the model is meant for: the engine's context limit unless it sets its own
    (the model's forward does not check positions)."""
    tie_word_embeddings: bool = True
    """Share the embedding matrix with the output head."""
    initializer_range: float = 0.02
    """Standard deviation of the normal init of every weight matrix."""

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step ({self.decoder_sparse_step}) must be >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are not layer indices (0..{self.num_hidden_layers - 1})")
        return self

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen3-MoE's rule for which layers are sparse."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the sparse layers, in order; routes are indexed by position in this list."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)
