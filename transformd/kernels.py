"""Fused Triton kernel for the MXFP8 -> 128x128 block-FP8 conversion.

One program converts one 128x128 tile: it reads each input byte once (codes and
E8M0 scales), keeps the tile in registers while it takes the tile maximum,
then writes each output byte once (codes, one float32 scale, one status word).
It computes the same function as :mod:`transformd.reference`, bit for bit:

* decoding ``e4m3fn(q) * 2**(s - 127)`` is exact: the code's 7 magnitude bits
  shifted into a float32's exponent/mantissa fields give ``q * 2**-120``
  (a float32 subnormal for e4m3fn subnormals), times ``2**120`` exactly;
* ``exact`` mode finds the tile's power-of-two scale from the block maxima with
  integer arithmetic on float32 bits, so no rounding is involved;
* ``amax`` mode divides with ``tl.math.div_rn`` (IEEE round-to-nearest-even;
  plain ``/`` is not IEEE-rounded in Triton on NVIDIA);
* the float32 -> e4m3fn cast is done with integer operations (the algorithm of
  c10's ``fp8e4m3fn_from_fp32_value``) unless ``native_fp8`` asks for the
  hardware conversion (``tl.float8e4nv``). Both round to nearest even; the
  integer form behaves the same on every back-end (CUDA, ROCm, interpreter).

Invalid input is not converted silently: each tile writes a status word
(bit 0: NaN code, bit 1: E8M0 0xFF, bit 2: a decoded value that is not finite
in float32) and the wrapper raises :class:`~transformd.formats.MxFormatError`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import (
    MX_BLOCK,
    TILE,
    MxFormatError,
    ScaleMode,
    Target,
    as_codes,
    check_pair_shapes,
    find_value_problem,
    tile_grid,
)

STATUS_NAN_CODE = 1
STATUS_NAN_SCALE = 2
STATUS_OVERFLOW = 4


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
def _exp2(e):
    """Exact float32 2**e for integer e in [-149, 127]."""
    bits = tl.where(e >= -126, (tl.maximum(e, -126) + 127) << 23, 1 << tl.minimum(tl.maximum(e + 149, 0), 22))
    return bits.to(tl.float32, bitcast=True)


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
    NATIVE_FP8: tl.constexpr,
    TILE_: tl.constexpr,
    BLOCK_: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_e = tl.program_id(2).to(tl.int64)
    n_tiles_k = tl.num_programs(0)
    n_tiles_n = tl.num_programs(1)
    KB = K // BLOCK_
    NB: tl.constexpr = TILE_ // BLOCK_

    # One expert's matrix at a time; 64-bit base offsets, 32-bit within it.
    q_ptr += pid_e * N * K
    out_ptr += pid_e * N * K
    s_ptr += pid_e * N * KB

    rows = pid_n * TILE_ + tl.arange(0, TILE_)
    blks = pid_k * NB + tl.arange(0, NB)
    lane = tl.arange(0, BLOCK_)
    smask = (rows[:, None] < N) & (blks[None, :] < KB)  # [TILE, NB]
    qmask = smask[:, :, None]  # [TILE, NB, 1], broadcast over the block
    q_off = rows[:, None, None] * K + blks[None, :, None] * BLOCK_ + lane[None, None, :]
    s_off = rows[:, None] * KB + blks[None, :]

    q = tl.load(q_ptr + q_off, mask=qmask, other=0).to(tl.int32)  # [TILE, NB, BLOCK]
    s = tl.load(s_ptr + s_off, mask=smask, other=127).to(tl.int32)  # [TILE, NB]
    mag = q & 0x7F
    sign = q & 0x80

    # Block maxima: e4m3fn magnitude codes are ordered like their values.
    bmax = tl.max(mag, axis=2)  # [TILE, NB]
    block_scale = tl.where(s > 0, s << 23, 1 << 22).to(tl.float32, bitcast=True)  # 2**(s-127)
    if NATIVE_FP8:
        bmax_v = bmax.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        m = mag.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        bmax_v = (bmax << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36  # * 2**120
        m = (mag << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36
    amax = tl.max(tl.max(bmax_v * block_scale, axis=1), axis=0)

    status = tl.max(tl.max(tl.where(bmax == 0x7F, STATUS_NAN_CODE, 0), axis=1), axis=0)
    status |= tl.max(tl.max(tl.where(s == 0xFF, STATUS_NAN_SCALE, 0), axis=1), axis=0)
    status |= tl.where(amax < float("inf"), 0, STATUS_OVERFLOW)

    if EXACT:
        # Smallest E with amax <= 448 * 2**E, from amax's float32 bits.
        ab = amax.to(tl.int32, bitcast=True)
        subnormal = ab < 0x800000
        # A subnormal amax (tiny E8M0 scales) is normalised by an exact int -> float conversion.
        ab = tl.where(subnormal, ab.to(tl.float32).to(tl.int32, bitcast=True), ab)
        e_unbiased = (ab >> 23) - tl.where(subnormal, 127 + 149, 127)
        exp = e_unbiased - 8 + tl.where((ab & 0x7FFFFF) > 0x600000, 1, 0)
        exp = tl.where(amax == 0, 0, exp)
        scale = _exp2(exp)
        # Per block, v / 2**E = m * 2**(s - 127 - E): a power-of-two multiply.
        # d <= 17 for any nonzero block; below -117 every result rounds to 0 anyway.
        d = tl.minimum(tl.maximum(s - 127 - exp, -117), 17)
        shift = ((d + 127) << 23).to(tl.float32, bitcast=True)
        y = m * shift[:, :, None]
    else:
        scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, 448.0))
        v = m * block_scale[:, :, None]
        y = tl.math.div_rn(v, scale)

    if NATIVE_FP8:
        code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        code = _e4m3fn_magnitude(y)
    if FNUZ:
        sign = tl.where(code == 0, 0, sign)  # -0 (0x80) is NaN in FNUZ: write +0
        scale = scale * 2.0
    tl.store(out_ptr + q_off, (code | sign).to(tl.uint8), mask=qmask)

    tile = (pid_e * n_tiles_n + pid_n) * n_tiles_k + pid_k
    tl.store(out_scale_ptr + tile, scale)
    tl.store(status_ptr + tile, status)


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, NATIVE_FP8: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    if NATIVE_FP8:
        code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        code = _e4m3fn_magnitude(y)
    tl.store(out_ptr + offs, code.to(tl.uint8), mask=offs < n)


def round_to_e4m3fn(x: torch.Tensor, *, native_fp8: bool = False) -> torch.Tensor:
    """The kernel's float32 -> e4m3fn rounding on its own, for 0 <= x < 464 (uint8 codes); for tests."""
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), NATIVE_FP8=native_fp8, BLOCK=1024)
    return out


