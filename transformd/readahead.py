"""Reading a checkpoint ahead of its conversion while the process starts, and how far ahead is safe.

A cold ``transformd convert`` spends its first seconds importing torch and starting CUDA, and its conversion
cannot write before that. The disk would idle meanwhile, so the source's first shards are read into the page cache
then (:class:`ReadAhead`), and the conversion finds them there. It stops when the conversion starts (from then on
its reads would take the disk from the conversion's writes) and after :func:`read_ahead_bytes` at the most (what is
read ahead must stay in the page cache until the conversion reads it). The hashing beside a conversion of a source
new to the cache (:class:`transformd.cache.alongside.Hasher`) starts one of its own for the same time, and reads
ahead of the conversion afterwards (by a smaller lead and the same memory bound). No torch here.

The reading must not wait for the GIL, which the import holds nearly all the time: a thread that takes it back
after every 8 MiB ``preadv`` read 2.8-3.4 GiB during 3.5-4.2 s start-ups on the H200 machine, about half the
disk's 1.6 GiB/s. So each slice is one ``sendfile`` into ``/dev/null`` (the kernel reads the file into the page
cache and copies nothing to this process), :data:`_SLICE_BYTES` at a time: 4.75-5.94 GiB in the same start-ups
(``benchmarks/startup_bench.py``).

:func:`in_page_cache` tells whether a file is in the page cache without reading it (``mincore``): a lone
conversion's head start (:mod:`transformd.checkpoint.headstart`) only converts shards that are.
"""

from __future__ import annotations

import ctypes
import functools
import json
import mmap
import os
import platform
import stat
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

#: Bytes read ahead of a conversion at the most (:func:`read_ahead_bytes` lowers it to an eighth of the memory). In
#: practice the start-up's length bounds it: a cold start-up of 9-10 s on the H200 machine, whose disk reads ~1.4 GB/s
#: at the idle class, read the 8 GiB that were the bound before in 6.5 s and left the disk idle for the rest.
READ_AHEAD_BYTES = 32 << 30
#: Bytes read by one system call (at the disk's ~1.6 GiB/s, 40 ms: what :meth:`ReadAhead.stop` may leave running).
_SLICE_BYTES = 64 << 20
#: Bytes read at once where ``sendfile`` cannot be used (into a buffer of this size).
_FALLBACK_BYTES = 8 << 20
#: An index larger than this is not read here (the conversion's plan reports it).
_INDEX_MAX_BYTES = 64 << 20
#: ioprio_get's and ioprio_set's system call numbers per machine (Python and glibc have no wrapper).
_IOPRIO = {"x86_64": (252, 251), "aarch64": (31, 30)}
#: Each thread's I/O priority before :func:`set_idle_io` first made it idle.
_thread_io = threading.local()


