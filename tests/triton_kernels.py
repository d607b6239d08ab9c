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


def _interpreter_dot_in_fp32(monkeypatch) -> None:
    """Triton's interpreter multiplies bf16 tiles as their raw 16-bit patterns; widen them to
    fp32 first, as the hardware does (a product of two bf16 values is exact in fp32)."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args):
        return original(self, widened(a), widened(b), d, *args)

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
    _interpreter_dot_in_fp32(monkeypatch)
    _interpreter_scalars_to_int(monkeypatch)
    return torch.device("cpu"), invariant_triton.on_cpu
