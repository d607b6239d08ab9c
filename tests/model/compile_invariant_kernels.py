"""Compile every invariant Triton kernel for NVIDIA GPUs, ahead of time, on a machine without one:
`python -m tests.model.compile_invariant_kernels` prints one JSON line per kernel and target.

Triton's compiler and ptxas ship in its wheel, so a kernel that would not compile on an H100
fails here, in CI, rather than on the GPU machine. The strides a launch specialises on (the
innermost ones are 1, the others multiples of 16) are given as such, so the code compiled is
what a launch on contiguous tensors compiles. Run with TRITON_INTERPRET unset (the interpreter
replaces `triton.jit`)."""

from __future__ import annotations

import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from whetstone.model import invariant_kernels as kernels

TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
HEAD_DIMS = (64, 128)
"""Qwen3's head sizes (the fp32 kernel at 128 takes 156 KB of shared memory: an A100 has 163)."""
MATMUL_TILES = {"bf16": (False, 64, 128, 64, 3), "fp32": (True, 32, 64, 32, 2)}


def _compile(fn, signature: dict, constexprs: dict, aligned: tuple[str, ...], target, **options):
    """Compile `fn`: `signature` name -> type, `constexprs` the constant arguments (given in the
    signature as "constexpr"), `aligned` the arguments a launch sees divisible by 16."""
    signature = {name: "constexpr" if name in constexprs else kind for name, kind in signature.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options=options)


def _report(name: str, target: str, dtype: str, compiled) -> dict:
    ptx = compiled.asm["ptx"]
    return {
        "kernel": name,
        "target": target,
        "dtype": dtype,
        "shared_bytes": compiled.metadata.shared,
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "mma": len(re.findall(r"\bmma\.sync", ptx)),
        "cp_async": len(re.findall(r"cp\.async", ptx)),
    }


def compile_all():
    for target_name, target in TARGETS.items():
        for dtype, (ieee, block_m, block_n, block_k, stages) in MATMUL_TILES.items():
            tiles = {"IEEE": ieee, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
            ints = "rows columns depth x_row x_col w_row w_col out_row out_col".split()
            signature = {"x": f"*{dtype}", "w": f"*{dtype}", "out": f"*{dtype}"} | dict.fromkeys(ints, "i32")
            signature |= dict.fromkeys(tiles, "constexpr")
            unit = {"x_col": 1, "w_col": 1, "out_col": 1}
            aligned = ("x", "w", "out", "columns", "depth", "x_row", "w_row", "out_row")
            compiled = _compile(
                kernels.matmul, signature, tiles | unit, aligned, target, num_warps=4, num_stages=stages
            )
            yield _report("matmul", target_name, dtype, compiled)

            ints = "columns depth x_row x_col w_expert w_row w_col out_row out_col".split()
            signature = {"x": f"*{dtype}", "w": f"*{dtype}", "out": f"*{dtype}"}
            signature |= dict.fromkeys(("tile_expert", "tile_start", "tile_end"), "*i32")
            signature |= dict.fromkeys(ints, "i32") | dict.fromkeys(tiles, "constexpr")
            aligned += ("tile_expert", "tile_start", "tile_end", "w_expert")
            compiled = _compile(
                kernels.grouped_matmul, signature, tiles | unit, aligned, target, num_warps=4, num_stages=stages
            )
            yield _report("grouped_matmul", target_name, dtype, compiled)

            ints = "rows columns a_slot a_col b_slot b_col out_expert out_row out_col".split()
            signature = {"a": f"*{dtype}", "b": f"*{dtype}", "out": f"*{dtype}", "offsets": "*i32"}
            signature |= dict.fromkeys(ints, "i32") | dict.fromkeys(tiles, "constexpr")
            unit = {"a_col": 1, "b_col": 1, "out_col": 1}
            aligned = ("a", "b", "out", "offsets", "rows", "columns", "a_slot", "b_slot", "out_expert", "out_row")
            compiled = _compile(
                kernels.grouped_weight_grad, signature, tiles | unit, aligned, target, num_warps=4, num_stages=stages
            )
            yield _report("grouped_weight_grad", target_name, dtype, compiled)

            ints = "keys rows group kv_heads causal q_b q_h q_t k_b k_h k_s v_b v_h v_s m_b m_t m_s o_b o_h o_t"
            signature = {name: f"*{dtype}" for name in ("q", "k", "v")} | {"mask": "*u8", "out": f"*{dtype}"}
            signature |= dict.fromkeys(ints.split(), "i32") | {"scale": "fp32"}
            signature |= dict.fromkeys(("IEEE", "HEAD_DIM", "BLOCK_M", "BLOCK_N"), "constexpr")
            aligned = ("q", "k", "v", "out", "q_b", "q_h", "q_t", "k_b", "k_h", "k_s", "v_b", "v_h", "v_s")
            aligned += ("o_b", "o_h", "o_t")
            for dim in HEAD_DIMS:
                constants = {"IEEE": ieee, "HEAD_DIM": dim, "BLOCK_M": 32 if ieee else 64, "BLOCK_N": 64}
                compiled = _compile(kernels.attention, signature, constants, aligned, target, num_warps=4)
                yield _report(f"attention_d{dim}", target_name, dtype, compiled)

        for dtype in ("bf16", "fp32"):
            signature = {"x": f"*{dtype}", "weight": "*fp32", "out": "*fp32", "rstd": "*fp32", "width": "i32"}
            signature |= {"heads": "i32", "eps": "fp32", "x_token": "i32", "x_head": "i32", "w_head": "i32"}
            aligned = ("x", "weight", "out", "rstd", "width", "x_token", "x_head", "w_head")
            compiled = _compile(kernels.rms_norm, signature | {"BLOCK": "constexpr"}, {"BLOCK": 64}, aligned, target)
            yield _report("rms_norm", target_name, dtype, compiled)
            ints = "slots hidden e_token e_slot g_token o_token".split()
            signature = {"expert_out": f"*{dtype}", "gates": "*fp32", "out": f"*{dtype}"} | dict.fromkeys(ints, "i32")
            aligned = ("expert_out", "gates", "out", "hidden", "e_token", "e_slot", "o_token")
            compiled = _compile(
                kernels.moe_combine, signature | {"BLOCK": "constexpr"}, {"BLOCK": 1024}, aligned, target
            )
            yield _report("moe_combine", target_name, dtype, compiled)
        for log in (True, False):
            signature = {"x": "*fp32", "out": "*fp32", "width": "i32", "x_row": "i32", "out_row": "i32"}
            signature |= {"LOG": "constexpr", "BLOCK": "constexpr"}
            aligned = ("x", "out", "x_row", "out_row")
            compiled = _compile(kernels.softmax, signature, {"LOG": log, "BLOCK": 2048}, aligned, target)
            yield _report("log_softmax" if log else "softmax", target_name, "fp32", compiled)


if __name__ == "__main__":
    for line in compile_all():
        print(json.dumps(line), flush=True)