def memory_limit() -> int:
    """The memory this process may use: the machine's, or its container's (cgroup v2) limit when lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 64 << 30  # (unknown: taken for 64 GiB, 8 GiB ahead at the most)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def read_ahead_bytes(most: int = READ_AHEAD_BYTES) -> int:
    """How far a read may run ahead of the conversion: ``most``, and an eighth of :func:`memory_limit` at the most."""
    return min(most, memory_limit() // 8)


class ReadAhead:
    """A thread that reads ``files`` (in the order the conversion will) into the page cache, ``budget`` bytes at
    the most, until :meth:`stop`. Best effort: a file it cannot read is skipped (the conversion reports it)."""

    def __init__(self, files: Sequence[str | os.PathLike[str]], budget: int | None = None):
        self._files, self._budget = [os.fspath(f) for f in files], read_ahead_bytes() if budget is None else budget
        self._stopped = threading.Event()
        self.bytes_read = 0
        self._thread = threading.Thread(target=self._run, name="transformd-read-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            set_idle_io()
            with _Reader() as read:
                for path in self._files:
                    if not self._read_file(read, path):
                        return
        except Exception:  # noqa: BLE001, S110 - best effort (no memory for a buffer, say): the conversion reads
            pass

    def _read_file(self, read: _Reader, path: str) -> bool:
        """Read ``path`` ahead (as much as the budget allows); whether to go on with the next file."""
        fd = _open_regular(path)
        if fd is None:
            return True
        try:
            offset = 0
            while not self._stopped.is_set() and self.bytes_read < self._budget:
                n = read(fd, offset, min(_SLICE_BYTES, self._budget - self.bytes_read))
                if n <= 0:
                    break
                offset += n
                self.bytes_read += n
        except OSError:
            pass
        finally:
            os.close(fd)
        return not self._stopped.is_set() and self.bytes_read < self._budget

    def stop(self) -> None:
        """Stop after the slice being read (does not wait)."""
        self._stopped.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


class _Reader:
    """``read(fd, offset, size)``: read that range of a file into the page cache; the bytes read (0 at its end).
    By ``sendfile`` into ``/dev/null``; by ``preadv`` into a buffer (:data:`_FALLBACK_BYTES` at a time) once that
    fails (a file system or a kernel that refuses it), or where ``/dev/null`` is not the null device."""

    def __enter__(self) -> _Reader:
        self._null, self._buf = _null_device(), None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._null is not None:
            os.close(self._null)

    def __call__(self, fd: int, offset: int, size: int) -> int:
        if self._null is not None:
            try:
                return os.sendfile(self._null, fd, offset, size)
            except OSError:  # (a read error proper comes again from preadv)
                os.close(self._null)
                self._null = None
        if self._buf is None:
            self._buf = memoryview(bytearray(_FALLBACK_BYTES))
        return os.preadv(fd, [self._buf[: min(size, _FALLBACK_BYTES)]], offset)


def _null_device() -> int | None:
    """A write descriptor of ``/dev/null`` if it is a character device (a sandbox's regular file would fill up)."""
    return _open_of_kind(os.devnull, os.O_WRONLY | os.O_CLOEXEC, stat.S_ISCHR)


def set_idle_io(idle: bool = True) -> None:
    """Put the calling thread in the idle I/O class (``idle``): its reads go to the disk only when nobody else's wait
    (where the kernel's I/O scheduler has classes: mq-deadline, BFQ); else back in the class it had before (an
    ``ionice`` of the process is kept). A cold ``import torch`` reads its libraries through page faults meanwhile:
    on the H200 machine a read-ahead at the normal class made the start-up 2-4 s longer, and the whole ``convert
    --out`` gained 0-3.6 s; at the idle class 0.6-2.8 s (benchmarks/convert_bench.py --read-ahead-modes)."""
    numbers = _IOPRIO.get(platform.machine())
    if numbers is None or not sys.platform.startswith("linux") or sys.maxsize <= 2**32:  # (a 64-bit process)
        return
    (get, put), who = numbers, threading.get_native_id()  # (IOPRIO_WHO_PROCESS with a thread's id: that thread)
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
        if idle and not hasattr(_thread_io, "before"):
            before = syscall(get, 1, who)
            _thread_io.before = before if before >= 0 else 0  # (0: none, the class of the thread's nice value)
        syscall(put, 1, who, 3 << 13 if idle else getattr(_thread_io, "before", 0))
    except Exception:  # noqa: BLE001, S110 - best effort: at the normal class it still reads
        pass


def _open_regular(path: str | os.PathLike[str]) -> int | None:
    """A read descriptor of ``path`` if it is a regular file, else None (a FIFO or a device is never waited on:
    the conversion refuses them, with their names)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # as securefs.OPEN_FLAGS
    return _open_of_kind(path, flags, stat.S_ISREG)


def _open_of_kind(path: str | os.PathLike[str], flags: int, is_kind: Callable[[int], bool]) -> int | None:
    """A descriptor of ``path`` opened with ``flags`` if ``is_kind`` of its mode (a ``stat.S_IS*``), else None."""
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        if is_kind(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


#: The index whose shards a conversion reads (:mod:`transformd.checkpoint.plan` reads it under this name too).
INDEX_NAME = "model.safetensors.index.json"


def shard_files(src: str | os.PathLike[str]) -> list[Path]:
    """The shards of a checkpoint directory in the order the conversion reads them (:func:`shard_order`); [] when
    neither the index nor the directory can be read."""
    src = Path(src)
    index = None
    fd = _open_regular(src / INDEX_NAME)
    if fd is not None:
        try:
            index = read_index(fd)
        finally:
            os.close(fd)
    try:
        names = os.listdir(src)
    except OSError:
        names = []
    return [src / name for name in shard_order(index, names)]


def shard_order(index: bytes | None, names: Iterable[str]) -> list[str]:
    """The shards a conversion reads, in its order: those that ``index`` (the bytes of the index; None: there is
    none) names, sorted as the plan sorts them; else, without an index or with one that is not valid JSON (a larger
    one is cut), the ``*.safetensors`` of ``names`` (a directory's) in name order."""
    try:
        if index is None:
            raise ValueError("no index")
        listed = json.loads(index)["weight_map"].values()
        return sorted({n for n in listed if isinstance(n, str) and Path(n).name == n != ".." and n[:1] != "."})
    except (ValueError, KeyError, TypeError, AttributeError):
        return sorted(n for n in names if n.endswith(".safetensors") and not n.startswith(".") and "/" not in n)


def read_index(fd: int) -> bytes | None:
    """The bytes of an index open as ``fd`` (:data:`_INDEX_MAX_BYTES` at the most), None when it cannot be read."""
    try:
        return os.pread(fd, _INDEX_MAX_BYTES, 0)
    except OSError:
        return None


# -- is a file in the page cache? -------------------------------------------------------------------------------------

#: Places in a file whose page-cache presence :func:`in_page_cache` checks.
CACHE_PROBES = 16


def in_page_cache(path: Path) -> bool:
    """Whether the pages of ``path`` at ``CACHE_PROBES`` + 1 places spread over it are in the page cache (mincore:
    asking starts no read, where a read with ``RWF_NOWAIT`` would start one; where mincore cannot be used, or the
    file cannot be read: no)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        size, libc = os.fstat(fd).st_size, _libc()
        if size == 0 or libc is None:
            return False
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return False
        try:
            page, resident = mmap.PAGESIZE, ctypes.c_ubyte()
            for i in range(CACHE_PROBES + 1):
                at = min(size - 1, size * i // CACHE_PROBES) // page * page
                failed = libc.mincore(ctypes.c_void_p(address + at), 1, ctypes.byref(resident))
                if failed or not resident.value & 1:
                    return False
            return True
        finally:
            libc.munmap(ctypes.c_void_p(address), size)
    finally:
        os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library with mmap, mincore and munmap typed (None where it cannot be loaded)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def last_shard_in_page_cache(src: str | os.PathLike[str]) -> bool:
    """Whether the checkpoint's last shard (in the conversion's order) is in the page cache: a lone conversion's
    head start would find work (:mod:`transformd.checkpoint.headstart`)."""
    shards = shard_files(src)
    return bool(shards) and in_page_cache(shards[-1])
