"""The codec is lossless for every dtype and every bit pattern, and small where RL deltas are."""

import json
import struct
from unittest.mock import patch

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from whetstone.sync import chunks, codec
from whetstone.sync.bits import int_view, numpy_int_type, ordered, to_planes, unzigzag, zigzag
from whetstone.sync.chunks import decode_chunk, encode_chunk, plan_chunks, read_header
from whetstone.sync.codec import (
    CorruptDataError,
    apply_steps,
    decode_sparse,
    encode_sparse,
    encode_xor,
    find_changes,
    step_codes,
)

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
]


def roundtrip(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor] | None, chunk_elements: int = 1 << 20):
    """Encode `new` against `old` chunk by chunk, decode, and rebuild the tensors from the pieces."""

    def start_from(name, tensor):
        base = (old or {}).get(name)
        same = base is not None and base.shape == tensor.shape and base.dtype == tensor.dtype
        return base.clone() if same else torch.zeros_like(tensor)

    rebuilt = {name: start_from(name, tensor) for name, tensor in new.items()}
    dtypes = {name: t.dtype for name, t in new.items()}
    for segments in plan_chunks([(name, t.numel()) for name, t in new.items()], chunk_elements):
        blob, _ = encode_chunk(segments, new, old, level=1)
        for segment, decoded in decode_chunk(blob, old, dtypes):
            bits = int_view(rebuilt[segment.tensor])
            if decoded.indices is None:
                bits[segment.start : segment.stop] = decoded.values
            else:
                assert ((decoded.indices >= segment.start) & (decoded.indices < segment.stop)).all()
                bits[decoded.indices] = decoded.values
    return rebuilt


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(int_view(a), int_view(b))


@st.composite
def tensor_pair(draw, dtype):
    """Old and new tensors from arbitrary bit patterns (NaN payloads, infinities, -0.0, subnormals
    all included), with an arbitrary subset of positions changed."""
    size = draw(st.integers(0, 300))
    int_type = numpy_int_type(dtype)
    nbytes = size * dtype.itemsize
    old = np.frombuffer(draw(st.binary(min_size=nbytes, max_size=nbytes)), int_type)
    changes = np.frombuffer(draw(st.binary(min_size=nbytes, max_size=nbytes)), int_type)
    mask = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)), dtype=bool)
    new = np.where(mask, changes, old)
    return torch.from_numpy(new.copy()).view(dtype), torch.from_numpy(old.copy()).view(dtype)


@st.composite
def states(draw):
    """A few tensors of mixed dtypes and sizes, and a base that lacks one of them."""
    names = [f"t{i}" for i in range(draw(st.integers(1, 4)))]
    pairs = {name: draw(tensor_pair(draw(st.sampled_from(DTYPES)))) for name in names}
    new = {name: pair[0] for name, pair in pairs.items()}
    old = {name: pair[1] for name, pair in pairs.items() if name != names[-1] or draw(st.booleans())}
    return new, old


@settings(max_examples=60, deadline=None)
@given(states(), st.integers(20, 400), st.integers(1, 200), st.sampled_from([0.0, None, 1.0]))
def test_decode_of_encode_is_the_new_state_bit_for_bit(state, chunk_elements, share_below, try_xor_above):
    new, old = state
    # Small constants so that tiny tensors cross scan blocks, share runs or go alone, and span
    # chunks; xor tried on every run that changed (0.0: it wins on many of these small random
    # ones), at the shipped thresholds, or never.
    thresholds = {} if try_xor_above is None else dict.fromkeys((1, 2, 4, 8), try_xor_above)
    with (
        patch.object(codec, "_SCAN_BLOCK", 64),
        patch.object(chunks, "_SHARE_BELOW", share_below),
        patch.dict(chunks._TRY_XOR_ABOVE, thresholds),
    ):
        for base in (old, None):
            rebuilt = roundtrip(new, base, chunk_elements)
            assert all(same_bits(rebuilt[name], new[name]) for name in new)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_special_values_survive(dtype):
    specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0]
    if dtype != torch.float8_e4m3fn:
        specials += [torch.finfo(dtype).tiny / 4, -torch.finfo(dtype).tiny / 4]  # subnormals
    old = torch.tensor(specials, dtype=torch.float32).to(dtype)
    new = torch.tensor(specials[::-1], dtype=torch.float32).to(dtype)
    assert same_bits(roundtrip({"w": new}, {"w": old})["w"], new)
    # A NaN with a different payload is a different value and must come back exactly.
    nan_bits = int_view(new).copy()
    nan_bits[new.float().isnan().numpy()] ^= 1
    odd_nan = torch.from_numpy(nan_bits).view(dtype)
    assert same_bits(roundtrip({"w": odd_nan}, {"w": new})["w"], odd_nan)


