"""The Triton kernels of invariant numerics: each against a torch reference, and each row's bits
independent of the batch (other rows, their number, padding, the split of attention's keys).
They run on a GPU (marked `gpu`) and, on any machine with Triton, under its interpreter."""

import sys

import pytest
import torch
import torch.nn.functional as F

import whetstone.model
from tests.host_work import no_gpu_waits, watch_host_work
from tests.triton_kernels import WHERE, kernels
from whetstone.errors import WhetstoneError
from whetstone.model import invariant_triton as kt
from whetstone.model.experts import expert_mlp, grouped_mm_on_cpu

GROUPED_MATMUL, WEIGHT_GRAD = kt.grouped_matmul, kt.grouped_weight_grad

DTYPES = [torch.float32, torch.bfloat16]
CLOSE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=0.05, rtol=0.02)}


def randn(*shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", WHERE)
def test_matmul_matches_torch_and_ignores_the_batch(where, dtype, monkeypatch):
    device, context = kernels(where, monkeypatch)
    x, w = randn(150, 96, dtype=dtype, device=device), randn(200, 96, dtype=dtype, device=device, seed=1)
    with context():
        full = kt.matmul(x, w)
        torch.testing.assert_close(full.float(), x.float() @ w.float().T, **CLOSE[dtype])
        assert full.dtype == dtype
        for rows in (slice(7, 8), slice(0, 1), slice(3, 70), slice(64, 150)):
            assert torch.equal(kt.matmul(x[rows], w), full[rows])
        # a row among other rows than its own: same bits
        others = torch.cat([randn(5, 96, dtype=dtype, device=device, seed=2), x[40:41]])
        assert torch.equal(kt.matmul(others, w)[5], full[40])
        # a strided view (a column slice of a wider tensor) is read correctly
        wide = torch.cat([x, x], dim=1)
        assert torch.equal(kt.matmul(wide[:, 96:], w), full)
        assert kt.matmul(x[:0], w).shape == (0, 200)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", WHERE)
def test_grouped_matmul_matches_per_expert_and_ignores_other_experts_tokens(where, dtype, monkeypatch):
    device, context = kernels(where, monkeypatch)
    x = randn(90, 64, dtype=dtype, device=device)
    weight = randn(5, 48, 64, dtype=dtype, device=device, seed=1)
    counts = [7, 0, 70, 1, 12]  # an empty expert, one with a lone token, one across two tiles
    with context():

        def ends(per_expert):  # each expert's rows end here (torch._grouped_mm's `offs`)
            return torch.tensor(per_expert, device=device).cumsum(0)

        out = kt.grouped_matmul(x, weight, ends(counts))
        reference = torch.cat([rows.float() @ weight[e].float().T for e, rows in enumerate(x.split(counts))])
        torch.testing.assert_close(out.float(), reference, **CLOSE[dtype])
        # expert 2's rows again, now with other counts around them (and its rows split across them)
        moved = kt.grouped_matmul(x[7:77], weight, ends([0, 3, 60, 7, 0]))
        assert torch.equal(moved[3:63], out[10:70])
        alone = kt.grouped_matmul(x[77:78], weight, ends([0, 0, 0, 1, 0]))
        assert torch.equal(alone, out[77:78])
        assert kt.grouped_matmul(x[:0], weight, ends([0] * 5)).shape == (0, 48)


@pytest.mark.parametrize("where", WHERE)
def test_fast_fp32_experts_take_the_grouped_kernel_where_torchs_would_read_back(where, monkeypatch):
    """torch._grouped_mm on CUDA in fp32 loops over the groups after copying the offsets to the
    host (no CUDA graph can capture that): there fast numerics use the Triton grouped kernel,
    which computes what the per-expert path does and waits for nothing."""
    device, context = kernels(where, monkeypatch)
    x = randn(20, 32, dtype=torch.float32, device=device)
    gate_up = randn(4, 64, 32, dtype=torch.float32, device=device, seed=1)
    down = randn(4, 32, 32, dtype=torch.float32, device=device, seed=2)
    ids = torch.randint(0, 3, (20, 2), generator=torch.Generator().manual_seed(3)).to(device)  # expert 3 idle
    expected = expert_mlp(x.cpu(), ids.cpu(), gate_up.cpu(), down.cpu())  # the CPU's per-expert path
    calls = []
    monkeypatch.setattr(kt, "grouped_matmul", lambda *args: calls.append(1) or GROUPED_MATMUL(*args))
    with context(), grouped_mm_on_cpu(), torch.no_grad(), watch_host_work() as work, no_gpu_waits(device):
        got = expert_mlp(x, ids, gate_up, down)
    assert len(calls) == 2 and work.syncs == [] and work.host_tensors == []
    # fp32 sums of products ~30 in size: the library's order moves the last bits (MKL's AVX2 path: 1.5e-4)
    torch.testing.assert_close(got.cpu(), expected, **CLOSE[torch.float32])


@pytest.mark.parametrize("where", WHERE)
def test_a_layers_grouped_matmuls_lay_their_tiles_out_once(where, monkeypatch):
    # gate/up and down take the same offsets tensor: the tile layout (a score of small ops) is
    # made for the first and kept for the second; other offsets get their own
    device, context = kernels(where, monkeypatch)
    made = []
    make = kt._make_tile_layout
    monkeypatch.setattr(kt, "_make_tile_layout", lambda *args: made.append(args) or make(*args))
    x = randn(20, 32, dtype=torch.float32, device=device)
    gate_up, down = (
        randn(3, 48, 32, dtype=torch.float32, device=device),
        randn(3, 32, 48, dtype=torch.float32, device=device),
    )
    offsets = torch.tensor([5, 5, 20], device=device, dtype=torch.int32)
    with context():
        hidden = kt.grouped_matmul(x, gate_up, offsets)
        out = kt.grouped_matmul(hidden, down, offsets)
        assert len(made) == 1
        again = kt.grouped_matmul(hidden, down, offsets.clone())
    assert len(made) == 2 and torch.equal(again, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", WHERE)
def test_grouped_weight_grad_sums_each_experts_slots(where, dtype, monkeypatch):
    device, context = kernels(where, monkeypatch)
    a = randn(90, 40, dtype=dtype, device=device)
    b = randn(90, 72, dtype=dtype, device=device, seed=1)
    counts = [7, 0, 70, 1, 12]  # an empty expert, a lone slot, more slots than one BLOCK_K
    ends = torch.tensor(counts, device=device).cumsum(0)
    with context():
        out = kt.grouped_weight_grad(a, b, ends)
        # strided operands (what the backward hands it: slices of wider tensors) read the same
        wide = torch.cat([a, a], dim=1)
        assert torch.equal(kt.grouped_weight_grad(wide[:, 40:], b, ends), out)
    expected = torch.stack([sa.float().T @ sb.float() for sa, sb in zip(a.split(counts), b.split(counts))])
    assert out.shape == (5, 40, 72) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **CLOSE[dtype])
    assert not out[1].any()


@pytest.mark.parametrize("numerics", ["fast", "invariant"])
@pytest.mark.parametrize("where", WHERE)
def test_fp32_experts_train_on_the_grouped_kernels_and_read_nothing_back(where, numerics, monkeypatch):
    """torch's grouped mm would read the offsets back four times a layer in the backward (fp32
    on CUDA, GPUs outside 9.x/10.x): there the backward runs the Triton kernels, and its
    gradients are the per-expert path's."""
    from whetstone.model import numerics as numerics_mode

    device, context = kernels(where, monkeypatch)
    x = randn(20, 32, dtype=torch.float32, device=device).requires_grad_()
    gate_up = randn(4, 64, 32, dtype=torch.float32, device=device, seed=1).requires_grad_()
    down = randn(4, 32, 32, dtype=torch.float32, device=device, seed=2).requires_grad_()
    ids = torch.randint(0, 3, (20, 2), generator=torch.Generator().manual_seed(3)).to(device)  # expert 3 idle
    probe = randn(20, 2, 32, dtype=torch.float32, device=device, seed=4)
    calls = []
    monkeypatch.setattr(kt, "grouped_weight_grad", lambda *args: calls.append(1) or WEIGHT_GRAD(*args))
    monkeypatch.setattr(torch, "_grouped_mm", lambda *args, **kwargs: pytest.fail("took torch's grouped mm"))
    with context(), numerics_mode(numerics), grouped_mm_on_cpu(), watch_host_work() as work, no_gpu_waits(device):
        got = torch.autograd.grad((expert_mlp(x, ids, gate_up, down) * probe).sum(), (x, gate_up, down))
    assert len(calls) == 2 and work.syncs == [] and work.host_tensors == []
    cpu = [t.detach().cpu().requires_grad_() for t in (x, gate_up, down)]
    expected = torch.autograd.grad((expert_mlp(*cpu[:1], ids.cpu(), *cpu[1:]) * probe.cpu()).sum(), cpu)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.cpu(), b, **CLOSE[torch.float32])
    assert not got[1][3].any() and not got[2][3].any()  # the idle expert's weights get zeros


