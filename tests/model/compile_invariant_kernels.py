"""Compile every invariant Triton kernel for NVIDIA GPUs, ahead of time, on a machine without one:
`python -m tests.model.compile_invariant_kernels` prints one JSON line per kernel, case and
target.

Triton's compiler and ptxas ship in its wheel, so a kernel that would not compile on an H100
fails here, in CI, rather than on the GPU machine. Each case is what a launch of the 380M model
compiles: the tile sizes and launch options come from `invariant_triton` itself, the row
kernels at the model's widths, and the arguments a launch specialises on (innermost strides 1,
a `heads` of 1, others multiples of 16, except those the kernel declines to specialise on) are
given as such. Run with TRITON_INTERPRET unset (the interpreter replaces `triton.jit`)."""

from __future__ import annotations

import json
import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from whetstone.model import invariant_kernels as kernels
from whetstone.model import invariant_triton as kt

TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = (64, 128)
"""Qwen3's head sizes (the fp32 kernel at 128 takes 156 KB of shared memory: an A100 has 163)."""
HIDDEN, HEADS, EXPERTS, VOCAB = 1024, 20, 64, 32768
"""The 380M model's widths: its hidden size (layer norms, the combine), its q and k heads (the
joint q/k norm), its experts (the router's softmax) and its vocabulary (log-softmax of logits)."""


def _compile(fn, signature: dict, constexprs: dict, aligned: tuple[str, ...], target, options: dict):
    """Compile `fn`: `signature` name -> type, `constexprs` the constant arguments (given in the
    signature as "constexpr"), `aligned` the arguments a launch sees divisible by 16, `options`
    the launch's (num_warps, num_stages, enable_fp_fusion)."""
    signature = {name: "constexpr" if name in constexprs else kind for name, kind in signature.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options=options)


def _split(config: dict) -> tuple[dict, dict]:
    """A launch's keyword arguments as (constexprs, launch options)."""
    options = {key: config[key] for key in ("num_warps", "num_stages", "enable_fp_fusion")}
    return {key: value for key, value in config.items() if key not in options}, options


def _report(name: str, case: str, target: str, dtype: str, compiled) -> dict:
    ptx = compiled.asm["ptx"]
    return {
        "kernel": name,
        "case": case,
        "target": target,
        "dtype": dtype,
        "shared_bytes": compiled.metadata.shared,
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "mma": len(re.findall(r"\bmma\.sync", ptx)),
        "cp_async": len(re.findall(r"cp\.async", ptx)),
        "fp32_fma": len(re.findall(r"\bfma\.rn\.f32", ptx)),
        "approximate_division": len(re.findall(r"\bdiv\.(?:full|approx)\.f32", ptx)),
    }


def _products(target_name: str, target, dtype: str):
    constants, options = _split(kt.matmul_tiles(DTYPES[dtype]))
    ints = "rows columns depth x_row x_col w_row w_col out_row out_col".split()
    signature = {"x": f"*{dtype}", "w": f"*{dtype}", "out": f"*{dtype}"} | dict.fromkeys(ints, "i32")
    signature |= dict.fromkeys(constants, "constexpr")
    unit = {"x_col": 1, "w_col": 1, "out_col": 1}
    aligned = ("x", "w", "out", "columns", "depth", "x_row", "w_row", "out_row")
    compiled = _compile(kernels.matmul, signature, constants | unit, aligned, target, options)
    yield _report("matmul", "", target_name, dtype, compiled)

    ints = "columns depth x_row x_col w_expert w_row w_col out_row out_col".split()
    signature = {"x": f"*{dtype}", "w": f"*{dtype}", "out": f"*{dtype}"}
    signature |= dict.fromkeys(("tile_expert", "tile_start", "tile_end"), "*i32")
    signature |= dict.fromkeys(ints, "i32") | dict.fromkeys(constants, "constexpr")
    aligned += ("tile_expert", "tile_start", "tile_end", "w_expert")
    compiled = _compile(kernels.grouped_matmul, signature, constants | unit, aligned, target, options)
    yield _report("grouped_matmul", "", target_name, dtype, compiled)

    ints = "rows columns a_slot a_col b_slot b_col out_expert out_row out_col".split()
    signature = {"a": f"*{dtype}", "b": f"*{dtype}", "out": f"*{dtype}", "offsets": "*i32"}
    signature |= dict.fromkeys(ints, "i32") | dict.fromkeys(constants, "constexpr")
    unit = {"a_col": 1, "b_col": 1, "out_col": 1}
    aligned = ("a", "b", "out", "offsets", "rows", "columns", "a_slot", "b_slot", "out_expert", "out_row")
    compiled = _compile(kernels.grouped_weight_grad, signature, constants | unit, aligned, target, options)
    yield _report("grouped_weight_grad", "", target_name, dtype, compiled)

    ints = "keys rows group kv_heads causal q_b q_h q_t k_b k_h k_s v_b v_h v_s m_b m_t m_s o_b o_h o_t"
    signature = {name: f"*{dtype}" for name in ("q", "k", "v")} | {"mask": "*u8", "out": f"*{dtype}"}
    signature |= dict.fromkeys(ints.split(), "i32") | {"scale": "fp32"}
    signature |= dict.fromkeys(("IEEE", "HEAD_DIM", "BLOCK_M", "BLOCK_N"), "constexpr")
    aligned = ("q", "k", "v", "out", "q_b", "q_h", "q_t", "k_b", "k_h", "k_s", "v_b", "v_h", "v_s")
    aligned += ("o_b", "o_h", "o_t")
    for dim in HEAD_DIMS:
        constants, options = _split(kt.attention_tiles(DTYPES[dtype], dim))
        compiled = _compile(kernels.attention, signature, constants, aligned, target, options)
        yield _report("attention", f"d{dim}", target_name, dtype, compiled)


