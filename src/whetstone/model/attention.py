"""Grouped-query self-attention with per-head q/k RMSNorm (Qwen3) and RoPE."""

from __future__ import annotations

import torch
from torch import nn

from whetstone.model import ops
from whetstone.model.config import ModelConfig
from whetstone.model.layers import Linear, RMSNorm
from whetstone.model.layout import cat_rows


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index  # the cache keeps one K/V buffer per layer
        self.head_dim = cfg.head_dim
        self.heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_key_value_heads)
        self.q_proj = Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim)
        self.o_proj = Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self._qkv: tuple[tuple, torch.Tensor] | None = None

    def qkv_weight(self) -> torch.Tensor:
        """q, k and v's weights as one matrix, so one matmul computes all three (the weights stay
        separate tensors, as in HF checkpoints). Under inference mode (the engine) the matrix is
        kept, and made again only when a weight is written to in place (its version counter
        moves, as on a hot swap) or replaced; elsewhere (training, FSDP's gathered weights) it is
        concatenated per call, as it is for weights made under inference mode, which have no
        version counter to tell a write by. The kept matrix has the weights' layout (the engine's
        is column-major) and, once made, keeps its storage: a swap refreshes it in place, so the
        engine's captured decode graphs stay valid."""
        weights = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        if not torch.is_inference_mode_enabled() or any(w.is_inference() for w in weights):
            self._qkv = None
            return torch.cat(weights)
        key = tuple((w.data_ptr(), w._version, w.dtype) for w in weights)
        if self._qkv is None or self._qkv[0] != key:
            fresh = cat_rows(weights)
            kept = None if self._qkv is None else self._qkv[1]
            if kept is not None and (kept.shape, kept.stride(), kept.dtype, kept.device) == (
                fresh.shape,
                fresh.stride(),
                fresh.dtype,
                fresh.device,
            ):
                fresh = kept.copy_(fresh)  # refreshed in place: a captured CUDA graph reads this storage
            self._qkv = (key, fresh)
        return self._qkv[1]

    def _norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """q_norm on the query heads and k_norm on the key heads of qk [B, T, Hq + Hkv, D].

        Both norms run as one, with a weight per head, so a forward issues the norm's handful of
        elementwise ops (and then RoPE's) once per layer instead of twice: a decode step is
        mostly such small ops (each a kernel on a GPU). The same arithmetic row by row. Where
        torch's fused norm applies (fp32 rows), one fused call per norm is cheaper still."""
        q_heads = self.heads[0]
        q_weight, k_weight = self.q_norm.weight, self.k_norm.weight
        if ops.fused_rms_norm_applies(qk, q_weight):
            q, k = qk.split((q_heads, qk.shape[2] - q_heads), dim=2)
            return torch.cat((self.q_norm(q), self.k_norm(k)), dim=2)
        weight = torch.cat((q_weight.expand(q_heads, -1), k_weight.expand(qk.shape[2] - q_heads, -1)))
        return ops.rms_norm(qk, weight, self.q_norm.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        batch, length, _ = x.shape
        qkv = ops.linear(x, self.qkv_weight()).view(batch, length, -1, self.head_dim)
        q_heads, kv_heads, _ = self.heads
        qk, v = qkv.split((q_heads + kv_heads, kv_heads), dim=2)
        # Norm each head before RoPE, then go to [B, heads, T, D].
        q, k = ops.apply_rope(self._norm_heads(qk), cos, sin).transpose(1, 2).split((q_heads, kv_heads), dim=1)
        v = v.transpose(1, 2)
        mask = None
        if cache is not None:
            k, v, mask = cache.update(self.layer_index, k, v)
        out = ops.attention(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