@pytest.mark.parametrize("where", WHERE)
def test_row_reductions_match_torch_and_ignore_the_batch(where, monkeypatch):
    device, context = kernels(where, monkeypatch)
    x = randn(6, 5000, dtype=torch.float32, device=device) * 4  # wider than one ROW_BLOCK
    x[2, 100:] = float("-inf")  # masked logits
    with context():
        torch.testing.assert_close(kt.log_softmax(x), torch.log_softmax(x, -1))
        torch.testing.assert_close(kt.softmax(x), torch.softmax(x, -1))
        for reduce in (kt.log_softmax, kt.softmax):
            whole = reduce(x)
            assert torch.equal(reduce(x[2:3]), whole[2:3])
            assert torch.equal(reduce(x[1:5]), whole[1:5])
            # bf16 rows (the router's) from a flat buffer at an odd offset: the bits of aligned ones
            flat = randn(4 * 2048 + 1, dtype=torch.bfloat16, device=device, seed=5)
            assert torch.equal(reduce(flat[1:].view(4, 2048)), reduce(flat[1:].clone().view(4, 2048)))


def _reference_rms_norm(x, weight, eps):
    x32 = x.float()
    rstd = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(x.dtype), rstd


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", WHERE)
def test_rms_norm_is_qwen3s_in_one_kernel_and_ignores_the_batch(where, dtype, monkeypatch):
    device, context = kernels(where, monkeypatch)
    x = randn(6, 5, 3000, dtype=dtype, device=device) * 4  # rows wider than one ROW_BLOCK
    weight = randn(3000, dtype=torch.float32, device=device, seed=1)
    with context():
        out, rstd = kt.rms_norm(x, weight, 1e-6)
        expected, expected_rstd = _reference_rms_norm(x, weight, 1e-6)
        assert out.dtype == torch.float32 and rstd.shape == (6, 5, 1)
        torch.testing.assert_close(rstd, expected_rstd, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out, expected, **CLOSE[dtype])
        assert torch.equal(kt.rms_norm(x[2:3, 1:4], weight, 1e-6)[0], out[2:3, 1:4])  # fewer rows: same bits
        assert torch.equal(kt.rms_norm(x[::2], weight, 1e-6)[0], out[::2])  # strided rows
        # rows read from a view at an odd offset and stride (a pointer not 16-byte aligned): the
        # kernel is not specialised on either, so the same sums in the same order as a copy's
        wide = randn(6, 3003, dtype=dtype, device=device, seed=4)
        view = wide[:, 1:3001]
        assert torch.equal(kt.rms_norm(view, weight, 1e-6)[0], kt.rms_norm(view.contiguous(), weight, 1e-6)[0])
        # a weight per head over [..., heads, D], the heads read from a wider tensor (attention's
        # q and k heads, a split of the fused q/k/v projection), as the norm of each head apart
        qkv = randn(2, 3, 7, 64, dtype=dtype, device=device, seed=2)
        heads = qkv[:, :, :5]
        per_head = randn(5, 64, dtype=torch.float32, device=device, seed=3)
        joint, _ = kt.rms_norm(heads, per_head, 1e-6)
        for head in range(5):
            alone, _ = kt.rms_norm(heads[:, :, head], per_head[head], 1e-6)
            assert torch.equal(joint[:, :, head], alone)
        torch.testing.assert_close(joint, _reference_rms_norm(heads, per_head, 1e-6)[0], **CLOSE[dtype])
        same_dtype = kt.rms_norm(x, weight.to(dtype), 1e-6)[0]
        assert same_dtype.dtype == dtype
        with pytest.raises(WhetstoneError, match="weight"):
            kt.rms_norm(heads, per_head[:4], 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", WHERE)
def test_moe_combine_adds_the_slots_in_order_in_one_kernel(where, dtype, monkeypatch):
    device, context = kernels(where, monkeypatch)
    expert_out = randn(9, 8, 1500, dtype=dtype, device=device)  # wider than one program's block
    gates = randn(9, 8, dtype=torch.float32, device=device, seed=1).softmax(-1)
    reference = (expert_out.float() * gates.unsqueeze(-1)).sum(1).to(dtype)
    # slot by slot with torch's element-wise ops, on the same device: the kernel's exact bits
    # (each multiply and add rounded on its own, no fused multiply-add). The interpreter casts
    # fp32 to bf16 toward zero, where the GPU and torch round to nearest: there fp32 only.
    formula = expert_out[:, 0].float() * gates[:, :1]
    for slot in range(1, 8):
        formula = formula + expert_out[:, slot].float() * gates[:, slot : slot + 1]
    with context():
        out = kt.moe_combine(expert_out, gates)
        assert out.dtype == dtype and out.shape == (9, 1500)
        torch.testing.assert_close(out, reference, **CLOSE[dtype])
        if device.type == "cuda" or dtype == torch.float32:
            assert torch.equal(out, formula.to(dtype))
        assert torch.equal(kt.moe_combine(expert_out[3:5], gates[3:5]), out[3:5])  # fewer tokens: same bits
        # the differentiable path: the same forward, torch's gradients
        leaves = expert_out.float().requires_grad_(), gates.clone().requires_grad_()
        probe = randn(9, 1500, dtype=torch.float32, device=device, seed=2)
        got = torch.autograd.grad((kt.moe_combine(*leaves) * probe).sum(), leaves)
    expected = torch.autograd.grad(((leaves[0] * leaves[1].unsqueeze(-1)).sum(1) * probe).sum(), leaves)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **CLOSE[torch.float32])


