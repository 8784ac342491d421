"""Independent oracles for the conversion, written without transformd's code.

* :func:`numpy_oracle` follows DESIGN.md's formulas with NumPy and ml_dtypes'
  float8 types (its own RNE casts), in float64 where that is exact and in
  NumPy float32 (IEEE) where the contract says float32.
* :func:`pr45726_convert` is the in-engine path of vLLM PR #45726 as that PR
  describes it: per expert, dequantize to BF16, take each padded 128x128 tile's
  amax, fp32 ``amax / 448``, fp32 divide, cast to e4m3fn, FNUZ fix (-128 -> 0,
  scale doubled). The benchmark times it as the baseline transformd replaces.
  Where BF16 cannot hold a decoded value exactly (E8M0 bytes below ~7, far
  outside real checkpoints) it differs from the exact contract by design.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

TILE = 128


def _pad_tiles(a: np.ndarray) -> np.ndarray:
    n, k = a.shape
    nt, kt = -(-n // TILE), -(-k // TILE)
    padded = np.zeros((nt * TILE, kt * TILE), dtype=a.dtype)
    padded[:n, :k] = a
    return padded.reshape(nt, TILE, kt, TILE)


def numpy_oracle(codes: np.ndarray, scales: np.ndarray, target: str, scale_mode: str) -> tuple[np.ndarray, np.ndarray]:
    """One [N, K] matrix: uint8 codes and uint8 E8M0 scales -> (uint8 codes, float32 scale_inv)."""
    n, k = codes.shape
    m = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    v = m * np.ldexp(1.0, np.repeat(scales.astype(np.int64) - 127, 32, axis=1))  # exact in float64
    amax = np.abs(_pad_tiles(v)).max(axis=(1, 3))
    if scale_mode == "exact":
        # Smallest integer E with amax <= 448 * 2**E, by search on exact float64 powers of two.
        e = np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / 448.0)).astype(np.int64)
        e = np.where(amax > 448.0 * np.ldexp(1.0, e), e + 1, e)
        e = np.where(amax <= 448.0 * np.ldexp(1.0, e - 1), e - 1, e)
        scale = np.where(amax > 0, np.ldexp(1.0, e), 1.0)
        y = v / np.repeat(np.repeat(scale, TILE, 0)[:n], TILE, 1)[:, :k]  # exact: power-of-two divide
        scale32 = scale.astype(np.float32)
    else:
        scale32 = np.where(amax > 0, amax.astype(np.float32) / np.float32(448.0), np.float32(1.0)).astype(np.float32)
        y = v.astype(np.float32) / np.repeat(np.repeat(scale32, TILE, 0)[:n], TILE, 1)[:, :k]
    q = y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    if target == "fnuz":
        q = np.where(q == 0x80, np.uint8(0), q)
        scale32 = (scale32 * np.float32(2.0)).astype(np.float32)
    return q.astype(np.uint8), scale32


def pr45726_convert_expert(
    weight: torch.Tensor, weight_scale: torch.Tensor, fnuz: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM PR #45726's per-expert conversion. weight: float8_e4m3fn [N, K]; weight_scale: uint8 [N, K/32]."""
    n, k = weight.shape
    scale_bf16 = weight_scale.view(torch.float8_e8m0fnu).to(torch.bfloat16)
    w = weight.to(torch.bfloat16) * scale_bf16.repeat_interleave(32, dim=1)
    nt, kt = -(-n // TILE), -(-k // TILE)
    w = torch.nn.functional.pad(w, (0, kt * TILE - k, 0, nt * TILE - n))
    tiles = w.view(nt, TILE, kt, TILE)
    amax = tiles.abs().amax(dim=(1, 3)).to(torch.float32)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    q = (tiles.to(torch.float32) / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    q = q.view(nt * TILE, kt * TILE)[:n, :k].contiguous()
    if fnuz:
        as_int8 = q.view(torch.int8)
        as_int8[as_int8 == -128] = 0
        return as_int8.view(torch.float8_e4m3fnuz), scale * 2.0
    return q, scale


def pr45726_convert(weight: torch.Tensor, weight_scale: torch.Tensor, fnuz: bool = True):
    """[E, N, K] (or [N, K]) weights, one expert at a time, as the PR does."""
    if weight.dim() == 2:
        return pr45726_convert_expert(weight, weight_scale, fnuz)
    outs = [pr45726_convert_expert(weight[i], weight_scale[i], fnuz) for i in range(weight.shape[0])]
    return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