def native_fp8_default(device: torch.device) -> bool:
    """Use the hardware e4m3 conversion where it is known to round like the reference.

    On NVIDIA GPUs of compute capability 8.9+ the cvt instructions were checked
    bit for bit against the reference (benchmarks/kernel_bench.py). Elsewhere
    (ROCm, older GPUs, the interpreter) the integer path is used.
    """
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def convert_triton(
    codes: torch.Tensor,
    scales: torch.Tensor,
    target: Target | str = Target.FNUZ,
    scale_mode: ScaleMode | str = ScaleMode.EXACT,
    *,
    native_fp8: bool | None = None,
    num_warps: int = 8,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert a 2-D [N, K] or 3-D [E, N, K] MXFP8 weight with the fused kernel.

    Returns (uint8 codes, same shape; float32 scale_inv [..., Nt, Kt]), the same
    bytes as :func:`transformd.reference.convert_reference`. Raises
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
    if native_fp8 is None:
        native_fp8 = native_fp8_default(codes.device)
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
            NATIVE_FP8=native_fp8,
            TILE_=TILE,
            BLOCK_=MX_BLOCK,
            num_warps=num_warps,
        )
        if check and bool(status.any()):
            raise MxFormatError(find_value_problem(codes, scales) or "invalid MXFP8 values")
    if squeeze:
        return out_codes[0], out_scale[0]
    return out_codes, out_scale
