"""Plain PyTorch reference of the MXFP8 -> 128x128 block-FP8 conversion.

This is the definition the fast kernel is held to, bit for bit. It favours
being obviously right over being fast: it decodes every element to float32,
takes the tile maximum, divides and casts with PyTorch's own IEEE arithmetic.
Runs on any device PyTorch runs on. 3-D expert tensors are converted one expert
at a time, so temporary memory is that of one [N, K] matrix.
"""

from __future__ import annotations

import torch

from .formats import E4M3FN_MAX, MX_BLOCK, TILE, ScaleMode, Target, tile_grid
from .mx import as_codes, decode_codes, exp2_e8m0


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2 ** e`` for integer ``e`` in [-149, 127], subnormals included."""
    e = e.to(torch.int32)
    bits = torch.where(e >= -126, (e + 127).clamp(min=0) << 23, 1 << (e + 149).clamp(min=0, max=22))
    return bits.view(torch.float32)


def dequantize_mx(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Exact float32 values ``e4m3fn(q) * 2**(s - 127)`` of an MXFP8 tensor."""
    block_scale = exp2_e8m0(scales).repeat_interleave(MX_BLOCK, dim=-1)
    return decode_codes(codes) * block_scale


def tile_amax(v: torch.Tensor) -> torch.Tensor:
    """max |v| over each (zero-padded) 128x128 tile of a 2-D tensor -> [Nt, Kt]."""
    n, k = v.shape
    nt, kt = tile_grid(n, k)
    padded = torch.nn.functional.pad(v.abs(), (0, kt * TILE - k, 0, nt * TILE - n))
    return padded.view(nt, TILE, kt, TILE).amax(dim=(1, 3))


def exact_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2**E`` with E the smallest integer such that ``amax <= 448 * 2**E``; 1.0 for amax == 0."""
    mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
    # 448 * 2**E = 0.875 * 2**(E + 9).
    e = torch.where(mant <= 0.875, exp - 9, exp - 8)
    return torch.where(amax == 0, torch.ones_like(amax), exp2_int(e))


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 ``amax / 448`` (IEEE division); 1.0 for amax == 0.

    The divisor is a tensor on purpose: for a Python-scalar divisor PyTorch's CUDA
    kernel multiplies by the rounded reciprocal instead, which differs from the
    IEEE quotient in the last bit for some amax values.
    """
    return torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, E4M3FN_MAX))


def expand_tiles(t: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[Nt, Kt] per-tile values -> [N, K] per-element values."""
    return t.repeat_interleave(TILE, 0)[:n].repeat_interleave(TILE, 1)[:, :k]


def to_fnuz(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn codes/scales -> FNUZ: -0 (0x80, NaN in FNUZ) becomes 0x00, scale doubles.

    Every other finite code means, in FNUZ, exactly half of its e4m3fn value, so
    doubling the scale makes this lossless.
    """
    codes = torch.where(codes == 0x80, torch.zeros_like(codes), codes)
    return codes, scale * 2


def convert_matrix_reference(
    codes: torch.Tensor,
    scales: torch.Tensor,
    target: Target = Target.FNUZ,
    scale_mode: ScaleMode = ScaleMode.EXACT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert one [N, K] MXFP8 matrix. Returns (uint8 codes [N, K], float32 scale_inv [Nt, Kt])."""
    n, k = codes.shape
    v = dequantize_mx(codes, scales)
    amax = tile_amax(v)
    scale = exact_scale(amax) if ScaleMode(scale_mode) is ScaleMode.EXACT else amax_scale(amax)
    q = (v / expand_tiles(scale, n, k)).to(torch.float8_e4m3fn).view(torch.uint8)
    if Target(target) is Target.FNUZ:
        q, scale = to_fnuz(q, scale)
    return q, scale


def convert_reference(
    codes: torch.Tensor,
    scales: torch.Tensor,
    target: Target | str = Target.FNUZ,
    scale_mode: ScaleMode | str = ScaleMode.EXACT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert a 2-D [N, K] or 3-D [E, N, K] MXFP8 weight; 3-D one expert at a time.

    Inputs must be valid (see :func:`transformd.formats.validate_pair`).
    Returns (uint8 codes, same shape as input; float32 scale_inv [..., Nt, Kt]).
    """
    target, scale_mode = Target(target), ScaleMode(scale_mode)
    codes, scales = as_codes(codes), as_codes(scales)
    if codes.dim() == 2:
        return convert_matrix_reference(codes, scales, target, scale_mode)
    e, n, k = codes.shape
    out = torch.empty_like(codes)
    out_scale = torch.empty((e, *tile_grid(n, k)), dtype=torch.float32, device=codes.device)
    for i in range(e):
        out[i], out_scale[i] = convert_matrix_reference(codes[i], scales[i], target, scale_mode)
    return out, out_scale


def dequantize_block(codes: torch.Tensor, scale_inv: torch.Tensor, target: Target | str) -> torch.Tensor:
    """float32 values of a converted [..., N, K] weight: ``fp8(q) * scale_inv`` per 128x128 tile."""
    dtype = Target(target).torch_dtype
    values = as_codes(codes).view(dtype).to(torch.float32)
    n, k = values.shape[-2:]
    per_elem = scale_inv.repeat_interleave(TILE, -2)[..., :n, :].repeat_interleave(TILE, -1)[..., :k]
    return values * per_elem
