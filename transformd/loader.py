"""Map converted shards copy-on-write and hand out zero-copy torch tensors.

:func:`load_tensors` opens each safetensors file once, maps it whole (a private, copy-on-write
mapping backed by the file), and cuts every tensor out of the mapping with :func:`torch.frombuffer`:
no byte is copied or read until a tensor is touched, and the kernel pages the data in from the page
cache. Because the mapping is backed by the file and pages are only copied when written,
**every process on the node that maps the same file (every rank of a tensor-parallel engine,
every replica) shares one copy of the data in the page cache**; loading N ranks costs the file's
size in memory once, not N times, and a second start finds the pages already there.

The tensor table comes from the daemon's ``GET /v1/checkpoints/{key}/files`` (absolute offsets, so
nothing is parsed here) or, for a directory or file paths, from the files' own headers
(:func:`transformd.safetensors_io.read_header`, which validates them).

Lifetime and safety:

* each tensor holds a reference to its file's mapping (through the buffer ``torch.frombuffer``
  took), so the mapping lives exactly as long as some tensor, or a view of one, still uses it;
  nothing has to be closed by hand;
* the mapping is private and copy-on-write (``MAP_PRIVATE``, ``MAP_NORESERVE`` where the platform has
  it): reading shares the page cache as above; **writing to a returned tensor is allowed and changes
  only this process's copy of the pages it touches**, never the file (the cache entry stays intact,
  other processes keep seeing the file's bytes). Earlier versions mapped ``PROT_READ`` only, and a
  write killed the process with SIGSEGV. A node with strict overcommit accounting
  (``vm.overcommit_memory=2``) may refuse a private writable mapping of a large file; the loader then
  falls back to a read-only mapping and warns that writing into those tensors would crash;
* a cache entry evicted while mapped stays readable (Linux keeps an unlinked file's pages while a
  mapping holds it), but hold a lease (:meth:`TransformdClient.lease`) while serving so the next
  rank or restart still finds it;
* a mapping of a file is only as safe as whoever may shorten that file: if its owner truncates it, reading a
  tensor past the new end kills the process with SIGBUS (no Python error can be raised there). The daemon's
  cache entries are the daemon's own and read-only; map another user's files only if you trust him, or copy
  them first (an attack review truncated a file of its own under an engine that had mapped it);
* a tensor whose offset is not a multiple of its element size (possible in a safetensors file,
  never in transformd's own output for the usual dtypes) is copied into an aligned buffer instead;
  ``result.copied`` lists them.

``device="cuda"`` (or any non-CPU device) copies each tensor to the device; the mapping is then
only the source of that one copy.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import mmap
import os
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch

from .errors import ServerError
from .safetensors_header import open_regular
from .safetensors_io import DTYPE_BITS, TORCH_DTYPES, CheckpointError, read_header

if TYPE_CHECKING:
    from .client import ShardFile, TransformdClient

__all__ = ["LoadedTensors", "MappedFile", "load_from_daemon", "load_tensors"]

#: What :func:`load_tensors` accepts: a checkpoint directory or a .safetensors file; a list of those
#: files; the daemon's ``/files`` answer (``{"files": [...]}``), its list of file objects, or
#: :class:`transformd.client.ShardFile` objects.
FilesOrDir = Union[str, os.PathLike, Mapping[str, Any], Iterable[Any]]


@dataclass(frozen=True)
class MappedFile:
    """One mapped file: where the mapping starts in this process's address space, and its length."""

    path: Path
    address: int
    size: int

    def contains(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor``'s bytes lie inside this mapping (it is a zero-copy view of the file)."""
        begin = tensor.data_ptr()
        end = begin + tensor.numel() * tensor.element_size()
        return self.address <= begin and end <= self.address + self.size


class LoadedTensors(dict):
    """``dict[str, torch.Tensor]`` as returned by :func:`load_tensors`, plus what was mapped.

    ``mappings``: one :class:`MappedFile` per file; ``copied``: names of the tensors that had to be
    copied (misaligned, or moved to another device) rather than viewed in place.
    """

    mappings: list[MappedFile]
    copied: list[str]


@dataclass(frozen=True)
class _Spec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class _FilePlan:
    path: Path
    expected_size: int | None
    tensors: list[_Spec]


def load_tensors(
    files_or_dir: FilesOrDir,
    *,
    names: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
    writable: bool = True,
) -> LoadedTensors:
    """Every tensor (or those in ``names``) of the given safetensors files, as zero-copy views of file maps.

    ``files_or_dir`` is a checkpoint directory (its ``*.safetensors`` files), a file, a list of
    files, or the daemon's ``/files`` answer (the dict, its ``files`` list, or
    :class:`~transformd.client.ShardFile` objects) whose tensor tables are used as they are.
    Unknown ``names`` raise :class:`KeyError`; a malformed file or table raises
    :class:`~transformd.safetensors_io.CheckpointError`. See the module docstring for lifetime,
    writes and page-cache sharing.

    The maps are private and copy-on-write: writing into a tensor changes this process's copy only,
    never the file. ``writable=False`` maps read-only (``PROT_READ``) instead, as earlier versions
    did by default: no private memory can ever be charged, but a write kills the process (SIGSEGV).
    """
    plans = _plans(files_or_dir)
    wanted = None if names is None else set(names)
    seen: dict[str, Path] = {}
    for plan in plans:
        for spec in plan.tensors:
            if spec.name in seen:
                raise CheckpointError(f"tensor also in {seen[spec.name]}", file=plan.path, tensor=spec.name)
            seen[spec.name] = plan.path
    if wanted is not None:
        missing = sorted(wanted - seen.keys())
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise KeyError(f"no tensor named {', '.join(missing[:5])}{more} in {len(plans)} file(s)")

    device = torch.device(device)
    out = LoadedTensors()
    out.mappings, out.copied = [], []
    for plan in plans:
        specs = [s for s in plan.tensors if wanted is None or s.name in wanted]
        if not specs:
            continue
        mm, mapped = _map(plan.path, plan.expected_size, writable)
        out.mappings.append(mapped)
        _check_layout(plan.tensors, plan.path, mm)
        for spec in specs:
            _check_bounds(spec, plan.path, mapped.size)
            tensor, copied = _view(mm, spec, plan.path)
            if device.type != "cpu":
                tensor, copied = tensor.to(device), True
            if copied:
                out.copied.append(spec.name)
            out[spec.name] = tensor
    return out


def load_from_daemon(
    client: TransformdClient,
    key: str,
    *,
    names: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
    wait: bool = True,
    timeout: float | None = None,
) -> LoadedTensors:
    """:func:`load_tensors` over the daemon's ``/files`` table of entry ``key``.

    With ``wait`` (default), a shard that is not converted yet is asked for by name
    (``GET .../files/{name}``, which moves it to the front of the conversion) and waited for, one
    shard at a time, so mapping the first shards overlaps converting the last. With ``names``,
    only the shards that hold those tensors are waited for. Without ``wait`` a shard that is not
    ready raises :class:`ValueError` (an entry whose shards are not known yet: the client's
    :class:`~transformd.errors.ConflictError`). ``timeout`` bounds the whole wait
    (:class:`~transformd.client.ResolveTimeoutError`).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    wanted = None if names is None else set(names)
    shards = client.files(key, wait=wait, timeout=timeout)
    if not shards:  # (an entry has at least one shard: an empty table is never "no tensors")
        raise ServerError(f"transformd's table of entry {key} lists no shards")
    ready: list[ShardFile] = []
    for shard in shards:
        needed = wanted is None or not shard.tensors or bool(wanted & shard.tensors.keys())
        if not needed:
            continue
        if not shard.ready:
            if not wait:
                raise ValueError(f"shard {shard.name} of {key} is not converted yet (pass wait=True)")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            shard = client.file(key, shard.name, wait=True, timeout=left)
        ready.append(shard)

    def where_now() -> list[ShardFile]:  # a shard written in staging is renamed to its final path once all are
        return [dataclasses.replace(s, path=s.final_path) if s.final_path is not None and s.final_path.exists() else s
                for s in ready]

    try:
        return load_tensors(where_now(), names=wanted, device=device)
    except CheckpointError:  # (published between the look and the map: a review saw every such load fail)
        if not any(s.final_path is not None and s.final_path.exists() for s in ready):
            raise
        return load_tensors(where_now(), names=wanted, device=device)


# ---------------------------------------------------------------------------------------------------------------------
# Plans: which files, which tensors where


def _plans(files_or_dir: FilesOrDir) -> list[_FilePlan]:
    if isinstance(files_or_dir, (str, os.PathLike)):
        path = Path(files_or_dir)
        if path.is_dir():
            files = sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("."))
            if not files:
                raise CheckpointError("no .safetensors files in this directory", file=path)
            return [_plan_from_header(p) for p in files]
        return [_plan_from_header(path)]
    if isinstance(files_or_dir, Mapping):
        if "files" not in files_or_dir:
            raise TypeError("a mapping must be the daemon's /files answer: {'files': [...]}")
        return [_plan_from_table(f) for f in files_or_dir["files"]]
    plans = []
    for item in files_or_dir:
        if isinstance(item, (str, os.PathLike)):
            plans.append(_plan_from_header(Path(item)))
        else:
            plans.append(_plan_from_table(item))
    return plans


def _plan_from_header(path: Path) -> _FilePlan:
    header = read_header(path)
    specs = [_Spec(t.name, t.dtype, tuple(t.shape), t.begin, t.end) for t in header.tensors.values()]
    return _FilePlan(path, header.file_size, specs)


def _plan_from_table(entry: Any) -> _FilePlan:
    """A /files entry: a dict as the daemon sends it, or a ShardFile."""
    if isinstance(entry, Mapping):
        raw_path, name = entry.get("path"), entry.get("name")
        ready, size, tensors = entry.get("ready", True), entry.get("size"), entry.get("tensors") or {}
        items = [(k, v["dtype"], v["shape"], v["offsets"]) for k, v in tensors.items()]
    else:  # ShardFile (duck-typed, so the loader does not import the client)
        raw_path, name, ready, size = entry.path, entry.name, entry.ready, entry.size
        items = [(k, v.dtype, v.shape, v.offsets) for k, v in entry.tensors.items()]
    if not ready or not raw_path:
        raise ValueError(
            f"shard {name} is not converted yet; wait for it (load_from_daemon, or client.file(wait=True))")
    path = Path(raw_path)
    specs = []
    for tname, dtype, shape, offsets in items:
        try:
            begin, end = (int(o) for o in offsets)
            shape_t = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise CheckpointError(f"table entry has bad shape {shape!r} or offsets {offsets!r}", file=path,
                                  tensor=tname) from None
        specs.append(_Spec(str(tname), str(dtype), shape_t, begin, end))
    return _FilePlan(path, int(size) if size is not None else None, specs)


# ---------------------------------------------------------------------------------------------------------------------
# Mapping and viewing


def _map(path: Path, expected_size: int | None, writable: bool) -> tuple[mmap.mmap, MappedFile]:
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if expected_size is not None and size != expected_size:
                raise CheckpointError(f"file is {size} bytes, the table says {expected_size}: it changed", file=path)
            if size == 0:
                raise CheckpointError("file is empty", file=path)
            # The mapping keeps its own reference to the file; closing f here is fine.
            mm = _mmap_private(f.fileno(), path) if writable else mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as err:
        raise CheckpointError(f"cannot map: {err.strerror or err}", file=path) from err
    base = _frombuffer(mm, torch.uint8, 1, 0).data_ptr()
    return mm, MappedFile(path, base, size)


def _mmap_private(fd: int, path: Path) -> mmap.mmap:
    """A private copy-on-write map of the whole file: reads share the page cache, writes copy the page they touch.

    ``MAP_NORESERVE`` (Linux): no swap is reserved up front for pages that are, in the usual case, never
    written. Where the kernel refuses the mapping for lack of commit (``vm.overcommit_memory=2``), fall
    back to a read-only map, with a warning: writing into those tensors would then crash the process.
    """
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", 0)
    try:
        return mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as err:
        if err.errno != errno.ENOMEM:
            raise
    warnings.warn(
        f"{path}: the kernel refused a private copy-on-write map (ENOMEM, strict overcommit?); mapped read-only: "
        "writing into its tensors would kill the process, clone them first",
        RuntimeWarning,
        stacklevel=4,
    )
    return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)


def _frombuffer(mm: mmap.mmap, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point (see the module docstring).
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        return torch.frombuffer(mm, dtype=dtype, count=count, offset=offset)


def _check_layout(specs: list[_Spec], path: Path, mm: mmap.mmap) -> None:
    """The tensors' byte ranges lie after the file's header and do not overlap, as read_header requires of a file:
    a table from a daemon (or a socket's squatter) could otherwise make two tensors one memory, or a tensor of
    header bytes (an attack review)."""
    data_start = 8 + int.from_bytes(mm[:8], "little") if len(mm) >= 8 else 0
    end = data_start
    for spec in sorted(specs, key=lambda s: (s.begin, s.end)):
        if spec.begin < end and spec.end > spec.begin:
            what = "the header" if spec.begin < data_start else "another tensor's bytes"
            raise CheckpointError(f"bytes [{spec.begin}, {spec.end}) overlap {what}", file=path, tensor=spec.name)
        end = max(end, spec.end)


def _check_bounds(spec: _Spec, path: Path, size: int) -> None:
    if spec.dtype not in DTYPE_BITS:
        raise CheckpointError(f"unknown dtype {spec.dtype!r}", file=path, tensor=spec.name)
    if any(d < 0 for d in spec.shape):
        raise CheckpointError(f"negative dimension in shape {list(spec.shape)}", file=path, tensor=spec.name)
    if math.prod(d for d in spec.shape if d) >= 1 << 60:  # (zeros aside: torch sizes its storage from the rest)
        raise CheckpointError(f"shape {list(spec.shape)[:8]} has more elements than a tensor can", file=path,
                              tensor=spec.name)
    bits = DTYPE_BITS[spec.dtype] * math.prod(spec.shape)
    if not 0 <= spec.begin <= spec.end <= size:
        raise CheckpointError(f"bytes [{spec.begin}, {spec.end}) are outside the {size}-byte file", file=path,
                              tensor=spec.name)
    if bits != 8 * (spec.end - spec.begin):
        raise CheckpointError(f"holds {spec.end - spec.begin} bytes, but {spec.dtype} {list(spec.shape)} needs "
                              f"{bits / 8:g}", file=path, tensor=spec.name)


def _view(mm: mmap.mmap, spec: _Spec, path: Path) -> tuple[torch.Tensor, bool]:
    """The tensor as a view of the mapping (copied only when misaligned); returns (tensor, copied)."""
    dtype = TORCH_DTYPES.get(spec.dtype)
    if dtype is None:
        raise CheckpointError(f"dtype {spec.dtype} has no torch equivalent (leave it out with names=)", file=path,
                              tensor=spec.name)
    numel = math.prod(spec.shape)
    if numel == 0:
        return torch.empty(spec.shape, dtype=dtype), False
    itemsize = torch.empty((), dtype=dtype).element_size()
    if spec.begin % itemsize:
        raw = _frombuffer(mm, torch.uint8, spec.end - spec.begin, spec.begin).clone()
        return raw.view(dtype).reshape(spec.shape), True
    return _frombuffer(mm, dtype, numel, spec.begin).view(spec.shape), False
