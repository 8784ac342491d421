"""Cache keys: the recipe plus the content identity of the source checkpoint.

A key is ``blake3(canonical JSON of {recipe, [(relative name, size, content id), ...], writers})``,
truncated to 32 hex digits. Paths and mtimes are not part of it: two copies of one checkpoint with the same
writers share a key, and one changed byte anywhere gives a new key.

``writers`` (:func:`source_writers`) names who could change the source's bytes in place: each file's owner,
its group where the group may write, ``other`` where everyone may, its POSIX ACL (:mod:`.writers`: ids as the
host names them, from a user namespace too). A content id stands for the bytes that were hashed, and the
conversion reads them again afterwards; a writer can change them in between without moving any timestamp (a
write through a shared memory map whose pages are already dirty leaves mtime and ctime as they were), so the
entry he gets may hold the conversion of other bytes than its key names. With the writers in the key such an
entry is served only for sources the same people could rewrite anyway, never for another user's copy of that
content (a shared daemon's entries are otherwise content-addressed for everyone).

Content ids are prefixed by their kind:

- ``blake3:<64 hex>``: BLAKE3 of the file's bytes (read, not mapped; on all cores, or on
  :data:`BACKGROUND_HASH_THREADS` beside a conversion).
- ``hf-sha256:<64 hex>``: SHA-256 of the file's bytes, used for a file that *claims* it: a Hugging
  Face hub snapshot file linking to ``blobs/<sha256>`` (LFS files), or a file whose
  ``hf download --local-dir`` record (``.cache/huggingface/download/<name>.metadata``) names that etag.
- ``hf-git-sha1:<40 hex>``: the git blob id of the bytes, for a file that claims it the same way
  (small, non-LFS files).

A claim is a hint, never proof: the file's bytes are read (through the checked descriptor) and
hashed in the claimed kind, and the claimed id is used only when it matches; otherwise the id is
the BLAKE3 of the bytes. The download record's timestamp is ignored. So a hub snapshot and a
local-dir download of one revision share a key once verified (with the same writers), a forged blob name or etag never
lends a file another content's key, and a plain copy (``cp -r``) of the same files gets another key
(one extra conversion). Any two plain copies of the same content with the same writers share one.

The stat cache remembers, per source directory, ``(device, inode, size, mtime_ns, ctime_ns) ->
content id`` for each file (only ids computed from the bytes, claims included once verified), so an
unchanged checkpoint is never read twice. ``ctime`` is set by the kernel on a change through a system call and
cannot be set by a user, so a forged timestamp cannot keep an old id (a write through a memory map may not move
it: that is what ``writers`` above confines). A file modified
less than :data:`RACY_WINDOW_NS` before it was hashed is not remembered (its mtime may not
change on a second write within the file system's timestamp granularity); it is hashed again
on the next request.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import mmap
import os
import re
import stat as stat_mod
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from .._durable import read_json, write_json_atomic
from ..checkpoint.layout import Layout
from ..formats import FORMAT_VERSION, ScaleMode, Target
from ..readahead import set_idle_io
from .errors import InvalidKeyError, SourceChangedError, SourceError
from .securefs import SourceTree, open_source
from .writers import source_writers

#: Version of the key derivation itself (bump when the canonical form changes).
KEY_SCHEMA = 2  # 2: the source's writers are part of the key
#: Hex digits of a key (128 bits).
KEY_HEX_LEN = 32
KEY_RE = re.compile(r"^[0-9a-f]{32}$")
#: Files changed this recently (ns) when hashed are not remembered in the stat cache.
RACY_WINDOW_NS = 2_000_000_000
#: Bytes of a file hashed at once: a paced hashing (``pace`` below) is asked before each such slice.
HASH_CHUNK_BYTES = 8 << 20
#: Threads that read a file's slices ahead of its hashing.
_READERS = 4
#: BLAKE3's threads for a hashing that runs beside a conversion (the source's, paced by it; the output's shards as
#: they are finished): enough to keep up with any disk, where all cores (its ``AUTO``) are for a hashing someone waits
#: on. On the H100 machine (16 cores), a ``convert --cache-dir`` from the page cache, whose source is hashed while the
#: head start's worker and the pipeline convert, took 1.7-2.2 s less system CPU with 4 threads (and 4.1 s less user
#: CPU in one of two calls), in no more time (``benchmarks/results/convert_bench_h100_cache_modes.txt``,
#: ``..._background_hashing.txt``): cores the conversion beside it, or the node's other work, can use.
BACKGROUND_HASH_THREADS = 4
#: Each reader thread's I/O class (``idle``: see :data:`Pace`).
_reader = threading.local()

#: ``pace(n)``: called before a hashing reads its next slice, with the position in the source where that slice ends
#: (the bytes of the files before it, in the tree's order, plus the file's own up to there); it may block (to keep
#: the hashing behind a conversion) or raise (to stop it). A true return reads that slice at the idle I/O class
#: (:func:`transformd.readahead.set_idle_io`: while a process starts, its imports' reads go first).
Pace = Callable[[int], bool | None]

_HUB_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HUB_SHA1 = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Recipe:
    """Everything besides the source content that changes the output bytes."""

    target: str = Target.FNUZ.value
    scale_mode: str = ScaleMode.EXACT.value
    select: str | None = None
    format_version: int = FORMAT_VERSION
    #: ``as-is``, or ``per-expert`` (fused expert stacks written per expert, for SGLang:
    #: :mod:`transformd.checkpoint.layout`); in the key only when not ``as-is``, so earlier keys stay what they were
    layout: str = "as-is"

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", Target(self.target).value)
        object.__setattr__(self, "scale_mode", ScaleMode(self.scale_mode).value)
        object.__setattr__(self, "layout", Layout(self.layout).value)
        if self.select is not None and not isinstance(self.select, str):
            raise TypeError(f"select must be a string or None, not {type(self.select).__name__}")
        if self.select == "":
            object.__setattr__(self, "select", None)

    def as_dict(self) -> dict[str, Any]:
        d = {
            "target": self.target,
            "scale_mode": self.scale_mode,
            "select": self.select,
            "format_version": self.format_version,
        }
        return d if self.layout == "as-is" else {**d, "layout": self.layout}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        return cls(d["target"], d["scale_mode"], d.get("select"), int(d["format_version"]), d.get("layout", "as-is"))

    def describe(self) -> str:
        """``fnuz/exact``, ``fnuz/exact per-expert`` or ``fnuz/exact select=...``."""
        s = f"{self.target}/{self.scale_mode}" + (f" {self.layout}" if self.layout != "as-is" else "")
        return f"{s} select={self.select}" if self.select else s


@dataclass(frozen=True)
class FileRecord:
    """One file: name relative to its checkpoint directory (``/``-separated), size, content id."""

    name: str
    size: int
    digest: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "digest": self.digest}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FileRecord:
        return cls(str(d["name"]), int(d["size"]), str(d["digest"]))


#: (device, inode, size, mtime_ns, ctime_ns) of a file, following symlinks.
StatSig = tuple[int, int, int, int, int]


def _sig(st: os.stat_result) -> StatSig:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class SourceIdentity:
    """The content identity of a source checkpoint directory. Equality ignores path and statistics."""

    files: tuple[FileRecord, ...]
    path: Path = field(compare=False)
    #: stat signature of each file when it was identified (for "changed during conversion" checks)
    stats: tuple[StatSig, ...] = field(compare=False, repr=False, default=())
    #: files and bytes actually read and hashed to compute this identity (0 on a warm stat cache)
    hashed_files: int = field(compare=False, default=0)
    hashed_bytes: int = field(compare=False, default=0)
    #: who may read the source (securefs.AccessFacts): the daemon serves it only to such callers
    access: Any = field(compare=False, repr=False, default=None)
    #: who could change its bytes in place (:func:`source_writers`); part of the key
    writers: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def canonical(self) -> list[list[Any]]:
        return [[f.name, f.size, f.digest] for f in self.files]


def validate_key(key: str) -> str:
    """Return ``key`` if it is a well-formed cache key, else raise :class:`InvalidKeyError`.

    Keys are used as path components, so this is what stops ``../`` and friends.
    """
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise InvalidKeyError(f"not a cache key (expected {KEY_HEX_LEN} lowercase hex digits): {key!r}")
    return key


def cache_key(identity: SourceIdentity, recipe: Recipe) -> str:
    """The cache key of converting ``identity`` with ``recipe`` (its files' content ids and its writers)."""
    doc = {"schema": KEY_SCHEMA, "recipe": recipe.as_dict(), "files": identity.canonical(),
           "writers": list(identity.writers)}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return blake3.blake3(text.encode()).hexdigest()[:KEY_HEX_LEN]


def hash_file(path: Path | str, pace: Pace | None = None, *, background: bool = False) -> str:
    """``blake3:<hex>`` of a file's content (read, see :func:`_feed`); ``pace``: see :data:`Pace`. On all cores, or
    with ``background`` (a hashing beside a conversion) on :data:`BACKGROUND_HASH_THREADS`."""
    h = blake3.blake3(max_threads=_background_threads() if background else blake3.blake3.AUTO)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        _feed(h, fd, os.fstat(fd).st_size, pace)
    finally:
        os.close(fd)
    return "blake3:" + h.hexdigest()


def _background_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(BACKGROUND_HASH_THREADS, cores))


