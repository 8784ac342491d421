"""The fused kernel compiles for both GPU back-ends, without a GPU.

Triton can compile ahead of time for a named target; this catches CUDA-only
constructs (and ROCm compile failures) on every CI run. It also pins two
numerical facts the kernel relies on: the IEEE divide and no flush-to-zero of
float32 subnormals; and that the ptx programs, compiled as they are launched (the
register cap of ``kernels._maxnreg`` included), spill no register with this Triton.
Compilation runs in a subprocess because the test session itself runs Triton in
interpreter mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from transformd.formats import ScaleMode
from transformd.kernels import _maxnreg, _mx_to_block_fp8_grouped_kernel as grouped, _mx_to_block_fp8_kernel as kernel

signature = {"q_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*u8", "out_scale_ptr": "*fp32", "status_ptr": "*i32",
             "N": "i32", "K": "i32", "EXACT": "constexpr", "FNUZ": "constexpr", "PTX": "constexpr",
             "TILE_": "constexpr", "BLOCK_": "constexpr"}
builds = {"cuda": (False, GPUTarget("cuda", 90, 32)), "hip": (False, GPUTarget("hip", "gfx942", 64)),
          "ptx": (True, GPUTarget("cuda", 90, 32))}
out = {}
for name, (ptx, target) in builds.items():
    for exact in (True, False):
        constexprs = {"EXACT": exact, "FNUZ": True, "PTX": ptx, "TILE_": 128, "BLOCK_": 32}
        k = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=target,
                           options={"num_warps": 8, "enable_fp_fusion": False})
        binary = k.asm["hsaco" if name == "hip" else "cubin"]
        text = k.asm["llir" if name == "hip" else "ptx"]
        out[f"{name}-{'exact' if exact else 'amax'}"] = {
            "binary_bytes": len(binary),
            "div_rn": "div.rn.f32" in text,
            "ftz": bool(re.search(r"\.ftz\.", text)) if name != "hip" else None,
            "ieee_denormals": '"denormal-fp-math-f32"="ieee"' in text if name == "hip" else None,
        }

# The ptx programs as launched on an aligned weight (pointers and K divisible by 16, as Triton specialises them), 8
# warps, the register cap of their mode: ptxas -v's spill count.
try:
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
except Exception:  # an older Triton: no spill facts
    ptxas = None
grouped_signature = {"table_ptr": "*i64", "N": "i32", "K": "i32", "q_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*u8",
                     "out_scale_ptr": "*fp32", "status_ptr": "*i32", "EXACT": "constexpr", "FNUZ": "constexpr",
                     "PTX": "constexpr", "TILE_": "constexpr", "BLOCK_": "constexpr"}
out["spills"] = {}
for name, fn, sig in (("one launch", kernel, signature), ("grouped", grouped, grouped_signature)) if ptxas else ():
    aligned = {(i,): [["tt.divisibility", 16]] for i, (arg, t) in enumerate(sig.items()) if "*" in t or arg == "K"}
    for mode in ScaleMode:
        options = {"num_warps": 8, "enable_fp_fusion": False}
        if _maxnreg(True, 8, mode) is not None:
            options["maxnreg"] = _maxnreg(True, 8, mode)
        constexprs = {"EXACT": mode is ScaleMode.EXACT, "FNUZ": True, "PTX": True, "TILE_": 128, "BLOCK_": 32}
        k = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=aligned), target=GPUTarget("cuda", 90, 32),
                           options=options)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
            src.write(k.asm["ptx"])
            src.flush()
            log = subprocess.run([ptxas, "-arch=sm_90a", "-v", src.name, "-o", os.devnull], capture_output=True,
                                 text=True).stderr
        found = re.search(r"(\d+) bytes spill stores", log)
        out["spills"][f"{name} {mode.value}"] = {"bytes": int(found.group(1)) if found else None, "log": log[-400:]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", ["cuda-exact", "cuda-amax", "hip-exact", "hip-amax", "ptx-exact", "ptx-amax"])
def test_kernels_compile_for_cuda_sm90_and_rocm_gfx942(compiled, variant):
    """The portable kernel for both back-ends; the inline-PTX kernel assembles for sm_90."""
    assert compiled[variant]["binary_bytes"] > 1000


def test_cuda_code_keeps_ieee_division_and_subnormals(compiled):
    assert compiled["cuda-amax"]["div_rn"] and compiled["ptx-amax"]["div_rn"]
    assert not any(compiled[v]["ftz"] for v in ("cuda-amax", "cuda-exact", "ptx-amax", "ptx-exact"))


def test_ptx_programs_spill_no_register_as_launched(compiled):
    """A register cap that makes ptxas spill costs more than the occupancy it buys (kernels.PTX_MAXNREG)."""
    if not compiled["spills"]:
        pytest.skip("this Triton has no get_ptxas: no spill count")
    assert len(compiled["spills"]) == 4
    for build, found in compiled["spills"].items():
        assert found["bytes"] == 0, (build, found["log"])


def test_rocm_code_keeps_float32_subnormals(compiled):
    assert compiled["hip-amax"]["ieee_denormals"] and compiled["hip-exact"]["ieee_denormals"]
