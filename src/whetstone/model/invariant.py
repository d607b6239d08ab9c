"""Batch-invariant kernels: a row's result does not depend on the other rows of the batch.

A row's bits must not depend on which code path the BLAS library picks, and libraries pick by
shape and thread count: MKL's fp32 GEMM sums in another order for fewer than 4 rows on its AVX2
path, for 4 rows against 8 on its SSE path (`MKL_CBWR=COMPATIBLE`), for other row counts on
AVX-512; with 2 threads it splits the K of a thin GEMM across them. So every matmul here is made
of tiles of one fixed shape, whatever the batch:

- a tile has a fixed number of rows, ROW_TILE (EXPERT_ROW_TILE for the MoE experts) where the
  check below passes (rows are padded with zeros, or copies of a real row, to a multiple of
  it), the full K of the weight, and a fixed block of at least MIN_COLUMNS of its columns; in
  attention, K is the head dim or KEY_CHUNK and N is KEY_CHUNK or the head dim;
- a library may still compute the rows of one tile differently by where they sit in it: MKL's
  AVX2 path on Intel CPUs computes 6 rows at a time and the 2 left of an 8-row tile another
  way. So the tile's row count is checked once per shape, on the library path the process
  runs (`row_tile`): a row put anywhere in the tile must give the same bits. Where the base
  size fails, the next multiple of it that passes is used, and one row per tile if none does;
- the rows left after a batch's whole tiles may take one smaller tile of their own, of a size
  for which the library computes every row exactly as in the whole tiles (`tail_tiles`,
  checked once per shape as `row_tile`): a decode step's few rows (an expert given one token)
  then cost a tile of 2 or 4 rows, not 8 or 16, with the bits the trainer's whole tiles give;
- many rows (the trainer's) take bulk tiles of a multiple of that row count where the library
  computes every row of a tile exactly as in a bulk tile (`bulk_tile`, checked once per shape
  as `tail_tiles`): the library packs the weight once per tile call, which fewer, larger tiles
  amortise;
- each tile is one library call of one shape on one thread (`one_thread`): fp32 tiles go
  through `torch.bmm` (MKL's GEMM, batched or tile by tile), bf16 tiles through one `torch.mm`
  each. The same instructions in the same order for a given row, whether it came alone or
  among thousands. No row count, thread count or tile position enters the arithmetic. The
  tests check it under each CPU dispatch path MKL and oneDNN can be forced to
  (tests/model/test_invariant_dispatch.py);
- attention reduces over keys in fixed chunks of KEY_CHUNK absolute positions and adds the
  chunks up one after the other, in order. Masked keys contribute exact zeros, so the chunks
  after a query's own position change nothing: a one-token decode over a long KV cache and a
  full forward over the sequence give the same bits.
- F.silu and torch.sigmoid take a vectorised path and a scalar path (tails of a row, thread
  boundaries) that differ in the last bit; torch.exp does not. SiLU and sigmoid are written
  with exp, so each element's value no longer depends on where it sits in the tensor.
- A reduction over a single row wider than torch's grain size (32768) is split across threads;
  a lone row is reduced beside a copy of itself.

Norms, softmaxes, log-softmaxes and the per-chunk sums of attention are torch's own row
reductions (one row per worker, an order set by the row's length), in fp32.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from whetstone.model import invariant_triton

log = logging.getLogger(__name__)

ROW_TILE = 16
"""Rows per matmul tile, where the library computes every row of such a tile alike (`row_tile`).
Smaller tiles waste less on padding when decoding a few rows (an expert with one token computes
a whole tile); larger ones cost the trainer less per row."""
EXPERT_ROW_TILE = 8
"""Rows per tile of the MoE experts' matmuls, as ROW_TILE. Decoding gives an expert one or two
tokens, which its tile pads to this many rows: 8 costs a decode step of the benchmark model 20%
less than 16, and the trainer's expert matmuls (hundreds of rows each) ~25% more."""
TILE_MULTIPLES = 4
"""`row_tile` tries this many multiples of a base tile before it falls back to one-row tiles."""
BULK_MULTIPLES = (8, 4, 2)
"""The multiples of a tile that `bulk_tile` tries for many rows, largest first: with 8 (128 rows
of 16) a trainer's [1376, 512] x [512, 1024] costs 1.2x one GEMM in fp32, 1.9x in 16-row tiles
(Intel Xeon, one thread)."""
BLOCK_BYTES = 1 << 20
"""A tile's block of the weight is at most this big (an L2's worth; at least 64 columns): 512
output columns of a K = 512 fp32 weight, 1024 in bf16."""
MIN_COLUMNS = ROW_TILE
"""Weights with fewer output columns are padded to this many: with one output column the library
takes a matrix-vector path, whose sum for a row depends on where the row sits in the tile (MKL,
AVX2)."""
KEY_CHUNK = 128
"""Attention adds keys up in chunks of this many absolute positions (the K of every P·V tile)."""


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block's torch ops on one intra-op thread (the calling thread's setting, restored)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _pad_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    """x [M, K] with zero rows added up to `count`."""
    missing = count - x.shape[0]
    return torch.cat([x, x.new_zeros(missing, x.shape[1])]) if missing else x


