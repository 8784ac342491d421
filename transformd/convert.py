"""Tensor-level entry point: validate one MXFP8 weight and convert it on a device.

Picks the fused Triton kernel on a GPU and NumPy table lookups on the CPU (:mod:`transformd.numpy_exact`; the
PyTorch reference for what they refuse). All give the same bytes.
3-D expert tensors go to the GPU in chunks of whole experts, so device memory stays bounded whatever
the tensor's size.
"""

from __future__ import annotations

import numpy as np
import torch

from .formats import MxFormatError, ScaleMode, Target, infer_row_block
from .kernels import convert_triton
from .mx import as_codes, check_pair_shapes, expand_row_blocks, find_value_problem
from .numpy_exact import converter
from .reference import convert_reference

#: Largest slice of a weight (input code bytes) sent to the GPU at once.
DEFAULT_CHUNK_BYTES = 1 << 30


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``auto`` (or None) -> the current CUDA/ROCm device when there is one, else the CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but PyTorch sees no GPU")
    return device


def convert_weight(
    codes: torch.Tensor,
    scales: torch.Tensor,
    target: Target | str = Target.FNUZ,
    scale_mode: ScaleMode | str = ScaleMode.EXACT,
    device: str | torch.device | None = "auto",
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    row_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate and convert one MXFP8 weight ([N, K] or [E, N, K]).

    Returns ``(codes, scale_inv)`` on the input's device: codes as
    ``float8_e4m3fnuz`` (target ``fnuz``) or ``float8_e4m3fn`` (``ocp``), scale_inv
    float32 ``[..., ceil(N/128), ceil(K/128)]``. Raises :class:`MxFormatError`
    for input that breaks the MXFP8 contract.

    ``scales`` may also be AMD Quark ``per_block`` scales ``[..., ceil(N/R), K/32]`` (one E8M0 scale per Rx32
    block): ``row_block`` gives R, or is inferred from the shapes where they leave one choice.
    """
    target, scale_mode = Target(target), ScaleMode(scale_mode)
    codes, scales = as_codes(codes), as_codes(scales)
    if row_block is None and codes.dim() >= 2 and scales.dim() == codes.dim():
        row_block = infer_row_block(codes.shape[-2], scales.shape[-2])  # None: the shape check below explains
    check_pair_shapes(codes, scales, row_block or 1)
    scales = expand_row_blocks(scales, codes.shape[-2], row_block or 1)
    dev = resolve_device(device)
    if dev.type == "cpu" or codes.numel() == 0:
        looked_up = _convert_cpu(codes, scales, target, scale_mode)
        if looked_up is not None:
            return looked_up
        q, s = convert_reference_checked(codes, scales, target, scale_mode)
    elif codes.dim() == 2 or codes.device == dev:
        q, s = convert_triton(codes.to(dev), scales.to(dev), target, scale_mode)
    else:
        q, s = _convert_chunked(codes, scales, target, scale_mode, dev, chunk_bytes)
    return q.to(codes.device).view(target.torch_dtype), s.to(codes.device)


def convert_reference_checked(codes: torch.Tensor, scales: torch.Tensor, target: Target, scale_mode: ScaleMode
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference on the CPU for a pair whose shapes have passed :func:`check_pair_shapes` (scales one
    per 32 elements): first the value check, whose :class:`MxFormatError` names the first invalid value."""
    problem = find_value_problem(codes, scales)
    if problem:
        raise MxFormatError(problem)
    return convert_reference(codes.cpu(), scales.cpu(), target, scale_mode)


def _convert_cpu(codes: torch.Tensor, scales: torch.Tensor, target: Target, scale_mode: ScaleMode
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Either mode by NumPy table lookups, expert by expert (bit for bit the reference; on the 2-core development
    machine, one thread, 13-16x faster on DeepSeek-V3's experts in the exact mode and 10x in the amax mode:
    ``benchmarks/results/cpu_lookup_bench_cpu.txt``); None for an empty weight, one with an invalid value (the
    reference path then raises the error that names it) or amax tables that would outnumber its codes."""
    if codes.numel() == 0:
        return None
    host_codes, host_scales = codes.cpu().contiguous(), scales.cpu().contiguous()
    q = torch.empty_like(host_codes)
    convert = converter(scale_mode)
    codes3, scales3, out3 = (t.numpy().reshape(-1, *t.shape[-2:]) for t in (host_codes, host_scales, q))
    scale_invs = []
    for e in range(codes3.shape[0]):
        done = convert(codes3[e], scales3[e], fnuz=target is Target.FNUZ, out=out3[e])
        if done is None:
            return None
        scale_invs.append(done[1])
    s = torch.from_numpy(np.stack(scale_invs).reshape(*codes.shape[:-2], *scale_invs[0].shape))
    return q.to(codes.device).view(target.torch_dtype), s.to(codes.device)


def _convert_chunked(codes, scales, target, scale_mode, dev, chunk_bytes):
    """[E, N, K] host tensors -> GPU in chunks of whole experts -> host."""
    e = codes.shape[0]
    per_expert = max(1, codes[0].numel())
    step = max(1, chunk_bytes // per_expert)
    out_codes = torch.empty_like(codes)
    out_scales = []
    for start in range(0, e, step):
        stop = min(e, start + step)
        try:
            q, s = convert_triton(codes[start:stop].to(dev), scales[start:stop].to(dev), target, scale_mode)
        except MxFormatError as err:
            raise MxFormatError(f"{err.problem} (in experts {start}..{stop - 1})") from None
        out_codes[start:stop].copy_(q)
        out_scales.append(s.cpu())
    return out_codes, torch.cat(out_scales)
