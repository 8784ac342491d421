"""A strict safetensors header reader and a streaming, byte-range-copying writer.

Why not ``safetensors.safe_open`` for everything: the converter must (a) check
every header of a checkpoint before writing one byte, with errors that name the
file and the tensor, (b) copy untouched tensors into a new shard without parsing
or even loading them (so they stay byte-identical and cost no memory), and
(c) write a shard whose header is known up front while its tensors arrive one at
a time (memory bounded by one tensor, or one chunk of one). The header reader and
the format's rules are in :mod:`transformd.safetensors_header` and the writer in
:mod:`transformd.safetensors_writer` (both torch-free); this module adds tensor reads as torch tensors.
"""

from __future__ import annotations

import os
from typing import BinaryIO

import torch

from .errors import CheckpointError
from .safetensors_header import (
    DTYPE_BITS,
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    Header,
    TensorInfo,
    read_header,
    tensor_nbytes,
)
from .safetensors_writer import SafetensorsWriter

__all__ = [
    "DTYPE_BITS",
    "MAX_HEADER_BYTES",
    "MAX_TENSORS",
    "TORCH_DTYPES",
    "CheckpointError",
    "Header",
    "SafetensorsWriter",
    "TensorInfo",
    "read_header",
    "read_range",
    "read_tensor",
    "tensor_nbytes",
]

#: safetensors dtype name -> torch dtype, for the dtypes torch has.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
    "C64": torch.complex64,
}


def read_range(
    f: BinaryIO, begin: int, nbytes: int, *, path: str | os.PathLike[str] | None = None, tensor: str | None = None
) -> torch.Tensor:
    """``nbytes`` bytes of an open file from absolute offset ``begin``, as a fresh uint8 tensor (errors name
    ``path`` and ``tensor``)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes == 0:
        return out
    view = memoryview(out.numpy())
    f.seek(begin)
    done = 0
    while done < nbytes:
        got = f.readinto(view[done:])
        if not got:
            problem = f"file ended {nbytes - done} bytes early while reading bytes [{begin}, {begin + nbytes})"
            raise CheckpointError(problem, file=path, tensor=tensor)
        done += got
    return out


def read_tensor(f: BinaryIO, info: TensorInfo, *, path: str | os.PathLike[str] | None = None) -> torch.Tensor:
    """One tensor of an open safetensors file, typed and shaped as its header says (little-endian host)."""
    if info.dtype not in TORCH_DTYPES:
        raise CheckpointError(f"dtype {info.dtype} has no torch equivalent", file=path, tensor=info.name)
    raw = read_range(f, info.begin, info.nbytes, path=path, tensor=info.name)
    return raw.view(TORCH_DTYPES[info.dtype]).reshape(info.shape)