@pytest.mark.parametrize("where", WHERE)
def test_softmax_gradients_are_torchs(where, monkeypatch):
    device, context = kernels(where, monkeypatch)
    x = randn(4, 33, dtype=torch.float32, device=device).requires_grad_()
    weights = randn(4, 33, dtype=torch.float32, device=device, seed=3)
    for ours, theirs in ((kt.softmax, torch.softmax), (kt.log_softmax, torch.log_softmax)):
        with context():
            (got,) = torch.autograd.grad((ours(x) * weights).sum(), x)
        (want,) = torch.autograd.grad((theirs(x, -1) * weights).sum(), x)
        torch.testing.assert_close(got, want)


def _qkv(batch, length, dtype, device, q_heads=4, kv_heads=2, dim=16, seed=0):
    return (
        randn(batch, q_heads, length, dim, dtype=dtype, device=device, seed=seed),
        randn(batch, kv_heads, length, dim, dtype=dtype, device=device, seed=seed + 1),
        randn(batch, kv_heads, length, dim, dtype=dtype, device=device, seed=seed + 2),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", WHERE)
def test_attention_matches_sdpa(where, dtype, monkeypatch):
    device, context = kernels(where, monkeypatch)
    q, k, v = _qkv(2, 150, dtype, device)  # keys over three chunks, the last one partial
    mask = torch.rand(2, 1, 150, 150, generator=torch.Generator().manual_seed(5)) < 0.7
    mask = (mask | torch.eye(150, dtype=torch.bool)).to(device)  # every query sees a key
    with context():
        causal, masked = kt.attention(q, k, v, None), kt.attention(q, k, v, mask)
    up = [t.float() for t in (q, k, v)]
    torch.testing.assert_close(
        causal.float(), F.scaled_dot_product_attention(*up, is_causal=True, enable_gqa=True), **CLOSE[dtype]
    )
    torch.testing.assert_close(
        masked.float(), F.scaled_dot_product_attention(*up, attn_mask=mask, enable_gqa=True), **CLOSE[dtype]
    )


@pytest.mark.parametrize("where", WHERE)
def test_attention_past_the_grids_limit_launches_in_parts_with_the_same_bits(where, monkeypatch):
    device, context = kernels(where, monkeypatch)
    q, k, v = _qkv(5, 40, torch.bfloat16, device)  # 2 kv heads a sequence
    mask = (torch.rand(5, 1, 40, 40, generator=torch.Generator().manual_seed(3)) < 0.6) | torch.eye(40, dtype=bool)
    with context():
        whole = kt.attention(q, k, v, None), kt.attention(q, k, v, mask.to(device))
        monkeypatch.setattr(kt, "GRID_Y", 5)  # 2 sequences a launch: three launches, the last of one
        grids = []
        kernel = kt._kernels().attention
        monkeypatch.setattr(kt, "_kernels", lambda: type("Kernels", (), {"attention": Launches(kernel, grids)}))
        parts = kt.attention(q, k, v, None), kt.attention(q, k, v, mask.to(device))
    assert [grid[1] for grid in grids] == [4, 4, 2] * 2
    assert all(torch.equal(a, b) for a, b in zip(whole, parts))


class Launches:
    """A kernel that records each launch's grid."""

    def __init__(self, kernel, grids: list):
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("dim", [8, 24])
@pytest.mark.parametrize("where", WHERE)
def test_attention_takes_a_head_dim_its_tiles_do_not(where, dim, monkeypatch):
    """head_dim 8 (the tests' tiny models) or 24 is padded with zero columns to the tiles' power of
    two: the same result as SDPA, and a row's bits still do not depend on the batch."""
    device, context = kernels(where, monkeypatch)
    q, k, v = _qkv(2, 70, torch.float32, device, dim=dim)
    with context():
        both, first = kt.attention(q, k, v, None), kt.attention(q[:1], k[:1], v[:1], None)
    assert both.shape == q.shape and torch.equal(both[:1], first)
    torch.testing.assert_close(both, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", WHERE)
def test_attention_is_the_same_decoded_prefilled_in_chunks_or_batched(where, dtype, monkeypatch):
    device, context = kernels(where, monkeypatch)
    length = 140
    q, k, v = _qkv(1, length, dtype, device)
    with context():
        full = kt.attention(q, k, v, None)
        # the causal mask given explicitly (the KV cache's way): the same bits
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril().expand(1, 1, length, length)
        assert torch.equal(kt.attention(q, k, v, causal), full)
        # one query at a time over a cache longer than its position (keys past it unwritten)
        cache = 200
        k_cache, v_cache = F.pad(k, (0, 0, 0, cache - length)), F.pad(v, (0, 0, 0, cache - length))
        for t in (0, 63, 64, 65, 139):
            visible = (torch.arange(cache, device=device) <= t).view(1, 1, 1, cache)
            decoded = kt.attention(q[:, :, t : t + 1], k_cache, v_cache, visible)
            assert torch.equal(decoded[:, :, 0], full[:, :, t]), t
        # prefill in chunks of 48 queries against the keys so far
        for start in range(0, length, 48):
            end = min(start + 48, length)
            rows = torch.arange(start, end, device=device).view(-1, 1)
            visible = (torch.arange(end, device=device) <= rows).view(1, 1, end - start, end)
            part = kt.attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], visible)
            assert torch.equal(part, full[:, :, start:end])
        # the sequence as row 1 of a batch, beside a longer one, padded at the end
        other = _qkv(1, 190, dtype, device, seed=9)
        padded = [torch.cat([o, F.pad(t, (0, 0, 0, 50))]) for o, t in zip(other, (q, k, v))]
        keys = torch.arange(190, device=device)
        visible = (keys <= keys.view(-1, 1)) & torch.stack([keys < 190, keys < length]).view(2, 1, 1, 190)
        batched = kt.attention(*padded, visible)
        assert torch.equal(batched[1:, :, :length], full)


