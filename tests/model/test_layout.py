"""The serving layout: column-major matmul weights change strides only, never values or bits; bf16
matmul weights hold what bf16 autocast computes with, so a bf16 forward keeps its bits."""

import torch

from whetstone.model import ModelConfig, Transformer
from whetstone.model.layout import (
    MIN_OUTPUTS,
    autocast_tables,
    cat_rows,
    flat_storage,
    in_storage_order,
    is_column_major,
    serving_copy,
    storage_indices,
    to_column_major,
)

CFG = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
)


def test_matmul_weights_become_column_major_with_the_same_values():
    model = Transformer(CFG)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    to_column_major(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    expected = {
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.experts.gate_up_proj",
        "layers.0.mlp.experts.down_proj",
        "embed_tokens.weight",
    }  # tied: the head reads it every step
    assert all(is_column_major(after[name]) for name in expected)
    assert after["layers.0.mlp.router.weight"].shape[0] < MIN_OUTPUTS
    assert after["layers.0.mlp.router.weight"].is_contiguous()
    assert not any(is_column_major(t) for t in after.values() if t.dim() < 2)
    to_column_major(model)  # idempotent
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())


def test_an_untied_input_embedding_keeps_its_rows_contiguous():
    model = to_column_major(Transformer(CFG.model_copy(update={"tie_word_embeddings": False})))
    assert model.embed_tokens.weight.is_contiguous()
    assert is_column_major(model.lm_head.weight)


def test_the_converted_model_still_trains():
    model = to_column_major(Transformer(CFG))
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    model(ids).logits.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_fused_rows_keep_the_weights_layout():
    rows = [torch.randn(n, 8) for n in (6, 3, 3)]
    served = [r.mT.contiguous().mT for r in rows]
    assert torch.equal(cat_rows(served), torch.cat(rows)) and is_column_major(cat_rows(served))
    assert cat_rows(rows).is_contiguous()


def test_writes_in_storage_order_land_at_their_logical_positions():
    generator = torch.Generator().manual_seed(1)
    for shape in [(6, 5), (3, 4, 7)]:
        logical = torch.randn(shape, generator=generator)
        stored = logical.transpose(-1, -2).contiguous().transpose(-1, -2)
        indices = torch.randperm(logical.numel(), generator=generator)[:9]
        values = torch.randn(9, generator=generator)
        logical.view(-1)[indices] = values
        flat_storage(stored).scatter_(0, storage_indices(stored, indices), values)
        assert torch.equal(stored, logical)
        whole = torch.randn(shape, generator=generator)
        flat_storage(stored).copy_(in_storage_order(stored, whole))
        assert torch.equal(stored, whole)


def test_bf16_matmul_weights_give_the_bits_of_autocast_and_leave_the_callers_model_alone():
    for tied in (True, False):
        torch.manual_seed(0)
        model = Transformer(CFG.model_copy(update={"tie_word_embeddings": tied})).eval()
        before = {name: t.clone() for name, t in model.state_dict().items()}
        served = serving_copy(model, torch.device("cpu"), torch.bfloat16)
        dtypes = {name: p.dtype for name, p in served.named_parameters()}
        assert dtypes["embed_tokens.weight"] == dtypes["norm.weight"] == torch.float32
        assert dtypes["layers.0.self_attn.q_proj.weight"] == dtypes["layers.0.mlp.router.weight"] == torch.bfloat16
        assert dtypes["layers.1.mlp.experts.gate_up_proj"] == torch.bfloat16
        assert ("lm_head.weight" in dtypes) == (not tied)  # a tied head is the embedding table: kept
        assert all(not p.requires_grad for p in served.parameters() if p.dtype == torch.bfloat16)
        # the caller's weights: unchanged, and its norms shared rather than copied
        assert all(
            torch.equal(t, before[name]) and t.dtype == before[name].dtype for name, t in model.state_dict().items()
        )
        assert served.norm.weight is model.norm.weight
        ids = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(served(ids).logits, model(ids).logits)


def test_a_serving_copy_on_another_device_leaves_the_callers_model_where_it_is():
    model = Transformer(CFG).eval()
    assert serving_copy(model, torch.device("cpu")) is model  # nothing to move or cast
    # the meta device stands in for a GPU: each weight goes there cast, the caller's stays
    served = serving_copy(model, torch.device("meta"), torch.bfloat16)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {t.device.type for t in served.state_dict().values()} == {"meta"}
    assert {t.device.type for t in served.buffers()} <= {"meta"}
    dtypes = {name: p.dtype for name, p in served.named_parameters()}
    assert dtypes["layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["embed_tokens.weight"] == dtypes["norm.weight"] == torch.float32


def test_autocast_publishing_sends_exactly_what_a_bf16_engine_holds():
    # sync.publish_dtype = "autocast": each tensor in the dtype, and with the values, of the bf16
    # serving copy (matrices bf16, embedding tables (a tied head) and norms fp32): nothing rounded
    # that the trainer's autocast does not round itself
    from whetstone.sync.publisher import prepare_state

    for tied in (True, False):
        torch.manual_seed(0)
        model = Transformer(CFG.model_copy(update={"tie_word_embeddings": tied}))
        tables = autocast_tables(model)
        assert tables == ({"embed_tokens.weight", "lm_head.weight"} if tied else {"embed_tokens.weight"})
        published = prepare_state(model.state_dict(), "autocast", tables)
        served = serving_copy(model, torch.device("cpu"), torch.bfloat16).state_dict()
        assert published.keys() == served.keys()
        for name, tensor in published.items():
            assert tensor.dtype == served[name].dtype and torch.equal(tensor, served[name]), name
        assert published["layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
        assert published["norm.weight"].dtype == torch.float32