def hash_own_file(path: Path | str) -> str:
    """:func:`hash_file` of a file the cache wrote (an entry's): memory-mapped when this user owns it, about ten times
    faster from the page cache (46.7 against 4.2 GiB/s for one reader on the H200 machine); read like a source's
    otherwise. A mapped file that its owner shortens meanwhile kills the process with SIGBUS, so never a file of
    another user (one who converts into a shared cache owns the files of his entries)."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not st.st_size:
            _feed(h, fd, st.st_size, None)
        else:
            with mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ) as mm:
                h.update(mm)
    finally:
        os.close(fd)
    return "blake3:" + h.hexdigest()


def _feed(h: Any, fd: int, size: int, pace: Pace | None) -> None:
    """Hash the ``size`` bytes behind ``fd`` into ``h``, :data:`HASH_CHUNK_BYTES` at a time, read by
    :data:`_READERS` threads ahead of the hashing (one thread copying from the page cache is the bottleneck; BLAKE3
    spreads each slice over the cores). Read, not memory-mapped: a source file that its owner truncates meanwhile
    ends in an error here, not in a SIGBUS that kills the daemon."""
    starts = range(0, size, HASH_CHUNK_BYTES)
    if not starts:
        return
    bufs = [memoryview(bytearray(min(size, HASH_CHUNK_BYTES))) for _ in range(min(len(starts), _READERS + 1))]
    with concurrent.futures.ThreadPoolExecutor(_READERS, thread_name_prefix="transformd-hash-read") as pool:
        reads: collections.deque[concurrent.futures.Future[memoryview]] = collections.deque()

        def read(i: int) -> None:  # slice i, into the buffer that slice i - len(bufs) used (hashed by now)
            end = min(size, starts[i] + HASH_CHUNK_BYTES)
            idle = pace is not None and bool(pace(end))
            reads.append(pool.submit(_read_exactly, fd, bufs[i % len(bufs)][: end - starts[i]], starts[i], size, idle))

        for i in range(min(len(starts), _READERS)):
            read(i)
        for i in range(len(starts)):
            data = reads.popleft().result()
            if i + _READERS < len(starts):
                read(i + _READERS)
            h.update(data)


def _read_exactly(fd: int, view: memoryview, offset: int, size: int, idle: bool = False) -> memoryview:
    if getattr(_reader, "idle", False) != idle:  # (a reader thread starts in the normal class)
        set_idle_io(idle)
        _reader.idle = idle
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise ValueError(f"it ended at byte {offset + got} of {size}: it changed while it was read")
        got += n
    return view


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def iter_source_files(src: Path) -> Iterator[tuple[str, str, os.stat_result]]:
    """Yield ``(relative name, absolute path, stat)`` for every file the conversion reads or carries over.

    That is every regular file under ``src``, recursively, following symlinks (hub snapshots are
    symlinks), skipping hidden names (``.git``, ``.cache``, ...). Sorted by relative name.
    Raises :class:`SourceError` for a missing or non-directory source and for broken symlinks.
    """
    src = Path(src)
    try:
        top = os.stat(src)
    except FileNotFoundError:
        raise SourceError(f"source checkpoint directory {src} does not exist") from None
    except OSError as e:
        raise SourceError(f"cannot read source checkpoint directory {src}: {e.strerror}") from e
    if not stat_mod.S_ISDIR(top.st_mode):
        raise SourceError(f"source checkpoint {src} is not a directory")
    seen_dirs = {(top.st_dev, top.st_ino)}
    out: list[tuple[str, str, os.stat_result]] = []

    def walk(d: str, prefix: str) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            raise SourceError(f"cannot list {d}: {e.strerror}") from e
        for e in entries:
            if _is_hidden(e.name):
                continue
            rel = f"{prefix}{e.name}"
            try:
                st = os.stat(e.path)
            except FileNotFoundError:
                raise SourceError(f"{e.path} in source checkpoint {src} is a broken symlink") from None
            except OSError as err:
                raise SourceError(f"cannot stat {e.path}: {err.strerror}") from err
            if stat_mod.S_ISDIR(st.st_mode):
                ident = (st.st_dev, st.st_ino)
                if ident in seen_dirs:
                    continue  # a symlink loop, or the same directory twice
                seen_dirs.add(ident)
                walk(e.path, rel + "/")
            elif stat_mod.S_ISREG(st.st_mode):
                out.append((rel, e.path, st))

    walk(os.fspath(src), "")
    out.sort(key=lambda t: t[0])
    return iter(out)


def hub_content_id(path: str, src_real: str, target: str | None = None) -> str | None:
    """The content id a hub snapshot file *claims* from the blob it links to, or None if it is not one.

    A hub snapshot file ``<repo>/snapshots/<rev>/<name>`` is a symlink to
    ``<repo>/blobs/<sha256 or git sha1>``; the blob must belong to the same ``<repo>`` as the
    snapshot directory being identified. ``target``: the real path of the opened file (else resolved
    here). A claim only: :func:`identity_of_tree` hashes the bytes and uses it only when they match.
    """
    if target is None:
        if not os.path.islink(path):
            return None
        target = os.path.realpath(path)
    blobs = os.path.dirname(target)
    if os.path.basename(blobs) != "blobs":
        return None
    snapshots = os.path.join(os.path.dirname(blobs), "snapshots") + os.sep
    if not src_real.startswith(snapshots):
        return None
    name = os.path.basename(target)
    if _HUB_SHA256.fullmatch(name):
        return "hf-sha256:" + name
    if _HUB_SHA1.fullmatch(name):
        return "hf-git-sha1:" + name
    return None


def _parse_download_record(text: str | None) -> str | None:
    """The etag of a ``--local-dir`` download record (commit, etag, timestamp lines) as a claimed id, or None.

    The timestamp is ignored: whether the file still holds that content is decided by hashing it.
    """
    if not text:
        return None
    lines = text.splitlines()
    if len(lines) < 2:
        return None
    etag = lines[1].strip()
    if _HUB_SHA256.fullmatch(etag):
        return "hf-sha256:" + etag
    if _HUB_SHA1.fullmatch(etag):
        return "hf-git-sha1:" + etag
    return None


def hub_local_dir_content_id(src_real: str, rel: str, st: os.stat_result) -> str | None:
    """The content id a ``huggingface_hub`` ``--local-dir`` download record claims for ``rel``, or None.

    ``hf download --local-dir DIR`` records each file's etag (SHA-256 for LFS files, git blob
    SHA-1 for small ones) in ``DIR/.cache/huggingface/download/<name>.metadata``. A claim only.
    """
    meta = os.path.join(src_real, ".cache", "huggingface", "download", rel + ".metadata")
    try:
        fd = os.open(meta, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
            return None
        return _parse_download_record(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
    except OSError:
        return None
    finally:
        os.close(fd)


def _claim_digest(fd: int, size: int, claim: str, pace: Pace | None = None) -> str:
    """The id of the bytes behind ``fd`` in the kind of ``claim`` (``hf-sha256:`` or ``hf-git-sha1:``)."""
    if claim.startswith("hf-sha256:"):
        h = hashlib.sha256()
        kind = "hf-sha256:"
    else:
        h = hashlib.sha1(b"blob %d\0" % size)  # noqa: S324 - git's blob id, compared, not trusted
        kind = "hf-git-sha1:"
    _feed(h, fd, size, pace)
    return kind + h.hexdigest()


class StatCache:
    """Persistent map of ``stat signature -> content id``, one small JSON file per source directory.

    Lives in ``<cache root>/stat-cache/<blake3 of the source's real path>.json``. Concurrent
    writers may overwrite each other's additions; that only costs a re-hash, never a wrong key,
    because every remembered digest is tied to the full stat signature it was computed under.
    """

    def __init__(self, directory: Path | None):
        self.directory = Path(directory) if directory is not None else None

    def _file(self, src_real: str) -> Path | None:
        if self.directory is None:
            return None
        return self.directory / (blake3.blake3(src_real.encode()).hexdigest()[:32] + ".json")

    def load(self, src_real: str) -> dict[str, list[Any]]:
        p = self._file(src_real)
        if p is None:
            return {}
        data = read_json(p)
        if not isinstance(data, dict) or data.get("source") != src_real or not isinstance(data.get("files"), dict):
            return {}
        return data["files"]

    def save(self, src_real: str, files: dict[str, list[Any]]) -> None:
        p = self._file(src_real)
        if p is None:
            return
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(p, {"version": 1, "source": src_real, "files": files})
        except OSError:
            pass  # an unwritable stat cache costs speed, not correctness


def source_identity(
    src: Path | str,
    *,
    stat_cache: StatCache | None = None,
    roots: Sequence[str] | None = None,
    before_hashing: Callable[[int], None] | None = None,
) -> SourceIdentity:
    """Identify the content of the checkpoint directory ``src`` (see the module docstring).

    ``roots``: every file must resolve inside one of these real paths (see :mod:`.securefs`).
    """
    with open_source(src, roots) as tree:
        return identity_of_tree(tree, stat_cache=stat_cache, before_hashing=before_hashing)


def identity_of_tree(
    tree: SourceTree,
    *,
    stat_cache: StatCache | None = None,
    before_hashing: Callable[[int], None] | None = None,
    known: SourceIdentity | None = None,
    cancelled: Callable[[], bool] | None = None,
    before_saving: Callable[[SourceIdentity], None] | None = None,
    pace: Pace | None = None,
) -> SourceIdentity:
    """The identity of the files of an opened :class:`SourceTree`, hashing what the stat cache does not know.

    ``known``: an identity this process computed of the same directory moments ago (the daemon identifies a
    source when the request comes, then converts it from a new open): a file whose full stat signature is
    still the one recorded there keeps that digest, without being read again, even inside the stat cache's
    racy window (the same signature check that tells whether a source changed during its conversion).

    Every byte hashed is read through the tree's checked descriptors. A digest that a hub blob name or a
    download record claims is used as the file's id only once the file's bytes were hashed and matched it
    (remembered in the stat cache under the file's full stat signature); otherwise the id is the BLAKE3 of
    the bytes. Modification times never stand in for content. ``before_hashing(total bytes of the source)`` is
    called once before the first byte is hashed (a size check that may raise: no work before limits).
    ``cancelled()`` is asked before each file is hashed; true raises :class:`HashingCancelled`.
    ``before_saving(identity)`` runs before the stat cache learns the new digests (from then on other processes
    find the key without hashing): the hashing beside a conversion takes the key's lock there. ``pace`` (see
    :data:`Pace`) is asked before each slice of a file is read, with its position in the tree then (the sizes of the
    files before it, read or not, and the bytes of this one read so far).
    """
    src_real = tree.real
    remembered, just_read = _remembered(tree, stat_cache, known)
    updated: dict[str, list[Any]] = {}
    records: list[FileRecord] = []
    sigs: list[StatSig] = []
    hashed_files = hashed_bytes = position = 0  # position: the bytes of the files before this one, hashed or not
    for f in tree.files:
        rel, st = f.rel, f.st
        sig = _sig(st)
        old = remembered.get(rel)
        if _still_valid(old, sig):
            digest = str(old[5])
            if rel not in just_read or st.st_mtime_ns < time.time_ns() - RACY_WINDOW_NS:
                updated[rel] = old
        else:
            if before_hashing is not None:
                before_hashing(sum(x.st.st_size for x in tree.files))
                before_hashing = None
            if cancelled is not None and cancelled():
                raise HashingCancelled(f"hashing {tree.src} was stopped")
            claim = hub_content_id(os.path.join(src_real, rel), src_real, f.real)
            if claim is None:
                claim = _parse_download_record(tree.read_meta(rel))
            started = time.time_ns()
            paced = None if pace is None else lambda n, before=position: pace(before + n)
            try:
                digest = None
                if claim is not None:
                    actual = _claim_digest(f.fd, st.st_size, claim, paced)
                    digest = claim if actual == claim else None
                if digest is None:
                    digest = hash_file(f.proc_path, paced, background=pace is not None)
            except (OSError, ValueError) as e:
                raise SourceError(f"cannot read {os.path.join(tree.src, rel)}: {getattr(e, 'strerror', e)}") from e
            hashed_files += 1
            hashed_bytes += st.st_size
            try:
                after = _sig(os.fstat(f.fd))
            except OSError:
                after = None
            if after != sig:
                raise SourceChangedError(
                    f"{os.path.join(tree.src, rel)} changed while it was being read; try again when it is complete"
                )
            if st.st_mtime_ns < started - RACY_WINDOW_NS:
                updated[rel] = [*sig, digest]
        records.append(FileRecord(rel, st.st_size, digest))
        position += st.st_size
        sigs.append(sig)
    identity = SourceIdentity(tuple(records), Path(src_real), tuple(sigs), hashed_files, hashed_bytes, tree.facts(),
                              source_writers((f.fd, f.st) for f in tree.files))
    if before_saving is not None:
        before_saving(identity)
    if stat_cache is not None and updated != remembered:
        stat_cache.save(src_real, updated)
    return identity


class HashingCancelled(Exception):
    """:func:`identity_of_tree` was stopped by its ``cancelled`` callback (the conversion beside it failed)."""


def _remembered(
    tree: SourceTree, stat_cache: StatCache | None, known: SourceIdentity | None
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """What the stat cache and ``known`` say of the tree's files: (all remembered, those of ``known``)."""
    if not tree.files:
        raise SourceError(f"source checkpoint directory {tree.src} contains no files")
    remembered = stat_cache.load(tree.real) if stat_cache is not None else {}
    just_read: dict[str, list[Any]] = {}
    if known is not None and known.path == Path(tree.real):
        just_read = {rec.name: [*sig, rec.digest] for rec, sig in zip(known.files, known.stats)}  # noqa: B905
        remembered = {**remembered, **just_read}
    return remembered, just_read


