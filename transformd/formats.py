"""Format facts of MXFP8 input and 128x128 block-FP8 output, and input validation.

Nothing in here converts anything: this module states the contract of
``shared/DESIGN.md`` as constants and checks that a tensor pair obeys it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

#: Elements that share one E8M0 scale, along the last axis.
MX_BLOCK = 32
#: Output tile edge (rows and columns of the last two axes).
TILE = 128
#: Largest finite float8_e4m3fn value.
E4M3FN_MAX = 448.0
#: Exponent bias of E8M0 scales: a byte ``s`` means ``2 ** (s - 127)``.
E8M0_BIAS = 127
#: E8M0 byte that means NaN.
E8M0_NAN = 0xFF
#: Version of the bytes transformd writes; part of every cache key.
FORMAT_VERSION = 1

#: Dtypes accepted for the weight codes and for the E8M0 scales.
CODE_DTYPES = (torch.uint8, torch.float8_e4m3fn)
SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


class Target(str, enum.Enum):
    """Output float8 flavour."""

    FNUZ = "fnuz"  #: float8_e4m3fnuz (AMD gfx94x / MI300X), scale doubled.
    OCP = "ocp"  #: float8_e4m3fn, as produced.

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fnuz if self is Target.FNUZ else torch.float8_e4m3fn

    @property
    def safetensors_dtype(self) -> str:
        return "F8_E4M3FNUZ" if self is Target.FNUZ else "F8_E4M3"


class ScaleMode(str, enum.Enum):
    """How the 128x128 tile scale is chosen."""

    EXACT = "exact"  #: power of two: lossless except below e4m3fn's normal range.
    AMAX = "amax"  #: fp32 amax / 448, parity with the in-engine path of vLLM PR #45726.


class MxFormatError(ValueError):
    """An input tensor breaks the MXFP8 contract.

    The message names the file, the tensor and the problem, so that an operator
    can act on it without reading code.
    """

    def __init__(self, problem: str, *, tensor: str | None = None, file: str | None = None):
        self.problem = problem
        self.tensor = tensor
        self.file = file
        where = ", ".join(
            part for part in (f"file {file}" if file else "", f"tensor {tensor}" if tensor else "") if part
        )
        super().__init__(f"{where}: {problem}" if where else problem)

    def located(self, *, tensor: str | None = None, file: str | None = None) -> MxFormatError:
        """The same error with a file and tensor name filled in where they were missing."""
        return MxFormatError(self.problem, tensor=self.tensor or tensor, file=self.file or file)


def tile_grid(n: int, k: int) -> tuple[int, int]:
    """Number of 128x128 tiles along N and K (partial tiles count)."""
    return -(-n // TILE), -(-k // TILE)


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
    if codes.dim() not in (2, 3):
        raise MxFormatError(f"weight has {codes.dim()} dimensions {list(codes.shape)}; expected [N, K] or [E, N, K]")
    k = codes.shape[-1]
    if k % MX_BLOCK:
        raise MxFormatError(f"K = {k} (last axis of weight {list(codes.shape)}) is not a multiple of {MX_BLOCK}")
    if row_block < 1:
        raise MxFormatError(f"{row_block} rows per scale block; expected at least 1")
    expected = [*codes.shape[:-2], -(-codes.shape[-2] // row_block), k // MX_BLOCK]
    if list(scales.shape) != expected:
        blocks = f"{row_block}x{MX_BLOCK}" if row_block > 1 else f"1x{MX_BLOCK}"
        raise MxFormatError(
            f"scale shape {list(scales.shape)} does not match weight shape {list(codes.shape)}; expected {expected} "
            f"({blocks} blocks)"
        )


def infer_row_block(n: int, scale_rows: int) -> int | None:
    """Rows that share one scale row, when the shapes alone tell: 1 when ``scale_rows == n``; else the one R
    with ``ceil(n / R) == scale_rows`` if there is exactly one (Quark ``per_block``); else None (ambiguous or
    impossible: the quantization config must say).
    """
    if scale_rows == n:
        return 1
    if not 0 < scale_rows < n:
        return None
    smallest = -(-n // scale_rows)
    largest = -(-n // (scale_rows - 1)) - 1 if scale_rows > 1 else n
    return smallest if smallest == largest else None


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


def shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"
