"""Downloading an entry from the tier into a staging directory, every byte checked against its manifest.

:func:`fetch_entry` reads ``entries/<key>/manifest.json`` (absent: a miss), checks it (its key, every file name
(:func:`.names.check_file_names`), sizes, digests' form), then downloads every file in parallel: a large file in
ranges of :data:`RANGE_BYTES` written in place (``pwrite``) by :data:`STREAMS` threads, a small one (or every file
of a server that cannot answer ranges) as one stream. Each file is hashed (BLAKE3, as :meth:`Cache._seal
<transformd.cache.store.Cache._seal>` did where it was converted) as its bytes arrive, in order: a part that
arrives after every part before it is hashed from memory by the thread that fetched it, which then hashes the
parts already waiting on disk behind it (read back from the page cache); so the check is done when the last part
is, not one more pass over the file after it. Each file is then compared with the manifest's size and digest.
The staging directory then holds
``checkpoint/`` and ``manifest.json`` exactly as a sealed local entry (read-only files, fsynced), for the cache's
one-rename publish; on any failure everything written into it is removed before the error is raised.
"""

from __future__ import annotations

import json
import os
import stat as stat_mod
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import blake3

from .._durable import fsync_path, rmtree_force, start_writeback
from ..cache.keys import FileRecord, validate_key
from ..cache.manifest import CHECKPOINT_DIR, MANIFEST_NAME, Manifest
from . import names
from .errors import RemoteCorruptError, RemoteError
from .stores import NotPartialError, ObjectStore

#: Parts of a file read at once, and how many at a time over all files.
RANGE_BYTES = 32 << 20
STREAMS = 8
#: A file read as one stream starts its writes to the disk every this many bytes (:func:`start_writeback`).
WRITEBACK_BYTES = 32 << 20
#: Largest manifest the tier reads (a real one is tens of kilobytes).
MAX_MANIFEST_BYTES = 64 << 20


@dataclass(frozen=True)
class FetchProgress:
    """Where a download stands: bytes and files done of the entry's, seconds since it started."""

    key: str
    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    elapsed_s: float

    @property
    def eta_s(self) -> float | None:
        if not self.bytes_done or self.bytes_done >= self.bytes_total:
            return None
        return self.elapsed_s * (self.bytes_total - self.bytes_done) / self.bytes_done


def read_manifest(store: ObjectStore, key: str) -> Manifest | None:
    """The tier's manifest of ``key``, checked (see the module); None when the tier has no such entry."""
    validate_key(key)
    where = f"remote {store.url}: {names.manifest_name(key)}"
    raw = store.read_bytes(names.manifest_name(key), MAX_MANIFEST_BYTES)
    if raw is None:
        return None
    try:
        manifest = Manifest.from_dict(json.loads(raw))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RemoteCorruptError(f"{where}: not a manifest: {str(e)[:200]}") from None
    if manifest.key != key:
        raise RemoteCorruptError(f"{where}: the manifest is for key {manifest.key[:64]!r}, not {key}")
    names.check_file_names(manifest.files, where)
    return manifest