def _block_columns(depth: int, dtype: torch.dtype) -> int:
    """The columns of a weight's block in `tiled_mm` (BLOCK_BYTES of it, at least 64)."""
    return max(64, BLOCK_BYTES // (depth * dtype.itemsize) // 64 * 64)


def _block_shapes(weights_t: tuple[torch.Tensor, ...]) -> tuple:
    """What the tile checks multiply by for each of `weights_t`: (depth, width, dtype, column-major,
    the CPU's float32 matmul precision). The precision is part of every check's key: bf16 or tf32
    (`torch.backends.mkldnn.matmul.fp32_precision`, which `set_float32_matmul_precision("medium")`
    sets too) send fp32 tiles to oneDNN's reduced-precision kernels, which tile their rows
    otherwise, so a verdict reached under one precision says nothing of another. Read from the
    backend: the process-wide getter raises once a backend's precision was set."""
    shapes = []
    for weight_t in weights_t:
        depth, columns = weight_t.shape
        block = _block_columns(depth, weight_t.dtype)
        # the blocks tiled_mm makes: a whole weight of up to `block` columns in one call, else
        # whole blocks written into column slices of the output, and a narrower last one
        width = columns if columns <= block else block + (columns % block or block)
        column_major = weight_t.stride(0) == 1 and columns > 1
        shapes.append((depth, width, weight_t.dtype, column_major, torch.backends.mkldnn.matmul.fp32_precision))
    return tuple(shapes)


def row_tile(base: int, *weights_t: torch.Tensor) -> int:
    """The rows of a tile for `tiled_mm` against each of `weights_t` ([K, N], as it takes them):
    `base`, or the smallest multiple of it (up to TILE_MULTIPLES times) for which the library
    computes a row the same wherever it sits in a tile, on every block of every weight; 1 if none
    does (a one-row tile has one place). Checked once per shape, layout and dtype
    (`_rows_alike`), so the engine and the trainer of one machine, under the same library
    settings (MKL_*, ONEDNN_* variables), tile alike."""
    return _row_tile(base, _block_shapes(weights_t))


def tail_tiles(tile: int, *weights_t: torch.Tensor) -> tuple[int, ...]:
    """The smaller tiles that may hold the rows left after whole `tile`-row tiles (`padded_rows`,
    `tiled_rows_mm`), ascending: the powers of two below `tile` that divide it and for which the
    library computes each row of such a tile, alone, exactly as in `tile`-row tiles, on every
    block of every weight of `weights_t`. Checked once per shape, layout and dtype
    (`_rows_as_in`), as `row_tile`; empty where no size passes (the rows left take a whole tile)."""
    return _tail_tiles(tile, _block_shapes(weights_t))


@functools.lru_cache(maxsize=256)
def _tail_tiles(tile: int, shapes: tuple) -> tuple[int, ...]:
    if tile <= 1:
        return ()
    sizes = [1 << power for power in range(tile.bit_length()) if (1 << power) < tile and tile % (1 << power) == 0]
    return tuple(size for size in sizes if all(_rows_as_in(size, tile, *shape) for shape in shapes))


def padded_rows(count: int, tile: int, tails: tuple[int, ...] = ()) -> int:
    """`count` rows rounded up to whole `tile`-row tiles, the rows left (if any) to the smallest
    of `tails` (`tail_tiles`) that holds them, or to a whole tile where none does."""
    whole, left = divmod(count, tile)
    if not left:
        return count
    return whole * tile + next((size for size in tails if size >= left), tile)


def bulk_tile(tile: int, *weights_t: torch.Tensor) -> int:
    """The rows of the tiles that many rows (the trainer's) take in `tiled_rows_mm`: the largest
    of `tile` times BULK_MULTIPLES for which the library computes each row of a `tile`-row tile
    exactly as in such a bulk tile, wherever the row sits in either, on every block of every
    weight of `weights_t` (`_rows_as_in`, checked once per shape, layout and dtype, as
    `tail_tiles`); `tile` where none does. Bulk tiles have the rows' bits of `tile`-row tiles at
    the cost of fewer, larger calls: the library packs the weight once per tile."""
    return _bulk_tile(tile, _block_shapes(weights_t))


@functools.lru_cache(maxsize=256)
def _bulk_tile(tile: int, shapes: tuple) -> int:
    for multiple in BULK_MULTIPLES:
        if all(_rows_as_in(tile, tile * multiple, *shape) for shape in shapes):
            return tile * multiple
    return tile


def tiled_rows_mm(
    rows: torch.Tensor,
    weight_t: torch.Tensor,
    out: torch.Tensor | None = None,
    tile: int = ROW_TILE,
    shapes: tuple | None = None,
) -> torch.Tensor:
    """`tiled_mm` of rows counted by `padded_rows`: whole bulk tiles where there are enough rows
    (`bulk_tile`), whole `tile`-row tiles, then the rows left (one of `tail_tiles(tile,
    weight_t)`, by the caller's padding) as one tile of their own. `shapes`: `_block_shapes` of
    `weight_t`, where the caller has them already (a few µs a call, on the decode's hot path)."""
    count = rows.shape[0]
    whole = count - count % tile
    bulk = tile
    if count >= tile * min(BULK_MULTIPLES):
        bulk = _bulk_tile(tile, shapes or _block_shapes((weight_t,)))
    if whole == count and bulk == tile:
        return tiled_mm(rows, weight_t, out, tile)
    if out is None:
        out = rows.new_empty(count, weight_t.shape[1])
    in_bulk = count - count % bulk
    for start, end, size in ((0, in_bulk, bulk), (in_bulk, whole, tile), (whole, count, count - whole)):
        if end > start:
            tiled_mm(rows[start:end], weight_t, out[start:end], size)
    return out


@functools.lru_cache(maxsize=256)
def _row_tile(base: int, shapes: tuple) -> int:
    for tile in range(base, base * TILE_MULTIPLES + 1, base):
        if all(_rows_alike(tile, *shape) for shape in shapes):
            if tile != base:
                log.info(
                    "invariant numerics: %d-row tiles for %s (the library's %d-row tiles are not)", tile, shapes, base
                )
            return tile
    log.warning(
        "invariant numerics: the matrix library computes rows of every tile of %d to %d rows differently by "
        "their place in it for %s; multiplying one row at a time (slower)",
        base,
        base * TILE_MULTIPLES,
        shapes,
    )
    return 1


def _check_operands(
    rows: int, depth: int, width: int, dtype: torch.dtype, column_major: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Operands for the tile checks, made on the host (the tiles are the CPU's kernel) from a
    fixed seed (the global generator untouched): rows [rows, depth] and a weight [depth, width]
    in this dtype, as `tiled_mm` takes it in this layout. Their products cancel in pairs: K is
    paired at random, each pair's second element repeating the first with the weight negated,
    so each exact sum is 0 and the kernel returns the rounding of its partial sums, which
    spread magnitudes (2^-8..2^8) make round at almost every add. Two different orders of the
    sum then almost never give the same bits, even rounded to bf16, where sums of plain random
    bf16 products (each exact in fp32) often come out exact in any order. Pairs at random places,
    not two halves of K, so that no kernel's split of K sums to an exact 0 in every order."""
    generator = torch.Generator().manual_seed(seed)

    def spread(*shape: int) -> torch.Tensor:
        scale = torch.exp2(torch.randint(-8, 9, shape, generator=generator, device="cpu").float())
        return torch.randn(*shape, generator=generator, device="cpu") * scale

    weight, x = spread(depth, width), spread(rows, depth)
    pairs = torch.randperm(depth, generator=generator, device="cpu")
    first, second = pairs[: depth // 2], pairs[depth // 2 : 2 * (depth // 2)]
    weight[second], x[:, second] = -weight[first], x[:, first]
    x[:, pairs[2 * (depth // 2) :]] = 0  # an odd K's unpaired product would stand alone
    weight, x = weight.to(dtype), x.to(dtype)
    return x, (weight.t().contiguous().t() if column_major else weight)


@functools.lru_cache(maxsize=1024)
def _rows_alike(tile: int, depth: int, width: int, dtype: torch.dtype, column_major: bool, precision: str) -> bool:
    """Whether `tiled_mm` with `tile`-row tiles against a [depth, width] weight of this dtype and
    layout gives each row the same bits wherever it sits in its tile and whether it comes alone
    or beside another tile (`_check_operands`), under the CPU's float32 matmul `precision` in
    effect (`_block_shapes`: a key of the cache)."""
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        rows, weight_t = _check_operands(2 * tile, depth, width, dtype, column_major, tile * 7919 + depth * 31 + width)
        full = tiled_mm(rows, weight_t, tile=tile)
        if not torch.equal(tiled_mm(rows[:tile], weight_t, tile=tile), full[:tile]):
            return False
        return all(
            torch.equal(tiled_mm(rows.roll(shift, 0), weight_t, tile=tile), full.roll(shift, 0))
            for shift in range(1, tile)
        )


@functools.lru_cache(maxsize=1024)
def _rows_as_in(
    small: int, tile: int, depth: int, width: int, dtype: torch.dtype, column_major: bool, precision: str
) -> bool:
    """Whether `tiled_mm` with one `small`-row tile gives each of its rows the bits that
    `tile`-row tiles give it, wherever the row sits in either, against a [depth, width] weight
    of this dtype and layout (`_check_operands`), under the CPU's float32 matmul `precision` in
    effect (a key of the cache): every place of the small tile is tried with 2 * tile / small different
    rows."""
    seed = small * 104729 + tile * 7919 + depth * 31 + width
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        rows, weight_t = _check_operands(2 * tile, depth, width, dtype, column_major, seed)
        full = tiled_mm(rows, weight_t, tile=tile)
        return all(
            torch.equal(tiled_mm(rows[start : start + small], weight_t, tile=small), full[start : start + small])
            for start in range(0, 2 * tile, small)
        )


def tiled_mm(
    rows: torch.Tensor, weight_t: torch.Tensor, out: torch.Tensor | None = None, tile: int = ROW_TILE
) -> torch.Tensor:
    """rows @ weight_t as tiles of one shape per column block, on one thread: [M, K] @ [K, N].

    Tiles are [tile, K] x [K, C], C set by K and the dtype (`BLOCK_BYTES`; the last block of a
    weight may be narrower, the same for every call on it). Going block by block keeps a block
    of a large weight (an output head) in cache while every row tile passes; tile by tile, the
    whole weight would stream from memory once per tile of rows. A weight of fewer than
    MIN_COLUMNS columns is padded with zero columns. `rows` must have a multiple of `tile` rows;
    `out` ([M, N]) is written if given."""
    depth, columns = weight_t.shape
    if columns < MIN_COLUMNS:
        result = tiled_mm(rows, F.pad(weight_t, (0, MIN_COLUMNS - columns)), tile=tile)[:, :columns]
        return result if out is None else out.copy_(result)
    block_columns = _block_columns(depth, weight_t.dtype)
    tiles = rows.view(-1, tile, depth)
    if out is None:
        out = rows.new_empty(rows.shape[0], columns)
    out_tiles = out.view(tiles.shape[0], tile, columns)
    with one_thread():
        for start in range(0, columns, block_columns):
            block = weight_t[:, start : start + block_columns]
            into = out_tiles if block.shape[1] == columns else out_tiles[:, :, start : start + block_columns]
            if rows.dtype == torch.float32:  # MKL's batched GEMM: one call for all tiles
                torch.bmm(tiles, block.expand(tiles.shape[0], *block.shape), out=into)
            else:  # oneDNN is ~10x slower on a batch whose weight repeats (stride 0): one call per tile
                for tile_rows, tile_out in zip(tiles, into):
                    torch.mm(tile_rows, block, out=tile_out)
    return out


def expert_tile(gate_up: torch.Tensor, down: torch.Tensor) -> int:
    """The rows of the experts' tiles (`row_tile` from EXPERT_ROW_TILE): gate_up [E, 2I, H],
    down [E, H, I], as the experts multiply by them."""
    return row_tile(EXPERT_ROW_TILE, gate_up[0].t(), down[0].t())


def expert_tail_tiles(tile: int, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[int, ...]:
    """`tail_tiles` of the experts' `tile` (`expert_tile`) against both of their weights."""
    return tail_tiles(tile, gate_up[0].t(), down[0].t())


def _linear_forward(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [M, K] @ weight [N, K].T by the invariant kernel of the rows' device: the Triton
    matmul on CUDA (`invariant_triton`), tiles of ROW_TILE rows on the CPU (`row_tile`), the
    rows left in a tail tile (`tail_tiles`)."""
    if invariant_triton.applies(rows):
        return invariant_triton.matmul(rows, weight)
    weight_t = weight.t()
    shapes = _block_shapes((weight_t,))  # once: row_tile, tail_tiles and bulk_tile are lookups by it
    tile = _row_tile(ROW_TILE, shapes)
    count = padded_rows(rows.shape[0], tile, _tail_tiles(tile, shapes))
    return tiled_rows_mm(_pad_rows(rows, count), weight_t, tile=tile, shapes=shapes)[: rows.shape[0]]


class _Linear(torch.autograd.Function):
    """x @ weight.T by `_linear_forward`; the backward is the plain one (only the forward must be
    invariant)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _linear_forward(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.mm(weight) if ctx.needs_input_grad[0] else None
        grad_weight = grad.t().mm(x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T, batch-invariant (`_linear_forward`). Under autocast both operands are cast
    first, as nn.Linear's would be (casting the expanded weight would copy it once per tile)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
    rows = x.reshape(-1, x.shape[-1])
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad):
            out = _Linear.apply(rows, weight)
        else:  # decoding: skip the autograd.Function's bookkeeping
            out = _linear_forward(rows, weight)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def mean_last(x: torch.Tensor) -> torch.Tensor:
    """x.mean(-1, keepdim=True), never split across threads (a lone row is reduced beside a copy):
    the CPU's; on CUDA the norm that needs it is one kernel (`invariant_triton.rms_norm`)."""
    if x.numel() != x.shape[-1]:
        return x.mean(-1, keepdim=True)
    return torch.stack([x, x]).mean(-1, keepdim=True)[0]


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x). On the CPU computed in fp32 as x / (1 + exp(-x)), in x's dtype (torch's
    vectorised body and scalar tail differ); torch's own on CUDA, whose kernel computes every
    element the same way."""
    if x.device.type == "cuda":
        return F.silu(x)
    x32 = x.float()
    return (x32 / (1.0 + torch.exp(-x32))).to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """As `silu`: 1 / (1 + exp(-x)) in fp32 on the CPU, torch's own on CUDA."""
    if x.device.type == "cuda":
        return torch.sigmoid(x)
    x32 = x.float()
    return (1.0 / (1.0 + torch.exp(-x32))).to(x.dtype)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row, largest first, ties in index order: a stable sort, whose
    order is defined by the values alone. `topk` picks among equal values by its algorithm, which
    torch chooses by the tensor's shape (bf16 router logits tie often enough to matter)."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension in fp32, row by row."""
    if invariant_triton.applies(x):
        return invariant_triton.softmax(x)
    return torch.softmax(x, dim=-1, dtype=torch.float32)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dimension in fp32, row by row."""
    if invariant_triton.applies(x):
        return invariant_triton.log_softmax(x)
    return torch.log_softmax(x, dim=-1, dtype=torch.float32)


def moe_combine(expert_out: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """sum_j gates[:, j] * expert_out[:, j], added in fp32 in top-k order (slot 0 first): on CUDA
    one kernel (`invariant_triton.moe_combine`), elsewhere slot by slot."""
    if invariant_triton.applies(expert_out):
        return invariant_triton.moe_combine(expert_out, gates)
    gates = gates.float().unsqueeze(-1)
    out = expert_out[:, 0].float() * gates[:, 0]
    for slot in range(1, expert_out.shape[1]):
        out = out + expert_out[:, slot].float() * gates[:, slot]
    return out.to(expert_out.dtype)


@functools.lru_cache(maxsize=64)
def _query_rows(group: int, length: int, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows (g, t) of a kv head, padded to `count` rows with copies of row 0 (any real row
    works: their results are dropped): (row index, position t of each row)."""
    rows = group * length
    with torch.inference_mode(False):  # cached: normal tensors, usable by an engine and a trainer alike
        index = torch.arange(count, device=device)
        index[rows:] = 0
        return index, index % length


class _Attention(torch.autograd.Function):
    """`attention` on the CPU's tiles; the backward is torch's attention's, run again on the
    inputs in fp32 (only the forward must be invariant): the tiles' dozen small ops per 16 query
    rows, differentiated op by op, cost the trainer more than the forward, and their saved
    probabilities [rows, keys] more memory than the inputs."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        ctx.save_for_backward(q, k, v, mask)
        return _tiled_attention(q, k, v, mask)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, mask = ctx.saved_tensors
        inputs = [t.detach().float().requires_grad_(needed) for t, needed in zip((q, k, v), ctx.needs_input_grad)]
        with torch.enable_grad(), torch.autocast(q.device.type, enabled=False):
            out = F.scaled_dot_product_attention(*inputs, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            grads = iter(torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad.float()))
        q_grad, k_grad, v_grad = (
            next(grads).to(t.dtype) if t_in.requires_grad else None for t, t_in in zip((q, k, v), inputs)
        )
        return q_grad, k_grad, v_grad, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention in fp32, by fixed tiles, reduced over keys in fixed chunks.

    q [B, Hq, T, D]; k, v [B, Hkv, S, D] where key j sits at absolute position j (the caches and
    a full forward both index keys that way); mask [B, 1, T, S] (True = may attend), or None for
    causal attention over the same T tokens. Returns [B, Hq, T, D] in q's dtype.

    The query rows of a kv head ((g, t) pairs, padded to whole tiles of ROW_TILE, as `row_tile`
    checks it for these shapes, and a tail tile, `tail_tiles`) are taken a tile at a time. Each
    block's scores against each chunk of KEY_CHUNK keys is one [tile, D] x [D, KEY_CHUNK]
    matmul; the softmax
    subtracts the row's max (exact in any order); each chunk's probabilities are summed (a row
    reduction of KEY_CHUNK) and multiplied with its values as one [tile, KEY_CHUNK] x
    [KEY_CHUNK, D] matmul; the chunks are added in key order at the end.
    """
    if invariant_triton.applies(q):
        return invariant_triton.attention(q, k, v, mask)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, mask)
    return _tiled_attention(q, k, v, mask)


def _tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`attention` on the CPU (no autograd: `_Attention` differentiates it)."""
    batch, q_heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    with torch.autocast(q.device.type, enabled=False):
        if mask is None:
            mask = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril().expand(batch, 1, length, keys)
        missing = -keys % KEY_CHUNK
        if missing:  # zero keys at the end, never attended
            k, v = F.pad(k, (0, 0, 0, missing)), F.pad(v, (0, 0, 0, missing))
            mask = F.pad(mask, (0, missing), value=False)
        chunks = (keys + missing) // KEY_CHUNK
        # Tiles of keys and values: [B * Hkv * chunks, KEY_CHUNK, D].
        key_tiles = k.float().reshape(-1, KEY_CHUNK, dim).transpose(1, 2)
        value_tiles = v.float().reshape(-1, KEY_CHUNK, dim)
        # A head narrower than MIN_COLUMNS gets zero columns, as `tiled_mm` pads a narrow weight:
        # the P·V product is then the shape `row_tile` checks (with 6 or 10 output columns MKL
        # sums a row by its place in the tile, AVX2), and the extra columns are dropped at the end.
        width = max(dim, MIN_COLUMNS)
        if width != dim:
            value_tiles = F.pad(value_tiles, (0, width - dim))
        tiles = key_tiles.shape[0]
        tile = row_tile(ROW_TILE, key_tiles[0], value_tiles[0])
        rows = group * length
        count = padded_rows(rows, tile, tail_tiles(tile, key_tiles[0], value_tiles[0]))
        index, positions = _query_rows(group, length, count, q.device)
        queries = (q.float() * dim**-0.5).reshape(batch, kv_heads, rows, dim)
        if count > rows:
            queries = queries.index_select(2, index)
        weight_parts, out_parts = [], []
        for start in range(0, count, tile):
            size = min(tile, count - start)  # a whole tile, or the tail tile
            block = queries[:, :, start : start + size].unsqueeze(2).expand(-1, -1, chunks, -1, -1)
            with one_thread():
                scores = torch.bmm(block.reshape(tiles, size, dim), key_tiles)
            # [B, Hkv, chunks, size, KEY_CHUNK], and the mask of these rows in that layout.
            scores = scores.view(batch, kv_heads, chunks, size, KEY_CHUNK)
            visible = mask.index_select(2, positions[start : start + size])
            visible = visible.view(batch, 1, size, chunks, KEY_CHUNK).transpose(2, 3)
            scores = torch.where(visible, scores, float("-inf"))
            peak = scores.amax(dim=(2, 4), keepdim=True).detach()  # the result does not depend on it
            peak = peak.masked_fill(peak == float("-inf"), 0.0)  # a row that sees no key: all its probs 0
            probs = torch.exp(scores - peak)
            weight_parts.append(probs.sum(dim=-1, keepdim=True))
            with one_thread():
                part = torch.bmm(probs.reshape(tiles, size, KEY_CHUNK), value_tiles)
            out_parts.append(part.view(batch, kv_heads, chunks, size, width))
        # [B, Hkv, chunks, rows, 1] and [B, Hkv, chunks, rows, width], then added in key order.
        weight_parts = torch.cat(weight_parts, dim=3)
        out_parts = torch.cat(out_parts, dim=3)
        total, out = weight_parts[:, :, 0], out_parts[:, :, 0]
        for chunk in range(1, chunks):
            total = total + weight_parts[:, :, chunk]
            out = out + out_parts[:, :, chunk]
        out = (out / total.masked_fill(total == 0, 1.0))[:, :, :rows, :dim]  # a row that sees no key is 0, as in SDPA
    return out.reshape(batch, q_heads, length, dim).to(q.dtype)
