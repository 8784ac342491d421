"""The conversion in NumPy, without torch: what the CPU path and a head start while torch is imported convert with
(both scale modes).

In the exact mode a tile's scale is a power of two, ``2**E``, so an element's converted code depends only on its
code ``q`` and on ``d = s - 127 - E`` (its 32-block's E8M0 byte ``s`` against its tile's exponent): it is
``e4m3fn(value(q) * 2**d)``, rounded to nearest even. One table row per ``d`` holds that for every code, so
converting is a table lookup per element; the tile's ``E`` comes from the largest magnitude code of each block.
Bit for bit the reference's conversion (:func:`transformd.reference.convert_reference`, ``scale_mode="exact"``):

* the reference decodes ``value(q) * 2**(s - 127)`` in float32 exactly (4 significant bits, at least ``2**-136``)
  and divides by ``2**E`` exactly, except where the quotient falls below float32's normals; those quotients are
  below ``2**-126``, far under half of e4m3fn's smallest subnormal, and round to a signed zero either way;
* a block with a nonzero code has ``d <= 17`` (its largest value is at most the tile's amax <= ``448 * 2**E``, and
  its largest code at least ``2**-9``); ``d <= -19`` leaves every code below ``2**-10`` (a signed zero); an
  all-zero block maps to signed zeros at any ``d``. So rows for ``d`` in [-19, 17] cover every input.

The amax mode (:func:`convert_amax`) divides by a tile scale that is no power of two, so its tables are per tile:
one per E8M0 byte the tile's blocks that matter have (at most 38), each entry the IEEE float32 quotient rounded as
torch casts; the other blocks round to signed zeros whatever their codes.

``tests/test_numpy_exact.py`` checks the tables and the rounding against torch's own cast and the conversions against
the reference.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from .formats import E4M3FN_MAX, E8M0_BIAS, E8M0_NAN, MX_BLOCK, TILE, ScaleMode, tile_grid

#: Shifts ``d`` that have a row in the table (smaller ones take the first row, larger ones the last).
D_MIN, D_MAX = -19, 17
#: Bytes of table indices made at once: a lookup from an index array in the core's cache ran 2x faster.
_INDEX_BYTES = 1 << 20
#: Bytes of codes whose block maxima are taken at once (:func:`block_maxima`; fastest of 64 KiB to 1 MiB).
_MAX_BYTES = 1 << 18
#: Table bytes :func:`convert_amax` makes for a matrix beyond four per code at the most.
_AMAX_TABLE_BYTES = 1 << 16
#: Table entries :func:`convert_amax` computes at once (their float32 and int64 temporaries: ~40 bytes each).
_AMAX_ENTRIES = 1 << 16
#: Lookup tables up to this many entries are indexed with uint32, larger ones with uint64.
_UINT32_ENTRIES = 1 << 32


def tile_bands(shape: Sequence[int], most_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(expert, first row, end row) of each band of an [N, K] or [E, N, K] weight, in the order of its bytes: whole
    128-row tiles of one expert, at most ``most_bytes`` codes (one tile row at the least), each of which
    :func:`convert_exact` converts as it would the whole matrix."""
    *lead, n, k = shape
    rows = max(TILE, most_bytes // max(1, k) // TILE * TILE)
    for e in range(math.prod(lead)):
        for r0 in range(0, n, rows):
            yield e, r0, min(n, r0 + rows)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # (no affinity on this platform)
        return os.cpu_count() or 1


def e4m3fn_value(code: int) -> float:
    """The exact value of a finite e4m3fn code (0x7F and 0xFF are NaN: not asked for)."""
    e, m = (code >> 3) & 0xF, code & 0x7
    magnitude = math.ldexp(m, -9) if e == 0 else math.ldexp(8 + m, e - 10)
    return -magnitude if code & 0x80 else magnitude


def e4m3fn_code(x: float) -> int:
    """``x`` rounded to the nearest e4m3fn code, ties to even, as torch casts float32; beyond 448 (which no valid
    input reaches) the largest code, as torch's CPU cast saturates."""
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a < math.ldexp(1.0, -6):  # subnormal: a multiple of 2**-9 (8 of them: the first normal, code 0x08)
        return sign | round(math.ldexp(a, 9))  # (round: ties to even; the product is exact)
    _, e = math.frexp(a)  # a = f * 2**e, f in [0.5, 1)
    e -= 1  # a in [2**e, 2**(e + 1)): e4m3fn's exponent; 8 steps of 2**(e - 3) per binade
    q = round(math.ldexp(a, 3 - e))  # 8..16
    if q == 16:
        e, q = e + 1, 8
    if e > 8 or (e == 8 and q > 14):
        return sign | 0x7E
    return sign | ((e + 7) << 3) | (q - 8)


@functools.cache
def table(fnuz: bool) -> np.ndarray:
    """uint8 [D_MAX - D_MIN + 1, 256]: row ``d - D_MIN`` is every code's conversion at shift ``d``; FNUZ maps the
    negative zero (0x80, NaN in FNUZ) to 0x00 (its scale doubles, so every other code means the same)."""
    rows = np.zeros((D_MAX - D_MIN + 1, 256), dtype=np.uint8)
    for i, d in enumerate(range(D_MIN, D_MAX + 1)):
        for code in range(256):
            if code & 0x7F != 0x7F:  # (NaN codes are refused before a lookup)
                rows[i, code] = e4m3fn_code(math.ldexp(e4m3fn_value(code), d))
    if fnuz:
        rows[rows == 0x80] = 0
    rows.setflags(write=False)
    return rows


@functools.cache
def _magnitudes() -> np.ndarray:
    """float64 value of every magnitude code 0..127 (0x7F, NaN, as 0: refused before it is used)."""
    return np.array([0.0 if c == 0x7F else e4m3fn_value(c) for c in range(128)], dtype=np.float64)


@functools.cache
def _powers() -> np.ndarray:
    """float64 ``2**(s - 127)`` of every E8M0 byte ``s`` (0xFF, NaN, refused before it is used)."""
    return np.ldexp(1.0, np.arange(256) - E8M0_BIAS)


def block_maxima(codes: np.ndarray) -> np.ndarray:
    """The largest magnitude code (0..127) of each 32-block of uint8 ``codes`` [N, K] -> uint8 [N, K/32].

    By element-wise maxima of the codes and themselves shifted by 1, 2, 4, 8 and 16 (after which each position
    holds the largest of the 32 from it on), in pieces of :data:`_MAX_BYTES`: a reduction along 32-byte rows ran
    8x slower (18 ms against 2 ms for 16 MiB)."""
    n, k = codes.shape
    flat = codes.reshape(-1)
    out = np.empty(flat.size // MX_BLOCK, dtype=np.uint8)
    step = max(MX_BLOCK, min(_MAX_BYTES, flat.size))
    a, b = np.empty(step, dtype=np.uint8), np.empty(step, dtype=np.uint8)
    for at in range(0, flat.size, step):
        size = min(step, flat.size - at)
        np.bitwise_and(flat[at : at + size], 0x7F, out=a[:size])
        cur, spare, live, shift = a, b, size, 1
        while shift < MX_BLOCK:
            np.maximum(cur[: live - shift], cur[shift:live], out=spare[: live - shift])
            cur, spare, live, shift = spare, cur, live - shift, 2 * shift
        out[at // MX_BLOCK : (at + size) // MX_BLOCK] = cur[0:live:MX_BLOCK]
    return out.reshape(n, k // MX_BLOCK)


def _block_max(codes: np.ndarray, scales: np.ndarray) -> np.ndarray | None:
    """The largest magnitude of each 32-block (float64 [N, K/32], exact: float32's value), or None for an invalid
    value (a NaN code, an E8M0 NaN byte, a value not finite in float32)."""
    biggest = block_maxima(codes)
    if (biggest == 0x7F).any() or (scales == E8M0_NAN).any():
        return None
    block_max = _magnitudes()[biggest] * _powers()[scales]  # exact in float64
    if (block_max >= 2.0**128).any():  # not finite in float32
        return None
    return block_max


def _per_tile(reduce: np.ufunc, per_block: np.ndarray) -> np.ndarray:
    """[N, K/32] per-block values -> ``reduce`` over each 128x128 tile's blocks, [tiles along N, tiles along K] (a
    partial tile: the blocks it has)."""
    n, groups = per_block.shape
    by_rows = reduce.reduceat(per_block, np.arange(0, n, TILE), axis=0)
    return reduce.reduceat(by_rows, np.arange(0, groups, TILE // MX_BLOCK), axis=1)


def _per_block(per_tile: np.ndarray, n: int, groups: int) -> np.ndarray:
    """[tiles along N, tiles along K] -> each 32-block's tile's value, [N, K/32] (:func:`_per_tile`'s inverse)."""
    return np.repeat(np.repeat(per_tile, TILE, axis=0)[:n], TILE // MX_BLOCK, axis=1)[:, :groups]


def _look_up(lookup: np.ndarray, first: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
    """``out[r, c] = lookup[first[r, c // 32] + codes[r, c]]`` (``first``: multiples of 256, one per 32-block)."""
    n, k = codes.shape
    groups = k // MX_BLOCK
    blocks, converted, first = codes.reshape(n, groups, MX_BLOCK), out.reshape(n, groups, MX_BLOCK), first[:, :, None]
    step = max(1, _INDEX_BYTES // (first.itemsize * k))  # rows whose indices stay in the core's cache
    index = np.empty((min(step, n), groups, MX_BLOCK), dtype=first.dtype)
    for r in range(0, n, step):
        part = index[: min(step, n - r)]
        np.bitwise_or(first[r : r + step], blocks[r : r + step], out=part)
        np.take(lookup, part, out=converted[r : r + step], mode="wrap")  # (in range: never wraps; faster than clip)


def converter(scale_mode: ScaleMode | str) -> Callable[..., tuple[np.ndarray, np.ndarray] | None]:
    """:func:`convert_exact` or :func:`convert_amax`, by scale mode."""
    return convert_exact if ScaleMode(scale_mode) is ScaleMode.EXACT else convert_amax


def convert_exact(codes: np.ndarray, scales: np.ndarray, *, fnuz: bool, out: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """Convert an MXFP8 matrix in the exact scale mode: uint8 ``codes`` [N, K] (K a multiple of 32) and their E8M0
    ``scales`` [N, K/32] -> (uint8 codes [N, K], into ``out`` when given; float32 scale_inv [ceil(N/128),
    ceil(K/128)]). Tiles start at row 0: a slice of a larger matrix converts alike when it starts at a multiple
    of 128 rows.

    None when a value is invalid (a NaN code, an E8M0 NaN byte, a value not finite in float32): the caller leaves
    that weight to the torch path, whose error names it.
    """
    return _convert(codes, scales, out, functools.partial(_exact_tables, fnuz=fnuz))


def _convert(codes: np.ndarray, scales: np.ndarray, out: np.ndarray | None,
             tables: Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray] | None]
             ) -> tuple[np.ndarray, np.ndarray] | None:
    """Either mode: ``tables(amax, scales, block_max)`` gives (the lookup table, each block's first index in it,
    scale_inv) from the tiles' and the blocks' largest magnitudes, or None."""
    n, k = codes.shape
    if out is None:
        out = np.empty((n, k), dtype=np.uint8)
    if not (n and k // MX_BLOCK):
        return out, np.empty(tile_grid(n, k), dtype=np.float32)
    block_max = _block_max(codes, scales)
    made = None if block_max is None else tables(_per_tile(np.maximum, block_max), scales, block_max)
    if made is None:
        return None
    lookup, first, scale_inv = made
    _look_up(lookup, first, codes, out)
    return out, scale_inv


def _exact_tables(amax: np.ndarray, scales: np.ndarray, block_max: np.ndarray, *, fnuz: bool
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The exact mode's: one table row per shift ``d`` (:func:`table`), each block's row from its tile's exponent."""
    mant, exp = np.frexp(amax)  # amax = mant * 2**exp; 448 * 2**E = 0.875 * 2**(E + 9)
    e = np.where(amax == 0, 0, np.where(mant <= 0.875, exp - 9, exp - 8)).astype(np.int16)
    scale_inv = np.ldexp(np.float64(2.0) if fnuz else np.float64(1.0), e).astype(np.float32)
    d = scales.astype(np.int16) - (E8M0_BIAS + D_MIN) - _per_block(e, *scales.shape)
    return table(fnuz).reshape(-1), np.left_shift(np.clip(d, 0, D_MAX - D_MIN).astype(np.uint16), 8), scale_inv


def round_to_e4m3fn(a: np.ndarray) -> np.ndarray:
    """float32 magnitudes ``a`` in [0, 448] -> their e4m3fn codes (0..0x7E), rounded to nearest even as torch casts."""
    bits = a.view(np.uint32).astype(np.int64)
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)  # to 3 significand bits, ties to even (a carry bumps the exponent)
    normal = (rounded >> 20) - ((127 - 7) << 3)  # float32's exponent and 3 bits -> e4m3fn's (bias 7)
    subnormal = np.rint(a * np.float32(512))  # below 2**-6: a multiple of 2**-9, 0..8 (exact product)
    return np.where(a < np.float32(2.0**-6), subnormal, normal).astype(np.uint8)


def convert_amax(codes: np.ndarray, scales: np.ndarray, *, fnuz: bool, out: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`convert_exact` in the amax scale mode: each tile's scale is float32 ``amax / 448`` (IEEE division, as
    the reference), and each code ``e4m3fn(value / scale)``. That depends on the code, its block's E8M0 byte and its
    tile's scale, so each tile gets one table per E8M0 byte between the lowest and the highest of its blocks that
    matter (the value of each magnitude code, exact in float32, divided by the scale in float32 and rounded by
    :func:`round_to_e4m3fn`), and converting is a lookup per element as in the exact mode.

    A block matters when its largest magnitude is above ``scale * 2**-10``; every other block (all-zero blocks,
    and blocks so small against their tile that each quotient rounds to a signed zero) shares one table of signed
    zeros. A block that matters has an E8M0 byte within 9 above and 28 below its tile's amax's exponent (its largest
    code is at least ``2**-9`` and at most 448 times its power of two), so a tile has at most 38 tables: 9.5 KiB
    against a full tile's 16 KiB of codes. The tables are computed :data:`_AMAX_ENTRIES` entries at a time.

    None also when the tables would outnumber the codes by more than 4 to 1 beyond :data:`_AMAX_TABLE_BYTES` (only
    matrices of a few rows and very spread scales): the caller converts that weight with the reference.
    """
    return _convert(codes, scales, out, functools.partial(_amax_tables, fnuz=fnuz))


def _amax_tables(amax: np.ndarray, scales: np.ndarray, block_max: np.ndarray, *, fnuz: bool
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The amax mode's: the table of signed zeros, then a table per tile and E8M0 byte (:func:`convert_amax`), or
    None when they would outnumber the codes."""
    n, groups = scales.shape
    amax = amax.astype(np.float32)  # (exact)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(amax == 0, np.float32(1.0), amax / np.float32(E4M3FN_MAX))
    tiles_n, tiles_k = scale.shape
    # (exact in float64: a quotient at most 2**-10 rounds to 2**-10 at most in float32, and that to zero, ties even)
    matters = block_max > _per_block(scale.astype(np.float64) * 2.0**-10, n, groups)
    byte = scales.astype(np.int32)
    lowest = np.minimum(_per_tile(np.minimum, np.where(matters, byte, E8M0_NAN)), E8M0_NAN - 1)
    above = byte - _per_block(lowest, n, groups)  # each block's table among its tile's
    width = int(above.max(initial=-1, where=matters)) + 1
    tiles = tiles_n * tiles_k
    if tiles * width * 256 > _AMAX_TABLE_BYTES + 4 * n * groups * MX_BLOCK:
        return None
    lookup = np.empty(256 * (1 + tiles * width), dtype=np.uint8)
    lookup[:256] = np.repeat(np.array([0, 0 if fnuz else 0x80], dtype=np.uint8), 128)  # the signed zeros
    lowest, quotient_scale = lowest.reshape(-1), scale.reshape(-1, 1, 1)
    step = max(1, _AMAX_ENTRIES // (128 * max(1, width)))  # tiles at a time
    for t0 in range(0, tiles, step):
        t1 = min(tiles, t0 + step)
        exps = np.minimum(lowest[t0:t1, None] + np.arange(width), E8M0_NAN - 1)  # (past a tile's highest: unused)
        with np.errstate(over="ignore"):  # (tables no block uses may overflow; the used ones are at most ~448)
            values = _magnitudes().astype(np.float32) * _powers().astype(np.float32)[exps][..., None]
            quotients = np.minimum(values / quotient_scale[t0:t1], np.float32(E4M3FN_MAX))
        magnitudes = round_to_e4m3fn(quotients)  # [tiles, width, 128]
        part = lookup[256 * (1 + t0 * width) : 256 * (1 + t1 * width)].reshape(t1 - t0, width, 256)
        part[..., :128] = magnitudes
        np.bitwise_or(magnitudes, 0x80, out=part[..., 128:])
    if fnuz:
        lookup[lookup == 0x80] = 0
        scale = scale * np.float32(2.0)
    tile = _per_block(np.arange(tiles).reshape(tiles_n, tiles_k), n, groups)
    index = np.uint32 if lookup.size <= _UINT32_ENTRIES else np.uint64  # (wider only for matrices of over 1 GiB)
    first = np.where(matters, (1 + tile * width + above) << 8, 0).astype(index)
    return lookup, first, scale
