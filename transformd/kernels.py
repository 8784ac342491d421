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
* ``amax`` mode needs the IEEE quotient ``v / scale`` (plain ``/`` is not
  IEEE-rounded in Triton on NVIDIA). Elements and the tile amax both carry 4-bit
  significands, so the quotient comes from one reciprocal per tile and one FMA
  correction step (Markstein), checked on all 64 significand pairs; tiles of
  extreme magnitude, where intermediates could leave float32's normal range,
  use ``div_rn`` instead.

Invalid input is not converted silently: each tile writes a status word
(bit 0: NaN code, bit 1: E8M0 0xFF, bit 2: a decoded value that is not finite
in float32) and the wrapper raises :class:`~transformd.formats.MxFormatError`.
"""

from __future__ import annotations

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
def _amax_fast(amax):
    """Whether the FMA division is exact for this tile: intermediates stay normal float32."""
    return (amax >= 7.888609052210118e-31) & (amax <= 1.2676506002282294e30)  # 2**-100 .. 2**100


@triton.jit
def _tile_status(bmax_is_nan, s, amax):
    status = tl.max(tl.max(tl.where(bmax_is_nan, STATUS_NAN_CODE, 0), axis=1), axis=0)
    status |= tl.max(tl.max(tl.where(s == 0xFF, STATUS_NAN_SCALE, 0), axis=1), axis=0)
    return status | tl.where(amax < float("inf"), 0, STATUS_OVERFLOW)


@triton.jit
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
    TILE_: tl.constexpr,
    BLOCK_: tl.constexpr,
):
    """Portable kernel: integer decoding and rounding, identical on every back-end."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_e = tl.program_id(2).to(tl.int64)
    KB = K // BLOCK_
    NB: tl.constexpr = TILE_ // BLOCK_

    # 64-bit offset of the tile's first row; 32-bit offsets within the tile.
    row0 = pid_e * N + pid_n * TILE_
    q_ptr += row0 * K
    out_ptr += row0 * K
    s_ptr += row0 * KB

    rows = tl.arange(0, TILE_)
    blks = pid_k * NB + tl.arange(0, NB)
    lane = tl.arange(0, BLOCK_)
    smask = (pid_n * TILE_ + rows[:, None] < N) & (blks[None, :] < KB)  # [TILE, NB]
    qmask = smask[:, :, None]  # [TILE, NB, 1], broadcast over the block
    q_off = rows[:, None, None] * K + blks[None, :, None] * BLOCK_ + lane[None, None, :]
    s_off = rows[:, None] * KB + blks[None, :]

    q8 = tl.load(q_ptr + q_off, mask=qmask, other=0)  # uint8 [TILE, NB, BLOCK]
    s = tl.load(s_ptr + s_off, mask=smask, other=127).to(tl.int32)  # [TILE, NB]
    mag = (q8 & 0x7F).to(tl.int32)
    sign = q8 & 0x80

    # Block maxima: e4m3fn magnitude codes are ordered like their values.
    bmax = tl.max(mag, axis=2)  # [TILE, NB]
    block_scale = tl.where(s > 0, s << 23, 1 << 22).to(tl.float32, bitcast=True)  # 2**(s-127)
    amax = tl.max(tl.max(_decode_magnitude(bmax) * block_scale, axis=1), axis=0)
    status = _tile_status(bmax == 0x7F, s, amax)

    m = _decode_magnitude(mag)
    if EXACT:
        exp = _tile_exponent(amax)
        scale = _exp2(exp)
        y = m * _block_shift(s, exp)[:, :, None]
    else:
        scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, 448.0))
        v = m * block_scale[:, :, None]
        if _amax_fast(amax):
            r = tl.math.div_rn(1.0, scale)
            y0 = v * r
            y = tl.fma(tl.fma(-y0, scale, v), r, y0)
        else:
            y = tl.math.div_rn(v, scale)
    code = _e4m3fn_magnitude(y)
    if FNUZ:
        sign = tl.where(code == 0, 0, sign)  # -0 is NaN in FNUZ: write +0
        scale = scale * 2.0
    tl.store(out_ptr + q_off, (code | sign).to(tl.uint8), mask=qmask)

    tile = (pid_e * tl.num_programs(1) + pid_n) * tl.num_programs(0) + pid_k
    tl.store(out_scale_ptr + tile, scale)
    tl.store(status_ptr + tile, status)


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
# exact: f = m * 2**d ($2), a power-of-two multiply.
_PTX_EXACT = "\n".join(f"mul.rn.f32 f{i}, f{i}, $2;" for i in range(4))
# amax: v = m * 2**(s-127) ($2); y0 = v * r ($3 = 1/scale); y = y0 + (v - y0 * scale) * r ($4 = -scale).
_PTX_AMAX_FMA = "\n".join(
    f"mul.rn.f32 f{i}, f{i}, $2;\nmul.rn.f32 y{i}, f{i}, $3;\nfma.rn.f32 e{i}, y{i}, $4, f{i};\nfma.rn.f32 f{i}, e{i}, $3, y{i};"
    for i in range(4)
)
# amax, extreme tiles: v = m * 2**(s-127) ($2); y = v / scale ($3), IEEE division.
_PTX_AMAX_DIV = "\n".join(f"mul.rn.f32 f{i}, f{i}, $2;\ndiv.rn.f32 f{i}, f{i}, $3;" for i in range(4))
# Bytes of o are <= 0x7E, so adding 0x7F per byte sets bit 7 exactly where a byte is nonzero.
_PTX_SIGN_FNUZ = "add.u32 t, o, 0x7F7F7F7F;\nand.b32 t, t, sg;\nor.b32 $0, o, t;"
_PTX_SIGN_OCP = "or.b32 $0, o, sg;"