@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.02, 0.3, 1.0])
@pytest.mark.parametrize("size", [1, 7, 8, 63, 64, 65, 1000])
def test_find_changes_agrees_with_a_plain_comparison(fraction, size):
    """Across scan blocks, word padding, and both the sparse and the dense search."""
    rng = np.random.default_rng(size)
    old = rng.integers(-(2**15), 2**15, size, dtype=np.int16)
    new = old.copy()
    new[rng.random(size) < fraction] ^= 1
    with patch.object(codec, "_SCAN_BLOCK", 64):
        positions, new_values, old_values = find_changes(new, old)
    expected = np.flatnonzero(new != old)
    assert positions.dtype == np.int64 and np.array_equal(positions, expected)
    assert np.array_equal(new_values, new[expected]) and np.array_equal(old_values, old[expected])


def test_ordered_bits_follow_float_order_and_steps_count_representable_values():
    values = torch.tensor([float("-inf"), -2.0, -1e-40, -0.0, 0.0, 1e-40, 1.0, 2.0, float("inf")])
    keys = ordered(int_view(values), True)
    assert (np.diff(keys.astype(np.int64)) > 0).all()
    bits = int_view(torch.tensor([1.0, 1.0078125], dtype=torch.bfloat16))  # 1 + 2**-7: one bf16 step
    assert int(ordered(bits, True)[1]) - int(ordered(bits, True)[0]) == 1
    assert np.array_equal(ordered(keys, True), int_view(values))  # its own inverse


def test_zigzag_roundtrip_including_extremes():
    steps = np.array([0, -1, 1, -2, 2, -32768, 32767], dtype=np.int16)
    assert zigzag(steps).tolist() == [0, 1, 2, 3, 4, 65535, 65534]
    assert np.array_equal(unzigzag(zigzag(steps)), steps)


def test_steps_are_applied_by_integer_arithmetic_exactly():
    old = int_view(torch.tensor([1.0, -1.0, 0.0, -0.0, float("inf")], dtype=torch.bfloat16)).copy()
    new = int_view(torch.tensor([1.0078125, -1.0078125, -0.0, 1e-40, float("nan")], dtype=torch.bfloat16)).copy()
    codes = step_codes(new.copy(), old.copy(), is_float=True)
    assert codes[:2].tolist() == [2, 1]  # one representable value up (+1 -> 2), one down (-1 -> 1)
    assert np.array_equal(apply_steps(old.copy(), codes, is_float=True), new)


def test_few_changes_code_sparse_and_small():
    torch.manual_seed(0)
    old = torch.randn(100_000).bfloat16()
    new = old.clone()
    new[::50] = (old[::50].float() * 1.01).bfloat16()
    positions, new_values, old_values = find_changes(int_view(new), int_view(old))
    coded = encode_sparse(positions, step_codes(new_values, old_values, True), level=1)
    assert coded.count == 2000
    assert len(coded.payload) < 2 * old.numel() / 40  # vs 2 bytes per raw bf16 value


def test_even_when_every_value_changes_the_steps_beat_xor():
    """Why xor is only a fallback: weights moved by an optimizer step, even all of them, code
    smaller as steps than as old XOR new."""
    torch.manual_seed(0)
    old = torch.randn(100_000).bfloat16()
    new = (old.float() * (1 + 0.01 * torch.randn(100_000))).bfloat16()
    positions, new_values, old_values = find_changes(int_view(new), int_view(old))
    sparse = encode_sparse(positions, step_codes(new_values, old_values, True), level=1)
    xor = zstandard.ZstdCompressor(level=1).compress(to_planes(int_view(new) ^ int_view(old)))
    assert positions.size > 0.7 * old.numel() and len(sparse.payload) < len(xor)


def block_encodings(new, old, share_below=None) -> list[str]:
    segments = plan_chunks([(name, t.numel()) for name, t in new.items()], 1 << 20)[0]
    with patch.object(chunks, "_SHARE_BELOW", share_below or chunks._SHARE_BELOW):
        blob, _ = encode_chunk(segments, new, old, level=1)
    return [block["encoding"] for block in read_header(blob)[0]]


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_xor_blocks_are_lossless_for_special_values(dtype):
    """Every value's low bits replaced by random ones (sign and exponent kept, as when weights are
    re-initialised at the same scale): xor wins. Flipping low bits of specials makes NaNs with
    other payloads, NaNs from infinities, subnormals from +-0.0, all of which must come back."""
    rng = np.random.default_rng(0)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40]).to(dtype)
    old_bits = np.concatenate([int_view(specials), int_view((torch.randn(5000) * 0.05).to(dtype))])
    low_bits = (1 << 3 if dtype.itemsize == 1 else 1 << 7) - 1
    new_bits = old_bits ^ rng.integers(1, low_bits + 1, old_bits.size).astype(old_bits.dtype)
    old, new = {"w": torch.from_numpy(old_bits).view(dtype)}, {"w": torch.from_numpy(new_bits).view(dtype)}
    assert block_encodings(new, old, share_below=100) == ["xor"]
    assert same_bits(roundtrip(new, old)["w"], new["w"])


