"""Chunks: the unit of storage, transfer, checksum and parallel work of a version.

A version's tensors are laid end to end and cut into chunks of at most `chunk_elements` values,
so memory stays bounded by (workers x chunk) however large the model, and chunks encode, upload,
download and decode independently. Inside a chunk, segments are coded in blocks:

- one `sparse` block per dtype holds every segment coded as a delta, their values laid end to
  end: one pair of zstd frames and one set of numpy passes per chunk, not per tensor (a model
  has as many biases and norms as matrices);
- except a dense delta run (more than `_TRY_XOR_ABOVE` of its values changed: 35% of 1-byte
  values, 60% of wider ones; a run is one large segment, or the chunk's small segments of a
  dtype together) that codes smaller as `xor` than as `sparse` on its own: it gets an `xor`
  block of its own. The choice is per run, not per tensor: a tensor spanning chunks is chosen
  for chunk by chunk, and small tensors share one choice;
- segments without a base are `full`: a large one alone, the small ones of a dtype together.

A chunk object is

    MAGIC | u32 header length | header (JSON: one entry per block) | block payloads

and its CRC-32 and size are recorded in the version's manifest, checked before anything decodes.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from whetstone.sync.bits import int_view, numpy_int_type
from whetstone.sync.codec import (
    FULL,
    SPARSE,
    XOR,
    CorruptDataError,
    Decoded,
    Encoded,
    apply_steps,
    decode_full,
    decode_sparse,
    decode_xor,
    encode_full,
    encode_sparse,
    encode_xor,
    find_changes,
    step_codes,
)

MAGIC = b"WSYNC3\n"
# WSYNC2 chunks are WSYNC3 chunks without `xor` blocks: still read. (WSYNC2 readers reject
# WSYNC3 chunks by their magic rather than failing on an unknown block.)
_READABLE = (MAGIC, b"WSYNC2\n")
# Segments shorter than this are scanned (or coded whole) together with the chunk's other short
# segments of their dtype: a fixed cost per numpy call dwarfs the work on a 384-value bias.
_SHARE_BELOW = 1 << 16
# A delta run is also tried as `xor` when more than this fraction of its values changed, by
# value width in bytes. Measured (values re-initialised at the same scale, where xor does best;
# on optimizer steps it never won): xor wins from ~43% changed in fp8, ~65-70% in bf16/fp16,
# over 75% in fp32. So neither lr 1e-6 RL steps (~2% changed) nor lr 3e-4 ones (47-57% of a
# bf16 matrix) pay for trying it.
_TRY_XOR_ABOVE = {1: 0.35, 2: 0.6, 4: 0.6, 8: 0.6}
_XOR_SAMPLE = 1 << 12


@dataclass(frozen=True)
class Segment:
    """Values [start, stop) of the flattened tensor `tensor`."""

    tensor: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def plan_chunks(sizes: list[tuple[str, int]], chunk_elements: int) -> list[list[Segment]]:
    """Cut tensors (name, number of values), in order, into chunks of at most `chunk_elements`."""
    chunks: list[list[Segment]] = [[]]
    room = chunk_elements
    for name, numel in sizes:
        start = 0
        while start < numel or (numel == 0 and start == 0):
            if room == 0:
                chunks.append([])
                room = chunk_elements
            stop = min(numel, start + room)
            chunks[-1].append(Segment(name, start, stop))
            room -= stop - start
            start = stop
            if numel == 0:
                break
    return [chunk for chunk in chunks if chunk]


def checksum(data: bytes) -> str:
    return f"crc32:{zlib.crc32(data):08x}"


def encode_chunk(
    segments: list[Segment], new: dict[str, torch.Tensor], old: dict[str, torch.Tensor] | None, level: int
) -> tuple[bytes, int]:
    """Code the segments of `new` against `old` (tensors absent from `old`, or of another dtype or
    shape, are coded whole). Returns the chunk object and the number of changed values."""
    deltas, wholes = _group(segments, new, old)
    blocks = [(run, encode_full(_bits_of(run, new), level)) for runs in wholes for run in runs]
    changed = sum(seg.size for run, _ in blocks for seg in run)
    for runs in deltas:
        for block in _encode_deltas(runs, new, old, level):
            blocks.append(block)
            changed += block[1].count
    header = [
        {
            "segments": [[s.tensor, s.start, s.stop] for s in segs],
            "encoding": coded.encoding,
            "count": coded.count,
            "length": len(coded.payload),
            **coded.fields,
        }
        for segs, coded in blocks
    ]
    head = json.dumps({"blocks": header}, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + b"".join(coded.payload for _, coded in blocks), changed


Runs = list[list[Segment]]


def _group(segments, new, old) -> tuple[list[Runs], list[Runs]]:
    """Per dtype, the runs of segments coded as a delta and those coded whole. A run is one large
    segment, or all the small ones together (one scan, one copy of a few thousand values)."""
    deltas: dict[torch.dtype, Runs] = {}
    wholes: dict[torch.dtype, Runs] = {}
    for seg in segments:
        tensor, base = new[seg.tensor], None if old is None else old.get(seg.tensor)
        with_base = base is not None and base.dtype == tensor.dtype and base.shape == tensor.shape
        runs = (deltas if with_base else wholes).setdefault(tensor.dtype, [[]])
        if seg.size < _SHARE_BELOW:
            runs[0].append(seg)
        else:
            runs.append([seg])
    return _without_empty_runs(deltas), _without_empty_runs(wholes)


def _without_empty_runs(groups: dict[torch.dtype, Runs]) -> list[Runs]:
    return [[run for run in runs if run] for runs in groups.values()]


def _encode_deltas(runs: Runs, new, old, level: int) -> list[tuple[list[Segment], Encoded]]:
    """The delta blocks of a dtype: one sparse block for the runs laid end to end (positions
    count in the block), and a block of its own for each dense run that codes smaller as xor.
    A dense run that does not stays in the shared block: one frame codes better than several."""
    is_float = new[runs[0][0].tensor].is_floating_point()
    blocks, shared, positions, codes, first = [], [], [], [], 0
    for run in runs:
        new_bits, old_bits = _bits_of(run, new), _bits_of(run, old)
        found, new_found, old_found = find_changes(new_bits, old_bits)
        steps = step_codes(new_found, old_found, is_float)
        if found.size > _TRY_XOR_ABOVE[new_bits.itemsize] * new_bits.size:
            xor = _xor_if_smaller(new_bits, old_bits, found, steps, level)
            if xor is not None:
                blocks.append((run, xor))
                continue
        if first:
            found += first
        first += new_bits.size
        shared.extend(run)
        positions.append(found)
        codes.append(steps)
    if shared:
        blocks.append((shared, encode_sparse(_laid_end_to_end(positions), _laid_end_to_end(codes), level)))
    return blocks


def _xor_if_smaller(new_bits, old_bits, found, steps, level: int) -> Encoded | None:
    """The run's xor coding if it is smaller than its sparse one. The run's first 1/16 (at least
    `_XOR_SAMPLE` values) is coded both ways first, and the rest only if xor wins there: where
    sparse wins (optimizer steps, however dense) trying costs 1/16 of coding the run twice."""
    sample = max(_XOR_SAMPLE, new_bits.size // 16)
    if sample < new_bits.size:
        in_sample = int(np.searchsorted(found, sample))
        xor = encode_xor(new_bits[:sample], old_bits[:sample], in_sample, level)
        if len(xor.payload) >= len(encode_sparse(found[:in_sample], steps[:in_sample], level).payload):
            return None
    xor = encode_xor(new_bits, old_bits, found.size, level)
    return xor if len(xor.payload) < len(encode_sparse(found, steps, level).payload) else None


def _bits_of(run: list[Segment], tensors: dict[str, torch.Tensor]) -> np.ndarray:
    return _laid_end_to_end([int_view(tensors[seg.tensor])[seg.start : seg.stop] for seg in run])


def _laid_end_to_end(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def read_header(blob: bytes) -> tuple[list[dict], int]:
    """The block entries of a chunk object and the offset of its first payload."""
    if not blob.startswith(_READABLE) or len(blob) < len(MAGIC) + 4:
        raise CorruptDataError("chunk does not start with the weight-sync magic bytes (or is of another format)")
    (head_length,) = struct.unpack_from("<I", blob, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        blocks = json.loads(blob[start : start + head_length])["blocks"]
    except (ValueError, KeyError, TypeError):
        raise CorruptDataError("chunk header is not valid JSON") from None
    if not isinstance(blocks, list) or not all(isinstance(entry, dict) for entry in blocks):
        raise CorruptDataError(f"chunk header does not list its blocks: {str(blocks)[:200]}")
    return blocks, start + head_length


def decode_chunk(
    blob: bytes,
    base: dict[str, torch.Tensor] | None,
    dtypes: dict[str, torch.dtype],
    numels: dict[str, int] | None = None,
) -> list[tuple[Segment, Decoded]]:
    """Decode every segment of a chunk. A `Decoded`'s indices are flat indices into its tensor
    (int64), or None when it carries all the segment's values.

    `base` holds the tensors the deltas were coded against; `dtypes` the new version's dtypes, and
    `numels` their numbers of values (from the manifest): a segment past its tensor's end is refused
    before its block decodes, since a whole block decodes into as many values as its segments say.
    """
    blocks, offset = read_header(blob)
    view = memoryview(blob)
    decoded = []
    for entry in blocks:
        try:
            segments = [Segment(str(name), int(start), int(stop)) for name, start, stop in entry["segments"]]
            encoding, count, length = entry["encoding"], int(entry["count"]), int(entry["length"])
        except (KeyError, TypeError, ValueError):
            raise CorruptDataError(f"chunk header entry {str(entry)[:200]} is malformed") from None
        dtype = _block_dtype(segments, dtypes, numels)
        payload = view[offset : offset + length]
        if len(payload) != length:
            raise CorruptDataError(f"chunk is truncated inside the block of tensor {segments[0].tensor!r}")
        offset += length
        size = sum(seg.size for seg in segments)
        if encoding == SPARSE:
            old = [_base_bits(base, seg, dtype) for seg in segments]
            with _naming(segments):
                positions, codes = decode_sparse(count, payload, entry, size, np.dtype(f"u{dtype.itemsize}"))
            decoded.extend(_sparse_pieces(segments, old, positions, codes, dtype.is_floating_point))
        elif encoding == XOR:
            old = [_base_bits(base, seg, dtype) for seg in segments]
            with _naming(segments):
                flips = decode_xor(payload, size, numpy_int_type(dtype))
            decoded.extend(_xor_pieces(segments, old, flips, count))
        elif encoding == FULL:
            with _naming(segments):
                values = decode_full(payload, size, numpy_int_type(dtype))
            firsts = np.cumsum([0] + [seg.size for seg in segments]).tolist()
            decoded.extend((seg, Decoded(None, values[lo:hi])) for seg, lo, hi in zip(segments, firsts, firsts[1:]))
        else:
            raise CorruptDataError(f"unknown block encoding {encoding!r}")
    return decoded


@contextmanager
def _naming(segments: list[Segment]) -> Iterator[None]:
    """A block's payload that does not decode, named by its tensors: the codec knows only bytes."""
    try:
        yield
    except CorruptDataError as err:
        names = [seg.tensor for seg in segments]
        named = ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise CorruptDataError(f"block of tensor{'s' if len(names) > 1 else ''} {named}: {err}") from None


