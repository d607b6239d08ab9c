import pytest
import torch

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
    w = [(seg.start + values.indices).tolist() for seg, values in decoded["w"]]
    assert sum(w, []) == [1, 17, 29]
    assert decoded["fresh"][0][1].indices is None  # new tensor: carried whole


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
