"""KV cache protocol and a simple preallocated cache for a fixed batch.

The protocol the model speaks (any object with these two methods works, e.g. an inference
engine's slot cache for continuous batching):

    cache.begin(positions)                    # once per forward; positions [B, T_new]
    k_all, v_all, mask = cache.update(layer_index, k, v)   # once per attention layer

k, v are [B, n_kv_heads, T_new, head_dim], after RoPE and k-norm. The cache stores them at the
given positions and returns what to attend to: keys/values [B, n_kv_heads, S, head_dim] and a
boolean mask [B, 1, T_new, S], True where key position <= query position and has been written.
Rows may be at different positions (ragged decoding).
"""

from __future__ import annotations

import torch

from whetstone.errors import WhetstoneError
from whetstone.model.config import ModelConfig


class KVCache:
    """Preallocated keys/values for `batch_size` rows of up to `max_len` positions each, on
    `device` (the model's: positions given to a forward must be there too)."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.written = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.max_len = max_len
        self._positions: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def reset(self, rows: list[int] | None = None) -> None:
        """Forget what `rows` (default: all) hold, so they can start new sequences."""
        self.written[slice(None) if rows is None else rows] = False

    def begin(self, positions: torch.Tensor) -> None:
        batch = self.written.shape[0]
        if positions.shape[0] != batch:
            raise WhetstoneError(f"cache holds {batch} rows, forward has {positions.shape[0]}")
        # The positions' range, read back once per forward: it is checked, and it sets how many
        # key positions attention spans (only the prefix that can be in use, not the buffer).
        low, high = torch.stack(torch.aminmax(positions)).tolist() if positions.numel() else (0, -1)
        if low < 0 or high >= self.max_len:
            raise WhetstoneError(f"positions span [{low}, {high}], cache holds 0..{self.max_len - 1}")
        self._positions = positions
        self._rows = torch.arange(batch, device=positions.device).unsqueeze(1)
        self.written.scatter_(1, positions, True)
        # What every layer attends to in this forward: written keys at or before each query.
        key_positions = torch.arange(high + 1, device=positions.device)
        self._mask = ((key_positions <= positions.unsqueeze(-1)) & self.written[:, None, : high + 1]).unsqueeze(1)

    def update(self, layer_index: int, k: torch.Tensor, v: torch.Tensor):
        positions, rows, mask = self._positions, self._rows, self._mask
        span = mask.shape[-1]
        # Advanced indices (rows, positions) around a slice put their dims first: [B, T, Hkv, D].
        self.keys[layer_index][rows, :, positions] = k.transpose(1, 2).to(self.keys.dtype)
        self.values[layer_index][rows, :, positions] = v.transpose(1, 2).to(self.values.dtype)
        keys = self.keys[layer_index, :, :, :span].to(k.dtype)
        values = self.values[layer_index, :, :, :span].to(v.dtype)
        return keys, values, mask