@pytest.mark.parametrize("where", WHERE)
def test_attention_gradients_are_sdpas(where, monkeypatch):
    device, context = kernels(where, monkeypatch)
    q, k, v = (t.requires_grad_() for t in _qkv(1, 40, torch.float32, device))
    weights = randn(1, 4, 40, 16, dtype=torch.float32, device=device, seed=7)
    with context():
        got = torch.autograd.grad((kt.attention(q, k, v, None) * weights).sum(), (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = torch.autograd.grad((out * weights).sum(), (q, k, v))
    for a, b in zip(got, want):  # two kernels (on CUDA the backward's is SDPA's memory-efficient one)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", WHERE)
def test_bad_operands_are_named(where, monkeypatch):
    device, context = kernels(where, monkeypatch)
    with context():
        with pytest.raises(WhetstoneError, match="one float dtype"):
            kt.matmul(torch.ones(2, 4, device=device), torch.ones(3, 4, dtype=torch.float64, device=device))
    # a head past int32 offsets (meta tensors: refused before any launch)
    huge = torch.empty(65537, 32768, device="meta")
    with pytest.raises(WhetstoneError, match=r"\(65537, 32768\) reaches offset 2147516415, past 2\^31 - 1"):
        kt.matmul(torch.empty(2, 32768, device="meta"), huge)
    with pytest.raises(WhetstoneError, match="in int32"):
        kt.grouped_matmul(torch.empty(2, 32768, device="meta"), huge[None], torch.empty(1, device="meta"))
    assert kt.matmul(torch.empty(0, 32768, device="meta"), huge[:-1]).shape == (0, 65536)  # 2^31 - 1: reached


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("where", WHERE)
def test_a_model_decodes_the_bits_of_its_full_forward(where, dtype, monkeypatch):
    """The whole MoE model on the kernels: a sequence decoded token by token from a KV cache,
    and inside a padded batch, gives the logits and routes of its own full forward."""
    from tests.inference.inference_fixtures import tiny_model
    from whetstone.model import KVCache, numerics
    from whetstone.utils.device import autocast

    device, context = kernels(where, monkeypatch)
    # two query heads on one key/value head: the interpreter runs each row's norm as a program
    shape = dict(vocab_size=128, max_position_embeddings=96, num_attention_heads=2, num_key_value_heads=1)
    model = tiny_model(seed=3, **shape).to(device)
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(1)).to(device)
    other = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(2)).to(device)
    with context(), torch.no_grad(), numerics("invariant"), autocast(dtype, device):
        full = model(ids, return_routes=True)
        batched = model(torch.cat([other, F.pad(ids, (0, 10))]), return_routes=True)
        assert torch.equal(batched.logits[1, :70], full.logits[0])
        assert torch.equal(batched.routes[1, :70], full.routes[0])
        cache = KVCache(model.cfg, 1, 96, device=device)
        prefill = 60  # then one token at a time
        model(ids[:, :prefill], positions=torch.arange(prefill, device=device).view(1, -1), cache=cache)
        for t in range(prefill, 70):
            step = model(
                ids[:, t : t + 1], positions=torch.tensor([[t]], device=device), cache=cache, return_routes=True
            )
            assert torch.equal(step.logits[0, 0], full.logits[0, t]), t
            assert torch.equal(step.routes[0, 0], full.routes[0, t]), t


