"""MXFP8 tensors in PyTorch: decoding E4M3 codes and E8M0 scales, and the checks of a weight/scale pair."""

from __future__ import annotations

import torch

from .errors import MxFormatError
from .formats import E8M0_NAN, MX_BLOCK, check_pair_geometry

#: Dtypes accepted for the weight codes and for the E8M0 scales.
CODE_DTYPES = (torch.uint8, torch.float8_e4m3fn)
SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


def as_codes(t: torch.Tensor) -> torch.Tensor:
    """View float8_e4m3fn or uint8 codes as uint8, without copying."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def check_pair_shapes(codes: torch.Tensor, scales: torch.Tensor, row_block: int = 1) -> None:
    """Check dtypes and shapes of a weight/scale pair (no data is read).

    ``row_block`` is the number of rows that share one row of scales: 1 for MXFP8's 1x32 blocks,
    R for AMD Quark's ``per_block`` Rx32 blocks (scales ``[..., ceil(N/R), K/32]``).
    """
    if codes.dtype not in CODE_DTYPES:
        raise MxFormatError(f"weight dtype {_dt(codes.dtype)} is not float8_e4m3fn (or uint8 codes)")
    if scales.dtype not in SCALE_DTYPES:
        raise MxFormatError(f"scale dtype {_dt(scales.dtype)} is not E8M0 (float8_e8m0fnu or uint8)")
    check_pair_geometry(tuple(codes.shape), tuple(scales.shape), row_block)


def expand_row_blocks(scales: torch.Tensor, n: int, row_block: int) -> torch.Tensor:
    """Per-row scales ``[..., n, K/32]`` from Rx32 block scales ``[..., ceil(n/R), K/32]`` (a copy when R > 1).

    One E8M0 scale shared by R rows is still one power of two per element, so the expanded pair decodes to
    exactly the same values.
    """
    if row_block == 1:
        return scales
    return scales.repeat_interleave(row_block, dim=-2)[..., :n, :]


def find_value_problem(codes: torch.Tensor, scales: torch.Tensor) -> str | None:
    """Describe the first invalid value of a pair, or return None when all are valid.

    Invalid: e4m3fn NaN codes (0x7F, 0xFF), E8M0 NaN scale bytes (0xFF), and
    elements whose decoded value ``e4m3fn(q) * 2**(s - 127)`` is not finite in
    float32. Shapes must already have passed :func:`check_pair_shapes`.
    """
    q = as_codes(codes)
    s = as_codes(scales)
    nan_code = (q & 0x7F) == 0x7F
    if bool(nan_code.any()):
        return f"NaN weight code (0x7F/0xFF) at index {_first_index(nan_code)}"
    nan_scale = s == E8M0_NAN
    if bool(nan_scale.any()):
        return f"E8M0 scale byte 0xFF (NaN) at scale index {_first_index(nan_scale)}"
    # Largest magnitude code of each 32-block; codes are ordered by magnitude.
    block_max = (q & 0x7F).reshape(*q.shape[:-1], -1, MX_BLOCK).amax(dim=-1)
    overflow = ~torch.isfinite(decode_codes(block_max) * exp2_e8m0(s))
    if bool(overflow.any()):
        idx = _first_index(overflow)
        return f"dequantized value is not finite in float32 (E8M0 scale {int(s[idx])} too large) at scale index {idx}"
    return None


def validate_pair(codes: torch.Tensor, scales: torch.Tensor, row_block: int = 1) -> None:
    """Raise :class:`MxFormatError` unless the pair obeys the MXFP8 contract."""
    check_pair_shapes(codes, scales, row_block)
    problem = find_value_problem(codes, expand_row_blocks(scales, codes.shape[-2], row_block))
    if problem:
        raise MxFormatError(problem)


def decode_codes(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes (uint8) -> exact float32 values."""
    return as_codes(codes).view(torch.float8_e4m3fn).to(torch.float32)


def exp2_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> exact float32 ``2 ** (s - 127)`` (2**-127 is a float32 subnormal)."""
    s = as_codes(scales).to(torch.int32)
    # Normal powers of two are the exponent field alone; s == 0 is the subnormal 2**-127.
    bits = torch.where(s > 0, s << 23, torch.full_like(s, 1 << 22))
    return bits.view(torch.float32)


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
