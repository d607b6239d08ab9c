"""A preallocated KV cache with one slot per running sequence, for continuous batching.

The engine keeps running sequences packed in slots 0..B-1 (a finishing sequence's slot is
refilled by moving the last one down), so a decode step over all of them attends to a plain
view of the pool: no gather and no copy of the cache per step. The cache lives on the engine's
device.

It speaks the model's cache protocol (`whetstone/model/cache.py`): `begin(positions)` once per
forward, then `update(layer, k, v)` per attention layer, which writes the new keys/values at
their positions first and returns everything to attend to plus the causal mask.

How far a forward attends (`span`) comes from the caller, who knows each sequence's length on
the host: nothing here reads positions back from the device, so a forward over the cache can be
captured in a CUDA graph (the engine's static decode passes a fixed span per graph). The
attended length is rounded up to a multiple of `block` positions (`ATTENTION_BLOCK` by default):
CPU attention kernels sum in an order that depends on the key length, so a sequence would
otherwise get slightly different logits depending on the longest sequence sharing its batch.
Masked keys add exact zeros, so rounding changes nothing else. Invariant numerics attend in
chunks of `invariant.KEY_CHUNK` keys; the engine then rounds to that, so no chunk is padded by
a copy.
"""

from __future__ import annotations

import torch

ATTENTION_BLOCK = 32


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        block: int = ATTENTION_BLOCK,
        device: torch.device | str = "cpu",
    ):
        max_len = -(-max_len // block) * block
        shape = (num_layers, slots, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.slots, self.max_len, self.block = slots, max_len, block
        self.key_positions = torch.arange(max_len, device=device)
        """0..max_len-1, for the causal masks."""
        self.row_index = torch.arange(slots, device=device).unsqueeze(1)
        """[slots, 1]: a forward's batch rows, broadcast against its positions [B, T]."""

    @classmethod
    def for_model(
        cls,
        cfg,
        slots: int,
        max_len: int,
        dtype: torch.dtype,
        block: int = ATTENTION_BLOCK,
        device: torch.device | str = "cpu",
    ) -> "SlotKVCache":
        """A cache shaped for a `whetstone.model.ModelConfig`."""
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, slots, max_len, dtype, block, device)

    def rows(self, first: int, count: int, span: int) -> "SlotRows":
        """The cache as seen by a forward over slots first..first+count-1 (one batch row each)
        whose positions are all below `span`: it attends to the first `span` positions, rounded
        up to whole blocks."""
        if first < 0 or first + count > self.slots:
            raise IndexError(f"slots {first}..{first + count - 1} outside 0..{self.slots - 1}")
        if not 0 < span <= self.max_len:
            raise IndexError(f"span {span} outside 1..{self.max_len} (the cache length)")
        return SlotRows(self, first, count, -(-span // self.block) * self.block)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (to keep slots packed,
        or to start a sequence with another's prefix)."""
        self.keys[:, dst, :, :length] = self.keys[:, src, :, :length]
        self.values[:, dst, :, :length] = self.values[:, src, :, :length]


class SlotRows:
    """A contiguous range of slots implementing the model's KV-cache protocol, attending to the
    first `length` positions."""

    def __init__(self, cache: SlotKVCache, first: int, count: int, length: int):
        self.cache, self.first, self.count, self.length = cache, first, count, length
        self._positions: torch.Tensor | None = None

    def begin(self, positions: torch.Tensor) -> None:
        if positions.shape[0] != self.count:
            raise ValueError(f"positions has {positions.shape[0]} rows, cache view has {self.count}")
        self._positions = positions
        # key j is visible to the query at position p iff j <= p (earlier positions are written)
        self._mask = (self.cache.key_positions[: self.length] <= positions.unsqueeze(-1)).unsqueeze(1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        assert self._positions is not None, "begin(positions) must be called before update()"
        end = self.first + self.count
        keys = self.cache.keys[layer, self.first : end]
        values = self.cache.values[layer, self.first : end]
        rows = self.cache.row_index[: self.count]
        # advanced indices [B, T] around a slice put the new axes first: [B, T, heads, dim]
        keys[rows, :, self._positions] = k.transpose(1, 2).to(keys.dtype)
        values[rows, :, self._positions] = v.transpose(1, 2).to(values.dtype)
        return keys[:, :, : self.length], values[:, :, : self.length], self._mask
