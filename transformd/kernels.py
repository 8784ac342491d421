"""Fused Triton kernels for the MXFP8 -> 128x128 block-FP8 conversion.

One program converts one 128x128 tile: it reads each input byte once (codes and
E8M0 scales), keeps the tile in registers while it takes the tile maximum,
then writes each output byte once (codes, one float32 scale, one status word).
Both kernels compute the function of :mod:`transformd.reference`, bit for bit.

* ``portable`` (every back-end: CUDA, ROCm, the CPU interpreter): decodes with
  integer operations on float32 bits (exact, subnormals included) and rounds
  float32 -> e4m3fn with integer operations too (c10's algorithm), so every
  back-end agrees.
* ``ptx`` (NVIDIA compute capability 8.9+, the fast path on H100/H200): works on
  32-bit words of four codes with the hardware e4m3 <-> f16/f32 conversions in
  inline PTX, which round to nearest even like the reference.

Shared arithmetic facts:

* ``exact`` mode: the tile's power-of-two scale comes from the block maxima with
  integer arithmetic on float32 bits; ``v / 2**E`` is then one power-of-two
  multiply per block, exact unless the result falls below e4m3fn's normal range.
* ``amax`` mode rounds the IEEE quotient ``v / scale`` (plain ``/`` is not
  IEEE-rounded in Triton on NVIDIA), ``v = m * 2**(s-127)`` for a code's value m.
  With ``scale = sig * 2**e`` (sig in [1, 2)), ``d = s - 127 - e`` and ``r = 1/sig``
  (rounded), ``v / scale = (m / sig) * 2**d`` and the per-block factor ``r * 2**d``
  makes ``y0 = m * (r * 2**d)`` one multiply per element, as in ``exact`` mode
  (d is clamped to [-30, 20]: below, every quotient rounds to 0; above, a block
  holds only zeros; so every intermediate is a normal float32). y0 can be one
  float32 ulp off the IEEE quotient, but it rounds to the same e4m3fn code
  wherever the scale is a normal float32: its significand is one of 8, the code's
  one of 8, and no pair puts the quotient within an ulp of an e4m3fn rounding
  boundary (tests/test_amax_division.py checks the 64 pairs exactly). Tiles whose
  scale is subnormal (amax below 448 * 2**-126: 78 more significands) correct y0 by
  two FMAs (Markstein) to the IEEE quotient itself.

Launches: :func:`convert_triton` converts one weight ([N, K], or an [E, N, K] stack) per launch;
:func:`convert_triton_grouped` (a list of weights of any shapes) and :func:`convert_packed` (weights
packed in one buffer, as the checkpoint pipeline batches them) convert many weights of one shape in one
launch over all their tiles, through a table of offsets (a launch per distinct shape), so thousands of small
per-expert tensors cost a launch per shape, not one each.
Every launch runs the same tile programs (:func:`_tile_portable`, :func:`_tile_ptx`).

Invalid input is not converted silently: each tile writes a status word
(bit 0: NaN code, bit 1: E8M0 0xFF, bit 2: a decoded value that is not finite
in float32) and the wrapper raises :class:`~transformd.formats.MxFormatError`.

Long because the two tile programs and the launches that run them change together: a launch's table
row is both a kernel argument layout and the host code that fills it, and the GPU record
(tests/gpu/run_gpu_suite.py) covers them as one file.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from .formats import MX_BLOCK, TILE, MxFormatError, ScaleMode, Target, tile_grid
from .mx import as_codes, check_pair_shapes, find_value_problem

STATUS_NAN_CODE = tl.constexpr(1)
STATUS_NAN_SCALE = tl.constexpr(2)
STATUS_OVERFLOW = tl.constexpr(4)


@triton.jit
def _e4m3fn_magnitude(y):
    """Round float32 y (0 <= y < 464) to nearest even e4m3fn; returns the code (int32)."""
    a = y.to(tl.int32, bitcast=True)
    # Normal results: drop 20 mantissa bits with round-half-to-even, rebias 127 -> 7.
    normal = (a + 0x7FFFF + ((a >> 20) & 1) - 0x3C000000) >> 20
    # Results below 2**-6: adding 2**14 makes the float adder round y to a
    # multiple of 2**-9 (the e4m3fn subnormal step), half to even.
    sub = (y + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    return tl.where(a < 0x3C800000, sub, normal)


@triton.jit
def _decode_magnitude(mag):
    """Exact float32 value of e4m3fn magnitude codes (0..0x7E, int32).

    The 7 code bits placed at float32's bit 20 read as ``value * 2**-120``
    (a float32 subnormal for e4m3fn subnormals), so one multiply by 2**120 decodes.
    """
    return (mag << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36


@triton.jit
def _exp2(e):
    """Exact float32 2**e for integer e in [-149, 127]."""
    bits = tl.where(e >= -126, (tl.maximum(e, -126) + 127) << 23, 1 << tl.minimum(tl.maximum(e + 149, 0), 22))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _tile_exponent(amax):
    """Smallest integer E with amax <= 448 * 2**E (0 for amax == 0), from amax's float32 bits."""
    ab = amax.to(tl.int32, bitcast=True)
    subnormal = ab < 0x800000
    # A subnormal amax (tiny E8M0 scales) is normalised by an exact int -> float conversion.
    ab = tl.where(subnormal, ab.to(tl.float32).to(tl.int32, bitcast=True), ab)
    e_unbiased = (ab >> 23) - tl.where(subnormal, 127 + 149, 127)
    exp = e_unbiased - 8 + tl.where((ab & 0x7FFFFF) > 0x600000, 1, 0)
    return tl.where(amax == 0, 0, exp)