def _block_dtype(segments: list[Segment], dtypes: dict[str, torch.dtype], numels: dict[str, int] | None) -> torch.dtype:
    if not segments:
        raise CorruptDataError("chunk header has a block without segments")
    for seg in segments:
        if seg.tensor not in dtypes:
            raise CorruptDataError(f"chunk codes tensor {seg.tensor!r}, which the manifest does not list")
        if not 0 <= seg.start <= seg.stop:
            raise CorruptDataError(f"chunk codes values [{seg.start}, {seg.stop}) of tensor {seg.tensor!r}")
        if numels is not None and seg.stop > numels.get(seg.tensor, seg.stop):
            raise CorruptDataError(
                f"chunk codes values [{seg.start}, {seg.stop}) of tensor {seg.tensor!r}, which has {numels[seg.tensor]}"
            )
        if dtypes[seg.tensor] != dtypes[segments[0].tensor]:
            raise CorruptDataError(f"chunk codes tensors of different dtypes in one block: {seg.tensor!r}")
    return dtypes[segments[0].tensor]


def _base_bits(base: dict[str, torch.Tensor] | None, seg: Segment, dtype: torch.dtype) -> np.ndarray:
    """All the bits of the base tensor a segment's delta was coded against."""
    tensor = None if base is None else base.get(seg.tensor)
    if tensor is None or tensor.dtype != dtype or tensor.numel() < seg.stop:
        raise CorruptDataError(f"delta for tensor {seg.tensor!r} has no matching tensor in the base")
    return int_view(tensor)


