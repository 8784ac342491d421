"""Cache keys: the recipe plus the content identity of the source checkpoint.

A key is ``blake3(canonical JSON of {recipe, [(relative name, size, content id), ...]})``,
truncated to 32 hex digits. Paths, mtimes and owners are not part of it: two copies of one
checkpoint share a key, and one changed byte anywhere gives a new key.

Content ids are prefixed by their kind:

- ``blake3:<64 hex>``: BLAKE3 of the file's bytes (hashed with all cores, memory-mapped).
- ``hf-sha256:<64 hex>``: a Hugging Face hub snapshot file that links to ``blobs/<sha256>``
  (LFS files: the blob name is the SHA-256 of the content). Not read at all.
- ``hf-git-sha1:<40 hex>``: a hub snapshot file linking to ``blobs/<git blob sha1>`` (small,
  non-LFS files). Not read at all.
- The same two kinds for a file downloaded with ``hf download --local-dir``, from the etag that
  huggingface_hub records in ``.cache/huggingface/download/<name>.metadata``, as long as the file
  was not modified after that record (huggingface_hub's own rule).

So a hub snapshot and a local-dir download of one revision share a key; a plain copy (``cp -r``)
of the same files gets another (one extra conversion). Any two plain copies of the same content
share one.

The stat cache remembers, per source directory, ``(device, inode, size, mtime_ns, ctime_ns) ->
content id`` for each file, so an unchanged checkpoint is never read twice. A file modified
less than :data:`RACY_WINDOW_NS` before it was hashed is not remembered (its mtime may not
change on a second write within the file system's timestamp granularity); it is hashed again
on the next request.
"""

from __future__ import annotations

import json
import os
import re
import stat as stat_mod
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from ..formats import FORMAT_VERSION, ScaleMode, Target
from ._fs import read_json, write_json_atomic
from .errors import InvalidKeyError, SourceError

#: Version of the key derivation itself (bump when the canonical form changes).
KEY_SCHEMA = 1
#: Hex digits of a key (128 bits).
KEY_HEX_LEN = 32
KEY_RE = re.compile(r"^[0-9a-f]{32}$")
#: Files changed this recently (ns) when hashed are not remembered in the stat cache.
RACY_WINDOW_NS = 2_000_000_000

_HUB_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HUB_SHA1 = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Recipe:
    """Everything besides the source content that changes the output bytes."""

    target: str = Target.FNUZ.value
    scale_mode: str = ScaleMode.EXACT.value
    select: str | None = None
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", Target(self.target).value)
        object.__setattr__(self, "scale_mode", ScaleMode(self.scale_mode).value)
        if self.select is not None and not isinstance(self.select, str):
            raise TypeError(f"select must be a string or None, not {type(self.select).__name__}")
        if self.select == "":
            object.__setattr__(self, "select", None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "scale_mode": self.scale_mode,
            "select": self.select,
            "format_version": self.format_version,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        return cls(d["target"], d["scale_mode"], d.get("select"), int(d["format_version"]))

    def describe(self) -> str:
        """``fnuz/exact`` or ``fnuz/exact select=...``."""
        s = f"{self.target}/{self.scale_mode}"
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
    """The cache key of converting ``identity`` with ``recipe``."""
    doc = {"schema": KEY_SCHEMA, "recipe": recipe.as_dict(), "files": identity.canonical()}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return blake3.blake3(text.encode()).hexdigest()[:KEY_HEX_LEN]


def hash_file(path: Path | str) -> str:
    """``blake3:<hex>`` of a file's content (memory-mapped, multi-threaded)."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(os.fspath(path))
    return "blake3:" + h.hexdigest()


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


def hub_content_id(path: str, src_real: str) -> str | None:
    """Content id of a hub snapshot file from the blob it links to, or None if it is not one.

    A hub snapshot file ``<repo>/snapshots/<rev>/<name>`` is a symlink to
    ``<repo>/blobs/<sha256 or git sha1>``; the blob must belong to the same ``<repo>`` as the
    snapshot directory being identified.
    """
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


def hub_local_dir_content_id(src_real: str, rel: str, st: os.stat_result) -> str | None:
    """Content id of a file downloaded with ``huggingface_hub`` into a local directory, or None.

    ``hf download --local-dir DIR`` records each file's etag (SHA-256 for LFS files, git blob
    SHA-1 for small ones) in ``DIR/.cache/huggingface/download/<name>.metadata`` (three lines:
    commit, etag, timestamp). Like huggingface_hub itself, the record is trusted only while the
    file has not been modified after it was written (mtime - 1 s <= timestamp).
    """
    meta = os.path.join(src_real, ".cache", "huggingface", "download", rel + ".metadata")
    try:
        with open(meta, encoding="utf-8") as f:
            lines = f.read(4096).splitlines()
        etag, timestamp = lines[1].strip(), float(lines[2].strip())
    except (OSError, IndexError, ValueError):
        return None
    if st.st_mtime - 1 > timestamp:
        return None
    if _HUB_SHA256.fullmatch(etag):
        return "hf-sha256:" + etag
    if _HUB_SHA1.fullmatch(etag):
        return "hf-git-sha1:" + etag
    return None


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


def source_identity(src: Path | str, *, stat_cache: StatCache | None = None) -> SourceIdentity:
    """Identify the content of the checkpoint directory ``src`` (see the module docstring)."""
    src = Path(src)
    src_real = os.path.realpath(src)
    listing = list(iter_source_files(src))
    if not listing:
        raise SourceError(f"source checkpoint directory {src} contains no files")
    remembered = stat_cache.load(src_real) if stat_cache is not None else {}
    local_dir = os.path.isdir(os.path.join(src_real, ".cache", "huggingface", "download"))
    updated: dict[str, list[Any]] = {}
    records: list[FileRecord] = []
    sigs: list[StatSig] = []
    hashed_files = hashed_bytes = 0
    for rel, path, st in listing:
        sig = _sig(st)
        digest = hub_content_id(path, src_real)
        if digest is None and local_dir and not os.path.islink(path):
            digest = hub_local_dir_content_id(src_real, rel, st)
        if digest is None:
            old = remembered.get(rel)
            if isinstance(old, list) and len(old) == 6 and tuple(old[:5]) == sig:
                digest = str(old[5])
                updated[rel] = old
            else:
                started = time.time_ns()
                try:
                    digest = hash_file(path)
                except OSError as e:
                    raise SourceError(f"cannot read {path}: {e.strerror}") from e
                hashed_files += 1
                hashed_bytes += st.st_size
                try:
                    after = _sig(os.stat(path))
                except OSError:
                    after = None
                if after != sig:
                    raise SourceError(f"{path} changed while it was being read; try again when it is complete")
                if st.st_mtime_ns < started - RACY_WINDOW_NS:
                    updated[rel] = [*sig, digest]
        records.append(FileRecord(rel, st.st_size, digest))
        sigs.append(sig)
    if stat_cache is not None and updated != remembered:
        stat_cache.save(src_real, updated)
    return SourceIdentity(tuple(records), Path(src_real), tuple(sigs), hashed_files, hashed_bytes)


def changed_files(identity: SourceIdentity) -> list[str]:
    """Names of source files that changed, appeared or disappeared since ``identity`` was computed."""
    before = dict(zip((rec.name for rec in identity.files), identity.stats))  # noqa: B905
    try:
        now = {rel: _sig(st) for rel, _, st in iter_source_files(identity.path)}
    except SourceError:
        return sorted(before)
    return sorted(name for name in before.keys() | now.keys() if before.get(name) != now.get(name))