@triton.jit
def _block_shift(s, exp):
    """float32 2**d per block, d = s - 127 - E: multiplying a code's value by it divides v by 2**E.

    d <= 17 for any block holding a nonzero code; below -117 every product rounds to 0 anyway.
    """
    d = tl.minimum(tl.maximum(s - 127 - exp, -117), 17)
    return ((d + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _amax_factors(s, amax):
    """amax mode: the tile's scale (amax / 448, IEEE), per block [TILE, NB] the factors ``rb = r * 2**d`` and
    ``nsb = -sig * 2**-d`` of the division ``v / scale`` (module docstring), and whether the scale is subnormal.

    For a code's value m, ``y0 = m * rb`` rounds to the right e4m3fn code unless the scale is subnormal; then
    ``fma(fma(y0, nsb, m), rb, y0)`` is the IEEE quotient.
    """
    scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, 448.0))
    bits = scale.to(tl.int32, bitcast=True)
    subnormal = bits < 0x800000
    # A subnormal scale (the tiniest tiles) is normalised by an exact int -> float conversion of its bits.
    bits = tl.where(subnormal, bits.to(tl.float32).to(tl.int32, bitcast=True), bits)
    e = (bits >> 23) - tl.where(subnormal, 127 + 149, 127)
    sig_bits = (bits & 0x7FFFFF) | 0x3F800000
    r_bits = tl.math.div_rn(1.0, sig_bits.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    d = tl.minimum(tl.maximum(s - 127 - e, -30), 20)
    rb = (r_bits + (d << 23)).to(tl.float32, bitcast=True)
    nsb = -((sig_bits - (d << 23)).to(tl.float32, bitcast=True))
    return scale, rb, nsb, subnormal


@triton.jit
def _tile_status(bmax_is_nan, s, amax):
    status = tl.max(tl.max(tl.where(bmax_is_nan, STATUS_NAN_CODE, 0), axis=1), axis=0)
    status |= tl.max(tl.max(tl.where(s == 0xFF, STATUS_NAN_SCALE, 0), axis=1), axis=0)
    return status | tl.where(amax < float("inf"), 0, STATUS_OVERFLOW)


@triton.jit
def _spread(x, TILE_: tl.constexpr, NB: tl.constexpr, W: tl.constexpr):
    """Per-block values [TILE, NB] -> [TILE, NB * W], each repeated over the W elements (or words) of its block.

    Tiles are loaded and stored as 2-D [TILE, TILE] blocks (of codes, or of 32-bit words) and viewed as
    [TILE, NB, W] only for the per-block values. On the H200, loads and stores of 32-bit words alone reached
    76-86% of a device copy with a [TILE, NB, WB] layout, 97-100% with the 2-D one
    (benchmarks/results/kernel_layout_experiment_h200.txt).
    """
    return tl.reshape(tl.broadcast_to(x[:, :, None], [TILE_, NB, W]), [TILE_, NB * W])


@triton.jit
def _tile_portable(q_ptr, s_ptr, out_ptr, scale_ptr, status_ptr, N, K, pid_n, pid_k, EXACT, FNUZ, TILE_, BLOCK_):
    """Portable tile program: integer decoding and rounding, identical on every back-end.

    ``q_ptr``, ``s_ptr``, ``out_ptr``: the first byte of one [N, K] matrix (codes, E8M0 scales, output codes);
    ``scale_ptr``, ``status_ptr``: the matrix's tile scales and status words (row-major, a row of tiles per 128
    rows); (pid_n, pid_k): the tile.
    """
    KB = K // BLOCK_
    NB: tl.constexpr = TILE_ // BLOCK_

    # 64-bit offset of the tile's first row; 32-bit offsets within the tile.
    row0 = (pid_n * TILE_).to(tl.int64)
    q_ptr += row0 * K
    out_ptr += row0 * K
    s_ptr += row0 * KB

    rows = tl.arange(0, TILE_)
    blks = pid_k * NB + tl.arange(0, NB)
    cols = pid_k * TILE_ + tl.arange(0, TILE_)
    in_rows = pid_n * TILE_ + rows[:, None] < N
    smask = in_rows & (blks[None, :] < KB)  # [TILE, NB]
    qmask = in_rows & (cols[None, :] < K)  # [TILE, TILE]; whole blocks, K being a multiple of 32
    q_off = rows[:, None] * K + cols[None, :]
    s_off = rows[:, None] * KB + blks[None, :]

    q8 = tl.load(q_ptr + q_off, mask=qmask, other=0)  # uint8 [TILE, TILE]
    s = tl.load(s_ptr + s_off, mask=smask, other=127).to(tl.int32)  # [TILE, NB]
    tile = pid_n * tl.cdiv(K, TILE_) + pid_k
    scale_ptr += tile
    status_ptr += tile
    mag = (q8 & 0x7F).to(tl.int32)
    sign = q8 & 0x80

    # Block maxima: e4m3fn magnitude codes are ordered like their values.
    bmax = tl.max(tl.reshape(mag, [TILE_, NB, BLOCK_]), axis=2)  # [TILE, NB]
    block_scale = tl.where(s > 0, s << 23, 1 << 22).to(tl.float32, bitcast=True)  # 2**(s-127)
    amax = tl.max(tl.max(_decode_magnitude(bmax) * block_scale, axis=1), axis=0)
    status = _tile_status(bmax == 0x7F, s, amax)

    m = _decode_magnitude(mag)
    if EXACT:
        exp = _tile_exponent(amax)
        scale = _exp2(exp)
        y = m * _spread(_block_shift(s, exp), TILE_, NB, BLOCK_)
    else:
        scale, rb, nsb, subnormal = _amax_factors(s, amax)
        rb = _spread(rb, TILE_, NB, BLOCK_)
        y = m * rb
        if subnormal:
            y = tl.fma(tl.fma(y, _spread(nsb, TILE_, NB, BLOCK_), m), rb, y)
    code = _e4m3fn_magnitude(y)
    if FNUZ:
        sign = tl.where(code == 0, 0, sign)  # -0 is NaN in FNUZ: write +0
        scale = scale * 2.0
    tl.store(out_ptr + q_off, (code | sign).to(tl.uint8), mask=qmask)
    tl.store(scale_ptr, scale)
    tl.store(status_ptr, status)


# --- NVIDIA fast path: inline PTX on 32-bit words of four e4m3fn codes --------------------------

# f16 bits of the largest magnitude among a word's four codes (NaN codes propagate as f16 NaN,
# whose bits exceed every finite positive f16's: positive f16 bit patterns order like values).
_PTX_WORD_MAX = """{
.reg .b32 m, a, b, c;
.reg .b16 lo, hi, c0, c1, d;
and.b32 m, $1, 0x7F7F7F7F;
mov.b32 {lo, hi}, m;
cvt.rn.f16x2.e4m3x2 a, lo;
cvt.rn.f16x2.e4m3x2 b, hi;
max.NaN.f16x2 c, a, b;
mov.b32 {c0, c1}, c;
max.NaN.f16 d, c0, c1;
cvt.u32.u16 $0, d;
}"""

# Decode four magnitudes exactly to float32 (f0..f3 = bytes 0..3), then {body}, then round to
# e4m3fn (cvt.rn: nearest even) and put the signs back; {fnuz} drops the sign of zero codes.
_PTX_CONVERT = """{{
.reg .b32 m, sg, h01, h23, o, t;
.reg .b16 lo, hi, p0, p1, q0, q1, q2, q3;
.reg .f32 f0, f1, f2, f3, y0, y1, y2, y3, e0, e1, e2, e3;
and.b32 m, $1, 0x7F7F7F7F;
and.b32 sg, $1, 0x80808080;
mov.b32 {{lo, hi}}, m;
cvt.rn.f16x2.e4m3x2 h01, lo;
cvt.rn.f16x2.e4m3x2 h23, hi;
mov.b32 {{q0, q1}}, h01;
mov.b32 {{q2, q3}}, h23;
cvt.f32.f16 f0, q0;
cvt.f32.f16 f1, q1;
cvt.f32.f16 f2, q2;
cvt.f32.f16 f3, q3;
{body}
cvt.rn.satfinite.e4m3x2.f32 p0, f1, f0;
cvt.rn.satfinite.e4m3x2.f32 p1, f3, f2;
mov.b32 o, {{p0, p1}};
{fnuz}
}}"""
# f = m * $2: exact mode's power of two 2**d, amax mode's r * 2**d (_amax_factors).
_PTX_MUL = "\n".join(f"mul.rn.f32 f{i}, f{i}, $2;" for i in range(4))
# amax, subnormal scale: y0 = m * rb ($2 = r * 2**d); y = y0 + (m - y0 * sig * 2**-d) * rb ($3 = -sig * 2**-d).
_PTX_AMAX_CORRECTED = "\n".join(
    f"mul.rn.f32 y{i}, f{i}, $2;\nfma.rn.f32 e{i}, y{i}, $3, f{i};\nfma.rn.f32 f{i}, e{i}, $2, y{i};" for i in range(4)
)
# Bytes of o are <= 0x7E, so adding 0x7F per byte sets bit 7 exactly where a byte is nonzero.
_PTX_SIGN_FNUZ = "add.u32 t, o, 0x7F7F7F7F;\nand.b32 t, t, sg;\nor.b32 $0, o, t;"
_PTX_SIGN_OCP = "or.b32 $0, o, sg;"


def _ptx(body: str, sign: str) -> tl.constexpr:
    return tl.constexpr(_PTX_CONVERT.format(body=body, fnuz=sign))


_PTX_MUL_FNUZ = _ptx(_PTX_MUL, _PTX_SIGN_FNUZ)
_PTX_MUL_OCP = _ptx(_PTX_MUL, _PTX_SIGN_OCP)
_PTX_AMAX_CORRECTED_FNUZ = _ptx(_PTX_AMAX_CORRECTED, _PTX_SIGN_FNUZ)
_PTX_AMAX_CORRECTED_OCP = _ptx(_PTX_AMAX_CORRECTED, _PTX_SIGN_OCP)
_PTX_WORD_MAX_C = tl.constexpr(_PTX_WORD_MAX)


@triton.jit
def _ptx_word_max(w):
    return tl.inline_asm_elementwise(_PTX_WORD_MAX_C, "=r,r", [w], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _load_words(q_ptr, s_ptr, N, K, pid_n, pid_k, TILE_, BLOCK_):
    """Tile (pid_n, pid_k) of a [N, K] weight as 32-bit words of four codes [TILE, TILE / 4] and its E8M0 scales
    [TILE, NB], with the words' offsets and mask within its row band and the band's first word."""
    KB = K // BLOCK_
    KW = K // 4
    NB: tl.constexpr = TILE_ // BLOCK_
    TW: tl.constexpr = TILE_ // 4
    row0 = (pid_n * TILE_).to(tl.int64)
    rows = tl.arange(0, TILE_)
    blks = pid_k * NB + tl.arange(0, NB)
    words = pid_k * TW + tl.arange(0, TW)
    in_rows = pid_n * TILE_ + rows[:, None] < N
    smask = in_rows & (blks[None, :] < KB)
    wmask = in_rows & (words[None, :] < KW)  # whole blocks: K is a multiple of 32
    w_off = rows[:, None] * KW + words[None, :]
    s_off = rows[:, None] * KB + blks[None, :]
    w = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + row0 * KW + w_off, mask=wmask, other=0)  # int32 [TILE, TW]
    s = tl.load(s_ptr + row0 * KB + s_off, mask=smask, other=127).to(tl.int32)  # [TILE, NB]
    return w, s, w_off, wmask, row0 * KW


@triton.jit
def _tile_ptx(q_ptr, s_ptr, out_ptr, scale_ptr, status_ptr, N, K, pid_n, pid_k, EXACT, FNUZ, TILE_, BLOCK_):
    """NVIDIA tile program (sm_89+): :func:`_tile_portable` on 32-bit words of four codes.

    The same arguments; ``q_ptr`` and ``out_ptr`` must be 16-byte aligned (whole words, vector loads). The order
    matters to the compiler: with the output addresses formed for the stores and the tile's scale and status addresses
    after its loads, the grouped launch issues all its loads first and needs 48 registers in exact mode, not 60;
    it ran 6-8 points nearer a device copy on the H200 (triton 3.6,
    benchmarks/results/kernel_registers_experiment_h200.txt).
    """
    NB: tl.constexpr = TILE_ // BLOCK_
    WB: tl.constexpr = BLOCK_ // 4
    w, s, w_off, wmask, band = _load_words(q_ptr, s_ptr, N, K, pid_n, pid_k, TILE_, BLOCK_)
    tile = pid_n * tl.cdiv(K, TILE_) + pid_k
    scale_ptr += tile
    status_ptr += tile

    bmax16 = tl.max(tl.reshape(_ptx_word_max(w), [TILE_, NB, WB]), axis=2)  # f16 bits of each block's largest magnitude
    block_scale = tl.where(s > 0, s << 23, 1 << 22).to(tl.float32, bitcast=True)
    bmax = bmax16.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    amax = tl.max(tl.max(bmax * block_scale, axis=1), axis=0)
    status = _tile_status(bmax16 > 0x7C00, s, amax)

    asm_mul: tl.constexpr = _PTX_MUL_FNUZ if FNUZ else _PTX_MUL_OCP
    if EXACT:
        exp = _tile_exponent(amax)
        scale = _exp2(exp)
        shift = _spread(_block_shift(s, exp), TILE_, NB, WB)
        o = tl.inline_asm_elementwise(asm_mul, "=r,r,f", [w, shift], dtype=tl.int32, is_pure=True, pack=1)
    else:
        scale, rb, nsb, subnormal = _amax_factors(s, amax)
        rb = _spread(rb, TILE_, NB, WB)
        if subnormal:
            asm_amax: tl.constexpr = _PTX_AMAX_CORRECTED_FNUZ if FNUZ else _PTX_AMAX_CORRECTED_OCP
            o = tl.inline_asm_elementwise(
                asm_amax, "=r,r,f,f", [w, rb, _spread(nsb, TILE_, NB, WB)], dtype=tl.int32, is_pure=True, pack=1
            )
        else:
            o = tl.inline_asm_elementwise(asm_mul, "=r,r,f", [w, rb], dtype=tl.int32, is_pure=True, pack=1)
    if FNUZ:
        scale = scale * 2.0
    tl.store(out_ptr.to(tl.pointer_type(tl.int32)) + band + w_off, o, mask=wmask)
    tl.store(scale_ptr, scale)
    tl.store(status_ptr, status)


#: Registers per thread of the ptx tile program in amax mode at 8 warps (``maxnreg``): at 48, five programs share an
#: SM's 64K registers, where triton 3.6 gives it 64 (four). It does not spill at 48 (tests/test_portability.py), and
#: on the H200 (triton 3.6) the packed launches ran 1-5 points nearer a device copy, the one launch 2-7
#: (benchmarks/results/kernel_registers_experiment_h200.txt). Exact mode is left uncapped: 48 registers with triton
#: 3.6, but 80 with triton 3.9, whose code spills at 48. Neither is capped at 4 warps, where a thread holds twice as
#: much of the tile (the cap halved the speed there), and the portable program never is.
PTX_MAXNREG = 48


def _maxnreg(ptx: bool, num_warps: int, scale_mode: ScaleMode) -> int | None:
    return PTX_MAXNREG if ptx and num_warps == 8 and scale_mode is ScaleMode.AMAX else None


# N is never specialised: Triton compiles an int argument equal to 1 as a constant, and the ptx tile program
# compiled for N == 1 took a wrong tile maximum on the H200 (triton 3.6; the one-row tiles of
# tests/support/kernel_cases.py). Its divisibility by 16 is not needed either: offsets come from K or the table.
@triton.jit(do_not_specialize=["N"])
def _mx_to_block_fp8_kernel(
    q_ptr,
    s_ptr,
    out_ptr,
    out_scale_ptr,
    status_ptr,
    N,
    K,
    EXACT: tl.constexpr,
    FNUZ: tl.constexpr,
    PTX: tl.constexpr,
    TILE_: tl.constexpr,
    BLOCK_: tl.constexpr,
):
    """One [E, N, K] stack: grid (K tiles, N tiles, E); ``PTX`` picks :func:`_tile_ptx` over :func:`_tile_portable`."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_e = tl.program_id(2).to(tl.int64)
    mat = pid_e * N  # the expert's first row
    tiles = pid_e * tl.num_programs(1) * tl.num_programs(0)  # and first tile
    if PTX:
        _tile_ptx(
            q_ptr + mat * K, s_ptr + mat * (K // BLOCK_), out_ptr + mat * K, out_scale_ptr + tiles, status_ptr + tiles,
            N, K, pid_n, pid_k, EXACT, FNUZ, TILE_, BLOCK_,
        )
    else:
        _tile_portable(
            q_ptr + mat * K, s_ptr + mat * (K // BLOCK_), out_ptr + mat * K, out_scale_ptr + tiles, status_ptr + tiles,
            N, K, pid_n, pid_k, EXACT, FNUZ, TILE_, BLOCK_,
        )


# --- grouped launches: many weights, one launch -------------------------------------------------------------------

# A grouped launch converts the experts of weights of one shape [N, K] (a launch per shape of the group): program
# (pid_k, pid_n, i) converts tile (pid_n, pid_k) of expert i, as the one-launch kernel does for a stack, the
# expert's offsets in row i of a table: 8 int64s (64 bytes): byte offsets of its codes, E8M0 scales and output codes
# from their base pointers, its first output scale's offset from theirs in float32 elements, and its first status
# word. Its coordinates come from the program id: no division precedes the tile's loads.

#: Most experts in one launch (CUDA's limit on the grid's third axis); more take several launches.
GRID_Z = 65535


@triton.jit(do_not_specialize=["N"])  # as _mx_to_block_fp8_kernel
def _mx_to_block_fp8_grouped_kernel(
    table_ptr,
    N,
    K,
    q_ptr,
    s_ptr,
    out_ptr,
    out_scale_ptr,
    status_ptr,
    EXACT: tl.constexpr,
    FNUZ: tl.constexpr,
    PTX: tl.constexpr,
    TILE_: tl.constexpr,
    BLOCK_: tl.constexpr,
):
    """Experts of one shape [N, K] anywhere in memory: program (pid_k, pid_n, i) converts that tile of expert i,
    whose offsets are row i of the table (one load before the tile's)."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    row = table_ptr + tl.program_id(2).to(tl.int64) * 8
    q_off = tl.load(row + 0)
    s_off = tl.load(row + 1)
    out_off = tl.load(row + 2)
    scale_ptr = out_scale_ptr + tl.load(row + 3)
    status = status_ptr + tl.load(row + 4)
    if PTX:
        q_off = tl.multiple_of(q_off, 16)
        out_off = tl.multiple_of(out_off, 16)
        _tile_ptx(
            q_ptr + q_off, s_ptr + s_off, out_ptr + out_off,
            scale_ptr, status, N, K, pid_n, pid_k, EXACT, FNUZ, TILE_, BLOCK_,
        )
    else:
        _tile_portable(
            q_ptr + q_off, s_ptr + s_off, out_ptr + out_off,
            scale_ptr, status, N, K, pid_n, pid_k, EXACT, FNUZ, TILE_, BLOCK_,
        )


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, _e4m3fn_magnitude(y).to(tl.uint8), mask=offs < n)


def round_to_e4m3fn(x: torch.Tensor) -> torch.Tensor:
    """The portable kernel's float32 -> e4m3fn rounding on its own, for 0 <= x < 464; for tests."""
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


KERNELS = ("portable", "ptx")


def default_kernel(device: torch.device) -> str:
    """``ptx`` on NVIDIA GPUs of compute capability 8.9+ (hardware e4m3 conversions), else ``portable``."""
    if device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9):
        return "ptx"
    return "portable"


