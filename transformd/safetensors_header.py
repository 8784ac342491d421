"""A strict, torch-free safetensors header reader (the format, the limits, the checks).

The file format is small enough to state here in full:

    u64 little-endian N | N bytes of JSON header | data

The header maps tensor names to ``{"dtype", "shape", "data_offsets": [begin,
end]}`` (offsets relative to the start of the data), plus an optional
``"__metadata__"`` object of string to string. The tensors must tile the data
section exactly: no gaps, no overlaps, nothing after the last one.

Torch-free so that what only looks at headers (a plan, engine readiness, a warm cache hit, the daemon's
file listing) starts without importing torch; :mod:`transformd.safetensors_io` adds tensor reads as torch tensors and
:mod:`transformd.safetensors_writer` the writer. :class:`ShardFiles` reads byte ranges of a checkpoint's shards into
buffers (the conversion pipeline's and the head start's reads).
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .errors import CheckpointError

__all__ = [
    "DTYPE_BITS",
    "MAX_HEADER_BYTES",
    "MAX_TENSORS",
    "CheckpointError",
    "Header",
    "ShardFiles",
    "TensorInfo",
    "read_header",
    "tensor_nbytes",
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


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for reading, refused (OSError ``EINVAL``) unless it is a regular file: a FIFO or a device
    named like a shard is never waited on (opened without blocking, then checked on the descriptor)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of a safetensors file; no tensor data is read.

    Raises :class:`CheckpointError` naming the file (and the tensor, where there
    is one) for anything a truncated or hostile file can get wrong.
    """
    path = Path(path)
    try:
        with open_regular(path) as f:
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


class ShardFiles:
    """A checkpoint's shards opened on first use (by name; each read ahead whole by the kernel), for positional
    reads from any thread, until :meth:`close`."""

    def __init__(self, src: str | os.PathLike[str]):
        self.src = Path(src)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def read_into(self, shard: str, offset: int, buf: object) -> None:
        """Fill the writable, contiguous buffer ``buf`` (a NumPy array, a memoryview) with ``shard``'s bytes from
        absolute offset ``offset``; :class:`CheckpointError` naming the file if it ends first."""
        with self._lock:
            fd = self._fds.get(shard)
            if fd is None:
                fd = self._fds[shard] = os.open(self.src / shard, os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):  # read ahead the whole shard while its first pieces convert
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if not got:
                end = offset + len(view)
                problem = f"file ended {len(view) - done} bytes early while reading bytes [{offset}, {end})"
                raise CheckpointError(problem, file=self.src / shard)
            done += got

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
