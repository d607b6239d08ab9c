from unittest.mock import patch

import pytest
import torch

from whetstone.sync import chunks
from whetstone.sync.chunks import Segment, decode_chunk, encode_chunk, plan_chunks, read_header
from whetstone.sync.codec import CorruptDataError


def test_plan_cuts_tensors_across_chunks_and_packs_small_ones_together():
    plan = plan_chunks([("a", 5), ("b", 12), ("empty", 0), ("c", 3)], chunk_elements=8)
    assert plan == [
        [Segment("a", 0, 5), Segment("b", 0, 3)],
        [Segment("b", 3, 11)],
        [Segment("b", 11, 12), Segment("empty", 0, 0), Segment("c", 0, 3)],
    ]
    assert all(sum(s.stop - s.start for s in chunk) <= 8 for chunk in plan)


def test_chunks_decode_to_the_new_values_against_the_old():
    torch.manual_seed(0)
    old = {"w": torch.randn(30).bfloat16(), "i": torch.arange(4)}
    new = {"w": old["w"].clone(), "i": old["i"] + 1, "fresh": torch.ones(3, dtype=torch.float16)}
    new["w"][[1, 17, 29]] = 0.5
    dtypes = {k: v.dtype for k, v in new.items()}
    decoded = {}
    for segments in plan_chunks([(k, v.numel()) for k, v in new.items()], chunk_elements=16):
        blob, _ = encode_chunk(segments, new, old, level=3)
        for segment, values in decode_chunk(blob, old, dtypes):
            decoded.setdefault(segment.tensor, []).append((segment, values))
    w = sorted(sum([values.indices.tolist() for _, values in decoded["w"]], []))
    assert w == [1, 17, 29]  # flat indices into the tensor, whichever chunk carried them
    assert decoded["fresh"][0][1].indices is None  # new tensor: carried whole


def test_a_chunk_codes_one_delta_block_per_dtype_and_new_tensors_whole():
    """Per-stream costs are paid per chunk, not per tensor: every bf16 delta (large matrices and
    small biases alike) shares one sparse block; small new tensors share one full block."""
    torch.manual_seed(0)
    old = {
        "a": torch.randn(300).bfloat16(),
        "a.bias": torch.randn(4).bfloat16(),
        "b": torch.randn(200).bfloat16(),
        "b.bias": torch.randn(4).bfloat16(),
        "step": torch.tensor([7]),
    }
    new = {k: v + 1 for k, v in old.items()} | {"fresh": torch.ones(5), "fresh2": torch.zeros(2)}
    segments = plan_chunks([(k, v.numel()) for k, v in new.items()], chunk_elements=10_000)[0]
    # Every value changes here, and on runs this small xor's one frame beats sparse's two: xor
    # off, or each run would get an xor block of its own.
    with patch.object(chunks, "_SHARE_BELOW", 100), patch.dict(chunks._TRY_XOR_ABOVE, dict.fromkeys((1, 2, 4, 8), 1.0)):
        blob, changed = encode_chunk(segments, new, old, level=1)
    blocks = {(b["encoding"], tuple(name for name, _, _ in b["segments"])) for b in read_header(blob)[0]}
    assert blocks == {("full", ("fresh", "fresh2")), ("sparse", ("a.bias", "b.bias", "a", "b")), ("sparse", ("step",))}
    assert changed == sum(v.numel() for v in new.values())


def test_truncated_or_foreign_chunks_are_rejected():
    new = {"w": torch.randn(10).bfloat16()}
    blob, _ = encode_chunk(plan_chunks([("w", 10)], 100)[0], new, None, level=3)
    assert read_header(blob)[0][0]["encoding"] == "full"
    with pytest.raises(CorruptDataError, match="truncated"):
        decode_chunk(blob[:-3], None, {"w": torch.bfloat16})
    with pytest.raises(CorruptDataError, match="magic"):
        decode_chunk(b"PK\x03\x04" + blob, None, {"w": torch.bfloat16})
    with pytest.raises(CorruptDataError, match="does not list"):
        decode_chunk(blob, None, {"other": torch.bfloat16})


def test_chunks_of_the_previous_format_are_still_read():
    """WSYNC2 chunks are WSYNC3 chunks that never hold an xor block."""
    old = {"w": torch.zeros(10).bfloat16()}
    new = {"w": torch.ones(10).bfloat16()}
    blob, _ = encode_chunk(plan_chunks([("w", 10)], 100)[0], new, old, level=1)
    assert blob.startswith(b"WSYNC3\n")
    previous = b"WSYNC2\n" + blob[len(chunks.MAGIC) :]
    assert decode_chunk(previous, old, {"w": torch.bfloat16})[0][1].indices.tolist() == list(range(10))
    with pytest.raises(CorruptDataError, match="magic"):
        decode_chunk(b"WSYNC1\n" + blob[len(chunks.MAGIC) :], old, {"w": torch.bfloat16})


def test_a_delta_needs_its_tensors_in_the_base():
    old = {"w": torch.zeros(10).bfloat16()}
    new = {"w": torch.ones(10).bfloat16()}
    blob, _ = encode_chunk(plan_chunks([("w", 10)], 100)[0], new, old, level=1)
    assert decode_chunk(blob, old, {"w": torch.bfloat16})[0][1].indices.tolist() == list(range(10))
    with pytest.raises(CorruptDataError, match="no matching tensor in the base"):
        decode_chunk(blob, {"w": torch.zeros(4).bfloat16()}, {"w": torch.bfloat16})
    with pytest.raises(CorruptDataError, match="no matching tensor in the base"):
        decode_chunk(blob, None, {"w": torch.bfloat16})