def _sparse_pieces(segments, old: list[np.ndarray], positions, codes, is_float) -> list[tuple[Segment, Decoded]]:
    """Per segment: its changes' tensor indices, and the old values there gathered into one
    array for the whole block, which is then stepped at once."""
    indices, cuts, old_values = _gather_old(segments, old, positions)
    values = apply_steps(old_values, codes, is_float)
    return [(seg, Decoded(index, values[lo:hi])) for seg, index, lo, hi in zip(segments, indices, cuts, cuts[1:])]


def _xor_pieces(segments, old: list[np.ndarray], flips: np.ndarray, count: int) -> list[tuple[Segment, Decoded]]:
    """As `_sparse_pieces`, the changed values of an xor block: where its bits flip."""
    positions = np.flatnonzero(flips)
    if positions.size != count:
        raise CorruptDataError(
            f"xor block of tensor {segments[0].tensor!r} changes {positions.size} values, its header says {count}"
        )
    indices, cuts, values = _gather_old(segments, old, positions)
    values ^= flips.take(positions)
    return [(seg, Decoded(index, values[lo:hi])) for seg, index, lo, hi in zip(segments, indices, cuts, cuts[1:])]


def _gather_old(segments, old: list[np.ndarray], positions) -> tuple[list[np.ndarray], list[int], np.ndarray]:
    """Block positions to each segment's tensor indices, where the block's positions of each
    segment start (`cuts`), and the old values at all the positions in one array."""
    firsts = np.cumsum([0] + [seg.size for seg in segments]).tolist()  # each segment's place in the block
    cuts = np.searchsorted(positions, firsts).tolist()
    old_values = np.empty(positions.size, dtype=old[0].dtype)
    indices = []
    for seg, old_bits, first, lo, hi in zip(segments, old, firsts, cuts, cuts[1:]):
        index = positions[lo:hi] + (seg.start - first) if seg.start != first else positions[lo:hi]
        np.take(old_bits, index, out=old_values[lo:hi])
        indices.append(index)
    return indices, cuts, old_values