@pytest.mark.parametrize("where", WHERE)
def test_a_model_on_the_kernels_trains_with_fast_modes_gradients(where, monkeypatch):
    """The trainer's backward through the kernels (linear, experts, router softmax, norms,
    attention, head): every parameter gets fast numerics' gradient, to fp32 rounding."""
    from tests.inference.inference_fixtures import tiny_model
    from whetstone.model import numerics

    device, context = kernels(where, monkeypatch)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1)).to(device)
    grads = {}
    for mode in ("fast", "invariant"):
        model = tiny_model(seed=3, vocab_size=128, max_position_embeddings=96).to(device).train()
        with context(), numerics(mode):
            out = model(ids[:, :-1], targets=ids[:, 1:])
            (-out.logprobs.mean() + 0.01 * out.aux_loss).backward()
        grads[mode] = {name: p.grad for name, p in model.named_parameters()}
    assert all(grad is not None for grad in grads["invariant"].values())
    for name, grad in grads["fast"].items():
        torch.testing.assert_close(grads["invariant"][name], grad, atol=1e-5, rtol=1e-3, msg=name)


def test_without_triton_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "whetstone.model.invariant_kernels", raising=False)
    monkeypatch.delattr(whetstone.model, "invariant_kernels", raising=False)
    kt._kernels.cache_clear()
    try:
        with kt.on_cpu(), pytest.raises(WhetstoneError, match="need Triton"):
            kt.matmul(torch.ones(2, 16), torch.ones(3, 16))
    finally:
        kt._kernels.cache_clear()  # the next test imports the real kernels again


