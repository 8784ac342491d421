"""The streaming, byte-range-copying safetensors writer (torch-free: a head start writes with it before torch is
imported, see :mod:`transformd.checkpoint.headstart`). Tensor data arrives as bytes, NumPy arrays or torch
tensors."""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from .errors import CheckpointError
from .safetensors_header import DTYPE_BITS, HEADER_ALIGN, tensor_nbytes

if TYPE_CHECKING:
    import torch

__all__ = ["SafetensorsWriter"]

_COPY_CHUNK = 16 * 1024 * 1024


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

    ``groups`` maps a name data is written under to several header entries, in order, whose bytes are consecutive:
    the data of that name fills them one after the other (a fused expert stack written as per-expert tensors,
    :mod:`transformd.checkpoint.layout`).

    Use as a context manager; on an exception the file is closed unchecked and
    left for the caller to delete (the converter writes into a staging directory).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        specs: Iterable[tuple[str, str, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
        groups: Mapping[str, Sequence[str]] | None = None,
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
        self._by_name = {slot.name: slot for slot in self._slots}
        self._groups = {name: tuple(parts) for name, parts in (groups or {}).items()}
        order = {slot.name: i for i, slot in enumerate(self._slots)}
        for name, parts in self._groups.items():
            at = [order.get(part) for part in parts]
            if not parts or None in at or at != list(range(at[0], at[0] + len(at))):
                raise ValueError(f"group {name}: {list(parts)[:3]} are not consecutive tensors of the header")
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % HEADER_ALIGN)
        self._file = open(self.path, "xb", buffering=0)
        self._put(struct.pack("<Q", len(raw)) + raw)

    # -- appending data -------------------------------------------------------------------------------------------

    def write(self, name: str, data: torch.Tensor | Any) -> None:
        """Append ``data`` (a tensor's raw little-endian bytes, or a contiguous piece of them: a bytes-like object, a
        NumPy array or a torch tensor) to tensor ``name``."""
        buf = _as_bytes(data)
        self._reserve(name, len(buf))
        self._put(buf)

    def copy_from(self, name: str, src: BinaryIO, begin: int) -> None:
        """Fill tensor ``name`` with its byte count copied from ``src`` at absolute offset ``begin``, unparsed."""
        n = sum(self._by_name[part].nbytes - self._by_name[part].filled for part in self._groups.get(name, (name,))
                if part in self._by_name)
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
        parts = self._groups.get(name)
        if parts is None:
            slot = self._slot_for(name)
            if slot.filled + n > slot.nbytes:
                raise ValueError(
                    f"{self.path}: tensor {name} would get {slot.filled + n} bytes; it holds {slot.nbytes}")
            slot.filled += n
            return
        left = n
        for part in parts:  # consecutive: the bytes fill the first incomplete part, then the next
            if self._by_name[part].filled == self._by_name[part].nbytes:
                continue
            slot = self._slot_for(part)
            take = min(left, slot.nbytes - slot.filled)
            slot.filled += take
            left -= take
            if not left:
                return
        if left:
            raise ValueError(f"{self.path}: tensor {name} would get {left} bytes more than its {len(parts)} parts hold")

    def _put(self, buf: memoryview | bytes) -> None:
        view = memoryview(buf)
        while view.nbytes:
            done = self._file.write(view)
            view = view[done:]
        self.bytes_written += len(buf)


def _as_bytes(data: Any) -> memoryview:
    """The bytes of ``data`` as a memoryview of its own memory (a copy only for a strided array or a device or
    strided tensor)."""
    try:
        view = memoryview(data)  # bytes-like objects and NumPy arrays (torch tensors do not export their buffer)
    except TypeError:
        pass
    else:
        return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    torch = sys.modules["torch"]  # (a tensor comes from a process that imported torch)
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