def convert_triton(
    codes: torch.Tensor,
    scales: torch.Tensor,
    target: Target | str = Target.FNUZ,
    scale_mode: ScaleMode | str = ScaleMode.EXACT,
    *,
    kernel: str | None = None,
    num_warps: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert a 2-D [N, K] or 3-D [E, N, K] MXFP8 weight with a fused kernel.

    Returns (uint8 codes, same shape; float32 scale_inv [..., Nt, Kt]), the same
    bytes as :func:`transformd.reference.convert_reference`. ``kernel`` is
    ``portable``, ``ptx`` or None (the device's default; ``ptx`` falls back to
    ``portable`` for buffers not aligned to 16 bytes). Raises
    :class:`MxFormatError` for invalid values (after the launch, from the
    per-tile status words, which costs one device synchronisation); pass
    ``check=False`` to skip that (benchmarks).
    """
    target, scale_mode = Target(target), ScaleMode(scale_mode)
    codes, scales = as_codes(codes), as_codes(scales)
    check_pair_shapes(codes, scales)
    codes, scales = codes.contiguous(), scales.contiguous()
    squeeze = codes.dim() == 2
    if squeeze:
        codes, scales = codes.unsqueeze(0), scales.unsqueeze(0)
    e, n, k = codes.shape
    nt, kt = tile_grid(n, k)
    if out is None:
        out_codes = torch.empty_like(codes)
        out_scale = torch.empty((e, nt, kt), dtype=torch.float32, device=codes.device)
    else:
        out_codes, out_scale = (t.view(e, *t.shape[-2:]) for t in out)
    status = torch.empty((e, nt, kt), dtype=torch.int32, device=codes.device)
    kernel = kernel or default_kernel(codes.device)
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    if kernel == "ptx" and (codes.data_ptr() % 16 or out_codes.data_ptr() % 16):
        kernel = "portable"
    if e and n and k:
        _mx_to_block_fp8_kernel[(kt, nt, e)](
            codes,
            scales,
            out_codes,
            out_scale,
            status,
            n,
            k,
            EXACT=scale_mode is ScaleMode.EXACT,
            FNUZ=target is Target.FNUZ,
            PTX=kernel == "ptx",
            TILE_=TILE,
            BLOCK_=MX_BLOCK,
            num_warps=num_warps or 8,
            maxnreg=_maxnreg(kernel == "ptx", num_warps or 8, scale_mode),
            enable_fp_fusion=False,  # keep each float operation's own IEEE rounding
        )
        if check and bool(status.any()):
            raise MxFormatError(find_value_problem(codes, scales) or "invalid MXFP8 values")
    if squeeze:
        return out_codes[0], out_scale[0]
    return out_codes, out_scale


# --- grouped launches (host side) ---------------------------------------------------------------------------------


class GroupMemberError(MxFormatError):
    """Invalid values in one weight of a grouped launch; ``index`` is its position in the group."""

    def __init__(self, problem: str, index: int):
        super().__init__(problem)
        self.index = index


@dataclass(frozen=True)
class PackedWeight:
    """Where one weight of :func:`convert_packed` lies in its buffers (byte offsets; the scale in float32s)."""

    shape: tuple[int, ...]  # [N, K] or [E, N, K]
    code_offset: int  # of the input codes in the input buffer, and of the output codes in the output buffer
    scale_offset: int  # of the E8M0 scales ([..., N, K/32]) in the input buffer
    out_scale_offset: int  # of the float32 scale_inv ([..., ceil(N/128), ceil(K/128)]) in the scale buffer

    @property
    def tiles(self) -> int:
        return math.prod(self.scale_inv_shape)

    @property
    def scale_inv_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-2], *tile_grid(*self.shape[-2:]))

    def views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, E8M0 scales) of this weight in the uint8 ``buffer``, shaped."""
        n = math.prod(self.shape)
        codes = buffer[self.code_offset : self.code_offset + n].view(self.shape)
        scales = buffer[self.scale_offset : self.scale_offset + n // MX_BLOCK]
        return codes, scales.view(*self.shape[:-1], self.shape[-1] // MX_BLOCK)


def _group_rows(
    rows: list[tuple[int, ...]],
) -> tuple[dict[tuple[int, int], list[tuple[int, ...]]], list[int], int]:
    """Group ``rows`` (as :func:`_launch_group` takes them) by [N, K]: each shape's weights as (the four offsets,
    their first tile, their expert count), each row's first tile, and the tile count."""
    shapes: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    firsts, tiles = [], 0  # this loop is the launch's per-weight cost: keep it short
    for shape, q_off, s_off, o_off, sc_off in rows:
        n, k = shape[-2], shape[-1]
        experts = 1
        for lead in shape[:-2]:
            experts *= lead
        count = experts * -(-n // TILE) * -(-k // TILE)  # formats.tile_grid inline: a call would double its cost
        firsts.append(tiles)
        if count:
            shapes.setdefault((n, k), []).append((q_off, s_off, o_off, sc_off, tiles, experts))
        tiles += count
    return shapes, firsts, tiles


def _launch_group(
    rows: list[tuple[int, ...]],
    bases: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    target: Target,
    scale_mode: ScaleMode,
    kernel: str | None,
    num_warps: int | None,
    aligned: bool,
) -> tuple[torch.Tensor, list[int]] | None:
    """Convert ``rows`` (shape, code, scale, output-code offsets in bytes, output-scale offset in floats): one
    launch per distinct [N, K] (more past :data:`GRID_Z` experts), all into one status buffer.

    Returns the per-tile status words and each row's first tile, or None when there is no tile at all.
    """
    shapes, firsts, tiles = _group_rows(rows)
    if not tiles:
        return None
    device = bases[0].device
    kernel = kernel or default_kernel(device)
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    ptx = kernel == "ptx" and aligned
    status = torch.empty(tiles, dtype=torch.int32, device=device)
    for (n, k), weights in shapes.items():
        nt, kt = -(-n // TILE), -(-k // TILE)
        w = np.array(weights, dtype=np.int64)
        experts = w[:, 5]
        if experts.max() > 1:  # one row per expert, from its weight's
            e = np.arange(int(experts.sum())) - np.repeat(np.cumsum(experts) - experts, experts)
            w = np.repeat(w, experts, axis=0)
        else:
            e = np.zeros(len(w), dtype=np.int64)
        # One host buffer and one copy; pinned, the copy is asynchronous (no wait for the work queued before) and
        # the caching host allocator keeps the buffer until it is done.
        host = torch.empty((len(w), 8), dtype=torch.int64, pin_memory=device.type == "cuda")
        table = host.numpy()
        table[:, 0] = w[:, 0] + e * (n * k)
        table[:, 1] = w[:, 1] + e * (n * k // MX_BLOCK)
        table[:, 2] = w[:, 2] + e * (n * k)
        table[:, 3] = w[:, 3] + e * (nt * kt)
        table[:, 4] = w[:, 4] + e * (nt * kt)
        device_table = host.to(device, non_blocking=True)
        for at in range(0, len(w), GRID_Z):
            _mx_to_block_fp8_grouped_kernel[(kt, nt, min(GRID_Z, len(w) - at))](
                device_table[at:],
                n,
                k,
                *bases,
                status,
                EXACT=scale_mode is ScaleMode.EXACT,
                FNUZ=target is Target.FNUZ,
                PTX=ptx,
                TILE_=TILE,
                BLOCK_=MX_BLOCK,
                num_warps=num_warps or 8,  # measured best on the H200 for both modes (kernel_bench_h200.txt)
                maxnreg=_maxnreg(ptx, num_warps or 8, scale_mode),
                enable_fp_fusion=False,  # keep each float operation's own IEEE rounding
            )
    return status, firsts


def _check_group(
    launched: tuple[torch.Tensor, list[int]] | None, pair: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Raise :class:`GroupMemberError` for the first weight with a bad tile (one device synchronisation)."""
    if launched is None:
        return
    status, firsts = launched
    bad = torch.nonzero(status)
    if bad.numel():
        index = bisect.bisect_right(firsts, int(bad[0, 0])) - 1
        raise GroupMemberError(find_value_problem(*pair(index)) or "invalid MXFP8 values", index)


def convert_packed(
    buffer: torch.Tensor,
    out: torch.Tensor,
    out_scales: torch.Tensor,
    weights: Sequence[PackedWeight],
    target: Target | str = Target.FNUZ,
    scale_mode: ScaleMode | str = ScaleMode.EXACT,
    *,
    kernel: str | None = None,
    num_warps: int | None = None,
    check: bool = True,
) -> None:
    """Convert every weight packed in the uint8 ``buffer``, one launch per distinct weight shape.

    Each weight's converted codes go to ``out`` (uint8) at its own ``code_offset``, its scale_inv to the
    float32 ``out_scales`` at ``out_scale_offset``: the bytes of :func:`convert_triton` for each. Shapes are
    not checked here (the caller laid the buffer out). Raises :class:`GroupMemberError` naming the first
    weight with invalid values unless ``check`` is False.
    """
    target, scale_mode = Target(target), ScaleMode(scale_mode)
    rows = [(w.shape, w.code_offset, w.scale_offset, w.code_offset, w.out_scale_offset) for w in weights]
    aligned = all(w.code_offset % 16 == 0 for w in weights) and buffer.data_ptr() % 16 == 0 == out.data_ptr() % 16
    launched = _launch_group(rows, (buffer, buffer, out, out_scales), target, scale_mode, kernel, num_warps, aligned)
    if check:
        _check_group(launched, lambda i: weights[i].views(buffer))


def convert_triton_grouped(
    items: Sequence[tuple[torch.Tensor, torch.Tensor]],
    target: Target | str = Target.FNUZ,
    scale_mode: ScaleMode | str = ScaleMode.EXACT,
    *,
    kernel: str | None = None,
    num_warps: int | None = None,
    out: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    check: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`convert_triton` for many weights (2-D or 3-D, any mix of shapes, one device), one launch per shape.

    Returns each weight's (codes, scale_inv), the same bytes as converting it alone. A launch costs one
    launch's CPU time whatever the number of weights of its shape, which is what thousands of small per-expert
    tensors need. ``out`` gives the output tensors (contiguous); by default the scales share one allocation. Raises
    :class:`GroupMemberError` (an :class:`MxFormatError`) with the index of the first invalid weight.
    """
    target, scale_mode = Target(target), ScaleMode(scale_mode)
    pairs = []
    for codes, scales in items:
        codes, scales = as_codes(codes), as_codes(scales)
        check_pair_shapes(codes, scales)
        pairs.append((codes.contiguous(), scales.contiguous()))
    if not pairs:
        return []
    if out is None:
        grids = [(*c.shape[:-2], *tile_grid(*c.shape[-2:])) for c, _ in pairs]
        flat = torch.empty(sum(math.prod(g) for g in grids), dtype=torch.float32, device=pairs[0][0].device)
        outs, at = [], 0
        for (codes, _), grid in zip(pairs, grids):
            scale = flat[at : at + math.prod(grid)].view(grid) if math.prod(grid) else flat.new_empty(grid)
            outs.append((torch.empty_like(codes), scale))
            at += math.prod(grid)
    else:
        outs = [(o.view(torch.uint8), sc) for o, sc in out]
    tensors = [[c for c, _ in pairs], [s for _, s in pairs], [o for o, _ in outs], [sc for _, sc in outs]]
    bases = tuple(min(ts, key=torch.Tensor.data_ptr) for ts in tensors)
    rows = [
        (c.shape, c.data_ptr() - bases[0].data_ptr(), s.data_ptr() - bases[1].data_ptr(),
         o.data_ptr() - bases[2].data_ptr(), (sc.data_ptr() - bases[3].data_ptr()) // 4)
        for (c, s), (o, sc) in zip(pairs, outs)
    ]
    aligned = all(t.data_ptr() % 16 == 0 for t in tensors[0] + tensors[2])
    launched = _launch_group(rows, bases, target, scale_mode, kernel, num_warps, aligned)
    if check:
        _check_group(launched, lambda i: pairs[i])
    return outs