def _rows(target_name: str, target, dtype: str):
    """The row kernels on rows of `dtype`, as the model launches them."""
    options = kt.ROW_LAUNCH
    signature = {"x": f"*{dtype}", "weight": "*fp32", "out": "*fp32", "rstd": "*fp32", "width": "i32"}
    signature |= {"heads": "i32", "eps": "fp32", "x_token": "i32", "x_head": "i32", "w_head": "i32"}
    signature |= {"BLOCK": "constexpr"}
    # x's alignment, the width and x's strides are not specialised on (the kernel says so)
    aligned = ("weight", "out", "rstd", "w_head")
    layer = {"BLOCK": kt.row_block(HIDDEN), "heads": 1}  # a layer norm: one weight, heads=1 a constant
    compiled = _compile(kernels.rms_norm, signature, layer, aligned, target, options)
    yield _report("rms_norm", f"w{HIDDEN}", target_name, dtype, compiled)
    per_head = {"BLOCK": kt.row_block(HEAD_DIMS[0])}  # the joint q/k norm: a weight per head
    compiled = _compile(kernels.rms_norm, signature, per_head, aligned, target, options)
    yield _report("rms_norm", f"w{HEAD_DIMS[0]}x{HEADS}", target_name, dtype, compiled)

    ints = "slots hidden e_token e_slot g_token o_token".split()
    signature = {"expert_out": f"*{dtype}", "gates": "*fp32", "out": f"*{dtype}"} | dict.fromkeys(ints, "i32")
    aligned = ("expert_out", "gates", "out", "hidden", "e_token", "e_slot", "o_token")
    signature |= {"BLOCK": "constexpr"}
    compiled = _compile(kernels.moe_combine, signature, {"BLOCK": kt.COMBINE_BLOCK}, aligned, target, options)
    yield _report("moe_combine", "", target_name, dtype, compiled)

    signature = {"x": f"*{dtype}", "out": "*fp32", "width": "i32", "x_row": "i32", "out_row": "i32"}
    signature |= {"LOG": "constexpr", "BLOCK": "constexpr"}
    aligned = ("out", "out_row")
    for name, log, width in (("softmax", False, EXPERTS), ("log_softmax", True, VOCAB)):
        constants = {"LOG": log, "BLOCK": kt.row_block(width)}
        compiled = _compile(kernels.softmax, signature, constants, aligned, target, options)
        yield _report(name, f"w{width}", target_name, dtype, compiled)


def compile_all():
    for target_name, target in TARGETS.items():
        for dtype in DTYPES:
            yield from _products(target_name, target, dtype)
            yield from _rows(target_name, target, dtype)


if __name__ == "__main__":
    for line in compile_all():
        print(json.dumps(line), flush=True)
