"""MXFP8 inputs for the kernel tests (tests/test_kernels.py) and the GPU suite (tests/gpu/run_gpu_suite.py):
random valid data, inputs at the edges of the contract, and invalid values every path must refuse.
"""

from __future__ import annotations

import torch


def random_mx(shape, lo=112, hi=140, seed=0):
    """Random valid MXFP8 data: every non-NaN code, E8M0 bytes in [lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    q[(q & 0x7F) == 0x7F] -= 1  # NaN codes -> 0x7E / 0xFE
    s = torch.randint(lo, hi, (*shape[:-1], shape[-1] // 32), dtype=torch.uint8, generator=g)
    return q, s


def every_scale_mx(shape, seed=9):
    """Random MXFP8 data with E8M0 bytes over their whole range in every tile (codes below 2.0 keep even 2**127
    finite)."""
    q, s = random_mx(shape, lo=0, hi=255, seed=seed)
    return q & 0xBF, s


def spread_row_mx():
    """A [1, 8192] weight whose 128-wide tiles each have E8M0 bytes 120, 125, 127 and 130 (all codes 0x30): 11
    tables of 256 bytes a tile for 128 codes, which the amax mode's CPU lookups leave to the reference."""
    q = torch.full((1, 8192), 0x30, dtype=torch.uint8)
    return q, torch.tensor([120, 125, 127, 130], dtype=torch.uint8).repeat(64)[None]


def awkward_cases():
    """Inputs at the edges of the contract: name -> (codes [E, N, K], scales)."""
    cases = {}
    q, s = random_mx((2, 160, 192), seed=1)
    cases["negative zeros"] = (torch.where(q < 0x90, torch.full_like(q, 0x80), q), s)
    cases["all zero with -0"] = (torch.full((1, 130, 160), 0x80, dtype=torch.uint8), s[:1, :130, :5])
    sub = torch.randint(0, 8, (1, 140, 160), dtype=torch.uint8) | (torch.randint(0, 2, (1, 140, 160)) * 0x80).to(
        torch.uint8
    )
    cases["subnormal codes only"] = (sub, torch.full((1, 140, 5), 127, dtype=torch.uint8))
    q, _ = random_mx((1, 200, 256), seed=2)
    cases["tiny scales 0..3"] = (q, torch.randint(0, 4, (1, 200, 8), dtype=torch.uint8))
    cases["huge scales, small codes"] = (q & 0x9F, torch.randint(240, 255, (1, 200, 8), dtype=torch.uint8))
    # One tile mixing the largest and smallest scales: most elements underflow to (signed) zero.
    # Codes below 2.0 keep even 2**127 finite in float32.
    s = torch.tensor([0, 1, 2, 250, 253, 254], dtype=torch.uint8)[torch.randint(0, 6, (1, 128, 4))]
    cases["mixed extreme scales"] = (q[:, :128, :128] & 0xBF, s)
    one = torch.zeros((1, 129, 129 // 32 * 32 + 32), dtype=torch.uint8)
    one[0, 128, 0] = 0xFE  # the only nonzero element sits alone in a partial tile
    cases["single element in partial tile"] = (one, torch.full((1, 129, one.shape[-1] // 32), 130, dtype=torch.uint8))
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    every = every[(every & 0x7F) != 0x7F].repeat(128 * 128 // 254 + 1)[: 128 * 128].view(1, 128, 128)
    cases["every code, scale 2**0"] = (every, torch.full((1, 128, 4), 127, dtype=torch.uint8))
    cases["every code, mixed scales"] = (every, torch.randint(100, 150, (1, 128, 4), dtype=torch.uint8))
    # amax mode's fast division is exact only if it is right for every pair of significands of an
    # element and of its tile's amax (4 bits each, so 64 pairs): one tile per amax significand,
    # holding every code up to it, both signs.
    tiles = []
    for amax_code in range(0x70, 0x78):
        codes = torch.arange(amax_code + 1, dtype=torch.int32)
        codes = torch.cat([codes, codes | 0x80]).to(torch.uint8)
        tiles.append(codes.repeat(128 * 128 // codes.numel() + 1)[: 128 * 128].view(128, 128))
    tiles = torch.stack(tiles)
    cases["every amax significand"] = (tiles, torch.full((8, 128, 4), 127, dtype=torch.uint8))
    cases["every amax significand, scales 120..134"] = (tiles, torch.randint(120, 135, (8, 128, 4), dtype=torch.uint8))
    # amax mode divides by the significand of the tile's scale (amax / 448): 8 significands where the scale is a
    # normal float32, 78 more where it is subnormal (amax < 448 * 2**-126), all reached by scale bytes 0 and 1.
    # One 1x128 tile per amax code, holding every code up to it (every quotient of the tile), signs alternating.
    rows = torch.zeros((0x7E, 1, 128), dtype=torch.int32)
    for amax_code in range(1, 0x7F):
        codes = torch.arange(amax_code + 1, dtype=torch.int32)
        rows[amax_code - 1, 0, : amax_code + 1] = codes | (codes % 2) * 0x80
    for byte in (0, 1, 127):
        cases[f"every amax code, one-row tiles, scale byte {byte}"] = (
            rows.to(torch.uint8), torch.full((0x7E, 1, 4), byte, dtype=torch.uint8)
        )
    # One multiply per element must round like the IEEE quotient at every exponent (tests/test_amax_division.py):
    # one tile per amax significand, every code below it in blocks 0..23 scale steps under the amax's block, so
    # quotients reach e4m3fn's subnormals and the rounding to 0.
    tiles = torch.zeros((8, 128, 128), dtype=torch.int32)
    scales = torch.zeros((8, 128, 4), dtype=torch.int32)
    block = torch.arange(128 * 4).view(128, 4)  # block j: 24 * t + shift
    for i, amax_code in enumerate(range(0x70, 0x78)):
        group = (block // 24) % 4  # which 32 codes (of 0..amax_code) block j holds
        codes = (group[:, :, None] * 32 + torch.arange(32)) % (amax_code + 1)
        tiles[i] = (codes | (block[:, :, None] % 2) * 0x80).view(128, 128)
        scales[i] = 127 - block % 24
    name = "every amax significand, every code 0..23 scale steps below"
    cases[name] = (tiles.to(torch.uint8), scales.to(torch.uint8))
    return cases


AWKWARD = awkward_cases()


def invalid_cases():
    """Invalid values: name -> (codes, scales, words of the error)."""
    q, s = random_mx((2, 128, 128), seed=7)
    nan_pos = q.clone()
    nan_pos[1, 5, 7] = 0x7F
    nan_neg = q.clone()
    nan_neg[0, 127, 100] = 0xFF
    bad_scale = s.clone()
    bad_scale[0, 3, 2] = 0xFF
    overflow_q = q.clone()
    overflow_q[0, 0, 0] = 0x7E  # 448 * 2**(254-127) is not finite in float32
    overflow_s = s.clone()
    overflow_s[0, 0, 0] = 254
    return {
        "NaN code 0x7F": (nan_pos, s, "NaN weight code"),
        "NaN code 0xFF": (nan_neg, s, "NaN weight code"),
        "E8M0 0xFF": (q, bad_scale, "0xFF"),
        "overflow": (overflow_q, overflow_s, "not finite"),
    }
