"""Weights as integers: every tensor is coded through a signed-integer view of its bits.

No floating-point arithmetic touches a weight anywhere in sync. A float's bits are mapped to an
integer whose order is the float's order (`ordered`), so "the new value is 1 representable step
above the old one" is the integer difference 1, and decoding adds integers, then maps back: the
result is the new value's exact bit pattern, NaN payloads, infinities, -0.0 and subnormals
included (the mapping is a bijection on bit patterns).
"""

from __future__ import annotations

import numpy as np
import torch

from whetstone.errors import WhetstoneError

_INT_VIEW = {
    1: (torch.int8, np.int8),
    2: (torch.int16, np.int16),
    4: (torch.int32, np.int32),
    8: (torch.int64, np.int64),
}

# Dtypes sync can carry, by the name written in manifests.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _NAMES:
        raise WhetstoneError(f"weight sync cannot carry dtype {dtype}; supported: {', '.join(DTYPES)}")
    return _NAMES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise WhetstoneError(f"unknown dtype {name!r} in weight store; supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def int_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bits as a flat signed-integer numpy array (no copy if contiguous).
    One torch view only: each torch view costs microseconds, and models have many tensors."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.view(_INT_VIEW[tensor.element_size()][0]).numpy().reshape(-1)


def from_int_view(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `int_view`: a flat tensor of `dtype` sharing the integers' memory."""
    return torch.from_numpy(np.ascontiguousarray(bits)).view(dtype)


def numpy_int_type(dtype: torch.dtype) -> type[np.signedinteger]:
    return _INT_VIEW[dtype.itemsize][1]


def ordered(bits: np.ndarray, is_float: bool, in_place: bool = False) -> np.ndarray:
    """Map float bits (sign-magnitude) to integers in the floats' order; its own inverse.

    Negative floats get every bit but the sign flipped, so larger magnitudes sort lower.
    Integers (two's complement) are already ordered.
    """
    if not is_float:
        return bits
    width = bits.dtype.itemsize * 8
    flip = bits >> (width - 1)  # all ones for negative floats
    flip &= bits.dtype.type((1 << (width - 1)) - 1)
    return np.bitwise_xor(bits, flip, out=bits if in_place else None)


def zigzag(steps: np.ndarray, in_place: bool = False) -> np.ndarray:
    """Signed steps to unsigned codes, small magnitudes first: 0, -1, 1, -2, 2 -> 0, 1, 2, 3, 4."""
    sign = steps >> (steps.dtype.itemsize * 8 - 1)  # all ones for negative steps
    codes = np.left_shift(steps, 1, out=steps if in_place else None)
    codes ^= sign
    return codes.view(f"u{steps.dtype.itemsize}")


def unzigzag(codes: np.ndarray, in_place: bool = False) -> np.ndarray:
    negative = codes & 1
    np.negative(negative, out=negative)  # all ones for odd codes (unsigned wrap-around)
    steps = np.right_shift(codes, 1, out=codes if in_place else None)
    steps ^= negative
    return steps.view(f"i{codes.dtype.itemsize}")


def to_planes(values: np.ndarray, nbytes: int | None = None) -> np.ndarray:
    """Byte planes: all lowest bytes, then all next bytes... (the high planes of small numbers
    are nearly constant, which an entropy coder takes for almost nothing). Shifts, not a
    transposing copy: several times faster in numpy."""
    nbytes = nbytes or values.dtype.itemsize
    unsigned = values.view(f"u{values.dtype.itemsize}")
    planes = np.empty((nbytes, values.size), dtype=np.uint8)
    for i in range(nbytes):
        planes[i] = unsigned >> (8 * i) if i else unsigned  # keeps the low byte
    return planes


def from_planes(data: bytes | memoryview, count: int, dtype: np.dtype, nbytes: int | None = None) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = nbytes or dtype.itemsize
    planes = np.frombuffer(data, dtype=np.uint8, count=count * nbytes).reshape(nbytes, count)
    unsigned = np.dtype(f"u{dtype.itemsize}")
    out = planes[0].astype(unsigned)
    for i in range(1, nbytes):
        out |= planes[i].astype(unsigned) << unsigned.type(8 * i)
    return out.view(dtype)


def bytes_needed(max_value: int) -> int:
    return max(1, (int(max_value).bit_length() + 7) // 8)
