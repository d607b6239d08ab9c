"""A preallocated KV cache with one slot per running sequence, for continuous batching.

The engine keeps running sequences packed in slots 0..B-1 (a finishing sequence's slot is
refilled by moving the last one down), so a decode step over all of them attends to a plain
view of the pool: no gather and no copy of the cache per step.

It speaks the model's cache protocol (`whetstone/model/cache.py`): `begin(positions)` once per
forward, then `update(layer, k, v)` per attention layer, which writes the new keys/values at
their positions first and returns everything to attend to plus the causal mask.

The attended length is rounded up to a multiple of `block` positions (`ATTENTION_BLOCK` by
default): CPU attention kernels sum in an order that depends on the key length, so a sequence
would otherwise get slightly different logits depending on the longest sequence sharing its
batch. Masked keys add exact zeros, so rounding changes nothing else. Invariant numerics attend
in chunks of `invariant.KEY_CHUNK` keys; the engine then rounds to that, so no chunk is padded
by a copy.
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
    ):
        max_len = -(-max_len // block) * block
        shape = (num_layers, slots, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)
        self.slots, self.max_len, self.block = slots, max_len, block

    @classmethod
    def for_model(
        cls, cfg, slots: int, max_len: int, dtype: torch.dtype, block: int = ATTENTION_BLOCK
    ) -> "SlotKVCache":
        """A cache shaped for a `whetstone.model.ModelConfig`."""
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, slots, max_len, dtype, block)

    def rows(self, first: int, count: int) -> "SlotRows":
        """The cache as seen by a forward over slots first..first+count-1 (one batch row each)."""
        if first < 0 or first + count > self.slots:
            raise IndexError(f"slots {first}..{first + count - 1} outside 0..{self.slots - 1}")
        return SlotRows(self, first, count)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (to keep slots packed,
        or to start a sequence with another's prefix)."""
        self.keys[:, dst, :, :length] = self.keys[:, src, :, :length]
        self.values[:, dst, :, :length] = self.values[:, src, :, :length]


class SlotRows:
    """A contiguous range of slots implementing the model's KV-cache protocol."""

    def __init__(self, cache: SlotKVCache, first: int, count: int):
        self.cache, self.first, self.count = cache, first, count
        self._positions: torch.Tensor | None = None

    def begin(self, positions: torch.Tensor) -> None:
        if positions.shape[0] != self.count:
            raise ValueError(f"positions has {positions.shape[0]} rows, cache view has {self.count}")
        end = int(positions.max()) + 1
        if end > self.cache.max_len:
            raise IndexError(f"position {end - 1} beyond the cache length {self.cache.max_len}")
        block = self.cache.block
        length = -(-end // block) * block
        self._positions = positions
        self._rows = torch.arange(self.count).unsqueeze(1)  # [B, 1], broadcasts against [B, T]
        self._length = length
        # key j is visible to the query at position p iff j <= p (earlier positions are written)
        self._mask = (torch.arange(length) <= positions.unsqueeze(-1)).unsqueeze(1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        assert self._positions is not None, "begin(positions) must be called before update()"
        end = self.first + self.count
        keys = self.cache.keys[layer, self.first : end]
        values = self.cache.values[layer, self.first : end]
        # advanced indices [B, T] around a slice put the new axes first: [B, T, heads, dim]
        keys[self._rows, :, self._positions] = k.transpose(1, 2).to(keys.dtype)
        values[self._rows, :, self._positions] = v.transpose(1, 2).to(values.dtype)
        return keys[:, :, : self._length], values[:, :, : self._length], self._mask