def _still_valid(old: Any, sig: StatSig) -> bool:
    """A remembered ``[*stat signature, digest]`` that still holds for a file of signature ``sig``."""
    return isinstance(old, list) and len(old) == 6 and tuple(old[:5]) == sig


def bytes_to_hash(tree: SourceTree, stat_cache: StatCache | None, known: SourceIdentity | None = None) -> int:
    """Bytes :func:`identity_of_tree` would read: the files of ``tree`` neither remembered nor in ``known``."""
    remembered, _ = _remembered(tree, stat_cache, known)
    return sum(f.st.st_size for f in tree.files if not _still_valid(remembered.get(f.rel), _sig(f.st)))


def settled(tree: SourceTree) -> bool:
    """Whether every file of ``tree`` is older than the racy window (so that the stat cache can remember it)."""
    limit = time.time_ns() - RACY_WINDOW_NS
    return all(f.st.st_mtime_ns < limit for f in tree.files)


def provisional_key(tree: SourceTree, recipe: Recipe) -> str:
    """The name of a conversion whose key is not known yet (its source is hashed while it converts).

    Key-shaped (staging names, locks, status and failure records work as for a key), never a key itself: it
    names the source directory, its files' stat signatures and the recipe, not content. Two requests for the
    same unchanged directory get the same one (one converts, the other waits); any change gives another.
    """
    return provisional_key_of(tree.real, provisional_files(tree), recipe)


