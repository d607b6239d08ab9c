"""The decoder-only transformer: embeddings, pre-norm blocks (attention, then a dense MLP or a
MoE), a final norm and the output head. Architecturally Qwen3 / Qwen3-MoE.

    model = Transformer(ModelConfig())
    out = model(input_ids)                                 # full causal forward
    out = model(input_ids, return_routes=True)             # also the chosen experts
    out = model(input_ids, routes=out.routes)              # replay exactly those experts
    out = model(new_ids, positions=pos, cache=kv_cache)    # incremental decoding
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from whetstone.errors import WhetstoneError
from whetstone.model import ops
from whetstone.model.attention import Attention
from whetstone.model.config import ModelConfig
from whetstone.model.head import target_logprobs
from whetstone.model.layers import MLP, Linear, RMSNorm
from whetstone.model.moe import MoE, check_routes, load_balancing_loss


@dataclass
class ModelOutput:
    logits: torch.Tensor | None
    """[B, T, vocab]; None when `targets` were given (logprobs instead)."""
    routes: torch.Tensor | None = None
    """[B, T, num_moe_layers, top_k] int64 expert ids in top-k order (if asked for; None when dense)."""
    aux_loss: torch.Tensor | None = None
    """Scalar load-balancing loss, unweighted (0 for a dense model; None under inference mode)."""
    logprobs: torch.Tensor | None = None
    """[B, T] fp32 log-probability of each target token, when `targets` were given."""
    entropy: torch.Tensor | None = None
    """[B, T] fp32 entropy of the next-token distribution at each position whose target is kept
    (0 elsewhere), when `targets` were given with `return_entropy`; differentiable."""


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.is_moe = cfg.is_moe_layer(index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, cache=None, routes=None):
        """Returns (x, (ids, probs)) for a MoE block, (x, None) for a dense one."""
        x = ops.residual(x, self.self_attn(self.input_layernorm(x), cos, sin, cache))
        h = self.post_attention_layernorm(x)
        if not self.is_moe:
            return ops.residual(x, self.mlp(h)), None
        out, ids, probs = self.mlp(h, routes)
        return ops.residual(x, out), (ids, probs)


class Transformer(nn.Module):
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them, in
    forwards that will be backpropagated (training mode, gradients on, no KV cache). The
    trainers set it from their config."""
    recomputing: bool = False
    """True while a checkpointed block runs again in the backward pass: forward hooks that count
    (`rl.routing`) skip that run."""

    def _recompute_context(self):
        """`checkpoint`'s context_fn: the forward runs as is; the recompute sees the context
        variables the forward saw (`ops.numerics`, `ops.training_kernels`: the backward runs
        outside their blocks) and `recomputing` set."""
        forward_context = contextvars.copy_context()

        @contextmanager
        def recompute():
            tokens = [(var, var.set(value)) for var, value in forward_context.items()]
            self.recomputing = True
            try:
                yield
            finally:
                self.recomputing = False
                for var, token in reversed(tokens):
                    var.reset(token)

        return nullcontext(), recompute()

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) for every matrix, ones for the norms (HF's init)."""
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, self.cfg.initializer_range)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache=None,
        routes: torch.Tensor | None = None,
        return_routes: bool = False,
        targets: torch.Tensor | None = None,
        logits_to_keep: int | None = None,
        return_entropy: bool = False,
    ) -> ModelOutput:
        """See the module docstring and docs/model.md. With `targets` [B, T] (token ids, e.g. the
        inputs shifted by one), the output holds `logprobs` of those tokens instead of `logits`:
        the full [B, T, vocab] logits are never kept, and training is faster (`return_entropy`
        adds each position's entropy, with its gradient). `logits_to_keep`
        = n computes logits for the last n positions only ([B, n, vocab]; 0: none, `logits` is
        None), e.g. a prefill that only fills the KV cache skips the output head."""
        cfg = self.cfg
        if input_ids.dim() != 2 or not input_ids.numel():
            raise WhetstoneError(f"input_ids have shape {tuple(input_ids.shape)}, expected [B, T] with B, T >= 1")
        batch, length = input_ids.shape
        if positions is None:
            positions = torch.arange(length, device=input_ids.device).expand(batch, length)
        elif positions.shape != input_ids.shape:
            raise WhetstoneError(f"positions have shape {tuple(positions.shape)}, expected {(batch, length)}")
        if routes is not None:
            check_routes(routes, (batch, length, cfg.num_moe_layers, cfg.num_experts_per_tok), cfg.num_experts)
            routes = routes.long()
        if logits_to_keep is not None and not 0 <= logits_to_keep <= length:
            raise WhetstoneError(f"logits_to_keep is {logits_to_keep}, expected 0..{length}")
        if cache is not None:
            cache.begin(positions)

        x = self.embed_tokens(input_ids)
        cos, sin = ops.rope_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        chosen, probs = [], []
        checkpointed = self.activation_checkpointing and self.training and torch.is_grad_enabled() and cache is None
        for block in self.layers:
            layer_routes = None if routes is None or not block.is_moe else routes[:, :, len(chosen)]
            if checkpointed:
                x, routing = checkpoint(
                    block, x, cos, sin, None, layer_routes, use_reentrant=False, context_fn=self._recompute_context
                )
            else:
                x, routing = block(x, cos, sin, cache, layer_routes)
            if routing is not None:
                chosen.append(routing[0])
                probs.append(routing[1])
        hidden = self.norm(x)
        logits, logprobs, entropy = None, None, None
        if targets is None and logits_to_keep is None:
            logits = self.lm_head(hidden)
        elif targets is None:
            logits = self.lm_head(hidden[:, length - logits_to_keep :]) if logits_to_keep else None
        else:
            if targets.shape != input_ids.shape:
                raise WhetstoneError(f"targets have shape {tuple(targets.shape)}, expected {(batch, length)}")
            logprobs, entropy = target_logprobs(hidden, self.lm_head.weight, targets, return_entropy)

        if not chosen:
            aux_loss = torch.zeros((), device=x.device)
        elif torch.is_inference_mode_enabled():
            aux_loss = None  # nobody trains on an inference-mode forward (the engine's): skip it
        else:
            aux_loss = load_balancing_loss(chosen, probs, cfg.num_experts)
        out_routes = None
        if return_routes and chosen:
            out_routes = torch.stack(chosen, dim=1).view(batch, length, len(chosen), -1)
        return ModelOutput(logits=logits, routes=out_routes, aux_loss=aux_loss, logprobs=logprobs, entropy=entropy)

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count (shared tensors once); with active=True, only top_k experts count."""
        total = sum(p.numel() for p in self.parameters())
        if active and self.cfg.num_experts:
            cfg = self.cfg
            per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
            total -= cfg.num_moe_layers * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
        return total
