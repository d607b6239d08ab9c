"""Batch-invariant kernels: a row's result does not depend on the other rows of the batch.

What varies with the batch on this CPU (measured; see docs/consistency.md) and what we do:

- MKL's fp32 GEMM takes another code path (another summation order) for fewer than 4 rows, and
  with 2 threads for 5..11 rows; from 4 rows up in multiples of 4 a row's result is the same
  for any row count, column count or thread count. So every matmul pads its rows up to a
  multiple of ROW_TILE with zeros (a copy only when the count is not already one; the MoE
  experts pad each expert's group of tokens the same way, `experts.py`).
- GEMM also splits the reduced dimension (K) into blocks whose size depends on K, so a sum over
  keys of a longer sequence is ordered differently. Attention therefore reduces over keys in
  fixed chunks of KEY_CHUNK absolute positions (the matmul's K is always KEY_CHUNK) and adds
  the chunks up one after the other, in order. Masked keys contribute exact zeros, so the
  chunks after a query's own position change nothing: a one-token decode over a long KV cache
  and a full forward over the sequence give the same bits.
- F.silu and torch.sigmoid take a vectorised path and a scalar path (tails of a row, thread
  boundaries) that differ in the last bit; torch.exp does not. SiLU and sigmoid are written
  with exp, so each element's value no longer depends on where it sits in the tensor.
- A reduction over a single row wider than torch's grain size (32768) is split across threads;
  a lone row is reduced beside a copy of itself.

Norms, softmaxes and log-softmaxes are already computed one row at a time by torch's CPU kernels
(measured: any row count, 1 or 2 threads), in fp32.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ROW_TILE = 4
"""Matmul row counts are padded to a multiple of this."""
KEY_CHUNK = 128
"""Attention adds keys up in chunks of this many absolute positions. Any fixed size is exact
(every chunk's matmul has this K); of 32, 64 and 128, 128 was the fastest here."""


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    missing = -x.shape[0] % ROW_TILE
    return torch.cat([x, x.new_zeros(missing, x.shape[1])]) if missing else x


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T with the rows of x padded to a multiple of ROW_TILE (autocast applies as usual)."""
    rows = x.reshape(-1, x.shape[-1])
    out = F.linear(_pad_rows(rows), weight)
    return out[: rows.shape[0]].view(*x.shape[:-1], weight.shape[0])


def mean_last(x: torch.Tensor) -> torch.Tensor:
    """x.mean(-1, keepdim=True), never split across threads (a lone row is reduced beside a copy)."""
    if x.numel() != x.shape[-1]:
        return x.mean(-1, keepdim=True)
    return torch.stack([x, x]).mean(-1, keepdim=True)[0]


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), computed in fp32 as x / (1 + exp(-x)), in x's dtype."""
    x32 = x.float()
    return (x32 / (1.0 + torch.exp(-x32))).to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (1.0 / (1.0 + torch.exp(-x32))).to(x.dtype)


def moe_combine(expert_out: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """sum_j gates[:, j] * expert_out[:, j], added in fp32 in top-k order (slot 0 first)."""
    gates = gates.float().unsqueeze(-1)
    out = expert_out[:, 0].float() * gates[:, 0]
    for slot in range(1, expert_out.shape[1]):
        out = out + expert_out[:, slot].float() * gates[:, slot]
    return out.to(expert_out.dtype)


@functools.lru_cache(maxsize=64)
def _query_rows(group: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows (g, t) of a kv head, padded to a multiple of ROW_TILE with copies of row 0
    (any real row works: their results are dropped): (row index, position t of each row)."""
    rows = group * length
    with torch.inference_mode(False):  # cached: normal tensors, which the trainer's backward may save
        index = torch.arange(rows + -rows % ROW_TILE)
        index[rows:] = 0
        return index, index % length


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention in fp32, reduced over keys in fixed chunks of absolute positions.

    q [B, Hq, T, D]; k, v [B, Hkv, S, D] where key j sits at absolute position j (the caches and
    a full forward both index keys that way); mask [B, 1, T, S] (True = may attend), or None for
    causal attention over the same T tokens. Returns [B, Hq, T, D] in q's dtype.

    The scores of one query row come from a matmul whose rows are padded (ROW_TILE) and whose K
    is the head dim: the same bits for any batch. The softmax subtracts the row's max (exact in
    any order), the probabilities of each KEY_CHUNK keys are summed and multiplied with their
    values as fixed-size pieces, and the pieces are added in key order.
    """
    batch, q_heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    with torch.autocast("cpu", enabled=False):
        if mask is None:
            mask = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril().expand(batch, 1, length, keys)
        missing = -keys % KEY_CHUNK
        if missing:  # zero keys at the end, never attended
            k, v = F.pad(k, (0, 0, 0, missing)), F.pad(v, (0, 0, 0, missing))
            mask = F.pad(mask, (0, missing), value=False)
        chunks = (keys + missing) // KEY_CHUNK
        # Rows are (query head within the group, position), padded: [B, Hkv, rows, D].
        rows = group * length
        index, positions = _query_rows(group, length)
        queries = (q.float() * dim**-0.5).reshape(batch, kv_heads, rows, dim)
        if index.numel() > rows:
            queries = queries.index_select(2, index)
        visible = mask.index_select(2, positions)  # [B, 1, rows, S]
        scores = torch.where(visible, torch.matmul(queries, k.float().transpose(-1, -2)), float("-inf"))
        peak = scores.amax(dim=-1, keepdim=True).detach()  # the result does not depend on it
        probs = torch.exp(scores - peak)
        # Per chunk: [B, Hkv, chunks, rows, KEY_CHUNK] probabilities against [.., KEY_CHUNK, D] values.
        probs = probs.view(batch, kv_heads, -1, chunks, KEY_CHUNK).transpose(2, 3)
        values = v.float().view(batch, kv_heads, chunks, KEY_CHUNK, dim)
        weight_parts = probs.sum(dim=-1, keepdim=True)
        out_parts = torch.matmul(probs, values)
        total, out = weight_parts[:, :, 0], out_parts[:, :, 0]
        for chunk in range(1, chunks):  # in key order
            total = total + weight_parts[:, :, chunk]
            out = out + out_parts[:, :, chunk]
        out = (out / total)[:, :, :rows]
    return out.reshape(batch, q_heads, length, dim).to(q.dtype)
