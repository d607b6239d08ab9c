"""Invariant numerics under every CPU code path the libraries can be forced to take.

MKL (fp32 matmuls) and oneDNN (bf16 matmuls) pick their kernels by CPU: AVX2, AVX-512, AVX-512
BF16 or AMX, and each path sums in its own order. The invariant kernels must hold on all of
them, so the kernel and whole-model invariance tests run again in a fresh process per path,
forced with the libraries' dispatch variables. A path the CPU cannot run is skipped, saying so;
`MKL_CBWR=COMPATIBLE` (MKL's baseline SSE2 kernels) runs on every x86 CPU. The path each run
actually took is read from the libraries' verbose output and checked.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ["tests/model/test_invariant.py", "tests/model/test_invariant_model.py"]
# The engine against the trainer, end to end, on the path every x86 CPU has.
CONSISTENCY = {"mkl-sse2": ["tests/inference/test_consistency.py"]}


def _cpu_vendor() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":")[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), "")


def _needs(probe: str, what: str):
    supported = getattr(torch.cpu, probe, lambda: False)()
    return pytest.mark.skipif(not supported, reason=f"this CPU has no {what}")


# oneDNN's kernel names carry the ISA they were built for, from the least to the most capable.
ISAS = ["avx2", "avx512_core", "avx512_core_bf16", "avx512_core_fp16", "avx512_core_amx"]
# Later oneDNNs name these ISAs after AVX10 in their verbose output (oneDNN 3.12 runs AMX kernels
# as `brg_matmul:avx10_1_512_amx`); the caps keep the older names.
ISA_ALIASES = {"avx10_1_512_amx": "avx512_core_amx", "avx10_1_512": "avx512_core_fp16"}


def _kernel_isas(line: str) -> str:
    """A oneDNN verbose line with its ISA names as ISAS spells them."""
    for name, alias in ISA_ALIASES.items():
        line = line.replace(f":{name},", f":{alias},")
    return line


# name: (environment, the oneDNN ISA it caps bf16 matmuls at, or None for an MKL path)
PATHS = {
    "mkl-sse2": ({"MKL_CBWR": "COMPATIBLE"}, None),
    "mkl-avx2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, None),
    "onednn-avx2": ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, "avx2"),
    "onednn-avx512": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, "avx512_core"),
    "onednn-avx512-bf16": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "avx512_core_bf16"),
    "onednn-amx": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, "avx512_core_amx"),
}
MARKS = {
    # MKL runs its AVX2 kernels on AMD CPUs whatever it is told: there this is the default path.
    "mkl-avx2": pytest.mark.skipif(_cpu_vendor() != "GenuineIntel", reason="MKL's default path on this CPU"),
    "onednn-avx512": _needs("_is_avx512_supported", "AVX-512"),
    "onednn-avx512-bf16": _needs("_is_avx512_bf16_supported", "AVX-512 BF16"),
    "onednn-amx": _needs("_is_amx_tile_supported", "AMX"),
}

PROBE = """
import torch
from whetstone.model import invariant
x, w = torch.randn(20, 96), torch.randn(80, 96)
invariant.linear(x, w)
invariant.linear(x.bfloat16(), w.bfloat16())
"""


def _run(env: dict, *args: str) -> subprocess.CompletedProcess:
    # The parent's own dispatch settings must not leak into a path's run.
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "ONEDNN_", "DNNL_"))}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("path", [pytest.param(name, marks=MARKS.get(name, ())) for name in PATHS])
def test_invariance_holds_on_each_library_path(path):
    env, cap = PATHS[path]
    if cap is not None:  # no bf16 matmul ran a kernel above the cap; the bf16-native caps ran theirs
        probe = _run({**env, "ONEDNN_VERBOSE": "1"}, "-c", PROBE)
        assert probe.returncode == 0, probe.stderr[-2000:]
        kernels = [_kernel_isas(line) for line in probe.stdout.splitlines() if ",exec,cpu,matmul," in line]
        above = ISAS[ISAS.index(cap) + 1 :]
        assert not any(f":{isa}," in line for line in kernels for isa in above), kernels
        if cap in ("avx512_core_bf16", "avx512_core_amx"):
            assert kernels and all(f":{cap}," in line for line in kernels), kernels
    run = _run(env, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *CHECKS, *CONSISTENCY.get(path, []))
    assert run.returncode == 0, run.stdout[-4000:]
