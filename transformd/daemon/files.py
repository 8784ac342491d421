"""The mmap API's data: published entries and their shards' tensor tables (absolute byte offsets).

Entries are immutable once published, so what is read from them (the manifest, each shard's header)
is remembered in memory, tied to the manifest's inode so that an entry removed and converted again is
read afresh; each later serve checks that every file still has the size, inode and change time it had (one
``stat`` each), so a shard deleted or truncated meanwhile is quarantined and converted again. Every function
here blocks on the file system: call it from a worker thread.

A file object (one shard)::

    {"name": "model-00001-of-00002.safetensors",
     "path": "/cache/entries/<key>-<tag>/checkpoint/model-00001-of-00002.safetensors",  # open this (null: not yet)
     "final_path": "/cache/entries/<key>-<tag>/checkpoint/model-00001-of-00002.safetensors",
     "size": 1234, "digest": "blake3:...",                                          # null until published
     "ready": true,
     "tensors": {"model.layers.0.mlp.experts.0.down_proj.weight":
                    {"dtype": "F8_E4M3FNUZ", "shape": [320, 224], "offsets": [begin, end]}}}

``offsets`` are absolute byte positions in the file (``end`` exclusive). While a conversion runs, a
finished shard is served from the conversion's staging directory (``path`` differs from
``final_path``): open it right away; it is renamed into place with the same inode, so an open file or
mapping stays valid, but the staging path itself disappears when the entry is published (then use
``final_path``).
"""

from __future__ import annotations

import collections
import json
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cache import MANIFEST_NAME, Cache, FileRecord, Manifest
from ..safetensors_io import CheckpointError, read_header
from .errors import ApiError
from .shards import is_shard_file

#: Entries whose manifest and tensor tables are kept in memory.
MAX_REMEMBERED_ENTRIES = 64


@dataclass(frozen=True)
class EntryInfo:
    """A published entry as the API shows it."""

    key: str
    root: Path
    path: Path
    size_bytes: int
    recipe: dict[str, Any]
    source: str
    created_at: float
    timings: dict[str, float]
    files: tuple[FileRecord, ...]
    #: the manifest's (device, inode, change time in ns): another publication of the key is another manifest, even
    #: where the file system gives it the inode of a removed one
    manifest_id: tuple[int, int, int]
    #: each file's path and (size, inode, change time in ns) when this process first served the entry
    stamps: tuple[tuple[str, tuple[int, int, int]], ...] = ()

    @property
    def shards(self) -> list[FileRecord]:
        return [f for f in self.files if is_shard_file(f.name)]


def tensor_table(path: Path) -> dict[str, dict[str, Any]]:
    """``{name: {"dtype", "shape", "offsets": [begin, end]}}`` of a safetensors file, offsets absolute."""
    header = read_header(path)
    return {
        t.name: {"dtype": t.dtype, "shape": list(t.shape), "offsets": [t.begin, t.end]} for t in header.tensors.values()
    }


def file_object(
    name: str,
    *,
    path: Path | None,
    final_path: Path,
    ready: bool,
    size: int | None = None,
    digest: str | None = None,
) -> dict[str, Any]:
    """One file object; reads the header of ``path`` when it is ready."""
    tensors: dict[str, Any] = {}
    if ready and path is not None:
        tensors = tensor_table(path)
        if size is None:
            size = os.stat(path).st_size
    return {
        "name": name,
        "path": str(path) if path is not None else None,
        "final_path": str(final_path),
        "size": size,
        "digest": digest,
        "ready": ready,
        "tensors": tensors,
    }


def _size_problems(
    path: Path, files: tuple[FileRecord, ...]
) -> tuple[list[str], tuple[tuple[str, tuple[int, int, int]], ...]]:
    """The files whose size is not the manifest's (or that are gone), and every file's stamp
    (:func:`_stamp_problems`)."""
    problems = []
    stamps = []
    for rec in files:
        p = os.path.join(path, rec.name)
        try:
            st = os.stat(p)
        except OSError as e:
            problems.append(f"{rec.name}: {e.strerror}")
            continue
        if st.st_size != rec.size:
            problems.append(f"{rec.name}: size {st.st_size} bytes, manifest says {rec.size}")
        stamps.append((p, (st.st_size, st.st_ino, st.st_ctime_ns)))
    return problems, tuple(stamps)


def _stamp_problems(stamps: tuple[tuple[str, tuple[int, int, int]], ...]) -> list[str]:
    """The files of a served entry that are no longer as they were when first served: gone, replaced (another
    inode), or changed (size or change time: a truncation, a write, a chmod). One ``stat`` per file, no read: a hit
    stays in microseconds, and a shard deleted or truncated after the first serve is noticed on the next."""
    problems = []
    for p, (size, ino, ctime) in stamps:
        try:
            st = os.stat(p)
        except OSError as e:
            problems.append(f"{os.path.basename(p)}: {e.strerror}")
            continue
        if st.st_size != size:
            problems.append(f"{os.path.basename(p)}: size {st.st_size} bytes, {size} when it was first served")
        elif st.st_ino != ino or st.st_ctime_ns != ctime:
            problems.append(f"{os.path.basename(p)}: replaced or changed since it was first served")
    return problems


