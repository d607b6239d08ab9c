"""Lossless coding of one tensor segment (a contiguous range of a flat tensor), given the old bits.

Three encodings; the encoder keeps the smallest that applies:
- `sparse`: positions of the changed values as gaps (zero-based distance from the previous
  change), and each new value as its step from the old one in representable values (`ordered`
  bits, zigzagged). Both are split into byte planes and compressed with zstd. Between RL steps
  ~2% of bf16 weights change and most by one step, so both streams are nearly constant bytes.
- `xor`: old XOR new in byte planes, zstd (the fallback when most values change).
- `full`: the new bits in byte planes, zstd (keyframes, and tensors new in this version).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from whetstone.errors import WhetstoneError
from whetstone.sync.bits import bytes_needed, from_planes, ordered, to_planes, unzigzag, zigzag

SPARSE, XOR, FULL = "sparse", "xor", "full"
# Find changes block by block so the boolean mask stays in cache.
_SCAN_BLOCK = 1 << 18
# Below this changed fraction the sparse coding always wins; above it both are tried.
_TRY_XOR_ABOVE = 1 / 8


_per_thread = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """One zstd context per thread and level: creating one costs more than coding a small tensor."""
    cache = _per_thread.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=False, write_checksum=False)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_per_thread, "decompressor"):
        _per_thread.decompressor = zstandard.ZstdDecompressor()
    return _per_thread.decompressor


class CorruptDataError(WhetstoneError):
    """Coded bytes that do not decode to what their header promises."""


@dataclass
class Encoded:
    encoding: str
    count: int  # values changed (sparse), or values carried (xor, full)
    payload: bytes
    fields: dict[str, int]  # encoding parameters the decoder needs
    changed: int  # values that differ from the base (all of them without a base)


@dataclass
class Decoded:
    """New values of a segment: `indices` (relative to the segment start) or None for all of it."""

    indices: np.ndarray | None
    values: np.ndarray


def find_changes(new: np.ndarray, old: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions where `new` differs from `old`, with the new and old values there. Block by
    block, so the values are gathered while the block is still in cache."""
    positions, new_values, old_values = [], [], []
    for i in range(0, new.size, _SCAN_BLOCK):
        new_block, old_block = new[i : i + _SCAN_BLOCK], old[i : i + _SCAN_BLOCK]
        found = np.flatnonzero(new_block != old_block)
        positions.append(found + i)
        new_values.append(new_block[found])
        old_values.append(old_block[found])
    if not positions:
        return np.zeros(0, dtype=np.int64), new[:0], old[:0]
    return np.concatenate(positions), np.concatenate(new_values), np.concatenate(old_values)


def encode_segment(new: np.ndarray, old: np.ndarray | None, is_float: bool, level: int) -> Encoded:
    """Code integer bits `new` against `old` (same shape and dtype; None codes `new` alone)."""
    zstd = _compressor(level)
    if old is None:
        return Encoded(FULL, new.size, zstd.compress(to_planes(new)), {}, new.size)
    positions, new_values, old_values = find_changes(new, old)
    sparse = _encode_sparse(positions, new_values, old_values, is_float, zstd)
    if positions.size > _TRY_XOR_ABOVE * new.size:
        dense = Encoded(XOR, new.size, zstd.compress(to_planes(new ^ old)), {}, positions.size)
        if len(dense.payload) < len(sparse.payload):
            return dense
    return sparse


def _encode_sparse(positions, new_values, old_values, is_float, zstd) -> Encoded:
    if positions.size == 0:
        return Encoded(SPARSE, 0, b"", {"gap_bytes": 1, "step_bytes": 1, "gap_length": 0}, 0)
    gaps = np.empty(positions.size, dtype=np.int64)
    gaps[0] = positions[0]
    np.subtract(positions[1:], positions[:-1], out=gaps[1:])
    gaps[1:] -= 1
    codes = zigzag(ordered(new_values, is_float) - ordered(old_values, is_float))
    gap_bytes, step_bytes = bytes_needed(gaps.max()), bytes_needed(codes.max())
    gap_frame = zstd.compress(to_planes(gaps, gap_bytes))
    step_frame = zstd.compress(to_planes(codes, step_bytes))
    fields = {"gap_bytes": gap_bytes, "step_bytes": step_bytes, "gap_length": len(gap_frame)}
    return Encoded(SPARSE, int(positions.size), gap_frame + step_frame, fields, int(positions.size))


def decode_segment(
    encoding: str, count: int, payload: bytes, fields: dict[str, int],
    old: np.ndarray | None, size: int, int_type: type, is_float: bool,
) -> Decoded:
    """Inverse of `encode_segment`; `old` is the base segment (None for `full`), `size` its length."""
    if encoding == FULL:
        return Decoded(None, from_planes(_unzstd(payload, size * np.dtype(int_type).itemsize), size, int_type))
    if old is None or old.size != size:
        raise CorruptDataError(f"{encoding} segment of {size} values needs a base segment of the same size")
    if encoding == XOR:
        flips = from_planes(_unzstd(payload, size * old.dtype.itemsize), size, int_type)
        positions = np.flatnonzero(flips)
        return Decoded(positions, old[positions] ^ flips[positions])
    if encoding != SPARSE:
        raise CorruptDataError(f"unknown segment encoding {encoding!r}")
    if count == 0:
        return Decoded(np.zeros(0, dtype=np.int64), old[:0].copy())
    gap_bytes, step_bytes, gap_length = fields["gap_bytes"], fields["step_bytes"], fields["gap_length"]
    if not (1 <= gap_bytes <= 4 and 1 <= step_bytes <= old.dtype.itemsize and 0 < count <= size):
        raise CorruptDataError(f"sparse segment header out of range: count={count} fields={fields}")
    # Positions within a segment fit in int32 (chunks hold < 2**31 values): half the memory traffic.
    positions = from_planes(_unzstd(payload[:gap_length], count * gap_bytes), count, np.int32, gap_bytes)
    if gap_bytes == 4 and positions.min() < 0 or int(positions.sum(dtype=np.int64)) + count > size:
        raise CorruptDataError(f"sparse segment positions run past the end of its {size} values")
    positions += 1
    np.cumsum(positions, out=positions)
    positions -= 1
    unsigned = np.dtype(f"u{old.dtype.itemsize}")
    codes = from_planes(_unzstd(payload[gap_length:], count * step_bytes), count, unsigned, step_bytes)
    values = ordered(ordered(old[positions], is_float) + unzigzag(codes), is_float)
    return Decoded(positions, values)


def _unzstd(frame: bytes, expected: int) -> bytes:
    if expected == 0:
        return b""
    try:
        data = _decompressor().decompress(frame, max_output_size=expected)
    except zstandard.ZstdError as err:
        raise CorruptDataError(f"zstd frame does not decode: {err}") from None
    if len(data) != expected:
        raise CorruptDataError(f"zstd frame decoded to {len(data)} bytes, expected {expected}")
    return data
