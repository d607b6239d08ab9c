"""The batch-invariant kernels, one by one: a row's result is the same bits whatever else is in
the batch (row count, position in the batch, threads), and the same function as the formula it
implements. These are properties of whetstone's kernels on whatever CPU and library path runs
them (test_invariant_dispatch.py runs them under each path MKL and oneDNN can be forced to)."""

import threading

import pytest
import torch
import torch.nn.functional as F

from whetstone.errors import WhetstoneError
from whetstone.model import experts, invariant, ops


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # the `torch ... differs` checks compare rounding: fixed inputs, fixed answers


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(1)


def rows_alone(fn, x: torch.Tensor, counts=range(1, 24)) -> list[int]:
    """Row counts m for which fn(x[3:3+m]) is not bit for bit fn(x)[3:3+m]."""
    full = fn(x)
    return [m for m in counts if not torch.equal(fn(x[3 : 3 + m]), full[3 : 3 + m])]


SHAPES = [(96, 80), (512, 8), (64, 1), (256, 768)]
"""(K, N) of the weights checked: odd sizes, a router (thin and long), a one-column gate, an MLP."""
SHAPE_IDS = [f"{k}x{n}" for k, n in SHAPES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_linear_rows_do_not_depend_on_the_row_count(threads, dtype, shape):
    x, weight = torch.randn(64, shape[0]).to(dtype), torch.randn(shape[1], shape[0]).to(dtype)
    assert rows_alone(lambda t: invariant.linear(t, weight), x, counts=range(1, 41)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_linear_rows_do_not_depend_on_their_place_in_the_batch(threads, dtype, shape):
    x, weight = torch.randn(40, shape[0]).to(dtype), torch.randn(shape[1], shape[0]).to(dtype)
    full = invariant.linear(x, weight)
    for shift in range(1, invariant.ROW_TILE + 3):
        assert torch.equal(invariant.linear(torch.roll(x, shift, 0), weight), torch.roll(full, shift, 0))


def test_linear_rows_do_not_depend_on_the_thread_count():
    x, weight = torch.randn(50, 512), torch.randn(8, 512)  # thin: a library may split K across threads
    torch.set_num_threads(2)
    two = invariant.linear(x, weight)
    torch.set_num_threads(1)
    assert torch.equal(invariant.linear(x[:1], weight), two[:1])


def test_the_row_check_catches_a_sum_that_depends_on_the_row_count():
    # What the checks above would see if the kernel summed K in another order for larger batches.
    x, weight = torch.randn(64, 96), torch.randn(80, 96)

    def split_k_when_many(t):
        if t.shape[0] < 8:
            return invariant.linear(t, weight)
        return invariant.linear(t[:, :48], weight[:, :48]) + invariant.linear(t[:, 48:], weight[:, 48:])

    assert rows_alone(split_k_when_many, x) == list(range(1, 8))


EXPERT_SHAPES = {"tiny": (32, 32, 16), "gpu-model": (1024, 768, 384)}
"""(hidden, 2 x intermediate, intermediate) of MoE experts: the tests' tiny model and the 380M one."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", EXPERT_SHAPES.values(), ids=EXPERT_SHAPES.keys())
def test_expert_rows_do_not_depend_on_their_place_in_the_tile(dtype, shape):
    # An expert's tokens fill its tiles from the first row; how many came before a token sets its
    # place in the tile. (MKL's AVX2 path on Intel computes 6 rows at a time: the 2 left of an
    # 8-row tile came out differently before tiles were checked.)
    hidden, double, inner = shape
    gate_up, down = torch.randn(2, double, hidden).to(dtype), torch.randn(2, hidden, inner).to(dtype)
    tile = invariant.expert_tile(gate_up, down)
    for weight_t, depth in ((gate_up[1].t(), hidden), (down[1].t(), inner)):
        x = torch.randn(1, depth).to(dtype)
        alone = invariant.tiled_mm(torch.cat([x, x.new_zeros(tile - 1, depth)]), weight_t, tile=tile)[0]
        for place in range(1, tile):
            rows = torch.randn(tile, depth).to(dtype)
            rows[place] = x[0]
            assert torch.equal(invariant.tiled_mm(rows, weight_t, tile=tile)[place], alone), place


@pytest.fixture
def fresh_tiles():
    checks = (
        invariant._row_tile,
        invariant._rows_alike,
        invariant._tail_tiles,
        invariant._rows_as_in,
        invariant._bulk_tile,
    )
    for check in checks:
        check.cache_clear()
    yield
    for check in checks:  # what a fake library granted must not outlive its test
        check.cache_clear()


def _six_rows_at_a_time(tiled_mm):
    """`tiled_mm` on a library that computes 6 rows at a time and the rows of a tile's last,
    incomplete group of 6 another way (here: K summed in two halves)."""

    def kernel(rows, weight_t, out=None, tile=invariant.ROW_TILE):
        result = tiled_mm(rows, weight_t, out, tile)
        half = rows.shape[1] // 2
        for start in range(0, rows.shape[0], tile):
            for first in range(start + tile - tile % 6, start + tile) if tile % 6 else ():
                row = rows[first : first + 1]
                result[first] = (
                    tiled_mm(row[:, :half], weight_t[:half], tile=1) + tiled_mm(row[:, half:], weight_t[half:], tile=1)
                )[0]
        return result

    return kernel


def test_a_tile_whose_rows_the_library_computes_apart_is_not_used(monkeypatch, fresh_tiles):
    monkeypatch.setattr(invariant, "tiled_mm", _six_rows_at_a_time(invariant.tiled_mm))
    weight_t = torch.randn(40, 64).t()
    # there 8 rows are 6 + 2 and 16 are 6 + 6 + 4: the first multiple of 8 of whole groups is 24
    assert invariant.row_tile(8, weight_t) == 24
    assert invariant.row_tile(6, weight_t) == 6


def test_without_such_a_tile_rows_are_multiplied_one_at_a_time(monkeypatch, fresh_tiles, caplog):
    monkeypatch.setattr(invariant, "tiled_mm", _six_rows_at_a_time(invariant.tiled_mm))
    monkeypatch.setattr(invariant, "TILE_MULTIPLES", 2)
    assert invariant.row_tile(8, torch.randn(40, 64).t()) == 1
    assert "one row at a time" in caplog.text


def _reversed_below(rows_below: int, tiled_mm):
    """`tiled_mm` on a library whose tiles of fewer than `rows_below` rows add K in reverse order:
    the same products, summed another way."""

    def kernel(rows, weight_t, out=None, tile=invariant.ROW_TILE):
        if tile >= rows_below:
            return tiled_mm(rows, weight_t, out, tile)
        result = tiled_mm(rows.flip(1).contiguous(), weight_t.flip(0), tile=tile)
        return result if out is None else out.copy_(result)

    return kernel


def _six_rows_at_a_time_reversed(tiled_mm):
    """`tiled_mm` on a library that computes 6 rows at a time and adds K in reverse order for
    the rows of a tile's last, incomplete group of 6 (as `_six_rows_at_a_time`, with the same
    products summed another way)."""

    def kernel(rows, weight_t, out=None, tile=invariant.ROW_TILE):
        result = tiled_mm(rows, weight_t, out, tile)
        late = tile % 6
        if late:
            depth, columns = rows.shape[1], result.shape[1]
            late_rows = rows.view(-1, tile, depth)[:, tile - late :].reshape(-1, depth)
            sums = tiled_mm(late_rows.flip(1).contiguous(), weight_t.flip(0), tile=1)
            result.view(-1, tile, columns)[:, tile - late :] = sums.view(-1, late, columns)
        return result

    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tail_tile_whose_rows_the_library_computes_apart_is_not_used(monkeypatch, fresh_tiles, dtype):
    # bf16 included: a bf16 product is exact in fp32, and sums of plain random bf16 products
    # often come out the same in any order; the check's operands must still tell them apart
    weights_t = [torch.randn(columns, depth).to(dtype).t() for depth, columns in ((96, 80), (256, 768))]
    granted = [invariant.tail_tiles(16, weight_t) for weight_t in weights_t]  # by this path's library
    invariant._tail_tiles.cache_clear()
    invariant._rows_as_in.cache_clear()
    monkeypatch.setattr(invariant, "tiled_mm", _reversed_below(4, invariant.tiled_mm))
    for weight_t, tails in zip(weights_t, granted):
        assert invariant.tail_tiles(16, weight_t) == tuple(size for size in tails if size >= 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bulk_tile_whose_rows_the_library_computes_apart_is_not_used(monkeypatch, fresh_tiles, dtype):
    # tiles of fewer than 32 rows add K in reverse: no bulk tile (32 rows or more) computes a
    # row as a 16-row tile does
    monkeypatch.setattr(invariant, "tiled_mm", _reversed_below(32, invariant.tiled_mm))
    for columns, depth in ((80, 96), (768, 256)):
        assert invariant.bulk_tile(16, torch.randn(columns, depth).to(dtype).t()) == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_many_rows_have_the_bits_of_whole_tiles(dtype, shape):
    # The trainer's many rows go in bulk tiles where this path's library grants them; each row
    # keeps the bits that tiles of the engine's row count give it.
    depth, columns = shape
    x, weight_t = invariant._check_operands(1000, depth, columns, dtype, True, seed=11)
    tile = invariant.row_tile(invariant.ROW_TILE, weight_t)
    count = invariant.padded_rows(1000, tile)
    x = F.pad(x, (0, 0, 0, count - 1000))
    assert invariant.bulk_tile(tile, weight_t) % tile == 0
    assert torch.equal(invariant.tiled_rows_mm(x, weight_t, tile=tile), invariant.tiled_mm(x, weight_t, tile=tile))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tile_whose_last_rows_add_in_another_order_is_not_used(monkeypatch, fresh_tiles, dtype):
    monkeypatch.setattr(invariant, "tiled_mm", _six_rows_at_a_time_reversed(invariant.tiled_mm))
    assert invariant.row_tile(8, torch.randn(80, 96).to(dtype).t()) == 24  # 8 rows and 16 have late rows
    assert invariant.row_tile(6, torch.randn(80, 96).to(dtype).t()) == 6


def test_rows_left_after_whole_tiles_take_the_smallest_tail_that_holds_them():
    assert [invariant.padded_rows(count, 8, (2, 4)) for count in (0, 1, 2, 3, 5, 8, 9, 13, 16)] == [
        0, 2, 2, 4, 8, 8, 10, 16, 16
    ]  # fmt: skip
    assert [invariant.padded_rows(count, 16) for count in (1, 16, 17)] == [16, 16, 32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_a_row_in_a_tail_tile_has_its_bits_in_whole_tiles(dtype, shape):
    # The tails the library's check grants on this path: a decode step's rows in one, the
    # trainer's in whole tiles (operands whose sums round at every add, as the check's).
    depth, columns = shape
    x, weight_t = invariant._check_operands(64, depth, columns, dtype, True, seed=5)
    tile = invariant.row_tile(invariant.ROW_TILE, weight_t)
    whole = invariant.tiled_mm(x, weight_t, tile=tile)
    for small in invariant.tail_tiles(tile, weight_t):
        for start in range(0, 64 - small + 1, small):
            rows = x[start : start + small]
            assert torch.equal(invariant.tiled_rows_mm(rows, weight_t, tile=tile), whole[start : start + small])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", EXPERT_SHAPES.values(), ids=EXPERT_SHAPES.keys())
def test_an_experts_token_alone_has_its_bits_among_many(dtype, shape):
    # Decoding gives an expert one token (a tail tile); training gives it many (whole tiles).
    hidden, double, inner = shape
    x = torch.randn(40, hidden).to(dtype) * torch.exp2(torch.randint(-4, 5, (40, 1))).to(dtype)
    gate_up = (torch.randn(3, double, hidden) / hidden**0.5).to(dtype)
    down = (torch.randn(3, hidden, inner) / inner**0.5).to(dtype)
    ids = torch.tensor([[1, 0]] * 40)
    with torch.no_grad(), ops.numerics("invariant"):
        together = experts.expert_mlp(x, ids, gate_up, down)
        for token in range(40):
            for count in (1, 3):  # alone, and with two other tokens before it
                rows = torch.cat([x[:token][-(count - 1) :] if count > 1 else x[:0], x[token : token + 1]])
                if rows.shape[0] < count:
                    continue
                alone = experts.expert_mlp(rows, ids[:count], gate_up, down)
                assert torch.equal(alone[-1], together[token]), (token, count)


def test_one_row_tiles_are_the_rows_alone():
    x, weight = torch.randn(5, 96), torch.randn(80, 96)
    full = invariant.tiled_mm(x, weight.t(), tile=1)
    assert all(torch.equal(invariant.tiled_mm(x[m : m + 1], weight.t(), tile=1), full[m : m + 1]) for m in range(5))
    torch.testing.assert_close(full, x @ weight.t())


def test_one_thread_restores_the_thread_count():
    torch.set_num_threads(2)
    with invariant.one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_linear_keeps_the_shape_and_the_value():
    x, weight = torch.randn(2, 3, 16), torch.randn(8, 16)
    out = invariant.linear(x, weight)
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(out, x @ weight.T)


def test_silu_and_sigmoid_do_not_depend_on_where_an_element_sits():
    x = torch.randn(4099) * 4  # odd length: a scalar tail and a vectorised body
    for fn in (invariant.silu, invariant.sigmoid):
        one_by_one = torch.cat([fn(x[i : i + 1]) for i in range(x.numel())])
        assert torch.equal(fn(x), one_by_one)
    torch.testing.assert_close(invariant.silu(x), F.silu(x))
    torch.testing.assert_close(invariant.sigmoid(x), torch.sigmoid(x))


def test_torch_silu_does_depend_on_where_an_element_sits():
    x = torch.randn(4099) * 4
    assert not torch.equal(F.silu(x), torch.cat([F.silu(x[i : i + 1]) for i in range(x.numel())]))


def test_a_lone_wide_row_is_reduced_like_a_row_among_others(threads):
    x = torch.randn(3, 70000)  # wider than torch's grain size: torch splits a lone row across threads
    assert torch.equal(invariant.mean_last(x[:1]), invariant.mean_last(x)[:1])
    assert torch.equal(invariant.mean_last(x), x.mean(-1, keepdim=True))
    if threads == 2:
        together = x.mean(-1, keepdim=True)
        assert any(not torch.equal(x[i : i + 1].mean(-1, keepdim=True), together[i : i + 1]) for i in range(3))


def test_moe_combine_adds_slots_in_top_k_order_in_fp32():
    expert_out, gates = torch.randn(5, 3, 8).bfloat16(), torch.rand(5, 3)
    expected = (
        (expert_out[:, 0].float() * gates[:, :1])
        + expert_out[:, 1].float() * gates[:, 1:2]
        + expert_out[:, 2].float() * gates[:, 2:]
    )
    assert torch.equal(invariant.moe_combine(expert_out, gates), expected.bfloat16())


def causal_reference(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_causal_attention(dtype):
    q, k, v = torch.randn(2, 4, 300, 16), torch.randn(2, 2, 300, 16), torch.randn(2, 2, 300, 16)
    out = invariant.attention(q.to(dtype), k.to(dtype), v.to(dtype), None)
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), causal_reference(q, k, v), atol=tolerance, rtol=tolerance)


def test_a_query_that_may_attend_to_no_key_gets_zeros_as_in_sdpa():
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 70, 16), torch.randn(2, 2, 70, 16)
    mask = torch.rand(2, 1, 5, 70) < 0.5
    mask[0, 0, 1] = False  # no key at all
    mask[1, 0, 3, :64] = False  # none in the first key chunk
    out = invariant.attention(q, k, v, mask)
    assert torch.equal(out[0, :, 1], torch.zeros(4, 16))
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_attention_of_a_query_does_not_depend_on_the_keys_after_it_or_the_batch(threads):
    # The engine decodes position p over a cache of any length (stale keys past p, other rows);
    # the trainer attends over the whole sequence at once: the same bits.
    q, k, v = torch.randn(3, 4, 300, 16), torch.randn(3, 2, 300, 16), torch.randn(3, 2, 300, 16)
    full = invariant.attention(q, k, v, None)
    for p in (0, 127, 128, 200, 299):  # chunks of KEY_CHUNK = 128 keys
        cache = 384 + p % 7  # longer than the sequence, filled with junk after p
        keys = torch.randn(3, 2, cache, 16)
        values = torch.randn(3, 2, cache, 16)
        keys[:, :, : p + 1], values[:, :, : p + 1] = k[:, :, : p + 1], v[:, :, : p + 1]
        mask = (torch.arange(cache) <= p).view(1, 1, 1, cache).expand(3, 1, 1, cache)
        one = invariant.attention(q[:, :, p : p + 1], keys, values, mask)
        assert torch.equal(one, full[:, :, p : p + 1])
        alone = invariant.attention(q[1:2, :, p : p + 1], keys[1:2], values[1:2], mask[1:2])
        assert torch.equal(alone, full[1:2, :, p : p + 1])


@pytest.mark.parametrize("dim", [6, 10])
def test_attention_of_heads_narrower_than_a_tile_does_not_depend_on_the_batch(dim):
    # P·V of such heads has fewer output columns than MIN_COLUMNS: multiplied as is, MKL (AVX2)
    # sums a query row by its place in the tile, which the row count of the batch sets.
    q, k, v = torch.randn(3, 4, 150, dim), torch.randn(3, 2, 150, dim), torch.randn(3, 2, 150, dim)
    full = invariant.attention(q, k, v, None)
    torch.testing.assert_close(full, causal_reference(q, k, v), atol=1e-5, rtol=1e-5)
    alone = invariant.attention(q[1:2, :, :37], k[1:2, :, :37], v[1:2, :, :37], None)
    assert torch.equal(alone, full[1:2, :, :37])
    mask = (torch.arange(150) <= 100).view(1, 1, 1, 150)
    assert torch.equal(invariant.attention(q[1:2, :, 100:101], k[1:2], v[1:2], mask), full[1:2, :, 100:101])


def test_attention_in_prefill_chunks_equals_one_pass():
    q, k, v = torch.randn(1, 4, 300, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    full = invariant.attention(q, k, v, None)
    positions = torch.arange(300)
    for start in range(0, 300, 100):
        end = start + 100
        mask = (positions[:end] <= positions[start:end, None]).view(1, 1, end - start, end)
        assert torch.equal(
            invariant.attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], mask), full[:, :, start:end]
        )


def test_attention_of_one_query_over_a_cache_is_the_query_in_a_full_forward():
    q, k, v = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    mask = (torch.arange(64) <= 30).view(1, 1, 1, 64)
    assert torch.equal(
        invariant.attention(q[:, :, 30:31], k, v, mask),
        invariant.attention(q, k[:, :, :40], v[:, :, :40], None)[:, :, 30:31],
    )


def test_attention_gradients_match_torch_attention():
    q = torch.randn(1, 4, 150, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 150, 8, requires_grad=True), torch.randn(1, 2, 150, 8, requires_grad=True)
    weights = torch.randn(1, 4, 150, 8)
    ours = torch.autograd.grad((invariant.attention(q, k, v, None) * weights).sum(), (q, k, v))
    theirs = torch.autograd.grad((causal_reference(q, k, v) * weights).sum(), (q, k, v))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mask", [False, True], ids=["causal", "masked"])
def test_attention_keeps_only_its_inputs_for_the_backward(mask):
    # The backward is torch's attention run again: nothing of the tiles (scores, probabilities
    # per key chunk) is kept, and the gradients are attention's.
    q = torch.randn(2, 4, 150, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 150, 8, requires_grad=True), torch.randn(2, 2, 150, 8, requires_grad=True)
    keys = torch.ones(150, 150, dtype=torch.bool).tril().expand(2, 1, 150, 150) if mask else None
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = invariant.attention(q, k, v, keys)
    inputs = q.numel() + k.numel() + v.numel() + (keys.numel() if mask else 0)
    assert sum(saved) <= inputs
    weights = torch.randn(2, 4, 150, 8)
    ours = torch.autograd.grad((out * weights).sum(), (q, k, v))
    theirs = torch.autograd.grad((causal_reference(q, k, v) * weights).sum(), (q, k, v))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_mode_is_a_context_like_autocast():
    assert not ops.is_invariant()
    with ops.numerics("invariant"):
        assert ops.is_invariant()
        with ops.numerics("fast"):
            assert not ops.is_invariant()
        assert ops.is_invariant()
    assert not ops.is_invariant()
    with pytest.raises(WhetstoneError, match="numerics must be one of"):
        with ops.numerics("exact"):
            pass


def test_the_mode_belongs_to_the_thread_that_set_it():
    seen = []
    with ops.numerics("invariant"):
        worker = threading.Thread(target=lambda: seen.append(ops.is_invariant()))
        worker.start()
        worker.join()
    assert seen == [False]


def test_top_k_breaks_ties_by_index_and_keeps_topks_order():
    x = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.3], [0.5, 0.1, 0.2, 0.15, 0.05]])
    values, indices = invariant.top_k(x, 2)
    assert indices.tolist() == [[1, 2], [0, 2]] and torch.equal(values, x.gather(1, indices))
    wide = torch.randn(40, 64)  # without ties: what topk gives
    assert all(torch.equal(a, b) for a, b in zip(invariant.top_k(wide, 8), wide.topk(8)))


def test_a_tile_verdict_holds_for_the_float32_matmul_precision_it_was_reached_under(fresh_tiles):
    # bf16 precision sends fp32 tiles to oneDNN's bf16 kernels, which tile their rows otherwise: a
    # verdict reached under one precision must not serve the other. Set either way (the legacy
    # process-wide call, or a backend's own), it must not make the tiles fail either.
    weight_t = torch.randn(64, 48)
    backends = torch.backends.mkldnn.matmul, torch.backends.cuda.matmul
    previous = [backend.fp32_precision for backend in backends]
    try:
        for setting in ("highest", "medium", "highest", "cuda tf32"):
            if setting == "cuda tf32":  # a GPU script's line: the process-wide getter raises after it
                torch.backends.cuda.matmul.fp32_precision = "tf32"
            else:
                torch.set_float32_matmul_precision(setting)
            invariant.row_tile(invariant.ROW_TILE, weight_t)
            invariant.tail_tiles(invariant.ROW_TILE, weight_t)
            invariant.linear(torch.randn(3, 64), weight_t.t())
    finally:
        for backend, precision in zip(backends, previous):
            backend.fp32_precision = precision
    # highest, medium, then highest and cuda's tf32 (the CPU's precision unchanged) from the cache
    assert invariant._row_tile.cache_info().misses == 2 and invariant._row_tile.cache_info().hits >= 2
    assert invariant._tail_tiles.cache_info().misses == 2
