"""Routing disagreement: replaying the model's own routes agrees everywhere; changed routes do not."""

from __future__ import annotations

import torch

from tests.model.conftest import tiny_config
from whetstone.model import Transformer, ops
from whetstone.model.moe import Router
from whetstone.rl.routing import RoutingStats, track_routing

CONFIG = tiny_config(vocab_size=61)


def model_and_routes():
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 6))
    return model, ids, model(ids, return_routes=True).routes  # [2, 6, 2 MoE layers, 2]


def test_replaying_the_models_own_routes_never_disagrees():
    model, ids, routes = model_and_routes()
    with track_routing(model, torch.ones(2, 6, dtype=torch.bool)) as routing:
        model(ids, routes=routes)
    assert (routing.choices, routing.disagreed, routing.tokens) == (2 * 6 * 2, 0, 12)


def test_a_changed_expert_set_counts_once_and_an_order_swap_not_at_all():
    model, ids, routes = model_and_routes()
    changed = routes.clone()
    changed[0, 1, 1] = changed[0, 1, 1].flip(0)  # same set, other order: agrees
    unused = [e for e in range(4) if e not in routes[1, 2, 0].tolist()]
    changed[1, 2, 0] = torch.tensor(unused)  # a different pair of experts: disagrees
    mask = torch.ones(2, 6, dtype=torch.bool)
    with track_routing(model, mask) as routing:
        model(ids, routes=changed)
    assert routing.metrics() == {"routing_disagreement": 1 / 24, "routing_disagreement_tokens": 1 / 12}
    mask[1, 2] = False  # positions outside the mask are not counted
    with track_routing(model, mask) as routing:
        model(ids, routes=changed)
    assert routing.disagreed == 0 and routing.choices == 22


def test_hooks_are_removed_and_stats_merge():
    model, ids, routes = model_and_routes()
    with track_routing(model, torch.ones(2, 6, dtype=torch.bool)) as first:
        model(ids, routes=routes)
    model(ids)  # outside the block: not counted
    assert first.choices == 24
    merged = RoutingStats.merge([first, RoutingStats(choices=8, disagreed=2, tokens=4, tokens_disagreed=1)])
    assert merged.metrics() == {"routing_disagreement": 2 / 32, "routing_disagreement_tokens": 1 / 16}


def test_under_activation_checkpointing_the_recomputed_forward_is_not_counted_again():
    model, ids, routes = model_and_routes()
    changed = routes.clone()
    unused = [e for e in range(4) if e not in routes[1, 2, 0].tolist()]
    changed[1, 2, 0] = torch.tensor(unused)
    model.activation_checkpointing = True
    calls = []
    next(m for m in model.modules() if isinstance(m, Router)).register_forward_hook(lambda *_: calls.append(1))
    with track_routing(model, torch.ones(2, 6, dtype=torch.bool)) as routing:
        out = model(ids, routes=changed, targets=ids)
        out.logprobs.sum().backward()  # runs each block's forward again
    assert len(calls) == 2  # the forward and its recompute
    assert (routing.choices, routing.disagreed, routing.tokens, routing.tokens_disagreed) == (24, 1, 12, 1)


def test_tied_router_probabilities_are_picked_as_the_router_picks_them():
    # every router scores every expert the same: a tie, which invariant numerics break by expert
    # index and `topk` by its algorithm; replaying the router's own picks must not disagree
    model, ids, _ = model_and_routes()
    for router in (m for m in model.modules() if isinstance(m, Router)):
        torch.nn.init.zeros_(router.weight)
    with ops.numerics("invariant"):
        routes = model(ids, return_routes=True).routes
        assert (routes.sort(dim=-1).values == torch.tensor([0, 1])).all()
        with track_routing(model, torch.ones(2, 6, dtype=torch.bool)) as routing:
            model(ids, routes=routes)
    assert (routing.choices, routing.disagreed) == (24, 0)
