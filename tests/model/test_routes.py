"""Router capture and replay (docs/model.md, "Routes")."""

import pytest
import torch

from whetstone.errors import WhetstoneError
from whetstone.model import Transformer, ops
from whetstone.model.moe import assert_route_ids_async, check_routes


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replaying_captured_routes_reproduces_logits_bit_for_bit(norm_topk_prob, make_config):
    cfg = make_config(norm_topk_prob=norm_topk_prob, shared_expert_intermediate_size=8)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 11))
    captured = model(ids, return_routes=True)
    replayed = model(ids, routes=captured.routes, return_routes=True)
    assert torch.equal(captured.logits, replayed.logits)
    assert torch.equal(captured.routes, replayed.routes)


def test_routes_are_in_top_k_selection_order(make_config):
    cfg = make_config(mlp_only_layers=[])
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    out = model(ids, return_routes=True)
    # The first choice of layer 0 is the argmax of its router over the embedded, normed tokens.
    block = model.layers[0]
    with torch.no_grad():
        x = model.embed_tokens(ids)
        cos, sin = ops.rope_tables(torch.arange(6).expand(1, 6), cfg.head_dim, cfg.rope_theta, x.dtype)
        x = x + block.self_attn(block.input_layernorm(x), cos, sin)
        logits = ops.linear(block.post_attention_layernorm(x), block.mlp.router.weight)
    assert torch.equal(out.routes[0, :, 0, 0], logits[0].argmax(-1))
    assert torch.equal(out.routes[0, :, 0], logits[0].topk(cfg.num_experts_per_tok).indices)


def test_foreign_routes_change_the_output_and_still_train_the_router(make_config):
    cfg = make_config()
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    own = model(ids, return_routes=True)
    # Shift every choice to the next expert: a valid but different routing.
    foreign = (own.routes + 1) % cfg.num_experts
    replayed = model(ids, routes=foreign)
    assert not torch.allclose(own.logits, replayed.logits)
    replayed.logits.square().mean().backward()
    for index in cfg.moe_layers:
        grad = model.layers[index].mlp.router.weight.grad
        assert grad is not None and grad.abs().sum() > 0


def test_replay_gates_come_from_the_full_softmax(make_config):
    cfg = make_config(norm_topk_prob=False)
    router = Transformer(cfg).layers[1].mlp.router
    x = torch.randn(5, cfg.hidden_size)
    routes = torch.tensor([[3, 0]] * 5)
    ids, gates, probs = router(x, routes)
    assert torch.equal(ids, routes)
    torch.testing.assert_close(gates, torch.softmax(x @ router.weight.T, -1)[:, [3, 0]])


@pytest.mark.parametrize(
    "routes, message",
    [
        (torch.zeros(2, 8, 1, 2, dtype=torch.long), "shape"),
        (torch.full((2, 8, 2, 2), 4), "expert ids"),
        (torch.zeros(2, 8, 2, 2), "integer"),
    ],
)
def test_bad_routes_are_rejected_with_a_clear_error(routes, message, make_config):
    cfg = make_config()
    model = Transformer(cfg)
    with pytest.raises(WhetstoneError, match=message):
        model(torch.randint(0, cfg.vocab_size, (2, 8)), routes=routes)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
def test_routes_of_a_narrow_integer_dtype_replay_as_int64(dtype, make_config):
    cfg = make_config()
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    captured = model(ids, return_routes=True)
    assert torch.equal(model(ids, routes=captured.routes.to(dtype)).logits, captured.logits)


def test_routes_of_a_dtype_that_holds_no_ids_are_refused_naming_the_dtypes_taken(make_config):
    cfg = make_config()
    routes = torch.zeros(2, 8, cfg.num_moe_layers, cfg.num_experts_per_tok, dtype=torch.bool)
    with pytest.raises(WhetstoneError, match=r"\(int64, int32, int16, int8, uint8\), got torch.bool"):
        Transformer(cfg)(torch.randint(0, cfg.vocab_size, (2, 8)), routes=routes)


def test_routes_on_a_device_are_checked_without_a_read_back():
    # a read-back would stall every forward; the check is queued with the forward's work instead
    # (on the meta device, which holds no values, a read-back would raise)
    routes = torch.full((1, 2, 1, 2), 5, device="meta")
    check_routes(routes, (1, 2, 1, 2), num_experts=8)
    with pytest.raises(WhetstoneError, match=r"expert ids in \[5, 5\], expected 0..3"):
        check_routes(torch.full((1, 2, 1, 2), 5), (1, 2, 1, 2), num_experts=4)  # on the host: read back


@pytest.mark.parametrize("bad", [4, -1])
def test_the_queued_check_fails_on_an_id_outside_the_experts(bad):
    # what a device runs, here on the CPU, where torch's asynchronous assert raises at once
    routes = torch.zeros(1, 3, 1, 2, dtype=torch.long)
    assert_route_ids_async(routes, num_experts=4)
    routes[0, 1, 0, 1] = bad
    with pytest.raises(RuntimeError, match=r"routes hold expert ids outside 0..3"):
        assert_route_ids_async(routes, num_experts=4)


def _router_preferring_expert_0(cfg, gap: float):
    """A router whose logits for a token x = e_0 are (gap, 0, 0, ...): the other experts' fp32
    probabilities are exp(-gap), subnormal past a gap of 87 and exactly 0 past 104."""
    router = Transformer(cfg).layers[1].mlp.router
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0, 0] = gap
    x = torch.zeros(3, cfg.hidden_size)
    x[:, 0] = 1
    return router, x.requires_grad_()


@pytest.mark.parametrize("gap", [200.0, 95.0])  # probabilities 0, or subnormal (5.5e-42)
def test_replayed_experts_the_router_gives_no_probability_get_finite_gates_and_gradients(gap, make_config):
    cfg = make_config(norm_topk_prob=True)
    router, x = _router_preferring_expert_0(cfg, gap)
    routes = torch.tensor([[2, 3], [1, 2], [3, 0]])
    ids, gates, probs = router(x, routes)
    # renormalised over the chosen experts: equal logits share the weight, expert 0 takes it all
    torch.testing.assert_close(gates, torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.0, 1.0]]), rtol=0, atol=1e-6)
    (gates * torch.tensor([3.0, -1.0])).sum().backward()
    assert torch.isfinite(router.weight.grad).all() and torch.isfinite(x.grad).all()


def test_replay_far_from_the_routers_choice_keeps_the_loss_finite(make_config):
    cfg = make_config(norm_topk_prob=True)
    torch.manual_seed(0)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    own = model(ids, return_routes=True).routes
    with torch.no_grad():  # a router that moved far since the routes were recorded
        for index in cfg.moe_layers:
            model.layers[index].mlp.router.weight.mul_(1000)
    out = model(ids, targets=ids.roll(-1, 1), routes=(own + 2) % cfg.num_experts)
    loss = -out.logprobs.mean() + cfg.router_aux_loss_coef * out.aux_loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_replay_renormalises_the_full_softmaxs_probabilities_where_they_are_representable(make_config):
    cfg = make_config(norm_topk_prob=True)
    router = Transformer(cfg).layers[1].mlp.router
    x = torch.randn(64, cfg.hidden_size)
    routes = torch.randint(0, cfg.num_experts, (64, 2))
    _, gates, probs = router(x, routes)
    chosen = probs.gather(-1, routes)
    assert torch.equal(gates, chosen / chosen.sum(-1, keepdim=True))
