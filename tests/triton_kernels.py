"""Where the Triton kernels of invariant numerics (`whetstone.model.invariant_triton`) run in
tests: on a CUDA device (tests marked `gpu`), or on the CPU under Triton's interpreter, which
checks their indexing, masking and invariance on any machine with Triton installed.

    @pytest.mark.parametrize("where", WHERE)
    def test_x(where, monkeypatch):
        device, context = kernels(where, monkeypatch)
        with context():
            ...
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from whetstone.model import invariant_triton

WHERE = ["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)]


def _interpreter_dot_in_a_fixed_order(monkeypatch) -> None:
    """Triton's interpreter multiplies tiles with NumPy's matmul, that is the CPU's BLAS, whose
    bits for one row depend on the row's place in the tile and on the buffers' alignment on some
    CPUs (OpenBLAS's Haswell kernels, with FMA), so a kernel the GPU runs batch-invariantly would
    look batch-dependent here. This dot adds the products one depth index at a time, each a
    separate fp32 multiply and add: the same bits for a row wherever it sits. bf16 tiles are
    widened to fp32 first, as the hardware does (the interpreter would multiply their raw 16-bit
    patterns; a product of two bf16 values is exact in fp32)."""
    import triton.language as tl
    from triton.runtime import interpreter

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle.data
        return (handle.data.astype(np.uint32) << 16).view(np.float32)

    def create_dot(self, a, b, d, *args):
        left, right = widened(a), widened(b)
        if left.dtype != np.float32 or right.dtype != np.float32 or left.ndim != 2 or right.ndim != 2:
            raise NotImplementedError(
                f"the tests' interpreter dot takes 2-d fp32 and bf16 tiles, got {a.dtype.scalar} "
                f"{left.shape} and {b.dtype.scalar} {right.shape}"
            )
        # products [K, M, N], added over the depth axis one slice after another (NumPy reduces an
        # outer axis slice by slice, element-wise), then the accumulator
        products = np.moveaxis(left, -1, 0)[..., :, None] * right[:, None, :]
        total = np.add.reduce(products, axis=0) + d.data.astype(np.float32)
        return interpreter.TensorHandle(total, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _interpreter_scalars_to_int(monkeypatch) -> None:
    """Triton 3.6's interpreter makes an int of a scalar argument (a loop bound) with
    `int(array)` on its one-element 1-d array, which NumPy 2.4 refuses; later Tritons squeeze it
    first, as this does."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # a Triton whose interpreter is laid out otherwise
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)


def kernels(where: str, monkeypatch) -> tuple[torch.device, object]:
    """(device, context in which invariant numerics take the Triton kernels there); skips when
    Triton is not installed."""
    pytest.importorskip("triton", reason="the invariant kernels need Triton")
    if where == "cuda":
        return torch.device("cuda"), nullcontext
    if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it where there is no GPU
        pytest.skip("Triton's interpreter was not chosen before Triton was imported")
    _interpreter_dot_in_a_fixed_order(monkeypatch)
    _interpreter_scalars_to_int(monkeypatch)
    return torch.device("cpu"), invariant_triton.on_cpu
