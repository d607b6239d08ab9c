import re

import pytest
import torch

from whetstone.errors import WhetstoneError
from whetstone.model import ModelOutput, Transformer, ops
from whetstone.model.moe import load_balancing_loss


def test_forward_shapes_and_output(make_config):
    cfg = make_config()
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    out = model(ids, return_routes=True)
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (2, 7, cfg.vocab_size)
    assert out.routes.shape == (2, 7, cfg.num_moe_layers, cfg.num_experts_per_tok)
    assert out.routes.dtype == torch.int64
    assert out.aux_loss.ndim == 0 and out.aux_loss > 0
    assert model(ids).routes is None


def test_causal_later_tokens_do_not_change_earlier_logits(make_config):
    cfg = make_config()
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    changed = ids.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % cfg.vocab_size
    torch.testing.assert_close(model(ids).logits[:, :6], model(changed).logits[:, :6])


def test_tied_embeddings_share_one_tensor_and_untied_do_not(make_config):
    tied = Transformer(make_config(tie_word_embeddings=True))
    assert tied.lm_head.weight is tied.embed_tokens.weight
    untied = Transformer(make_config(tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.embed_tokens.weight


def test_dense_model_has_no_routes_and_zero_aux_loss(make_config):
    model = Transformer(make_config(num_experts=0, mlp_only_layers=[]))
    out = model(torch.randint(0, 97, (2, 5)), return_routes=True)
    assert out.routes is None and out.aux_loss.item() == 0.0


def test_shared_expert_contributes_to_the_output(make_config):
    cfg = make_config(shared_expert_intermediate_size=24)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 5))
    before = model(ids).logits
    with torch.no_grad():
        model.layers[1].mlp.shared_expert.down_proj.weight.zero_()
    assert not torch.allclose(before, model(ids).logits)


def test_aux_loss_equals_top_k_for_perfectly_uniform_routing():
    probs = [torch.full((8, 4), 0.25)]
    ids = [torch.tensor([[0, 1], [2, 3]] * 4)]
    assert load_balancing_loss(ids, probs, num_experts=4).item() == 2.0


def test_aux_loss_trains_the_router_toward_balance(make_config):
    cfg = make_config()
    model = Transformer(cfg)
    model(torch.randint(0, cfg.vocab_size, (2, 6))).aux_loss.backward()
    assert model.layers[1].mlp.router.weight.grad.abs().sum() > 0


def test_runs_under_bf16_autocast_and_trains(make_config):
    cfg = make_config()
    model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, cfg.vocab_size, (4, 12))
    losses = []
    for _ in range(8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids[:, :-1])
            ce = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), ids[:, 1:].flatten())
            loss = ce + cfg.router_aux_loss_coef * out.aux_loss
        assert out.logits.dtype == torch.bfloat16
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(ce.item())
    assert losses[-1] < losses[0]


def test_logits_to_keep_computes_only_the_last_positions(make_config):
    cfg = make_config()
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    full = model(ids, return_routes=True)
    last_two = model(ids, return_routes=True, logits_to_keep=2)
    torch.testing.assert_close(last_two.logits, full.logits[:, -2:])  # fewer rows: same values
    assert torch.equal(last_two.routes, full.routes)  # routing still covers every position
    assert model(ids, logits_to_keep=0).logits is None
    with pytest.raises(WhetstoneError, match="logits_to_keep"):
        model(ids, logits_to_keep=8)


@pytest.mark.parametrize("shape", [(0, 5), (2, 0), (5,)])
@pytest.mark.parametrize("mode", ["fast", "invariant"])
def test_input_ids_without_tokens_or_a_batch_dim_are_refused_by_their_shape(shape, mode, make_config):
    model = Transformer(make_config())
    with ops.numerics(mode), pytest.raises(WhetstoneError, match=rf"input_ids have shape {re.escape(str(shape))}"):
        model(torch.zeros(shape, dtype=torch.long))


def test_inference_mode_keeps_the_fused_qkv_weight_until_a_weight_changes(make_config):
    model = Transformer(make_config()).eval()
    attn = model.layers[0].self_attn
    ids = torch.randint(0, model.cfg.vocab_size, (2, 5))
    with torch.inference_mode():
        first = model(ids).logits
        kept = attn.qkv_weight()
        model(ids)
        assert attn.qkv_weight() is kept  # not concatenated again per forward
    # A hot swap writes in place, through a view: the version counter moves, the matrix is remade.
    with torch.no_grad():
        attn.k_proj.weight.view(-1).scatter_(0, torch.tensor([0, 7]), torch.tensor([0.5, -0.5]))
    with torch.inference_mode():
        swapped = model(ids).logits
        assert attn.qkv_weight() is kept  # refreshed in place: the same storage, new values
        assert torch.equal(kept, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert not torch.equal(swapped, first)
    assert torch.equal(swapped, model(ids).logits)  # the same as a forward that concatenates afresh
    # A replaced tensor (new storage) is noticed too.
    attn.v_proj.weight = torch.nn.Parameter(attn.v_proj.weight.detach() * 2)
    with torch.inference_mode():
        replaced = model(ids).logits
    assert not torch.equal(replaced, swapped) and torch.equal(replaced, model(ids).logits)


def test_inference_mode_skips_the_aux_loss_nobody_trains_on(make_config):
    model = Transformer(make_config())
    ids = torch.randint(0, model.cfg.vocab_size, (2, 5))
    assert model(ids).aux_loss is not None
    with torch.no_grad():
        assert model(ids).aux_loss is not None  # e.g. a validation loss
    with torch.inference_mode():
        out = model(ids)
    assert out.aux_loss is None and out.logits is not None
