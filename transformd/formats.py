"""Format facts of MXFP8 input and 128x128 block-FP8 output: the contract of ``shared/DESIGN.md`` as constants.

Imports no torch, so the client, the daemon's thin paths and the engine profiles share this vocabulary
(:class:`Target`, :class:`ScaleMode`). The checks of tensor pairs are in :mod:`transformd.mx`.
"""


from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from .errors import MxFormatError

__all__ = [
    "E4M3FN_MAX", "E8M0_BIAS", "E8M0_NAN", "FORMAT_VERSION", "MX_BLOCK", "TILE", "MxFormatError", "ScaleMode",
    "Target", "infer_row_block", "shape_str", "tile_grid",
]

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
#: Version of the bytes transformd writes; part of every cache key, raised whenever the output of the same input
#: changes. 2: ``kv_cache_quant_algo: FP8`` in the config of an input that asks for an FP8 KV cache.
FORMAT_VERSION = 2



class Target(str, enum.Enum):
    """Output float8 flavour."""

    FNUZ = "fnuz"  #: float8_e4m3fnuz (AMD gfx94x / MI300X), scale doubled.
    OCP = "ocp"  #: float8_e4m3fn, as produced.

    @property
    def torch_dtype(self) -> Any:
        """The torch dtype (imports torch: this module itself does not)."""
        import torch

        return torch.float8_e4m3fnuz if self is Target.FNUZ else torch.float8_e4m3fn

    @property
    def safetensors_dtype(self) -> str:
        return "F8_E4M3FNUZ" if self is Target.FNUZ else "F8_E4M3"


class ScaleMode(str, enum.Enum):
    """How the 128x128 tile scale is chosen."""

    EXACT = "exact"  #: power of two: lossless except below e4m3fn's normal range.
    AMAX = "amax"  #: fp32 amax / 448, parity with the in-engine path of vLLM PR #45726.


def tile_grid(n: int, k: int) -> tuple[int, int]:
    """Number of 128x128 tiles along N and K (partial tiles count)."""
    return -(-n // TILE), -(-k // TILE)


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


def shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def check_pair_geometry(shape: Sequence[int], scale_shape: Sequence[int], row_block: int = 1) -> None:
    """Check the shapes of a weight/scale pair: ``[N, K]`` or ``[E, N, K]`` codes, K a multiple of 32, scales
    ``[..., ceil(N/R), K/32]`` (``row_block`` R rows share one row of scales: 1 for MXFP8, R for Quark's Rx32)."""
    shape, scale_shape = list(shape), list(scale_shape)
    if len(shape) not in (2, 3):
        raise MxFormatError(f"weight has {len(shape)} dimensions {shape}; expected [N, K] or [E, N, K]")
    k = shape[-1]
    if k % MX_BLOCK:
        raise MxFormatError(f"K = {k} (last axis of weight {shape}) is not a multiple of {MX_BLOCK}")
    if row_block < 1:
        raise MxFormatError(f"{row_block} rows per scale block; expected at least 1")
    expected = [*shape[:-2], -(-shape[-2] // row_block), k // MX_BLOCK]
    if scale_shape != expected:
        blocks = f"{row_block}x{MX_BLOCK}" if row_block > 1 else f"1x{MX_BLOCK}"
        raise MxFormatError(
            f"scale shape {scale_shape} does not match weight shape {shape}; expected {expected} ({blocks} blocks)"
        )
