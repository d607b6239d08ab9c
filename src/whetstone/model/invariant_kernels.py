"""The Triton kernels of invariant numerics on CUDA; `invariant_triton` launches them and says
what makes each batch-invariant. Imported only when a kernel is first needed (it imports Triton)."""

import triton
import triton.language as tl


@triton.jit
def tile_product(
    x, w, r, c, row_end, columns, depth, x_row, x_col, w_row, w_col,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # x[r] @ w[c].T for rows r below row_end, in fp32: the whole K, BLOCK_K at a time, in order
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in tl.range(0, depth, BLOCK_K):
        kk = start + k
        a = tl.load(x + r[:, None] * x_row + kk[None, :] * x_col, (r[:, None] < row_end) & (kk[None, :] < depth), 0.0)
        b = tl.load(w + c[None, :] * w_row + kk[:, None] * w_col, (c[None, :] < columns) & (kk[:, None] < depth), 0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee" if IEEE else None)
    return acc


@triton.jit(do_not_specialize=["rows"])
def matmul(
    x, w, out, rows, columns, depth,
    x_row, x_col, w_row, w_col, out_row, out_col,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # out[rows, columns] = x[rows, depth] @ w[columns, depth].T
    r = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tile_product(x, w, r, c, rows, columns, depth, x_row, x_col, w_row, w_col, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    mask = (r[:, None] < rows) & (c[None, :] < columns)
    tl.store(out + r[:, None] * out_row + c[None, :] * out_col, acc.to(out.dtype.element_ty), mask)


@triton.jit
def grouped_matmul(
    x, w, out, tile_expert, tile_start, tile_end, columns, depth,
    x_row, x_col, w_expert, w_row, w_col, out_row, out_col,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # out[s] = x[s] @ w[e].T for the slots s of each tile's expert e (tiles past the last: e < 0)
    tile = tl.program_id(0)
    expert = tl.load(tile_expert + tile)
    if expert < 0:
        return
    end = tl.load(tile_end + tile)
    r = tl.load(tile_start + tile).to(tl.int64) + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    weight = w + expert.to(tl.int64) * w_expert
    acc = tile_product(
        x, weight, r, c, end, columns, depth, x_row, x_col, w_row, w_col, IEEE, BLOCK_M, BLOCK_N, BLOCK_K
    )
    mask = (r[:, None] < end) & (c[None, :] < columns)
    tl.store(out + r[:, None] * out_row + c[None, :] * out_col, acc.to(out.dtype.element_ty), mask)


@triton.jit
def grouped_weight_grad(
    a, b, out, offsets, rows, columns,
    a_slot, a_col, b_slot, b_col, out_expert, out_row, out_col,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # out[e] = a[s].T @ b[s] summed over the slots s of expert e (offsets[e-1]:offsets[e]), in
    # slot order, BLOCK_K slots at a time; zeros for an expert no slot chose
    expert = tl.program_id(0)
    end = tl.load(offsets + expert).to(tl.int64)
    start = tl.where(expert > 0, tl.load(offsets + tl.maximum(expert - 1, 0)).to(tl.int64), 0)
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first in tl.range(start, end, BLOCK_K):
        s = first + k
        at = tl.load(a + s[None, :] * a_slot + r[:, None] * a_col, (s[None, :] < end) & (r[:, None] < rows), 0.0)
        bt = tl.load(b + s[:, None] * b_slot + c[None, :] * b_col, (s[:, None] < end) & (c[None, :] < columns), 0.0)
        acc = tl.dot(at, bt, acc, input_precision="ieee" if IEEE else None)
    mask = (r[:, None] < rows) & (c[None, :] < columns)
    weight = out + expert.to(tl.int64) * out_expert
    tl.store(weight + r[:, None] * out_row + c[None, :] * out_col, acc.to(out.dtype.element_ty), mask)


# The row kernels (rms_norm, softmax) are not specialised on x's alignment or strides: the
# layout of a row's values across threads, and so the order tl.sum adds them in, follows what
# the compiler knows of them (a bf16 row reads 8 or 4 values a thread), and one row's bits must
# not depend on whether it came as a view or a copy.
@triton.jit(do_not_specialize=["width", "x_token", "x_head"], do_not_specialize_on_alignment=["x"])
def rms_norm(x, weight, out, rstd, width, heads, eps, x_token, x_head, w_head, BLOCK: tl.constexpr):
    # Row (token, head) of x: its mean square summed BLOCK at a time in order, then
    # weight[head] * (x * rstd rounded to x's dtype), Qwen3's formula (division and square root
    # correctly rounded)
    row = tl.program_id(0).to(tl.int64)
    token, head = row // heads, row % heads
    source = x + token * x_token + head * x_head
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in tl.range(0, width, BLOCK):
        values = tl.load(source + start + offsets, start + offsets < width, 0.0).to(tl.float32)
        acc += values * values
    scale = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(acc, 0), width.to(tl.float32)) + eps))
    tl.store(rstd + row, scale)
    for start in tl.range(0, width, BLOCK):
        inside = start + offsets < width
        values = tl.load(source + start + offsets, inside, 0.0)
        normed = (values.to(tl.float32) * scale).to(values.dtype).to(tl.float32)
        scaling = tl.load(weight + head * w_head + start + offsets, inside, 0.0).to(tl.float32)
        tl.store(out + row * width + start + offsets, (normed * scaling).to(out.dtype.element_ty), inside)


@triton.jit
def moe_combine(expert_out, gates, out, slots, hidden, e_token, e_slot, g_token, o_token, BLOCK: tl.constexpr):
    # out[token, block] = sum over slots j of gates[token, j] * expert_out[token, j, block], in
    # fp32, slot 0 first
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < hidden
    rows = expert_out + token * e_token + columns
    acc = tl.load(rows, inside, 0.0).to(tl.float32) * tl.load(gates + token * g_token)
    for slot in tl.range(1, slots):
        values = tl.load(rows + slot * e_slot, inside, 0.0).to(tl.float32)
        acc = acc + values * tl.load(gates + token * g_token + slot)
    tl.store(out + token * o_token + columns, acc.to(out.dtype.element_ty), inside)


@triton.jit(do_not_specialize=["width", "x_row"], do_not_specialize_on_alignment=["x"])
def softmax(x, out, width, x_row, out_row, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    peak = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in tl.range(0, width, BLOCK):
        values = tl.load(x + row * x_row + start + offsets, start + offsets < width, float("-inf"))
        peak = tl.maximum(peak, values.to(tl.float32))
    top = tl.max(peak, 0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in tl.range(0, width, BLOCK):
        values = tl.load(x + row * x_row + start + offsets, start + offsets < width, float("-inf"))
        acc += tl.exp(values.to(tl.float32) - top)
    total = tl.sum(acc, 0)
    for start in tl.range(0, width, BLOCK):
        inside = start + offsets < width
        shifted = tl.load(x + row * x_row + start + offsets, inside, 0.0).to(tl.float32) - top
        result = shifted - tl.log(total) if LOG else tl.div_rn(tl.exp(shifted), total)
        tl.store(out + row * out_row + start + offsets, result, inside)


@triton.jit(do_not_specialize=["keys", "rows", "causal", "m_b", "m_t", "m_s"])
def attention(
    q, k, v, mask, out, keys, rows, group, kv_heads, scale, causal,
    q_b, q_h, q_t, k_b, k_h, k_s, v_b, v_h, v_s, m_b, m_t, m_s, o_b, o_h, o_t,
    IEEE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Rows of one (batch, kv head): row i is query position i // group of head kv_head * group + i % group.
    # `causal` (keys up to the query's position) or `mask` is a value, not a constant, and the
    # sizes that vary with the batch are not specialised on: the trainer's full forward and the
    # engine's cached prefill and decode run one compiled kernel.
    tile, batch_head = tl.program_id(0), tl.program_id(1)
    batch, kv_head = batch_head // kv_heads, batch_head % kv_heads
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    position = i // group
    head = kv_head * group + i % group
    real = i < rows
    d = tl.arange(0, HEAD_DIM)
    batch = batch.to(tl.int64)
    query_at = q + batch * q_b + head[:, None] * q_h + position[:, None] * q_t + d[None, :]
    query = tl.load(query_at, real[:, None], 0.0)
    key_base = k + batch * k_b + kv_head * k_h
    value_base = v + batch * v_b + kv_head * v_h
    peak = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    # causal: keys after the tile's last query are masked for all its rows, and not visited
    limit = tl.where(causal != 0, tl.minimum(keys, (tile * BLOCK_M + BLOCK_M - 1) // group + 1), keys)
    for start in tl.range(0, limit, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        present = j < keys
        key = tl.load(key_base + j[None, :] * k_s + d[:, None], present[None, :], 0.0)
        scores = tl.dot(query, key, input_precision="ieee" if IEEE else None) * scale
        given = tl.load(  # (causal: strides 0, one byte read again and again)
            mask + batch * m_b + position[:, None] * m_t + j[None, :] * m_s, real[:, None] & present[None, :], 0
        )
        visible = tl.where(causal != 0, j[None, :] <= position[:, None], given != 0) & present[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(scores, 1))
        safe = tl.where(new_peak == float("-inf"), 0.0, new_peak)  # no visible key yet
        probs = tl.exp(scores - safe[:, None])
        rescale = tl.exp(peak - safe)
        total = total * rescale + tl.sum(probs, 1)
        value = tl.load(value_base + j[:, None] * v_s + d[None, :], present[:, None], 0.0)
        acc = acc * rescale[:, None] + tl.dot(probs.to(value.dtype), value, input_precision="ieee" if IEEE else None)
        peak = new_peak
    result = acc / tl.where(total == 0.0, 1.0, total)[:, None]  # (padding rows see no key)
    out_at = out + batch * o_b + head[:, None] * o_h + position[:, None] * o_t + d[None, :]
    tl.store(out_at, result.to(out.dtype.element_ty), real[:, None])