class _Download:
    """One entry's download (see :func:`fetch_entry`)."""

    def __init__(self, store: ObjectStore, manifest: Manifest, out: Path,
                 progress: Callable[[FetchProgress], None] | None, ranges: bool):
        self.store, self.manifest, self.out, self.progress = store, manifest, out, progress
        self.ranges = ranges
        self.lock = threading.Lock()
        self.bytes_done = 0
        self.files_done = 0
        self.t0 = time.monotonic()
        self.fds: dict[str, int] = {}
        self.hashing: dict[str, _InOrderHash] = {}
        self.stop = threading.Event()

    def run(self, pool: ThreadPoolExecutor) -> bool:
        """Download and check every file; True, or False when the server cannot answer ranged reads (and nothing
        fetched stays); raises the first error."""
        jobs: list[Future[None]] = []
        try:
            for rec in self.manifest.files:
                path = self.out / rec.name
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
                self.fds[rec.name] = fd
                if self.ranges and rec.size > RANGE_BYTES:
                    os.ftruncate(fd, rec.size)
                    self.hashing[rec.name] = _InOrderHash(fd, rec.size)
                    jobs += [pool.submit(self._part, rec, s) for s in range(0, rec.size, RANGE_BYTES)]
                else:
                    jobs.append(pool.submit(self._whole, rec))
            done, _ = wait(jobs, return_when=FIRST_EXCEPTION)
            failed = [f.exception() for f in done if f.exception() is not None]
            if failed:
                self.stop.set()
                wait(jobs)
                if all(isinstance(e, NotPartialError) for e in failed):
                    return False
                raise next(e for e in failed if not isinstance(e, NotPartialError))  # type: ignore[misc]
            return True
        finally:
            self.stop.set()
            for fd in self.fds.values():
                os.close(fd)

    def _part(self, rec: FileRecord, start: int) -> None:
        if self.stop.is_set():
            return
        end = min(rec.size, start + RANGE_BYTES)
        obj = names.file_name(self.manifest.key, rec.name)
        data = self.store.read_range(obj, start, end)
        if len(data) != end - start:
            raise RemoteCorruptError(f"remote {self.store.url}: {obj}: bytes {start}-{end} came back as "
                                     f"{len(data)} bytes (the manifest says the file is {rec.size} bytes)")
        _pwrite_all(self.fds[rec.name], data, start)
        start_writeback(self.fds[rec.name], start, len(data))
        self._advance(len(data))
        digest = self.hashing[rec.name].arrived(start, data)
        if digest is not None:
            self._check(rec, digest)

    def _whole(self, rec: FileRecord) -> None:
        obj = names.file_name(self.manifest.key, rec.name)
        fd, offset, flushed = self.fds[rec.name], 0, 0
        h = blake3.blake3()  # hashed as it arrives: no second read of the file
        for chunk in self.store.read_stream(obj):
            if self.stop.is_set():
                return
            if offset + len(chunk) > rec.size:
                raise RemoteCorruptError(f"remote {self.store.url}: {obj} is larger than the {rec.size} bytes its "
                                         "manifest says")
            _pwrite_all(fd, chunk, offset)
            h.update(chunk)
            offset += len(chunk)
            if offset - flushed >= WRITEBACK_BYTES:
                start_writeback(fd, flushed, offset - flushed)
                flushed = offset
            self._advance(len(chunk))
        self._check(rec, "blake3:" + h.hexdigest())

    def _check(self, rec: FileRecord, digest: str) -> None:
        """Check the file's size and ``digest`` (taken as its bytes were written)."""
        obj = names.file_name(self.manifest.key, rec.name)
        fd = self.fds[rec.name]
        size = os.fstat(fd).st_size
        if size != rec.size:
            raise RemoteCorruptError(f"remote {self.store.url}: {obj} is {size} bytes, its manifest says {rec.size} "
                                     "(truncated or replaced); nothing was kept")
        os.fsync(fd)
        if digest != rec.digest:
            raise RemoteCorruptError(f"remote {self.store.url}: {obj}: content digest {digest} differs from the "
                                     f"manifest's {rec.digest}; nothing was kept")
        with self.lock:
            self.files_done += 1
        self._report()

    def _advance(self, n: int) -> None:
        with self.lock:
            self.bytes_done += n
        self._report()

    def _report(self) -> None:
        if self.progress is None:
            return
        with self.lock:
            p = FetchProgress(self.manifest.key, self.bytes_done, self.manifest.total_bytes, self.files_done,
                              len(self.manifest.files), time.monotonic() - self.t0)
            self.progress(p)


