"""Routing disagreement under replay: how often the trainer's own router would have chosen
different experts than the replayed rollout routes (R3 reports ~10% of choices on a bf16 30B MoE).

Computed alongside the training forward by forward hooks on the routers, without changing the
model: each router returns its full softmax, whose top-k is what the trainer would have chosen.
A choice is one (token, MoE layer); it disagrees when the expert *sets* differ (order aside).

    with track_routing(model, mask) as routing:
        out = model(input_ids, routes=routes, targets=targets)
    routing.metrics()   # routing_disagreement, routing_disagreement_tokens
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from whetstone.model.moe import Router


@dataclass
class RoutingStats:
    choices: int = 0
    """(token, MoE layer) pairs counted."""
    disagreed: int = 0
    tokens: int = 0
    tokens_disagreed: int = 0
    """Tokens where at least one layer disagreed."""

    @staticmethod
    def merge(parts: list["RoutingStats"]) -> "RoutingStats":
        fields = ("choices", "disagreed", "tokens", "tokens_disagreed")
        return RoutingStats(*(sum(getattr(p, name) for p in parts) for name in fields))

    def metrics(self) -> dict[str, float]:
        return {
            "routing_disagreement": self.disagreed / max(self.choices, 1),
            "routing_disagreement_tokens": self.tokens_disagreed / max(self.tokens, 1),
        }


@contextmanager
def track_routing(model: nn.Module, mask: torch.Tensor) -> Iterator[RoutingStats]:
    """Count disagreements at the positions of `mask` [B, T] (e.g. the loss mask) during the
    forwards inside the block. Forwards must have the mask's shape. Hooks are removed on exit."""
    stats = RoutingStats()
    flat_mask = mask.reshape(-1).bool()
    any_layer = torch.zeros_like(flat_mask)

    def hook(router: Router, inputs, output) -> None:
        ids, _, probs = output
        with torch.no_grad():
            own = probs.topk(router.top_k, dim=-1).indices
            differs = (own.sort(dim=-1).values != ids.sort(dim=-1).values).any(dim=-1)[flat_mask]
        stats.choices += differs.numel()
        stats.disagreed += int(differs.sum())
        any_layer[flat_mask] |= differs

    handles = [module.register_forward_hook(hook) for module in model.modules() if isinstance(module, Router)]
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()
        stats.tokens = int(flat_mask.sum())
        stats.tokens_disagreed = int(any_layer.sum())
