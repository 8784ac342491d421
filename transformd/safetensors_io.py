"""A strict safetensors header reader and a streaming, byte-range-copying writer.

Why not ``safetensors.safe_open`` for everything: the converter must (a) check
every header of a checkpoint before writing one byte, with errors that name the
file and the tensor, (b) copy untouched tensors into a new shard without parsing
or even loading them (so they stay byte-identical and cost no memory), and
(c) write a shard whose header is known up front while its tensors arrive one at
a time (memory bounded by one tensor, or one chunk of one). The header reader and
the format's rules are in :mod:`transformd.safetensors_header` (torch-free); this module adds
tensor reads and the writer.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from .errors import CheckpointError
from .safetensors_header import (
    DTYPE_BITS,
    HEADER_ALIGN,
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    Header,
    TensorInfo,
    read_header,
    tensor_nbytes,
)

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

_COPY_CHUNK = 16 * 1024 * 1024


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


@dataclass
class _Slot:
    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    filled: int = 0


class SafetensorsWriter:
    """Write a safetensors file whose tensor names, dtypes and shapes are known before their data.

    The header goes out first; then tensor bytes are appended in header order,
    each tensor in one or several pieces (:meth:`write`) or copied straight from
    a byte range of another file (:meth:`copy_from`), so memory stays bounded by
    the largest piece. :meth:`close` checks that every tensor was filled, then
    flushes and fsyncs. The header is padded with spaces to a multiple of 8
    bytes, as the safetensors library does, so the data section is aligned.

    Use as a context manager; on an exception the file is closed unchecked and
    left for the caller to delete (the converter writes into a staging directory).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        specs: Iterable[tuple[str, str, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
    ):
        self.path = Path(path)
        self.bytes_written = 0
        self._slots: list[_Slot] = []
        self._current = 0
        header: dict[str, object] = {}
        if metadata is not None:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for name, dtype, shape in specs:
            if name == "__metadata__" or name in header or not name:
                raise ValueError(f"tensor name {name!r} is empty, reserved or repeated")
            if dtype not in DTYPE_BITS:
                raise ValueError(f"tensor {name}: unknown dtype {dtype!r}")
            slot = _Slot(name, dtype, [int(d) for d in shape], tensor_nbytes(dtype, shape))
            header[name] = {"dtype": dtype, "shape": slot.shape, "data_offsets": [offset, offset + slot.nbytes]}
            offset += slot.nbytes
            self._slots.append(slot)
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % HEADER_ALIGN)
        self._file = open(self.path, "xb", buffering=0)
        self._put(struct.pack("<Q", len(raw)) + raw)

    # -- appending data -------------------------------------------------------------------------------------------

    def write(self, name: str, data: torch.Tensor | bytes | bytearray | memoryview) -> None:
        """Append ``data`` (a tensor's raw little-endian bytes, or a contiguous piece of them) to tensor ``name``."""
        buf = _as_bytes(data)
        self._reserve(name, len(buf))
        self._put(buf)

    def copy_from(self, name: str, src: BinaryIO, begin: int) -> None:
        """Fill tensor ``name`` with its byte count copied from ``src`` at absolute offset ``begin``, unparsed."""
        slot = self._slot_for(name)
        n = slot.nbytes - slot.filled
        self._reserve(name, n)
        _copy_range(src, begin, self._file, n)
        self.bytes_written += n

    # -- finishing --------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Check every tensor is complete, then flush, fsync and close the file."""
        if self._file.closed:
            return
        try:
            incomplete = [s.name for s in self._slots if s.filled != s.nbytes]
            if incomplete:
                raise ValueError(f"{self.path}: tensors left incomplete: {', '.join(incomplete[:5])}")
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def abort(self) -> None:
        """Close without checks (the caller removes the partial file)."""
        self._file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- helpers ------------------------------------------------------------------------------------------------------

    def _slot_for(self, name: str) -> _Slot:
        """The slot of ``name``, which must be the first incomplete tensor (or a complete one before it)."""
        while self._current < len(self._slots):
            slot = self._slots[self._current]
            if slot.name == name:
                return slot
            if slot.filled < slot.nbytes:
                raise ValueError(f"{self.path}: data for tensor {name} arrived while {slot.name} is incomplete")
            self._current += 1
        raise ValueError(f"{self.path}: data for tensor {name} arrived, but it is not (or no longer) expected")

    def _reserve(self, name: str, n: int) -> None:
        slot = self._slot_for(name)
        if slot.filled + n > slot.nbytes:
            raise ValueError(f"{self.path}: tensor {name} would get {slot.filled + n} bytes; it holds {slot.nbytes}")
        slot.filled += n

    def _put(self, buf: memoryview | bytes) -> None:
        view = memoryview(buf)
        while view.nbytes:
            done = self._file.write(view)
            view = view[done:]
        self.bytes_written += len(buf)


def _as_bytes(data: torch.Tensor | bytes | bytearray | memoryview) -> memoryview:
    """The bytes of ``data`` as a memoryview of its own memory (a copy only for a device or strided tensor)."""
    if not isinstance(data, torch.Tensor):
        return memoryview(data).cast("B")
    if data.device.type != "cpu" or not data.is_contiguous():
        data = data.detach().cpu().contiguous()
    if data.numel() == 0:
        return memoryview(b"")
    return memoryview(data.detach().reshape(-1).view(torch.uint8).numpy())


def _copy_range(src: BinaryIO, begin: int, dst: BinaryIO, n: int) -> None:
    """Copy ``n`` bytes of ``src`` from ``begin`` to ``dst``'s current position.

    Uses the kernel's ``copy_file_range`` (no trip through user space; a reflink
    on file systems that share extents) where it works, else pread/write.
    """
    src_fd, dst_fd = src.fileno(), dst.fileno()
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < n:
                got = os.copy_file_range(src_fd, dst_fd, n - done, begin + done)
                if got == 0:
                    break
                done += got
        except OSError:
            pass  # e.g. EXDEV/EINVAL/ENOSYS on some kernels and file systems: fall back below
    while done < n:
        chunk = os.pread(src_fd, min(_COPY_CHUNK, n - done), begin + done)
        if not chunk:
            problem = f"file ended {n - done} bytes early while copying bytes [{begin}, {begin + n})"
            raise CheckpointError(problem, file=getattr(src, "name", None))
        view = memoryview(chunk)
        while view.nbytes:
            view = view[os.write(dst_fd, view):]
        done += len(chunk)
