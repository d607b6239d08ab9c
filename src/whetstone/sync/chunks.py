"""Chunks: the unit of storage, transfer, checksum and parallel work of a version.

A version's tensors are laid end to end and cut into chunks of at most `chunk_elements` values,
so memory stays bounded by (workers x chunk) however large the model, and chunks encode, upload,
download and decode independently. A chunk object is

    MAGIC | u32 header length | header (JSON: one entry per segment) | segment payloads

and its CRC-32 and size are recorded in the version's manifest, checked before anything decodes.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import torch

from whetstone.sync.bits import int_view, numpy_int_type
from whetstone.sync.codec import FULL, CorruptDataError, Decoded, decode_segment, encode_segment

MAGIC = b"WSYNC1\n"


@dataclass(frozen=True)
class Segment:
    """Values [start, stop) of the flattened tensor `tensor`."""

    tensor: str
    start: int
    stop: int


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
    header, payloads, changed = [], [], 0
    for seg in segments:
        tensor = new[seg.tensor]
        is_float = tensor.is_floating_point()
        new_bits = int_view(tensor)[seg.start : seg.stop]
        base = old.get(seg.tensor) if old is not None else None
        same_layout = base is not None and base.dtype == tensor.dtype and base.shape == tensor.shape
        old_bits = int_view(base)[seg.start : seg.stop] if same_layout else None
        coded = encode_segment(new_bits, old_bits, is_float, level)
        changed += coded.changed
        header.append({"tensor": seg.tensor, "start": seg.start, "stop": seg.stop, "encoding": coded.encoding,
                       "count": coded.count, "length": len(coded.payload), **coded.fields})
        payloads.append(coded.payload)
    head = json.dumps({"segments": header}, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + b"".join(payloads), changed


def read_header(blob: bytes) -> tuple[list[dict], int]:
    """The segment entries of a chunk object and the offset of its first payload."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 4:
        raise CorruptDataError("chunk does not start with the weight-sync magic bytes")
    (head_length,) = struct.unpack_from("<I", blob, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        segments = json.loads(blob[start : start + head_length])["segments"]
    except (ValueError, KeyError, TypeError):
        raise CorruptDataError("chunk header is not valid JSON") from None
    return segments, start + head_length


def decode_chunk(
    blob: bytes, base: dict[str, torch.Tensor] | None, dtypes: dict[str, torch.dtype]
) -> list[tuple[Segment, Decoded]]:
    """Decode every segment, in chunk order.

    `base` holds the tensors the deltas were coded against; `dtypes` the new version's dtypes.
    """
    segments, offset = read_header(blob)
    decoded = []
    for entry in segments:
        try:
            name, start, stop, length = entry["tensor"], entry["start"], entry["stop"], entry["length"]
            encoding, count = entry["encoding"], entry["count"]
            fields = {k: entry[k] for k in ("gap_bytes", "step_bytes", "gap_length") if k in entry}
        except (KeyError, TypeError):
            raise CorruptDataError(f"chunk header entry {entry!r} is missing fields") from None
        if name not in dtypes:
            raise CorruptDataError(f"chunk codes tensor {name!r}, which the manifest does not list")
        payload = blob[offset : offset + length]
        if len(payload) != length:
            raise CorruptDataError(f"chunk is truncated inside tensor {name!r}")
        offset += length
        dtype = dtypes[name]
        old = None
        if encoding != FULL:
            if base is None or name not in base or base[name].dtype != dtype or base[name].numel() < stop:
                raise CorruptDataError(f"delta for tensor {name!r} has no matching tensor in the base")
            old = int_view(base[name])[start:stop]
        is_float = dtype.is_floating_point
        values = decode_segment(encoding, count, payload, fields, old, stop - start, numpy_int_type(dtype), is_float)
        decoded.append((Segment(name, start, stop), values))
    return decoded
