"""Sparse mixture-of-experts layer (Qwen3-MoE, plus Qwen2-MoE's optional shared expert).

A softmax router picks the top-k experts per token; each expert is a SwiGLU MLP. The router can
also be told which experts to use (route replay): the experts are then exactly the given ones
and the gate weights are gathered from the current router's full softmax, so gradients still
reach the router.
"""

from __future__ import annotations

import torch
from torch import nn

from whetstone.errors import WhetstoneError
from whetstone.model import ops
from whetstone.model.config import ModelConfig
from whetstone.model.experts import expert_counts, expert_mlp
from whetstone.model.layers import MLP, Linear


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor, routes: torch.Tensor | None = None):
        """x [N, H] -> (expert ids [N, k] in selection order, gates [N, k] fp32, probs [N, E] fp32)."""
        logits = ops.linear(x, self.weight)
        probs = ops.softmax(logits)
        if routes is None:
            gates, ids = ops.top_k(probs, self.top_k)
            if self.norm_topk_prob:  # never near 0: the sum holds the largest probability, >= 1 / E
                gates = gates / gates.sum(dim=-1, keepdim=True)
        else:
            ids = routes
            gates = probs.gather(-1, ids)
            if self.norm_topk_prob:
                gates = renormalised(gates, logits, ids)
        return ids, gates, probs


SMALLEST_GATE_SUM = torch.finfo(torch.float32).tiny ** 0.5
"""Below this sum of the chosen experts' probabilities (about 1e-19), `renormalised` takes the
softmax of their logits instead of dividing by the sum: there the probabilities may be 0 or
subnormal (few significant bits), and the division's gradient, 1 / sum, can overflow fp32."""


def renormalised(gates: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The chosen experts' probabilities `gates` [N, k] (gathered from the softmax of `logits`
    [N, E] at `ids`) scaled to sum to 1 per row: gates / their sum, as transformers computes it.

    Replayed experts may be ones the router now gives no probability (logits ~100 below its
    favourite's underflow to exactly 0 in fp32), where that division is 0 / 0. Such rows take the
    softmax over the chosen experts' logits, the same value computed without forming the
    probabilities. Other rows compute gates / their sum's bits, so a replay of captured routes
    (whose sum holds the largest probability, at least 1 / E) computes the capture's gates."""
    total = gates.sum(dim=-1, keepdim=True)
    small = total < SMALLEST_GATE_SUM
    # The divisor is replaced in small rows too: the branch `where` drops still gets a zero
    # gradient, and 0 / 0 there would make it NaN.
    divided = gates / torch.where(small, 1.0, total)
    return torch.where(small, ops.softmax(logits.gather(-1, ids)), divided)


class Experts(nn.Module):
    """All experts of one layer as stacked weights: gate and up fused (as in HF's in-memory
    layout), so one matmul per expert computes both."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        experts, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H], ids [N, k] -> each slot's expert output [N, k, H] (not yet gate-weighted)."""
        return expert_mlp(x, ids, self.gate_up_proj, self.down_proj)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor, routes: torch.Tensor | None = None):
        """x [B, T, H], routes [B, T, k] or None -> (output [B, T, H], ids [B*T, k], probs [B*T, E])."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, gates, probs = self.router(flat, None if routes is None else routes.reshape(-1, routes.shape[-1]))
        out = ops.moe_combine(self.experts(flat, ids), gates)
        if self.shared_expert is not None:
            out = out + ops.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(shape), ids, probs


def load_balancing_loss(ids: list[torch.Tensor], probs: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """Switch-style auxiliary loss over all MoE layers, as Qwen3-MoE computes it:
    num_experts * sum_e(fraction of token-slots sent to e * mean router probability of e),
    both averaged over every (layer, token) row. Equals top_k when routing is uniform.

    `ids` are the experts actually used (the replayed ones under route replay).
    """
    rows = sum(p.shape[0] for p in probs)
    counts = sum(expert_counts(i.reshape(-1), num_experts) for i in ids).float()
    prob_sum = sum(p.sum(dim=0) for p in probs)
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


ROUTE_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
"""The dtypes routes may come in: the integer dtypes whose ids the checks can read (torch has no
min/max of the wider unsigned ones on the CPU)."""


def check_routes(routes: torch.Tensor, expected_shape: tuple[int, ...], num_experts: int) -> None:
    """Reject routes that do not fit the model, naming the problem (they come from other processes).

    Expert ids are read back only from host tensors. On a device the check is queued with the
    forward's work (`assert_route_ids_async`): a read-back there would stall every forward until
    the device caught up. The trainer checks a batch's routes on the host before moving it
    (`check_route_ids`), and the engine replays only routes it recorded itself, so this is the
    last guard, against an out-of-bounds index in a kernel."""
    if tuple(routes.shape) != expected_shape:
        raise WhetstoneError(
            f"routes have shape {tuple(routes.shape)}, expected {expected_shape} [B, T, moe_layers, top_k]"
        )
    if routes.dtype not in ROUTE_DTYPES:
        accepted = ", ".join(str(dtype).removeprefix("torch.") for dtype in ROUTE_DTYPES)
        raise WhetstoneError(f"routes must be an integer tensor ({accepted}), got {routes.dtype}")
    if routes.device.type == "cpu":
        check_route_ids(routes, num_experts)
    else:
        assert_route_ids_async(routes, num_experts)


def assert_route_ids_async(routes: torch.Tensor, num_experts: int) -> None:
    """Fail the device's work if `routes` hold an id that is not one of `num_experts` experts,
    without waiting for it. On CUDA that is a device-side assert: it surfaces at the next sync
    as "device-side assert triggered" and leaves the process's CUDA context unusable (on the CPU
    it raises at once)."""
    if routes.numel():
        valid = ((routes >= 0) & (routes < num_experts)).all()
        torch._assert_async(valid, f"routes hold expert ids outside 0..{num_experts - 1}")


def check_route_ids(routes: torch.Tensor, num_experts: int) -> None:
    """Reject routes holding an id that is not one of `num_experts` experts (reads them back)."""
    if routes.numel():
        low, high = torch.stack(torch.aminmax(routes)).tolist()
        if low < 0 or high >= num_experts:
            raise WhetstoneError(f"routes hold expert ids in [{low}, {high}], expected 0..{num_experts - 1}")
