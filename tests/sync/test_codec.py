"""The codec is lossless for every dtype and every bit pattern, and picks the cheaper coding."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from whetstone.sync.bits import int_view, numpy_int_type, ordered, unzigzag, zigzag
from whetstone.sync.codec import FULL, SPARSE, XOR, CorruptDataError, decode_segment, encode_segment

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.int64]


def roundtrip(new: torch.Tensor, old: torch.Tensor | None, level: int = 3) -> tuple[str, torch.Tensor]:
    new_bits = int_view(new)
    old_bits = None if old is None else int_view(old)
    coded = encode_segment(new_bits, old_bits, new.dtype.is_floating_point, level)
    decoded = decode_segment(coded.encoding, coded.count, coded.payload, coded.fields, old_bits, new_bits.size,
                             numpy_int_type(new.dtype), new.dtype.is_floating_point)
    if decoded.indices is None:
        bits = decoded.values
    else:
        bits = old_bits.copy()
        bits[decoded.indices] = decoded.values
    return coded.encoding, torch.from_numpy(bits).view(new.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return np.array_equal(int_view(a), int_view(b))


@st.composite
def tensor_pairs(draw):
    """Old and new tensors of one dtype from arbitrary bit patterns (NaN payloads, infinities,
    -0.0, subnormals all included), with an arbitrary subset of positions changed."""
    dtype = draw(st.sampled_from(DTYPES))
    size = draw(st.integers(0, 300))
    width = dtype.itemsize
    old_bytes = draw(st.binary(min_size=size * width, max_size=size * width))
    new_bytes = draw(st.binary(min_size=size * width, max_size=size * width))
    changed = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    int_type = numpy_int_type(dtype)
    old = np.frombuffer(old_bytes, dtype=int_type).copy()
    new = old.copy()
    mask = np.array(changed, dtype=bool)
    new[mask] = np.frombuffer(new_bytes, dtype=int_type)[mask]
    return torch.from_numpy(new).view(dtype), torch.from_numpy(old).view(dtype)


@settings(max_examples=150, deadline=None)
@given(tensor_pairs())
def test_decode_of_encode_is_the_new_tensor_bit_for_bit(pair):
    new, old = pair
    assert same_bits(roundtrip(new, old)[1], new)
    assert same_bits(roundtrip(new, None)[1], new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2])
def test_special_values_survive(dtype):
    specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0]
    if dtype != torch.float8_e4m3fn:
        specials += [torch.finfo(dtype).tiny / 4, -torch.finfo(dtype).tiny / 4]  # subnormals
    old = torch.tensor(specials, dtype=torch.float32).to(dtype)
    new = torch.tensor(specials[::-1], dtype=torch.float32).to(dtype)
    assert same_bits(roundtrip(new, old)[1], new)
    # A NaN with a different payload is a different value and must come back exactly.
    nan_bits = int_view(new).copy()
    nan_bits[new.float().isnan().numpy()] ^= 1
    odd_nan = torch.from_numpy(nan_bits).view(dtype)
    assert same_bits(roundtrip(odd_nan, new)[1], odd_nan)


def test_ordered_bits_follow_float_order_and_steps_count_representable_values():
    values = torch.tensor([float("-inf"), -2.0, -1e-40, -0.0, 0.0, 1e-40, 1.0, 2.0, float("inf")])
    keys = ordered(int_view(values), True)
    assert (np.diff(keys.astype(np.int64)) > 0).all()
    bits = int_view(torch.tensor([1.0, 1.0078125], dtype=torch.bfloat16))  # 1 + 2**-7: one bf16 step
    assert int(ordered(bits, True)[1]) - int(ordered(bits, True)[0]) == 1


def test_zigzag_roundtrip_including_extremes():
    steps = np.array([0, -1, 1, -2, 2, -32768, 32767], dtype=np.int16)
    assert zigzag(steps).tolist() == [0, 1, 2, 3, 4, 65535, 65534]
    assert np.array_equal(unzigzag(zigzag(steps)), steps)


def test_few_changes_code_sparse_and_small():
    torch.manual_seed(0)
    old = torch.randn(100_000).bfloat16()
    new = old.clone()
    new[::50] = (old[::50].float() * 1.01).bfloat16()
    coded = encode_segment(int_view(new), int_view(old), True, 3)
    assert coded.encoding == SPARSE and coded.changed == 2000
    assert len(coded.payload) < 2 * old.numel() / 40  # vs 2 bytes per raw bf16 value


def test_mostly_changed_falls_back_to_xor_when_smaller():
    torch.manual_seed(0)
    old = torch.randn(50_000).bfloat16()
    new = torch.randn(50_000).bfloat16()
    encoding, decoded = roundtrip(new, old)
    assert encoding == XOR and same_bits(decoded, new)
    assert roundtrip(new, None)[0] == FULL


def test_a_corrupt_payload_is_rejected_not_misdecoded():
    old = torch.randn(10_000).bfloat16()
    new = old.clone()
    new[::10] = 0
    coded = encode_segment(int_view(new), int_view(old), True, 3)
    broken = bytearray(coded.payload)
    broken[len(broken) // 3] ^= 0xFF
    with pytest.raises(CorruptDataError):
        decode_segment(SPARSE, coded.count, bytes(broken[: len(broken) // 2]), coded.fields,
                       int_view(old), old.numel(), np.int16, True)