def _ptx(body: str, sign: str) -> tl.constexpr:
    return tl.constexpr(_PTX_CONVERT.format(body=body, fnuz=sign))


_PTX_EXACT_FNUZ = _ptx(_PTX_EXACT, _PTX_SIGN_FNUZ)
_PTX_EXACT_OCP = _ptx(_PTX_EXACT, _PTX_SIGN_OCP)
_PTX_AMAX_FMA_FNUZ = _ptx(_PTX_AMAX_FMA, _PTX_SIGN_FNUZ)
_PTX_AMAX_FMA_OCP = _ptx(_PTX_AMAX_FMA, _PTX_SIGN_OCP)
_PTX_AMAX_DIV_FNUZ = _ptx(_PTX_AMAX_DIV, _PTX_SIGN_FNUZ)
_PTX_AMAX_DIV_OCP = _ptx(_PTX_AMAX_DIV, _PTX_SIGN_OCP)
_PTX_WORD_MAX_C = tl.constexpr(_PTX_WORD_MAX)


@triton.jit
def _ptx_word_max(w):
    return tl.inline_asm_elementwise(_PTX_WORD_MAX_C, "=r,r", [w], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _mx_to_block_fp8_ptx_kernel(
    q_ptr,
    s_ptr,
    out_ptr,
    out_scale_ptr,
    status_ptr,
    N,
    K,
    EXACT: tl.constexpr,
    FNUZ: tl.constexpr,
    TILE_: tl.constexpr,
    BLOCK_: tl.constexpr,
):
    """NVIDIA kernel (sm_89+): the same tile program on 32-bit words of four codes."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_e = tl.program_id(2).to(tl.int64)
    KB = K // BLOCK_
    KW = K // 4
    NB: tl.constexpr = TILE_ // BLOCK_
    WB: tl.constexpr = BLOCK_ // 4

    row0 = pid_e * N + pid_n * TILE_
    q_ptr = q_ptr.to(tl.pointer_type(tl.int32)) + row0 * KW
    out_ptr = out_ptr.to(tl.pointer_type(tl.int32)) + row0 * KW
    s_ptr += row0 * KB

    rows = tl.arange(0, TILE_)
    blks = pid_k * NB + tl.arange(0, NB)
    lane = tl.arange(0, WB)
    smask = (pid_n * TILE_ + rows[:, None] < N) & (blks[None, :] < KB)
    wmask = smask[:, :, None]
    w_off = rows[:, None, None] * KW + blks[None, :, None] * WB + lane[None, None, :]
    s_off = rows[:, None] * KB + blks[None, :]

    w = tl.load(q_ptr + w_off, mask=wmask, other=0)  # int32 [TILE, NB, WB]
    s = tl.load(s_ptr + s_off, mask=smask, other=127).to(tl.int32)

    bmax16 = tl.max(_ptx_word_max(w), axis=2)  # f16 bits of each block's largest magnitude
    block_scale = tl.where(s > 0, s << 23, 1 << 22).to(tl.float32, bitcast=True)
    bmax = bmax16.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    amax = tl.max(tl.max(bmax * block_scale, axis=1), axis=0)
    status = _tile_status(bmax16 > 0x7C00, s, amax)

    shape: tl.constexpr = [TILE_, NB, WB]
    if EXACT:
        exp = _tile_exponent(amax)
        scale = _exp2(exp)
        shift = tl.broadcast_to(_block_shift(s, exp)[:, :, None], shape)
        asm: tl.constexpr = _PTX_EXACT_FNUZ if FNUZ else _PTX_EXACT_OCP
        o = tl.inline_asm_elementwise(asm, "=r,r,f", [w, shift], dtype=tl.int32, is_pure=True, pack=1)
    else:
        scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, 448.0))
        bs = tl.broadcast_to(block_scale[:, :, None], shape)
        if _amax_fast(amax):
            r = tl.full(shape, tl.math.div_rn(1.0, scale), tl.float32)
            neg_scale = tl.full(shape, -scale, tl.float32)
            asm_fma: tl.constexpr = _PTX_AMAX_FMA_FNUZ if FNUZ else _PTX_AMAX_FMA_OCP
            o = tl.inline_asm_elementwise(
                asm_fma, "=r,r,f,f,f", [w, bs, r, neg_scale], dtype=tl.int32, is_pure=True, pack=1
            )
        else:
            asm_div: tl.constexpr = _PTX_AMAX_DIV_FNUZ if FNUZ else _PTX_AMAX_DIV_OCP
            div_scale = tl.full(shape, scale, tl.float32)
            o = tl.inline_asm_elementwise(asm_div, "=r,r,f,f", [w, bs, div_scale], dtype=tl.int32, is_pure=True, pack=1)
    if FNUZ:
        scale = scale * 2.0
    tl.store(out_ptr + w_off, o, mask=wmask)

    tile = (pid_e * tl.num_programs(1) + pid_n) * tl.num_programs(0) + pid_k
    tl.store(out_scale_ptr + tile, scale)
    tl.store(status_ptr + tile, status)


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
    launch = _mx_to_block_fp8_ptx_kernel if kernel == "ptx" else _mx_to_block_fp8_kernel
    if e and n and k:
        launch[(kt, nt, e)](
            codes,
            scales,
            out_codes,
            out_scale,
            status,
            n,
            k,
            EXACT=scale_mode is ScaleMode.EXACT,
            FNUZ=target is Target.FNUZ,
            TILE_=TILE,
            BLOCK_=MX_BLOCK,
            num_warps=num_warps or 8,
            enable_fp_fusion=False,  # keep each float operation's own IEEE rounding
        )
        if check and bool(status.any()):
            raise MxFormatError(find_value_problem(codes, scales) or "invalid MXFP8 values")
    if squeeze:
        return out_codes[0], out_scale[0]
    return out_codes, out_scale
