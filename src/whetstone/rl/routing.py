"""Routing disagreement under replay: how often the trainer's own router would have chosen
different experts than the replayed rollout routes (R3 reports ~10% of choices on a bf16 30B MoE).

Computed alongside the training forward by forward hooks on the routers, without changing the
model: each router returns its full softmax, whose top-k is what the trainer would have chosen,
picked as the router picks under the forward's numerics (tied probabilities too: `topk` breaks
ties by its algorithm, invariant numerics by expert index).
A choice is one (token, MoE layer); it disagrees when the expert *sets* differ (order aside).

    with track_routing(model, mask) as routing:
        out = model(input_ids, routes=routes, targets=targets)
    routing.metrics()   # routing_disagreement, routing_disagreement_tokens

The counts stay 0-d tensors on the model's device until read back (`totals()`, `metrics()`), so
counting costs the step no wait on the device. Under activation checkpointing a block's forward
runs again in the backward pass (`Transformer.recomputing`); the hooks count the first run only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from whetstone.model import ops
from whetstone.model.moe import Router

Count = int | torch.Tensor
"""A count in `RoutingStats`: a 0-d tensor on the model's device until read back, then an int."""


@dataclass
class RoutingStats:
    choices: Count = 0
    """(token, MoE layer) pairs counted."""
    disagreed: Count = 0
    tokens: Count = 0
    tokens_disagreed: Count = 0
    """Tokens where at least one layer disagreed."""

    FIELDS = ("choices", "disagreed", "tokens", "tokens_disagreed")

    @staticmethod
    def merge(parts: list["RoutingStats"]) -> "RoutingStats":
        return RoutingStats(*(sum(getattr(p, name) for p in parts) for name in RoutingStats.FIELDS))

    def totals(self) -> dict[str, Count]:
        """The counts, unread, keyed `routing_<field>` (to read back with a step's other figures)."""
        return {f"routing_{name}": getattr(self, name) for name in self.FIELDS}

    def metrics(self, totals: dict[str, float] | None = None) -> dict[str, float]:
        """The rates from `totals()` read back (read back here when not given)."""
        if totals is None:
            from whetstone.training.readback import read_back

            totals = read_back(self.totals())
        return {
            "routing_disagreement": totals["routing_disagreed"] / max(totals["routing_choices"], 1),
            "routing_disagreement_tokens": totals["routing_tokens_disagreed"] / max(totals["routing_tokens"], 1),
        }


@contextmanager
def track_routing(model: nn.Module, mask: torch.Tensor) -> Iterator[RoutingStats]:
    """Count disagreements at the positions of `mask` [B, T] (e.g. the loss mask) during the
    forwards inside the block. Forwards must have the mask's shape. Hooks are removed on exit."""
    stats = RoutingStats()
    flat_mask = mask.reshape(-1).bool()
    any_layer = torch.zeros_like(flat_mask)

    def hook(router: Router, inputs, output) -> None:
        if getattr(model, "recomputing", False):  # a checkpointed block's second run: counted already
            return
        ids, _, probs = output
        with torch.no_grad():
            own = ops.top_k(probs, router.top_k)[1]  # the router's own pick, ties included (numerics')
            differs = (own.sort(dim=-1).values != ids.sort(dim=-1).values).any(dim=-1) & flat_mask
            stats.choices += flat_mask.sum()
            stats.disagreed += differs.sum()
            any_layer.logical_or_(differs)

    handles = [module.register_forward_hook(hook) for module in model.modules() if isinstance(module, Router)]
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()
        stats.tokens = flat_mask.sum()
        stats.tokens_disagreed = any_layer.sum()