def test_the_kernels_compile_for_hopper_and_ampere_without_a_gpu():
    """Triton's compiler and ptxas come with its wheel: every kernel compiles for sm_90 and sm_80
    here as the model launches it (attention at head sizes 64 and 128), the bf16 products on
    tensor cores (wgmma on Hopper, mma on Ampere) with their loads pipelined (cp.async), and the
    row kernels with each multiply and add rounded on its own and exact divisions, as torch's
    element-wise ops compute them."""
    import json
    import os
    import subprocess
    from pathlib import Path

    pytest.importorskip("triton", reason="the invariant kernels need Triton")
    root = Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), str(root / "src"), env.get("PYTHONPATH"))))
    done = subprocess.run(
        [sys.executable, "-m", "tests.model.compile_invariant_kernels"],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reports = list(map(json.loads, done.stdout.splitlines()))
    compiled = {(r["kernel"] + r["case"], r["target"], r["dtype"]): r for r in reports}
    assert len(compiled) == len(reports) == 40
    for kernel in ("matmul", "grouped_matmul", "grouped_weight_grad", "attentiond64", "attentiond128"):
        assert compiled[kernel, "sm_90", "bf16"]["wgmma"] > 0 and compiled[kernel, "sm_80", "bf16"]["mma"] > 0
        assert compiled[kernel, "sm_90", "bf16"]["cp_async"] > 0
    rows = [r for r in reports if r["kernel"] in ("rms_norm", "moe_combine", "softmax", "log_softmax")]
    assert len(rows) == 20
    assert all(r["fp32_fma"] == 0 and r["approximate_division"] == 0 for r in rows), rows