def test_the_smaller_coding_is_chosen_per_run():
    """Unrelated replacement values code as xor, no larger than sparse would; a small optimizer
    step (2% changed, not even tried) and a dense one (all changed, steps win) code as sparse."""
    torch.manual_seed(0)
    old = (torch.randn(100_000) * 0.05).bfloat16()
    replaced = (torch.randn(100_000) * 0.05).bfloat16()
    small_step = old.clone()
    small_step[::50] = (old[::50].float() * 1.01).bfloat16()
    dense_step = (old.float() * (1 + 0.01 * torch.randn(100_000))).bfloat16()
    assert block_encodings({"w": replaced}, {"w": old}) == ["xor"]
    assert block_encodings({"w": small_step}, {"w": old}) == ["sparse"]
    assert block_encodings({"w": dense_step}, {"w": old}) == ["sparse"]
    positions, new_values, old_values = find_changes(int_view(replaced), int_view(old))
    sparse = encode_sparse(positions, step_codes(new_values, old_values, True), level=1)
    xor = encode_xor(int_view(replaced), int_view(old), positions.size, level=1)
    assert len(xor.payload) <= len(sparse.payload)
    # Small tensors share one choice: a replaced bias and a barely moved one code as one block.
    tensors, base = {"a": replaced[:1000], "b": small_step[:200]}, {"a": old[:1000], "b": old[:200]}
    assert block_encodings(tensors, base) == ["xor"]
    rebuilt = roundtrip(tensors, base)
    assert same_bits(rebuilt["a"], tensors["a"]) and same_bits(rebuilt["b"], tensors["b"])


def test_an_xor_block_whose_changes_disagree_with_its_header_is_rejected():
    old = {"w": torch.zeros(100).bfloat16()}
    new = {"w": torch.randn(100).bfloat16()}
    blob, _ = encode_chunk(plan_chunks([("w", 100)], 1000)[0], new, old, level=1)
    blocks, offset = read_header(blob)
    assert blocks[0]["encoding"] == "xor"
    blocks[0]["count"] -= 1
    head = json.dumps({"blocks": blocks}).encode()
    forged = chunks.MAGIC + struct.pack("<I", len(head)) + head + blob[offset:]
    with pytest.raises(CorruptDataError, match="header says"):
        decode_chunk(forged, old, {"w": torch.bfloat16})


def test_a_corrupt_payload_is_rejected_not_misdecoded():
    positions = np.array([3, 10, 11, 40], dtype=np.int64)
    coded = encode_sparse(positions, np.array([2, 1, 2, 4], dtype=np.uint16), level=1)
    u16 = np.dtype(np.uint16)
    assert decode_sparse(coded.count, coded.payload, coded.fields, 41, u16)[0].tolist() == positions.tolist()
    with pytest.raises(CorruptDataError, match="not increasing"):  # the last change beyond the block
        decode_sparse(coded.count, coded.payload, coded.fields, 40, u16)
    with pytest.raises(CorruptDataError):  # a truncated frame
        decode_sparse(coded.count, coded.payload[: len(coded.payload) // 2], coded.fields, 41, u16)
    with pytest.raises(CorruptDataError, match="out of range"):
        decode_sparse(coded.count, coded.payload, {**coded.fields, "step_bytes": 3}, 41, u16)
    repeated = encode_sparse(np.array([3, 3], dtype=np.int64), np.array([2, 2], dtype=np.uint16), level=1)
    with pytest.raises(CorruptDataError, match="not increasing"):  # the same position twice
        decode_sparse(repeated.count, repeated.payload, repeated.fields, 41, u16)


def test_a_frame_that_would_decode_past_its_block_is_refused_before_decoding():
    """A zstd bomb: a frame of a few KB (or a header alone) declaring far more than the block's
    size. zstd would allocate what the header says; the decoder refuses it unread."""
    expected = 20 * np.dtype(np.int16).itemsize  # a block of 20 bf16 values
    inflating = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))  # 64 MB of zeros, ~2 KB
    assert len(inflating) < 10_000
    empty_block = b"\x01\x00\x00"  # the last block, raw, of no bytes
    header_only = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", 1 << 50) + empty_block  # 1 PiB
    for frame in (inflating, header_only):
        with pytest.raises(
            CorruptDataError,
            match=f"zstd frame declares {zstandard.frame_content_size(frame)} bytes, expected {expected}",
        ):
            codec.decode_full(frame, 20, np.int16)
    exact = zstandard.ZstdCompressor(level=1).compress(bytes(expected))  # declares its true size: fine
    assert not codec.decode_full(exact, 20, np.int16).any()
