"""A strict safetensors header reader and a streaming, byte-range-copying writer.

Why not ``safetensors.safe_open`` for everything: the converter must (a) check
every header of a checkpoint before writing one byte, with errors that name the
file and the tensor, (b) copy untouched tensors into a new shard without parsing
or even loading them (so they stay byte-identical and cost no memory), and
(c) write a shard whose header is known up front while its tensors arrive one at
a time (memory bounded by one tensor, or one chunk of one). The file format is
small enough to state here in full:

    u64 little-endian N | N bytes of JSON header | data

The header maps tensor names to ``{"dtype", "shape", "data_offsets": [begin,
end]}`` (offsets relative to the start of the data), plus an optional
``"__metadata__"`` object of string to string. The tensors must tile the data
section exactly: no gaps, no overlaps, nothing after the last one.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from .errors import CheckpointError

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
]

#: Largest header accepted (the safetensors library's own limit is 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: Most tensors in one shard header (real shards hold a few thousand; each entry costs parsing time and memory).
MAX_TENSORS = 250_000
#: Most dimensions of a tensor, and the largest dimension (torch sizes are int64; torch allows 64 dimensions).
MAX_DIMS = 64
MAX_DIM = 2**63 - 1
#: The data section starts at a multiple of this (the safetensors library pads the header with spaces).
HEADER_ALIGN = 8

#: Bits per element of every dtype the safetensors format defines.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}

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


@dataclass(frozen=True)
class TensorInfo:
    """One header entry, with offsets made absolute (from the start of the file)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """A parsed, validated safetensors header. ``tensors`` is in file (offset) order."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None
    data_start: int
    file_size: int

    @property
    def data_bytes(self) -> int:
        return self.file_size - self.data_start


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor; raises ValueError when sub-byte elements do not fill whole bytes."""
    bits = DTYPE_BITS[dtype] * math.prod(shape)
    if bits % 8:
        raise ValueError(f"{math.prod(shape)} elements of {dtype} are {bits} bits, not a whole number of bytes")
    return bits // 8


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of a safetensors file; no tensor data is read.

    Raises :class:`CheckpointError` naming the file (and the tensor, where there
    is one) for anything a truncated or hostile file can get wrong.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CheckpointError(f"file is {size} bytes, shorter than the 8-byte header length", file=path)
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                # the length itself is not quoted: it is the file's first 8 bytes, whatever the file is
                raise CheckpointError(f"header length is above the limit of {MAX_HEADER_BYTES} bytes", file=path)
            if 8 + n > size:
                raise CheckpointError(f"header length {n} runs past the end of the {size}-byte file", file=path)
            raw = f.read(n)
    except OSError as err:
        raise CheckpointError(f"cannot read: {err.strerror or err}", file=path) from err
    if raw.count(b"data_offsets") > MAX_TENSORS:  # counted in C before any parsing: bounded work and memory
        raise CheckpointError(f"header lists more than {MAX_TENSORS} tensors", file=path)
    entries, metadata = _parse_header_json(raw, path)
    data_start = 8 + n
    tensors = [_parse_entry(name, entry, path, data_start) for name, entry in entries.items()]
    _check_coverage(tensors, data_start, size - data_start, path)
    tensors.sort(key=lambda t: (t.begin, t.end))
    return Header(path, {t.name: t for t in tensors}, metadata, data_start, size)


def _parse_header_json(raw: bytes, path: Path) -> tuple[dict[str, object], dict[str, str] | None]:
    def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
        out: dict[str, object] = {}
        for key, value in pairs:
            if key in out:
                raise CheckpointError("header names this key twice", file=path, tensor=key)
            out[key] = value
        return out

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except CheckpointError:
        raise
    except (ValueError, RecursionError) as err:  # also integers past Python's digit limit, and deep nesting
        raise CheckpointError(f"header is not valid UTF-8 JSON ({str(err)[:200]})", file=path) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"header is a JSON {type(header).__name__}, not an object", file=path)
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise CheckpointError("__metadata__ is not an object of strings", file=path)
    return header, metadata


def _parse_entry(name: str, entry: object, path: Path, data_start: int) -> TensorInfo:
    def fail(problem: str) -> CheckpointError:
        return CheckpointError(problem, file=path, tensor=name)

    if not name:
        raise fail("empty tensor name")
    if not isinstance(entry, dict):
        raise fail(f"header entry is a JSON {type(entry).__name__}, not an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise fail(f"header entry lacks {', '.join(missing)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise fail(f"unknown dtype {_short(dtype)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise fail(f"shape {_short(shape)} is not a list of non-negative integers")
    if len(shape) > MAX_DIMS or any(d > MAX_DIM for d in shape):
        raise fail(f"shape {_short(shape)} has more than {MAX_DIMS} dimensions or one above {MAX_DIM} (int64)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)):
        raise fail(f"data_offsets {_short(offsets)} is not a pair of non-negative integers")
    begin, end = offsets
    if end < begin:
        raise fail(f"data_offsets {offsets} end before they begin")
    try:
        expected = tensor_nbytes(dtype, shape)
    except ValueError as err:
        raise fail(str(err)) from None
    if end - begin != expected:
        raise fail(f"holds {end - begin} bytes, but {dtype} {shape} needs {expected}")
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_coverage(tensors: list[TensorInfo], data_start: int, data_bytes: int, path: Path) -> None:
    """The tensors must tile the data section exactly, as the safetensors library requires."""
    pos = 0
    for t in sorted(tensors, key=lambda t: (t.begin, t.end)):
        begin, end = t.begin - data_start, t.end - data_start
        if begin < pos:
            problem = f"data bytes [{begin}, {end}) overlap the previous tensor's, which end at {pos}"
            raise CheckpointError(problem, file=path, tensor=t.name)
        if begin > pos:
            problem = f"{begin - pos} bytes of the data section before this tensor belong to none"
            raise CheckpointError(problem, file=path, tensor=t.name)
        if end > data_bytes:
            raise CheckpointError(
                f"data bytes [{begin}, {end}) run past the end of the file (the data section has {data_bytes} bytes)",
                file=path,
                tensor=t.name,
            )
        pos = end
    if pos != data_bytes:
        raise CheckpointError(f"{data_bytes - pos} bytes after the last tensor's data belong to none", file=path)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(x: object, limit: int = 200) -> str:
    """``repr(x)`` cut to ``limit`` characters: a hostile header must not make an error message huge."""
    try:
        text = repr(x)
    except (ValueError, RecursionError):  # an integer past Python's digit limit, or deep nesting
        text = f"<{type(x).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_range(f: BinaryIO, begin: int, nbytes: int, *, path: str | os.PathLike[str] | None = None) -> torch.Tensor:
    """``nbytes`` bytes of an open file from absolute offset ``begin``, as a fresh uint8 tensor."""
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
            raise CheckpointError(problem, file=path)
        done += got
    return out


def read_tensor(f: BinaryIO, info: TensorInfo, *, path: str | os.PathLike[str] | None = None) -> torch.Tensor:
    """One tensor of an open safetensors file, typed and shaped as its header says (little-endian host)."""
    if info.dtype not in TORCH_DTYPES:
        raise CheckpointError(f"dtype {info.dtype} has no torch equivalent", file=path, tensor=info.name)
    raw = read_range(f, info.begin, info.nbytes, path=path)
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
