"""Lossless coding of integer bits (a tensor segment, or several laid end to end) against old bits.

Three encodings:
- `sparse` (a delta): positions of the changed values as distances (from the start for the
  first, then from the previous change), and each new value as its step from the old one in
  representable values (`ordered` bits, zigzagged). Both are split into byte planes and
  compressed with zstd. Between RL steps ~2% of bf16 weights change and most by one step, so
  both streams are nearly constant bytes. Optimizer steps code smaller this way even when every
  value changes (0.55x to 1.0x the size of old XOR new + zstd, measured at 5% to 100% changed).
- `xor` (a dense delta): old XOR new in byte planes, zstd. It wins only where most values are
  replaced by unrelated ones (weights re-initialised at the same scale: 0.85x-0.98x the sparse
  size, from ~43% changed in fp8, ~65-70% in bf16/fp16, over 75% in fp32; random bits replacing
  values only tie at 100%), so the chunk coder tries it only on dense runs.
- `full`: the new bits in byte planes, zstd (keyframes, and tensors new in this version).

Speed: a delta is found with one comparison pass over the values; everything after it costs
O(changed values), on the narrowest integer type that holds them, in place where possible
(`xor`, tried only on dense runs, costs one more pass over the run).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from whetstone.errors import WhetstoneError
from whetstone.sync.bits import bytes_needed, from_planes, ordered, to_planes, unzigzag, zigzag

SPARSE, XOR, FULL = "sparse", "xor", "full"
# Find changes block by block so the mask and the compared values stay in cache.
_SCAN_BLOCK = 1 << 20

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


def _scan_mask() -> np.ndarray:
    """One change mask per thread, reused for every block (a fresh array per tensor costs page faults)."""
    mask = getattr(_per_thread, "mask", None)
    if mask is None or mask.size != _SCAN_BLOCK:
        mask = _per_thread.mask = np.empty(_SCAN_BLOCK, dtype=bool)
    return mask


class CorruptDataError(WhetstoneError):
    """Coded bytes that do not decode to what their header promises."""


@dataclass
class Encoded:
    encoding: str
    count: int  # values changed (sparse, xor), or values carried (full)
    payload: bytes
    fields: dict[str, int]  # encoding parameters the decoder needs


@dataclass
class Decoded:
    """New values of a segment: at `indices` (int64), or all of it when `indices` is None."""

    indices: np.ndarray | None
    values: np.ndarray


def find_changes(new: np.ndarray, old: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions (int64) where `new` differs from `old`, with the new and old values there.

    numpy's nonzero costs ~15 ns per hit on a sparse mask, more than the comparison itself, so
    hits are found in two steps: the 8-value words of the mask that hold a change (a scan of 8x
    fewer entries), then the changes within those words (dense enough for numpy's branch-free
    path). Values are gathered while their block is still in cache.
    """
    buffer = _scan_mask()
    positions, new_values, old_values = [], [], []
    for start in range(0, new.size, _SCAN_BLOCK):
        new_block, old_block = new[start : start + _SCAN_BLOCK], old[start : start + _SCAN_BLOCK]
        size = new_block.size
        mask = buffer[: -(-size // 8) * 8]  # whole 8-byte words
        mask[size - size % 8 :] = False  # the last word's padding
        np.not_equal(new_block, old_block, out=mask[:size])
        words = mask.view(np.uint64)
        word_changed = words != 0
        if np.count_nonzero(word_changed) * 2 > words.size:  # dense: numpy's own scan is faster
            found = mask.nonzero()[0]
        else:
            hit_words = word_changed.nonzero()[0]
            within = words.take(hit_words).view(np.bool_).nonzero()[0]
            found = hit_words.take(within >> 3)
            found <<= 3
            found |= within & 7
        new_values.append(new_block.take(found))
        old_values.append(old_block.take(found))
        if start:
            found += start
        positions.append(found)
    if len(positions) == 1:
        return positions[0], new_values[0], old_values[0]
    if not positions:
        return np.zeros(0, dtype=np.int64), new[:0].copy(), old[:0].copy()
    return np.concatenate(positions), np.concatenate(new_values), np.concatenate(old_values)


def step_codes(new_values: np.ndarray, old_values: np.ndarray, is_float: bool) -> np.ndarray:
    """Each change as its zigzagged step in representable values (unsigned, same width).
    Works in place: both inputs are overwritten (they are `find_changes`' own copies)."""
    steps = ordered(new_values, is_float, in_place=True)
    steps -= ordered(old_values, is_float, in_place=True)
    return zigzag(steps, in_place=True)


def apply_steps(old_values: np.ndarray, codes: np.ndarray, is_float: bool) -> np.ndarray:
    """Inverse of `step_codes`: the new values, computed in place of `old_values` (and `codes`)."""
    values = ordered(old_values, is_float, in_place=True)
    values += unzigzag(codes, in_place=True)
    return ordered(values, is_float, in_place=True)


def encode_sparse(positions: np.ndarray, codes: np.ndarray, level: int) -> Encoded:
    """Code increasing `positions` (< 2**31) and their step codes."""
    count = int(positions.size)
    if count == 0:
        return Encoded(SPARSE, 0, b"", {"distance_bytes": 1, "step_bytes": 1, "distance_length": 0})
    distances = np.empty(count, dtype=np.uint32)
    distances[0] = positions[0]
    np.subtract(positions[1:], positions[:-1], out=distances[1:], casting="unsafe")
    distance_bytes, step_bytes = bytes_needed(distances.max()), bytes_needed(codes.max())
    zstd = _compressor(level)
    distance_frame = zstd.compress(to_planes(distances, distance_bytes))
    step_frame = zstd.compress(to_planes(codes, step_bytes))
    fields = {"distance_bytes": distance_bytes, "step_bytes": step_bytes, "distance_length": len(distance_frame)}
    return Encoded(SPARSE, count, distance_frame + step_frame, fields)


def decode_sparse(
    count: int, payload: bytes | memoryview, fields: dict[str, int], size: int, code_type: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `encode_sparse`: positions (int64, increasing, < `size`) and step codes."""
    if count == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=code_type)
    try:
        distance_bytes, step_bytes, split = (
            int(fields[key]) for key in ("distance_bytes", "step_bytes", "distance_length")
        )
    except KeyError as missing:
        raise CorruptDataError(f"sparse block header lacks {missing}") from None
    except (TypeError, ValueError):
        raise CorruptDataError(f"sparse block header has a field that is not a number: {str(fields)[:200]}") from None
    if not (1 <= distance_bytes <= 4 and 1 <= step_bytes <= code_type.itemsize and 0 < count <= size):
        raise CorruptDataError(
            f"sparse block header out of range: count={count} distance_bytes={distance_bytes} "
            f"step_bytes={step_bytes} (values of {code_type.itemsize} bytes, block of {size})"
        )
    distance_type = np.uint16 if distance_bytes <= 2 else np.uint32
    distances = from_planes(_unzstd(payload[:split], count * distance_bytes), count, distance_type, distance_bytes)
    positions = np.cumsum(distances, dtype=np.int64)
    if positions[-1] >= size or not distances[1:].all():
        raise CorruptDataError(f"sparse block positions are not increasing within its {size} values")
    codes = from_planes(_unzstd(payload[split:], count * step_bytes), count, code_type, step_bytes)
    return positions, codes


def encode_xor(new: np.ndarray, old: np.ndarray, changed: int, level: int) -> Encoded:
    """Code all of `new` as its XOR with `old` (`changed` values differ: the decoder checks it)."""
    return Encoded(XOR, changed, _compressor(level).compress(to_planes(np.bitwise_xor(new, old))), {})


def decode_xor(payload: bytes | memoryview, size: int, int_type: type) -> np.ndarray:
    """The XOR of old and new bits: nonzero exactly where a value changed."""
    return decode_full(payload, size, int_type)


def encode_full(new: np.ndarray, level: int) -> Encoded:
    return Encoded(FULL, new.size, _compressor(level).compress(to_planes(new)), {})


def decode_full(payload: bytes | memoryview, size: int, int_type: type) -> np.ndarray:
    return from_planes(_unzstd(payload, size * np.dtype(int_type).itemsize), size, int_type)


def _unzstd(frame: bytes | memoryview, expected: int) -> bytes:
    """The `expected` bytes a frame decodes to. A frame whose header declares another size is
    refused before decoding: zstd allocates what the header declares and ignores
    `max_output_size`, so a small frame could otherwise take gigabytes (a zstd bomb)."""
    if expected == 0:
        return b""
    try:
        declared = zstandard.frame_content_size(frame)  # -1: not declared (whetstone's own frames)
        if declared not in (-1, expected):
            raise CorruptDataError(f"zstd frame declares {declared} bytes, expected {expected}")
        data = _decompressor().decompress(frame, max_output_size=expected)
    except zstandard.ZstdError as err:
        raise CorruptDataError(f"zstd frame does not decode: {err}") from None
    if len(data) != expected:
        raise CorruptDataError(f"zstd frame decoded to {len(data)} bytes, expected {expected}")
    return data