class _InOrderHash:
    """One file's BLAKE3, fed in file order while its parts (of :data:`RANGE_BYTES`) arrive in any order.

    :meth:`arrived` is called once per part, after the part is written to ``fd``. The thread whose part is next in
    order hashes it from memory, then the parts that arrived before it (read back from ``fd``); a thread that finds
    another hashing leaves its part to that one, which looks again after it lets go (so no part is left behind).
    The caller whose call hashes the file's last byte gets the digest."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        self.hashed = 0  # bytes of the file hashed so far (a part's start, or the size when done)
        self.waiting: set[int] = set()  # starts of parts written and not yet hashed
        self.lock = threading.Lock()  # guards hashed and waiting
        self.turn = threading.Lock()  # held by the one thread feeding the hash

    def arrived(self, start: int, data: memoryview) -> str | None:
        with self.lock:
            self.waiting.add(start)
        mine: memoryview | None = data
        while self.turn.acquire(blocking=False):
            try:
                while True:
                    with self.lock:
                        at = self.hashed
                        if at not in self.waiting:
                            break
                        self.waiting.discard(at)
                    n = min(RANGE_BYTES, self.size - at)
                    part = mine if mine is not None and at == start else os.pread(self.fd, n, at)
                    if len(part) != n:
                        raise RemoteCorruptError(f"{n} bytes at {at} read back as {len(part)}")
                    self.h.update(part)
                    with self.lock:
                        self.hashed = at + n
                    if self.hashed == self.size:
                        return "blake3:" + self.h.hexdigest()
                mine = None
            finally:
                self.turn.release()
            with self.lock:  # a part that arrived while this thread held the turn
                if self.hashed not in self.waiting:
                    return None
        return None


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def fetch_entry(store: ObjectStore, key: str, staging_dir: Path, progress: Callable[[FetchProgress], None] | None,
                *, ranges: bool = True, before: Callable[[Manifest], None] | None = None) -> tuple[bool, bool]:
    """Download entry ``key`` into ``staging_dir`` (see the module). Returns ``(found, ranges)``: ``found`` False on
    a miss (no manifest; nothing written), ``ranges`` whether the server answers ranged reads (False once it did
    not: the caller passes it next time). ``before`` is called with the checked manifest before anything is
    downloaded (to make room for its ``total_bytes``; what it raises propagates, nothing written). Raises
    :class:`RemoteError`; nothing unverified stays."""
    manifest = read_manifest(store, key)
    if manifest is None:
        return False, ranges
    if before is not None:
        before(manifest)
    staging_dir = Path(staging_dir)
    staging_dir.mkdir(parents=True, exist_ok=True)
    out = staging_dir / CHECKPOINT_DIR
    if out.exists() or (staging_dir / MANIFEST_NAME).exists():
        raise FileExistsError(f"{staging_dir} already holds an entry")
    if ranges and any(r.size > RANGE_BYTES for r in manifest.files):
        # One byte of the smallest file first: a server that answers a range with the whole object (and its status)
        # is read one stream per file; asked of a large file, that answer alone would be the whole file.
        small = min((r for r in manifest.files if r.size), key=lambda r: r.size)
        try:
            store.read_range(names.file_name(key, small.name), 0, 1)
        except NotPartialError:
            ranges = False
    try:
        with ThreadPoolExecutor(STREAMS, thread_name_prefix="transformd-remote-get") as pool:
            out.mkdir()
            if not _Download(store, manifest, out, progress, ranges).run(pool):
                rmtree_force(out)
                out.mkdir()
                ranges = False
                _Download(store, manifest, out, progress, ranges).run(pool)
        _seal(out)
        manifest.write(staging_dir / MANIFEST_NAME)
        fsync_path(staging_dir)
    except BaseException:
        rmtree_force(out)
        with_manifest = staging_dir / MANIFEST_NAME
        if with_manifest.exists():
            os.unlink(with_manifest)
        raise
    return True, ranges


def _seal(out: Path) -> None:
    """Read-only files and directories, fsynced, as :meth:`Cache._seal` leaves a local entry."""
    for dirpath, _dirnames, filenames in os.walk(out, topdown=False):
        for n in filenames:
            os.chmod(os.path.join(dirpath, n), 0o444)
        os.chmod(dirpath, 0o555)
        fsync_path(dirpath)
    assert stat_mod.S_ISDIR(os.lstat(out).st_mode)


__all__ = ["FetchProgress", "RemoteError", "fetch_entry", "read_manifest"]