class EntryIndex:
    """Published entries of one cache: their info, file objects and serialised ``/files`` bodies."""

    def __init__(self, cache: Cache):
        self.cache = cache
        self._lock = threading.Lock()
        self._infos: collections.OrderedDict[str, EntryInfo] = collections.OrderedDict()
        self._bodies: dict[tuple[str, tuple[int, int, int], str], bytes] = {}
        #: entries whose digests were (or are being) verified since this daemon started
        self._verified: set[str] = set()
        self._verify_queue: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._verifier: threading.Thread | None = None
        self._started = time.time()

    def final_dir(self, key: str) -> Path:
        return self.cache.entry_dir(key) / "checkpoint"

    def info(self, key: str, *, touch: bool = False) -> EntryInfo | None:
        """The published entry ``key`` or None (``touch`` marks it as used for the LRU eviction)."""
        entry = self.cache.get(key, touch=touch)
        if entry is None:
            return None
        try:
            st = os.stat(entry.root / MANIFEST_NAME)
        except OSError:
            return None
        mid = (st.st_dev, st.st_ino, st.st_ctime_ns)
        with self._lock:
            info = self._infos.get(key)
            if info is not None and info.manifest_id == mid:
                self._infos.move_to_end(key)
        if info is not None and info.manifest_id == mid:  # served before: its files must still be as they were
            problems = _stamp_problems(info.stamps)
            if problems:
                self.quarantine(key, problems)
                return None
            return info
        try:
            manifest = Manifest.read(entry.root / MANIFEST_NAME)
        except (OSError, ValueError, KeyError, TypeError):
            return None  # vanished or unreadable (verify quarantines corrupt entries)
        # The first time this process serves the entry: sizes now (cheap), digests in the background. A damaged
        # entry is quarantined, so the next request for its source converts it again.
        problems, stamps = _size_problems(entry.path, manifest.files)
        if problems:
            self.quarantine(key, problems)
            return None
        if manifest.created_at < self._started:  # this process sealed (hashed) the ones it published itself
            self._schedule_verify(key)
        info = EntryInfo(
            key=key,
            root=entry.root,
            path=entry.path,
            size_bytes=manifest.total_bytes + st.st_size,
            recipe=manifest.recipe.as_dict(),
            source=manifest.source_hint,
            created_at=manifest.created_at,
            timings=dict(manifest.timings),
            files=manifest.files,
            manifest_id=mid,
            stamps=stamps,
        )
        with self._lock:
            self._infos[key] = info
            self._infos.move_to_end(key)
            while len(self._infos) > MAX_REMEMBERED_ENTRIES:
                old, _ = self._infos.popitem(last=False)
                self._drop_bodies(old)
        return info

    def quarantine(self, key: str, problems: list[str]) -> None:
        """Move a damaged entry to quarantine/ (blocking); the next request for its source converts it again."""
        import logging

        logging.getLogger("transformd.daemon").warning("cache entry %s is damaged, quarantined: %s", key, problems[:3])
        try:
            self.cache._quarantine(key, problems)
        except Exception:  # noqa: BLE001 - a failed move leaves it for `transformd cache verify`
            logging.getLogger("transformd.daemon").exception("cannot quarantine %s", key)
        self.forget(key)

    def _schedule_verify(self, key: str) -> None:
        with self._lock:
            if key in self._verified:
                return
            self._verified.add(key)
            if self._verifier is None:
                self._verifier = threading.Thread(target=self._verify_loop, name="transformd-verify", daemon=True)
                self._verifier.start()
        self._verify_queue.put(key)

    def _verify_loop(self) -> None:
        while True:
            key = self._verify_queue.get()
            try:
                results = self.cache.verify(key, quarantine=True)
            except Exception:  # noqa: BLE001 - a verify that cannot run is retried on the next first serve
                with self._lock:
                    self._verified.discard(key)
                continue
            if any(not r.ok for r in results):
                self.forget(key)

    def forget(self, key: str) -> None:
        with self._lock:
            self._infos.pop(key, None)
            self._drop_bodies(key)

    def _drop_bodies(self, key: str) -> None:
        for k in [k for k in self._bodies if k[0] == key]:
            del self._bodies[k]

    def ready_file(self, info: EntryInfo, rec: FileRecord) -> dict[str, Any]:
        try:
            return file_object(
                rec.name,
                path=info.path / rec.name,
                final_path=info.path / rec.name,
                ready=True,
                size=rec.size,
                digest=rec.digest,
            )
        except CheckpointError as e:
            self.quarantine(info.key, [str(e)])
            raise ApiError(
                500,
                "entry_corrupt",
                f"cache entry {info.key} was damaged ({e}) and is quarantined; resolve the checkpoint again "
                "(POST /v1/checkpoints) to convert it anew",
            ) from None

    def body(self, info: EntryInfo, name: str | None = None) -> bytes | None:
        """The serialised ``/files`` body (``name`` None) or one file object; None for a name not in the entry."""
        ck = (info.key, info.manifest_id, name or "")
        with self._lock:
            cached = self._bodies.get(ck)
        if cached is not None:
            return cached
        shards = info.shards
        if name is None:
            obj: dict[str, Any] = {
                "key": info.key,
                "state": "ready",
                "files": [self.ready_file(info, r) for r in shards],
            }
        else:
            rec = next((r for r in shards if r.name == name), None)
            if rec is None:
                return None
            obj = self.ready_file(info, rec)
        data = json.dumps(obj, separators=(",", ":")).encode()
        with self._lock:
            if info.key in self._infos:
                self._bodies[ck] = data
        return data