def check_same_tree(tree: SourceTree, recipe: Recipe, slot: str, src: str | os.PathLike[str]) -> None:
    """Raise :class:`SourceChangedError` unless ``tree`` is the directory, with the same files (names and stat
    signatures), whose :func:`provisional_key` was ``slot`` when it was requested: a job reopens its source by
    path, and the path may name other files by then (a directory renamed, a symbolic link swapped in)."""
    if provisional_key(tree, recipe) != slot:
        raise SourceChangedError(f"source {src} changed after it was requested (other files, or another directory, "
                                 "at its path now)")


def check_same_files(tree: SourceTree, identity: SourceIdentity, src: str | os.PathLike[str]) -> None:
    """Raise :class:`SourceChangedError` unless ``tree`` is the directory ``identity`` was computed from, with the
    same files (names, devices and inodes): as :func:`check_same_tree`, for a job whose key is known. Times and
    sizes may move (a touch, a chmod while the job waits in the queue): the key checks the content itself."""
    files = [(f.rel, f.st.st_dev, f.st.st_ino) for f in tree.files]
    if tree.real != str(identity.path) or files != [(f.name, s[0], s[1]) for f, s in zip(identity.files,
                                                                                        identity.stats)]:
        raise SourceChangedError(f"source {src} changed after it was requested (other files, or another directory, "
                                 "at its path now)")


def check_as_requested(tree: SourceTree, recipe: Recipe, src: str | os.PathLike[str], *, slot: str | None,
                       identity: SourceIdentity | None) -> None:
    """The check a reopened source of a request gets: :func:`check_same_tree` against the request's ``slot``, else
    :func:`check_same_files` against its ``identity``; nothing when it has neither."""
    if slot is not None:
        check_same_tree(tree, recipe, slot, src)
    elif identity is not None:
        check_same_files(tree, identity, src)


def provisional_files(tree: SourceTree) -> list[list[Any]]:
    """What :func:`provisional_key` takes from a tree's files: their names and stat signatures."""
    return [[f.rel, *_sig(f.st)] for f in tree.files]


def provisional_key_of(real: str, files: list[list[Any]], recipe: Recipe) -> str:
    """:func:`provisional_key` of a tree whose real path and :func:`provisional_files` were taken earlier."""
    doc = {"provisional": KEY_SCHEMA, "source": real, "recipe": recipe.as_dict(), "files": files}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return blake3.blake3(text.encode()).hexdigest()[:KEY_HEX_LEN]
