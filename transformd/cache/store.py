"""The cache store: lookup, single-flight conversion, atomic publish, leases, eviction, verify.

See the package docstring (:mod:`transformd.cache`) for the on-disk layout and the rules.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import secrets
import stat as stat_mod
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .._durable import (
    free_bytes,
    fs_size_bytes,
    fsync_path,
    is_no_space,
    read_json,
    rmtree_force,
    write_json_atomic,
)
from ..progress import human_bytes
from .budget import parse_size
from .errors import (
    CacheError,
    CacheFullError,
    CacheTimeoutError,
    ConversionFailedError,
    DiskFullError,
    EntryLeasedError,
    EntryNotFoundError,
    NotACacheError,
    SourceChangedError,
)
from .keys import (
    KEY_HEX_LEN,
    KEY_RE,
    FileRecord,
    Recipe,
    SourceIdentity,
    StatCache,
    cache_key,
    hash_file,
    identity_of_tree,
    source_identity,
    validate_key,
)
from .lease import Lease, lease_path, new_lease_id, read_leases, validate_lease_id, write_lease
from .lock import FileLock, SharedExclusiveLock, process_alive, process_identity
from .manifest import CHECKPOINT_DIR, MANIFEST_NAME, Manifest, jsonable
from .securefs import SourceTree, open_source

#: Environment variable naming the cache root.
ENV_CACHE_DIR = "TRANSFORMD_CACHE_DIR"
#: Environment variable with the byte budget ("500G", "1.5TiB", "80%" of the file system, bytes).
ENV_BUDGET = "TRANSFORMD_CACHE_BUDGET"
#: Default budget, fixed when the cache root is created: this share of the free space then.
DEFAULT_BUDGET_FRACTION = 0.9
#: Added to the source size when estimating the size of a new entry (manifest, metadata).
ENTRY_OVERHEAD_BYTES = 64 * 1024
#: How often the in-flight status file is rewritten at most (seconds).
STATUS_INTERVAL_S = 0.25
#: How long a failed conversion's record is reported by :meth:`Cache.status` (seconds).
FAILURE_TTL_S = 3600.0
#: Leftover temporary files older than this (seconds) are removed by cleanup.
TMP_MAX_AGE_S = 600.0
#: Default lease duration of :meth:`Cache.lease` (seconds); a lease of a live process.
DEFAULT_LEASE_TTL_S = 24 * 3600.0
#: Sentinel: the lease is held by the calling process.
CURRENT_PROCESS = -1

_GC_LOCK = "gc.lock"


class Converter(Protocol):
    """Writes the converted checkpoint of ``src`` into ``out``.

    ``out`` does not exist yet; the converter creates it as a directory and writes every file of
    the converted checkpoint into it, each fsynced (the cache fsyncs the directories and renames
    the staging directory that holds ``out``: a converter neither stages nor renames). It calls
    ``progress(update)`` as it goes (any JSON-able object, a dataclass or a dict). Its return
    value (e.g. a ConversionResult) is summarised into the manifest's ``result``. It raises on
    invalid input; the cache removes everything it wrote.
    """

    def __call__(self, src: Path, out: Path, recipe: Recipe, progress: Callable[[Any], None]) -> Any: ...


class TransformdConverter:
    """The default converter: :func:`transformd.checkpoint.write_checkpoint` into ``out``."""

    def __init__(self, device: str = "auto"):
        self.device = device

    def __call__(
        self, src: Path, out: Path, recipe: Recipe, progress: Callable[[Any], None], *, shard_order: Any = None
    ) -> Any:
        """``shard_order``: a :class:`transformd.checkpoint.ShardOrder` (the daemon's just-in-time shards)."""
        # imported late: the cache does not need torch code
        from ..checkpoint import conversion_devices, plan_conversion, write_checkpoint

        return write_checkpoint(
            plan_conversion(src, select=recipe.select),
            out,
            target=recipe.target,
            scale_mode=recipe.scale_mode,
            devices=conversion_devices(self.device),
            progress=progress,
            shard_order=shard_order,
        )

    def __repr__(self) -> str:
        return f"TransformdConverter(device={self.device!r})"


def default_root(root: str | os.PathLike[str] | None = None) -> Path:
    """The cache root.

    ``root`` if given, else ``$TRANSFORMD_CACHE_DIR``, else ``$XDG_CACHE_HOME/transformd``, else
    ``~/.cache/transformd``. Relative paths are made absolute.
    """
    if root is not None and os.fspath(root) != "":
        return Path(root).expanduser().absolute()
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "transformd"
    return Path.home() / ".cache" / "transformd"


def existing_root(root: str | os.PathLike[str] | None = None) -> Path:
    """:func:`default_root`, checked to be a cache transformd created; else :class:`NotACacheError`.

    For commands that only read or maintain a cache (``transformd cache ls|verify|gc|rm``): unlike
    :class:`Cache`, which creates its root, they must not turn a mistyped directory into an empty cache.
    A cache is recognised by its ``CACHEDIR.TAG`` (written by transformd) or by ``entries/`` with
    ``config.json``.
    """
    path = default_root(root)
    if root is not None and os.fspath(root) != "":
        source = "--cache-dir"
    elif os.environ.get(ENV_CACHE_DIR):
        source = f"${ENV_CACHE_DIR}"
    else:
        source = "the default cache directory"
    hint = (
        f"check --cache-dir and ${ENV_CACHE_DIR} (default $XDG_CACHE_HOME/transformd, else ~/.cache/transformd); "
        "a cache is created by 'transformd convert' without --out or by 'transformd serve'"
    )
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise NotACacheError(f"no transformd cache at {path} ({source}): it {what}; {hint}")
    tag = path / "CACHEDIR.TAG"
    try:
        tagged = tag.is_file() and "transformd" in tag.read_text(encoding="utf-8", errors="replace")[:4096]
    except OSError:
        tagged = False
    if not (tagged or ((path / "entries").is_dir() and (path / "config.json").is_file())):
        raise NotACacheError(
            f"{path} ({source}) is not a transformd cache (no CACHEDIR.TAG written by transformd, no entries/ "
            f"and config.json); {hint}"
        )
    return path


@dataclass(frozen=True)
class ConversionStatus:
    """Where a key stands, as any process can read it.

    ``state``: ``converting`` (a live process converts it), ``publishing`` (digests, fsync,
    rename), ``ready`` (an entry exists), ``failed`` (the last attempt failed within the last
    hour; ``error`` says why). ``detail`` is the converter's latest progress update (JSON).
    ``waiting`` is True in the updates a process receives while another process converts.
    """

    key: str
    state: str
    pid: int | None = None
    host: str | None = None
    started_at: float | None = None
    updated_at: float | None = None
    source: str | None = None
    estimate_bytes: int | None = None
    #: the staging directory of the conversion (``staging/<key>.<pid>.<rand>``); the converter writes
    #: ``checkpoint/`` inside it, which is renamed (same inodes) into ``entries/<key>/`` when done
    staging_dir: str | None = None
    detail: Any = None
    error: str | None = None
    error_type: str | None = None
    waiting: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class Entry:
    """A published cache entry.

    ``path`` is the converted checkpoint directory (give it to the engine); ``root`` the entry
    directory holding it and ``manifest.json``. ``outcome`` says how this call got it: ``hit``,
    ``converted`` (this process converted it) or ``waited`` (another process did). ``lease`` is
    set when the entry was obtained with ``lease_ttl``.
    """

    def __init__(self, key: str, root: Path, last_used: float, *, outcome: str = "hit", lease: Lease | None = None):
        self.key = key
        self.root = root
        self.path = root / CHECKPOINT_DIR
        self.last_used = last_used
        self.outcome = outcome
        self.lease = lease

    @functools.cached_property
    def manifest(self) -> Manifest:
        return Manifest.read(self.root / MANIFEST_NAME)

    @property
    def size_bytes(self) -> int:
        """Bytes of the entry on disk: the converted files plus the manifest."""
        try:
            extra = os.stat(self.root / MANIFEST_NAME).st_size
        except OSError:
            extra = 0
        return self.manifest.total_bytes + extra

    def __repr__(self) -> str:
        return f"Entry(key={self.key!r}, path={str(self.path)!r}, outcome={self.outcome!r})"


@dataclass
class VerifyResult:
    key: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    #: where the entry was moved when it was quarantined
    quarantined_to: Path | None = None


@dataclass
class CleanupReport:
    staging_removed: list[str] = field(default_factory=list)
    locks_removed: list[str] = field(default_factory=list)
    trash_removed: int = 0
    tmp_removed: int = 0


@dataclass
class GcReport:
    evicted: list[tuple[str, int]] = field(default_factory=list)
    freed_bytes: int = 0
    used_bytes: int = 0
    budget_bytes: int = 0
    leases_removed: int = 0
    quarantine_removed: int = 0
    cleanup: CleanupReport = field(default_factory=CleanupReport)


@dataclass
class CacheUsage:
    root: Path
    budget_bytes: int
    used_bytes: int
    entries: int
    leased_bytes: int
    free_bytes: int
    quarantined: int
    in_flight: int


@dataclass
class _EntryInfo:
    key: str
    root: Path
    last_used: float
    size: int


class _StatusWriter:
    """Writes ``staging/<name>.json`` (owner, reservation, progress) and forwards progress to the caller."""

    def __init__(
        self,
        path: Path,
        key: str,
        source: str,
        estimate: int,
        user_progress: Callable[[ConversionStatus], None] | None,
    ):
        self.path = path
        self.key = key
        self.source = source
        self.estimate = estimate
        self.user_progress = user_progress
        self.owner = process_identity()
        self.started_at = time.time()
        self.state = "converting"
        self.detail: Any = None
        self._last_write = 0.0

    def status(self) -> ConversionStatus:
        return ConversionStatus(
            key=self.key,
            state=self.state,
            pid=self.owner["pid"],
            host=self.owner["host"],
            started_at=self.started_at,
            updated_at=time.time(),
            source=self.source,
            estimate_bytes=self.estimate,
            staging_dir=str(self.path.with_suffix("")) if self.path.name.endswith(".json") else None,
            detail=self.detail,
        )

    def write(self, *, force: bool = True) -> None:
        now = time.monotonic()
        if not force and now - self._last_write < STATUS_INTERVAL_S:
            return
        self._last_write = now
        data = self.status().as_dict()
        data["owner"] = self.owner
        write_json_atomic(self.path, data)

    def set_state(self, state: str, detail: Any = None) -> None:
        self.state = state
        if detail is not None:
            self.detail = detail
        self.write(force=True)
        if self.user_progress is not None:
            self.user_progress(self.status())

    def __call__(self, update: Any) -> None:
        self.detail = jsonable(update)
        self.write(force=False)
        if self.user_progress is not None:
            self.user_progress(self.status())


def _status_from_file(data: Any, *, waiting: bool = False) -> ConversionStatus | None:
    if not isinstance(data, dict) or not isinstance(data.get("key"), str):
        return None
    fields = ConversionStatus.__dataclass_fields__
    kw = {k: v for k, v in data.items() if k in fields}
    kw["waiting"] = waiting
    try:
        return ConversionStatus(**kw)
    except TypeError:
        return None


class Cache:
    """A content-addressed cache of converted checkpoints under one root directory.

    Safe to use from many threads and many processes at once. Every method works from the
    files alone; nothing is kept in memory between calls except settings.

    ``budget_bytes``: an int or a size string (``"500G"``, ``"80%"`` of the file system);
    default ``$TRANSFORMD_CACHE_BUDGET``, else ``budget_bytes`` of ``<root>/config.json``, which
    is written when the root is created as 90% of the file system's free space at that time.
    ``converter``: see :class:`Converter`; default :class:`TransformdConverter` on ``device``.
    ``cleanup``: remove what dead processes left behind (staging, locks, trash) right away.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        budget_bytes: int | str | None = None,
        converter: Converter | None = None,
        device: str = "auto",
        cleanup: bool = True,
    ):
        self.root = default_root(root)
        self.converter: Converter = converter if converter is not None else TransformdConverter(device)
        self._budget_arg = budget_bytes
        if budget_bytes is not None:
            parse_size(budget_bytes, total=1)  # validate early
        #: test hook: called with a phase name at each step of a conversion (see _convert_locked)
        self._fault_hook: Callable[[str], None] | None = None
        self._ensure_layout()
        self.stat_cache = StatCache(self.root / "stat-cache")
        #: real paths every source file must resolve inside (checked on the open descriptors); None: no check
        self.allowed_roots: tuple[str, ...] | None = None
        if cleanup:
            self.cleanup()

    # ------------------------------------------------------------------ layout

    @property
    def entries_dir(self) -> Path:
        return self.root / "entries"

    @property
    def staging_dir(self) -> Path:
        return self.root / "staging"

    @property
    def locks_dir(self) -> Path:
        return self.root / "locks"

    @property
    def leases_dir(self) -> Path:
        return self.root / "leases"

    @property
    def quarantine_dir(self) -> Path:
        return self.root / "quarantine"

    @property
    def trash_dir(self) -> Path:
        return self.root / "trash"

    @property
    def failures_dir(self) -> Path:
        return self.root / "failures"

    @property
    def config_path(self) -> Path:
        return self.root / "config.json"

    def _ensure_layout(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for d in (
                self.entries_dir,
                self.staging_dir,
                self.locks_dir,
                self.leases_dir,
                self.quarantine_dir,
                self.trash_dir,
                self.failures_dir,
                self.root / "stat-cache",
            ):
                d.mkdir(exist_ok=True)
            tag = self.root / "CACHEDIR.TAG"
            if not tag.exists():
                tmp = self.root / f".tmp.tag.{os.getpid()}.{secrets.token_hex(4)}"
                tmp.write_text(
                    "Signature: 8a477f597d28d172789f06886806bc55\n"
                    "# This directory is a cache of converted checkpoints made by transformd.\n"
                    "# See https://bford.info/cachedir/ and `transformd cache ls`.\n"
                )
                os.replace(tmp, tag)
            if not self.config_path.exists():
                self._create_config()
        except OSError as e:
            if is_no_space(e):
                raise DiskFullError(
                    f"cache directory {self.root}: no space left to create the cache layout",
                    root=self.root,
                    needed_bytes=0,
                    budget_bytes=0,
                    used_bytes=0,
                    free_bytes=0,
                ) from e
            raise CacheError(f"cannot create or use the cache directory {self.root}: {e}") from e

    def _create_config(self) -> None:
        budget = int(free_bytes(self.root) * DEFAULT_BUDGET_FRACTION)
        data = {
            "budget_bytes": budget,
            "budget_note": (
                "default: 90% of the free space of this file system when the cache was created; "
                "edit (bytes, or a string like '500G' or '80%'), or set TRANSFORMD_CACHE_BUDGET"
            ),
            "created_at": time.time(),
            "layout_version": 1,
        }
        tmp = self.root / f".tmp.config.{os.getpid()}.{secrets.token_hex(4)}"
        write_json_atomic(tmp, data)
        try:
            os.link(tmp, self.config_path)  # fails if another process created it first: keep theirs
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)

    @property
    def budget_bytes(self) -> int:
        """The byte budget in force (argument > environment > config.json > 90% of free space)."""
        total = fs_size_bytes(self.root)
        if self._budget_arg is not None:
            return parse_size(self._budget_arg, total=total)
        env = os.environ.get(ENV_BUDGET)
        if env:
            return parse_size(env, total=total)
        cfg = read_json(self.config_path)
        if isinstance(cfg, dict) and cfg.get("budget_bytes") is not None:
            try:
                return parse_size(cfg["budget_bytes"], total=total)
            except ValueError as e:
                raise CacheError(f"{self.config_path}: bad budget_bytes: {e}") from e
        return int(free_bytes(self.root) * DEFAULT_BUDGET_FRACTION) + self._used_bytes()

    @contextlib.contextmanager
    def _gc_lock(self, *, shared: bool = False) -> Iterator[None]:
        """The gc lock (see :class:`SharedExclusiveLock`); recreates a deleted cache directory first.

        A cache directory that cannot be used (read-only, no permission) raises :class:`CacheError`.
        """
        with contextlib.ExitStack() as stack:
            for attempt in (1, 2):
                lock = SharedExclusiveLock(self.locks_dir / _GC_LOCK)
                try:
                    stack.enter_context(lock.shared() if shared else lock.exclusive())
                    break
                except FileNotFoundError as e:
                    if attempt == 2:
                        raise self._unusable(e) from e
                    self._ensure_layout()  # the directory was removed under this Cache: start afresh
                except OSError as e:
                    raise self._unusable(e) from e
            yield

    def _unusable(self, e: OSError) -> CacheError:
        why = "its file system is read-only" if e.errno == errno.EROFS else (e.strerror or str(e))
        return CacheError(f"cannot use the cache directory {self.root}: {why} ({e.filename or self.root})")

    def _hook(self, phase: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(phase)

    # ------------------------------------------------------------------ keys and lookup

    def identity(self, src: str | os.PathLike[str]) -> SourceIdentity:
        """The content identity of ``src`` (hashes only files the stat cache does not know)."""
        return source_identity(
            Path(src), stat_cache=self.stat_cache, roots=self.allowed_roots, before_hashing=self.check_fits
        )

    def check_fits(self, source_bytes: int) -> None:
        """Raise :class:`CacheFullError` when a conversion of ``source_bytes`` can never fit (budget, or the file
        system's free space plus what the cache holds); checked from sizes alone, before anything is hashed."""
        needed = source_bytes + ENTRY_OVERHEAD_BYTES
        budget = self.budget_bytes
        if needed > budget:
            raise CacheFullError(
                f"cache {self.root} cannot hold the conversion: it needs about {human_bytes(needed)} ({needed} bytes) "
                f"but the budget is only {human_bytes(budget)}. Nothing was evicted or hashed. Raise the budget "
                "(--cache-budget) or use another --cache-dir",
                root=self.root, needed_bytes=needed, budget_bytes=budget, used_bytes=-1,
            )
        used = self._used_bytes()
        room = free_bytes(self.root) + used
        if needed > room:
            raise CacheFullError(
                f"the conversion needs about {human_bytes(needed)} ({needed} bytes); the cache's file system has "
                f"{human_bytes(room)} even with every entry evicted. Nothing was evicted or hashed. Free space on it "
                "or use another --cache-dir",
                root=self.root, needed_bytes=needed, budget_bytes=budget, used_bytes=used, free_bytes=room - used,
            )

    def open_source(self, src: str | os.PathLike[str]) -> SourceTree:
        """Every file of ``src`` opened and checked against :attr:`allowed_roots` (see :mod:`.securefs`)."""
        return open_source(src, self.allowed_roots)

    def key_for(self, src: str | os.PathLike[str], recipe: Recipe | None = None) -> str:
        return cache_key(self.identity(src), recipe or Recipe())

    def lookup(self, src: str | os.PathLike[str], recipe: Recipe | None = None) -> Entry | None:
        """The entry of ``src`` converted with ``recipe``, or None. Never converts.

        With a warm stat cache this lists and stats the source's files and reads one small JSON
        file; nothing is hashed. Marks the entry as used.
        """
        return self.get(self.key_for(src, recipe))

    def get(self, key: str, *, touch: bool = True) -> Entry | None:
        """The entry with ``key``, or None. ``touch`` marks it as used (LRU)."""
        validate_key(key)
        d = self.entries_dir / key
        try:
            st = os.stat(d / MANIFEST_NAME)
        except (FileNotFoundError, NotADirectoryError):
            return None
        last_used = st.st_mtime
        if touch:
            last_used = self._touch(d)
        else:
            with contextlib.suppress(OSError):
                last_used = os.stat(d).st_mtime
        return Entry(key, d, last_used)

    @staticmethod
    def _touch(d: Path) -> float:
        now = time.time()
        with contextlib.suppress(OSError):
            os.utime(d, (now, now))
        return now

    # ------------------------------------------------------------------ get or convert

    def get_or_convert(
        self,
        src: str | os.PathLike[str],
        recipe: Recipe | None = None,
        *,
        progress: Callable[[ConversionStatus], None] | None = None,
        converter: Converter | None = None,
        timeout: float | None = None,
        lease_ttl: float | None = None,
        poll_interval: float = 0.1,
    ) -> Entry:
        """The entry of ``src`` converted with ``recipe``, converting it if needed.

        Single flight: whatever the number of threads and processes asking for one key, one
        converts, the others poll (every ``poll_interval`` s, calling ``progress`` with the
        converter's status, ``waiting=True``) and return the same entry. If the converting
        process dies, a waiter takes over; if its conversion fails, waiters raise
        :class:`ConversionFailedError`. ``progress`` also receives this process' own
        conversion's updates. ``lease_ttl`` returns the entry with a lease of this process
        already held (``entry.lease``), so it cannot be evicted between lookup and use.

        Raises :class:`SourceError`, the converter's own errors for invalid input (e.g.
        ``MxFormatError``), :class:`CacheFullError` (the entry cannot fit; nothing changed),
        :class:`DiskFullError` (the disk filled up; staging removed, entries intact),
        :class:`CacheTimeoutError`.
        """
        recipe = recipe or Recipe()
        with self.open_source(src) as tree:
            return self._get_or_convert(
                tree, src, recipe, progress, converter, timeout, lease_ttl, poll_interval
            )

    def _get_or_convert(
        self,
        tree: SourceTree,
        src: str | os.PathLike[str],
        recipe: Recipe,
        progress: Callable[[ConversionStatus], None] | None,
        converter: Converter | None,
        timeout: float | None,
        lease_ttl: float | None,
        poll_interval: float,
    ) -> Entry:
        t0 = time.monotonic()
        ident = identity_of_tree(tree, stat_cache=self.stat_cache, before_hashing=self.check_fits)
        key = cache_key(ident, recipe)
        identify_s = time.monotonic() - t0
        deadline = None if timeout is None else time.monotonic() + timeout
        wait_started: float | None = None
        last_update: float | None = None
        lock = FileLock(self.locks_dir / f"{key}.lock")
        while True:
            entry = self._ready(key, lease_ttl, outcome="hit" if wait_started is None else "waited")
            if entry is not None:
                return entry
            self._ensure_layout()
            try:
                acquired = lock.try_acquire(owner=process_identity())
            except OSError as e:  # e.g. a read-only file system: the cache cannot take new conversions
                raise self._unusable(e) from e
            if acquired:
                try:
                    entry = self._ready(key, lease_ttl, outcome="waited")
                    if entry is not None:
                        return entry
                    if wait_started is not None:
                        failure = self._failure(key)
                        if failure is not None and failure.get("at", 0) >= wait_started:
                            error_type, detail = str(failure.get("error_type")), str(failure.get("message"))
                            raise ConversionFailedError(
                                f"conversion of cache key {key} failed in another process: {error_type}: {detail}",
                                key=key, error_type=error_type, detail=detail,
                            )
                    self._convert_locked(
                        key,
                        Path(src).absolute(),
                        tree,
                        ident,
                        recipe,
                        converter or self.converter,
                        progress,
                        {"identify": identify_s},
                    )
                finally:
                    lock.release()
                entry = self._ready(key, lease_ttl, outcome="converted")
                if entry is not None:
                    return entry
                continue  # evicted or removed in the meantime (extremely unlikely): go round again
            if wait_started is None:
                wait_started = time.time()
            if progress is not None:
                st = self._in_flight_status(key, waiting=True)
                if st is not None and st.updated_at != last_update:
                    last_update = st.updated_at
                    progress(st)
            if deadline is not None and time.monotonic() > deadline:
                raise CacheTimeoutError(
                    f"timed out after {timeout:.1f} s waiting for another process to convert {src} "
                    f"(cache key {key}, cache {self.root})"
                )
            time.sleep(poll_interval)

    def _ready(self, key: str, lease_ttl: float | None, *, outcome: str) -> Entry | None:
        entry = self.get(key)
        if entry is None:
            return None
        entry.outcome = outcome
        if lease_ttl is not None:
            try:
                entry.lease = self.acquire_lease(key, lease_ttl)
            except EntryNotFoundError:
                return None
        return entry

    def _convert_locked(
        self,
        key: str,
        src: Path,
        tree: SourceTree,
        ident: SourceIdentity,
        recipe: Recipe,
        converter: Converter,
        progress: Callable[[ConversionStatus], None] | None,
        timings: dict[str, float],
    ) -> None:
        """Convert into staging and publish. Called with the key's lock held and no entry present."""
        self.cleanup(_held_key=key)
        name = f"{key}.{os.getpid()}.{secrets.token_hex(4)}"
        stage = self.staging_dir / name
        status_path = self.staging_dir / f"{name}.json"
        estimate = ident.total_bytes + ENTRY_OVERHEAD_BYTES
        writer = _StatusWriter(status_path, key, str(src), estimate, progress)
        t_start = time.monotonic()
        try:
            self._reserve(key, estimate, str(src), writer)
            self._hook("reserved")
            stage.mkdir()
            out = stage / CHECKPOINT_DIR
            t = time.monotonic()
            # The converter reads the checked descriptors only (a view of the tree), never the source by name:
            # what it reads is what the key covers, and nothing outside the roots.
            view = tree.view()
            try:
                result = converter(view, out, recipe, writer)
            except BaseException as exc:
                raise tree.relocate(exc, view)  # noqa: B904 - the same exception, naming the source
            result = _relocate(jsonable(result), str(view), str(src))
            timings["convert"] = time.monotonic() - t
            self._hook("converted")
            changed = tree.changed()
            if changed:
                raise SourceChangedError(
                    f"source checkpoint {src} changed while it was converted ({', '.join(changed[:5])}"
                    f"{' ...' if len(changed) > 5 else ''}); the result was discarded"
                )
            t = time.monotonic()
            writer.set_state("publishing")
            for leftover in os.listdir(stage):  # e.g. a converter's own temporary files beside ``out``
                if leftover != CHECKPOINT_DIR:
                    rmtree_force(stage / leftover)
            files = self._seal(out, writer)
            self._hook("sealed")
            timings["publish"] = time.monotonic() - t
            timings["total"] = time.monotonic() - t_start + timings.get("identify", 0.0)
            from .. import __version__

            manifest = Manifest(
                key=key,
                recipe=recipe,
                source_files=ident.files,
                source_hint=str(src),
                files=files,
                created_at=time.time(),
                timings={k: round(v, 6) for k, v in timings.items()},
                result=_relocate(result, str(stage), str(self.entries_dir / key)),
                transformd_version=__version__,
                host=writer.owner["host"],
            )
            manifest.write(stage / MANIFEST_NAME)
            self._hook("manifest-written")
            fsync_path(stage)
            self._hook("before-rename")
            try:
                os.rename(stage, self.entries_dir / key)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and (self.entries_dir / key / MANIFEST_NAME).exists():
                    rmtree_force(stage)  # someone else published this key first: theirs stays
                else:
                    raise
            fsync_path(self.entries_dir)
            self._hook("published")
            self._touch(self.entries_dir / key)
            with contextlib.suppress(OSError):
                os.unlink(self.failures_dir / f"{key}.json")
        except BaseException as exc:
            rmtree_force(stage)
            with contextlib.suppress(OSError):
                os.unlink(status_path)
            if isinstance(exc, Exception):
                self._record_failure(key, exc)
            if isinstance(exc, FileNotFoundError) and not self.staging_dir.is_dir():
                raise CacheError(
                    f"the cache directory {self.root} was removed while {src} was being converted; nothing was "
                    f"published (the next request recreates the directory and converts again)"
                ) from exc
            if is_no_space(exc) and not isinstance(exc, CacheFullError):
                free = budget = used = None
                with contextlib.suppress(OSError, CacheError, ValueError):
                    free = free_bytes(self.root)
                    budget = self.budget_bytes
                    used = self._used_bytes()
                raise DiskFullError(
                    f"cache directory {self.root} ran out of disk space while converting {src}: the entry needs "
                    f"about {human_bytes(estimate)} ({estimate} bytes), {human_bytes(free)} are free now. "
                    f"The partial conversion was removed and every existing entry is intact; free space on that "
                    f"file system, lower the budget (transformd cache gc) or use another --cache-dir",
                    root=self.root,
                    needed_bytes=estimate,
                    budget_bytes=budget if budget is not None else -1,
                    used_bytes=used if used is not None else -1,
                    free_bytes=free,
                ) from exc
            raise
        with contextlib.suppress(OSError):
            os.unlink(status_path)
        with contextlib.suppress(CacheError, OSError):
            self._enforce_budget(protect={key})

    def _seal(self, out: Path, writer: _StatusWriter) -> tuple[FileRecord, ...]:
        """Digest and make read-only every file of ``out`` (the converter fsynced each); fsync its directories."""
        if not out.is_dir() or out.is_symlink():
            raise CacheError(f"the converter did not create the checkpoint directory {out}")
        files: list[tuple[str, str]] = []
        dirs: list[str] = []
        for dirpath, dirnames, filenames in os.walk(out):
            dirs.append(dirpath)
            for n in dirnames + filenames:
                p = os.path.join(dirpath, n)
                st = os.lstat(p)
                if stat_mod.S_ISLNK(st.st_mode) or not (stat_mod.S_ISDIR(st.st_mode) or stat_mod.S_ISREG(st.st_mode)):
                    raise CacheError(f"the converter wrote {p}, which is not a regular file or directory")
            for n in filenames:
                p = os.path.join(dirpath, n)
                files.append((os.path.relpath(p, out).replace(os.sep, "/"), p))
        if not files:
            raise CacheError(f"the converter wrote no files into {out}")

        done = [0, 0]

        def seal_one(item: tuple[str, str]) -> FileRecord:
            rel, p = item
            os.chmod(p, 0o444)
            return FileRecord(rel, os.stat(p).st_size, hash_file(p))

        records = []
        with ThreadPoolExecutor(max_workers=min(4, len(files))) as pool:
            for rec in pool.map(seal_one, files):
                records.append(rec)
                done[0] += 1
                done[1] += rec.size
                writer.detail = {
                    "phase": "publishing",
                    "files_done": done[0],
                    "files_total": len(files),
                    "bytes_done": done[1],
                }
                writer.write(force=False)
        for d in reversed(dirs):  # children first
            os.chmod(d, 0o555)
            fsync_path(d)
        records.sort(key=lambda r: r.name)
        return tuple(records)

    def _record_failure(self, key: str, exc: Exception) -> None:
        with contextlib.suppress(OSError):
            write_json_atomic(
                self.failures_dir / f"{key}.json",
                {
                    "key": key,
                    "error_type": type(exc).__name__,
                    "message": str(exc)[:4000],
                    "at": time.time(),
                    "pid": os.getpid(),
                },
            )

    def _failure(self, key: str) -> dict[str, Any] | None:
        data = read_json(self.failures_dir / f"{key}.json")
        return data if isinstance(data, dict) else None

    # ------------------------------------------------------------------ room and eviction

    def _scan_entries(self) -> list[_EntryInfo]:
        out = []
        try:
            names = os.listdir(self.entries_dir)
        except FileNotFoundError:
            return []
        for name in names:
            if not KEY_RE.fullmatch(name):
                continue
            d = self.entries_dir / name
            try:
                last_used = os.stat(d).st_mtime
            except OSError:
                continue
            try:
                size = Entry(name, d, last_used).size_bytes
            except (OSError, ValueError, KeyError, TypeError):
                size = _du(d)
            out.append(_EntryInfo(name, d, last_used, size))
        return out

    def _used_bytes(self) -> int:
        return sum(e.size for e in self._scan_entries())

    def _live_leased_keys(self) -> set[str]:
        out = set()
        now = time.time()
        try:
            keys = os.listdir(self.leases_dir)
        except FileNotFoundError:
            return out
        for key in keys:
            if KEY_RE.fullmatch(key) and any(lease.is_live(now) for lease in read_leases(self.leases_dir, key)):
                out.add(key)
        return out

    def _live_stagings(self) -> list[dict[str, Any]]:
        """Status files of conversions whose owner is not known to be dead."""
        out = []
        try:
            names = os.listdir(self.staging_dir)
        except FileNotFoundError:
            return out
        for n in names:
            if n.endswith(".json") and not n.startswith("."):
                data = read_json(self.staging_dir / n)
                if not isinstance(data, dict) or not KEY_RE.fullmatch(str(data.get("key"))):
                    continue
                alive = process_alive(data.get("owner"))
                if alive is None:  # another host or container: live while it holds the key's lock
                    alive = not self._key_lock_free(data["key"])
                if alive:
                    data["staging_dir"] = str(self.staging_dir / n.removesuffix(".json"))
                    out.append(data)
        return out

    def _reserve(self, key: str, estimate: int, source: str, writer: _StatusWriter) -> None:
        """Make room for ``estimate`` bytes (evicting LRU entries without live leases) and record the reservation.

        Raises :class:`CacheFullError` without evicting anything when it cannot be done.
        """
        victims: list[_EntryInfo] = []
        with self._gc_lock():
            entries = self._scan_entries()
            leased = self._live_leased_keys()
            reserved = sum(int(s.get("estimate_bytes") or 0) for s in self._live_stagings() if s.get("key") != key)
            used = sum(e.size for e in entries)
            budget = self.budget_bytes
            free = free_bytes(self.root)
            leased_bytes = sum(e.size for e in entries if e.key in leased)
            need = max(0, used + reserved + estimate - budget, estimate - free)
            candidates = sorted((e for e in entries if e.key not in leased), key=lambda e: (e.last_used, e.key))
            evictable = sum(e.size for e in candidates)
            if estimate > budget or evictable < need:
                why = (
                    f"the budget is only {human_bytes(budget)}"
                    if estimate > budget
                    else f"{human_bytes(used)} are used by {len(entries)} entries, {human_bytes(leased_bytes)} of "
                    f"them leased (in use, cannot be evicted), {human_bytes(reserved)} reserved by conversions in "
                    f"progress, budget {human_bytes(budget)}, {human_bytes(free)} free on disk"
                )
                raise CacheFullError(
                    f"cache {self.root} cannot hold the conversion of {source}: it needs about "
                    f"{human_bytes(estimate)} ({estimate} bytes) but {why}. Nothing was evicted. Raise the budget "
                    f"({ENV_BUDGET} or {self.config_path}), release leases, or use another --cache-dir",
                    root=self.root,
                    needed_bytes=estimate,
                    budget_bytes=budget,
                    used_bytes=used,
                    leased_bytes=leased_bytes,
                    free_bytes=free,
                )
            freed = 0
            for e in candidates:
                if freed >= need:
                    break
                victims.append(e)
                freed += e.size
            moved = [self._move_to_trash(e.key) for e in victims]
            writer.write(force=True)  # the reservation is visible to others from here on
        for m in moved:
            if m is not None:
                rmtree_force(m)

    def _move_to_trash(self, key: str) -> Path | None:
        """Rename an entry out of ``entries/`` (the atomic removal step); drop its leases."""
        dest = self.trash_dir / f"{key}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            os.rename(self.entries_dir / key, dest)
        except FileNotFoundError:
            return None
        rmtree_force(self.leases_dir / key)
        return dest

    def _enforce_budget(self, *, budget: int | None = None, protect: set[str] = frozenset()) -> list[tuple[str, int]]:
        victims: list[_EntryInfo] = []
        moved = []
        with self._gc_lock():
            budget = self.budget_bytes if budget is None else budget
            entries = self._scan_entries()
            leased = self._live_leased_keys() | set(protect)
            reserved = sum(int(s.get("estimate_bytes") or 0) for s in self._live_stagings())
            used = sum(e.size for e in entries) + reserved
            for e in sorted((e for e in entries if e.key not in leased), key=lambda e: (e.last_used, e.key)):
                if used <= budget:
                    break
                victims.append(e)
                used -= e.size
            moved = [self._move_to_trash(e.key) for e in victims]
        for m in moved:
            if m is not None:
                rmtree_force(m)
        return [(e.key, e.size) for e in victims]

    # ------------------------------------------------------------------ leases

    def acquire_lease(
        self, key: str, ttl_s: float, *, holder: str = "", pid: int | None = CURRENT_PROCESS, uid: int | None = None
    ) -> Lease:
        """Protect entry ``key`` from eviction for ``ttl_s`` seconds (renewable).

        ``pid``: the holding process (default: this one; the lease stops protecting when it
        dies), or None for a lease that only expires (e.g. held by the daemon for a client).
        Raises :class:`EntryNotFoundError` if there is no such entry.
        """
        validate_key(key)
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, not {ttl_s}")
        owner = None if pid is None else process_identity(None if pid == CURRENT_PROCESS else pid)
        now = time.time()
        lease = Lease(key, new_lease_id(), now, now + ttl_s, holder, owner, uid)
        self._write_lease_checked(lease)
        return lease

    def renew_lease(self, lease: Lease, ttl_s: float) -> Lease:
        """Extend ``lease`` to ``ttl_s`` seconds from now (recreating it if gc removed it as expired)."""
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, not {ttl_s}")
        renewed = Lease(
            lease.key, lease.id, lease.created_at, time.time() + ttl_s, lease.holder, lease.owner, lease.uid
        )
        self._write_lease_checked(renewed)
        return renewed

    def _write_lease_checked(self, lease: Lease) -> None:
        with self._gc_lock(shared=True):
            if not (self.entries_dir / lease.key / MANIFEST_NAME).exists():
                raise EntryNotFoundError(lease.key, self.root)
            write_lease(self.leases_dir, lease)
        self._touch(self.entries_dir / lease.key)

    def release_lease(self, lease: Lease | str, key: str | None = None) -> bool:
        """Remove a lease (a :class:`Lease`, or its id with ``key``). False if it was already gone."""
        if isinstance(lease, Lease):
            key, lease_id = lease.key, lease.id
        else:
            if key is None:
                raise TypeError("release_lease(lease_id, key) needs the key")
            lease_id = lease
        validate_key(key)
        validate_lease_id(lease_id)
        try:
            os.unlink(lease_path(self.leases_dir, key, lease_id))
        except FileNotFoundError:
            return False
        with contextlib.suppress(OSError):
            os.rmdir(self.leases_dir / key)  # only succeeds when it was the last one
        return True

    def get_lease(self, key: str, lease_id: str) -> Lease | None:
        """The lease ``lease_id`` of ``key`` (live or not), or None."""
        validate_key(key)
        validate_lease_id(lease_id)
        return next((lease for lease in read_leases(self.leases_dir, key) if lease.id == lease_id), None)

    def leases(self, key: str | None = None) -> list[Lease]:
        """Every lease file (live or not; see :meth:`Lease.is_live`) of ``key`` or of all keys."""
        if key is not None:
            return read_leases(self.leases_dir, validate_key(key))
        out: list[Lease] = []
        with contextlib.suppress(FileNotFoundError):
            for k in sorted(os.listdir(self.leases_dir)):
                if KEY_RE.fullmatch(k):
                    out.extend(read_leases(self.leases_dir, k))
        return out

    @contextlib.contextmanager
    def lease(self, key: str, ttl_s: float = DEFAULT_LEASE_TTL_S, *, holder: str = "") -> Iterator[Lease]:
        """Hold a lease of this process on ``key`` for the duration of a ``with`` block."""
        lease = self.acquire_lease(key, ttl_s, holder=holder)
        try:
            yield lease
        finally:
            self.release_lease(lease)

    # ------------------------------------------------------------------ status

    def _in_flight_status(self, key: str, *, waiting: bool = False) -> ConversionStatus | None:
        best = None
        for data in self._live_stagings():
            if data.get("key") == key:
                st = _status_from_file(data, waiting=waiting)
                if st is not None and (best is None or (st.updated_at or 0) > (best.updated_at or 0)):
                    best = st
        return best

    def status(self, key: str) -> ConversionStatus | None:
        """``ready``, ``converting``/``publishing`` (with progress), ``failed`` (recently, with the error), or None."""
        validate_key(key)
        if (self.entries_dir / key / MANIFEST_NAME).exists():
            return ConversionStatus(key=key, state="ready")
        st = self._in_flight_status(key)
        if st is not None:
            return st
        failure = self._failure(key)
        if failure is not None and time.time() - float(failure.get("at", 0)) < FAILURE_TTL_S:
            return ConversionStatus(
                key=key,
                state="failed",
                pid=failure.get("pid"),
                updated_at=failure.get("at"),
                error=failure.get("message"),
                error_type=failure.get("error_type"),
            )
        return None

    def in_flight(self) -> list[ConversionStatus]:
        """Conversions in progress in any live process."""
        out = [_status_from_file(d) for d in self._live_stagings()]
        return [s for s in out if s is not None]

    # ------------------------------------------------------------------ listing, usage, removal

    def entries(self) -> list[Entry]:
        """Every entry, most recently used first (does not mark them as used)."""
        infos = sorted(self._scan_entries(), key=lambda e: (-e.last_used, e.key))
        return [Entry(e.key, e.root, e.last_used) for e in infos]

    def usage(self) -> CacheUsage:
        entries = self._scan_entries()
        leased = self._live_leased_keys()
        try:
            quarantined = len([n for n in os.listdir(self.quarantine_dir) if not n.startswith(".")])
        except FileNotFoundError:
            quarantined = 0
        return CacheUsage(
            root=self.root,
            budget_bytes=self.budget_bytes,
            used_bytes=sum(e.size for e in entries),
            entries=len(entries),
            leased_bytes=sum(e.size for e in entries if e.key in leased),
            free_bytes=free_bytes(self.root),
            quarantined=quarantined,
            in_flight=len(self._live_stagings()),
        )

    def rm(self, key: str, *, force: bool = False) -> int:
        """Remove entry ``key``; returns the bytes freed.

        Refuses (:class:`EntryLeasedError`) while a live lease holds it, unless ``force``.
        Processes that mapped its files keep valid bytes until they unmap them.
        """
        validate_key(key)
        with self._gc_lock():
            d = self.entries_dir / key
            if not d.exists():
                raise EntryNotFoundError(key, self.root)
            live = [lease for lease in read_leases(self.leases_dir, key) if lease.is_live()]
            if live and not force:
                holders = tuple(lease.holder or f"pid {(lease.owner or {}).get('pid', '?')}" for lease in live)
                raise EntryLeasedError(
                    f"cache entry {key} is leased by {len(live)} live holder(s) ({', '.join(holders)}); wait for "
                    f"the leases to be released or expire, or remove it anyway with force=True "
                    f"(transformd cache rm --force {key})",
                    key=key,
                    holders=holders,
                )
            info = next((e for e in self._scan_entries() if e.key == key), None)
            moved = self._move_to_trash(key)
        if moved is not None:
            rmtree_force(moved)
        return info.size if info else 0

    def gc(self, budget_bytes: int | str | None = None, *, purge_quarantine: bool = False) -> GcReport:
        """Apply the budget (evict LRU entries without live leases) and remove leftovers.

        Leftovers: stale staging and locks, trash, expired and dead-holder lease files, failure
        records older than an hour, stat-cache files of sources that no longer exist, and with
        ``purge_quarantine`` the quarantined entries.
        """
        report = GcReport(cleanup=self.cleanup())
        budget = None if budget_bytes is None else parse_size(budget_bytes, total=fs_size_bytes(self.root))
        report.evicted = self._enforce_budget(budget=budget)
        report.freed_bytes = sum(s for _, s in report.evicted)
        report.budget_bytes = self.budget_bytes if budget is None else budget
        report.used_bytes = self._used_bytes()
        now = time.time()
        for lease in self.leases():
            if not lease.is_live(now) and self.release_lease(lease):
                report.leases_removed += 1
        with contextlib.suppress(FileNotFoundError):
            for k in os.listdir(self.leases_dir):
                with contextlib.suppress(OSError):
                    os.rmdir(self.leases_dir / k)
        with contextlib.suppress(FileNotFoundError):
            for n in os.listdir(self.failures_dir):
                data = read_json(self.failures_dir / n)
                if not isinstance(data, dict) or now - float(data.get("at", 0)) > FAILURE_TTL_S:
                    with contextlib.suppress(OSError):
                        os.unlink(self.failures_dir / n)
        sc = self.root / "stat-cache"
        with contextlib.suppress(FileNotFoundError):
            for n in os.listdir(sc):
                data = read_json(sc / n)
                if not isinstance(data, dict) or not os.path.isdir(str(data.get("source"))):
                    with contextlib.suppress(OSError):
                        os.unlink(sc / n)
        if purge_quarantine:
            with contextlib.suppress(FileNotFoundError):
                for n in os.listdir(self.quarantine_dir):
                    rmtree_force(self.quarantine_dir / n)
                    report.quarantine_removed += 1
        return report

    def cleanup(self, *, _held_key: str | None = None) -> CleanupReport:
        """Remove what dead processes left: staging directories, lock files, trash, temporary files.

        A staging directory is stale when its owner is known to be dead, or when its owner cannot
        be checked (another host or container) and nobody holds its key's lock. Never touches
        entries. (``_held_key``: this process holds that key's lock, so any staging of that key is
        a dead process'.)
        """
        report = CleanupReport()
        try:
            names = sorted(os.listdir(self.staging_dir))
        except FileNotFoundError:
            names = []
        bases = {n.removesuffix(".json") for n in names if not n.startswith(".")}
        for base in sorted(bases):
            key = base[:KEY_HEX_LEN]
            if not KEY_RE.fullmatch(key):
                continue
            status_file = self.staging_dir / f"{base}.json"
            data = read_json(status_file)
            owner = data.get("owner") if isinstance(data, dict) else None
            if owner is None:  # crashed before writing the status file: only the pid (name) is known
                parts = base.split(".")
                alive = None
                if (
                    len(parts) == 3
                    and parts[1].isdigit()
                    and process_alive(
                        {"pid": int(parts[1]), "host": process_identity()["host"], "pid_ns": None, "boot_id": None}
                    )
                    is False
                ):
                    alive = False
            else:
                alive = process_alive(owner)
            if alive is True:
                continue
            if alive is None and key != _held_key and not self._key_lock_free(key):
                continue
            rmtree_force(self.staging_dir / base)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(status_file)
            report.staging_removed.append(base)
        with contextlib.suppress(FileNotFoundError):
            for n in sorted(os.listdir(self.locks_dir)):
                if n.endswith(".lock") and KEY_RE.fullmatch(n[: -len(".lock")]):
                    lock = FileLock(self.locks_dir / n)
                    if lock.try_acquire():
                        lock.release(unlink=True)
                        report.locks_removed.append(n[: -len(".lock")])
        with contextlib.suppress(FileNotFoundError):
            for n in os.listdir(self.trash_dir):
                rmtree_force(self.trash_dir / n)
                report.trash_removed += 1
        now = time.time()
        for d in (self.root, self.staging_dir, self.root / "stat-cache", self.failures_dir):
            with contextlib.suppress(FileNotFoundError):
                for n in os.listdir(d):
                    if n.startswith(".tmp."):
                        with contextlib.suppress(OSError):
                            if now - os.lstat(d / n).st_mtime > TMP_MAX_AGE_S:
                                os.unlink(d / n)
                                report.tmp_removed += 1
        return report

    def _key_lock_free(self, key: str) -> bool:
        lock = FileLock(self.locks_dir / f"{key}.lock")
        if lock.try_acquire():
            lock.release(unlink=True)
            return True
        return False

    # ------------------------------------------------------------------ integrity

    def verify(self, key: str | None = None, *, quarantine: bool = True) -> list[VerifyResult]:
        """Re-hash entry files against their manifests; move corrupt entries to ``quarantine/``.

        A quarantined entry is never served again (a later request converts afresh). Checks:
        the manifest parses and names this key, no file is missing, extra or a symlink, and every
        file has the recorded size and digest.
        """
        if key is not None:
            validate_key(key)
            if not (self.entries_dir / key).is_dir():
                raise EntryNotFoundError(key, self.root)
            keys = [key]
        else:
            keys = sorted(e.key for e in self._scan_entries())
        results = []
        for k in keys:
            res = self._check_entry(k)
            if not res.ok and quarantine:
                res.quarantined_to = self._quarantine(k, res.problems)
            results.append(res)
        return results

    def _check_entry(self, key: str) -> VerifyResult:
        d = self.entries_dir / key
        res = VerifyResult(key, ok=True)
        try:
            manifest = Manifest.read(d / MANIFEST_NAME)
        except (OSError, ValueError, KeyError, TypeError) as e:
            res.ok = False
            res.problems.append(f"manifest.json unreadable: {e}")
            return res
        if manifest.key != key:
            res.problems.append(f"manifest.json is for key {manifest.key}, not {key}")
        ckpt = d / CHECKPOINT_DIR
        actual: dict[str, str] = {}
        for dirpath, dirnames, filenames in os.walk(ckpt):
            for n in dirnames + filenames:
                p = os.path.join(dirpath, n)
                rel = os.path.relpath(p, ckpt).replace(os.sep, "/")
                st = os.lstat(p)
                if stat_mod.S_ISLNK(st.st_mode):
                    res.problems.append(f"{rel}: is a symlink")
                elif stat_mod.S_ISREG(st.st_mode):
                    actual[rel] = p
        expected = {f.name: f for f in manifest.files}
        for name in sorted(actual.keys() - expected.keys()):
            res.problems.append(f"{name}: not in the manifest")
        for name in sorted(expected.keys() - actual.keys()):
            res.problems.append(f"{name}: missing")
        for name in sorted(expected.keys() & actual.keys()):
            rec = expected[name]
            p = actual[name]
            try:
                size = os.stat(p).st_size
                if size != rec.size:
                    res.problems.append(f"{name}: size {size} bytes, manifest says {rec.size}")
                    continue
                digest = hash_file(p)
            except OSError as e:
                res.problems.append(f"{name}: unreadable: {e.strerror}")
                continue
            res.files_checked += 1
            res.bytes_checked += size
            if digest != rec.digest:
                res.problems.append(f"{name}: content digest {digest} differs from the manifest's {rec.digest}")
        res.ok = not res.problems
        return res

    def _quarantine(self, key: str, problems: list[str]) -> Path | None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        dest = self.quarantine_dir / f"{key}.{stamp}.{secrets.token_hex(2)}"
        with self._gc_lock():
            try:
                os.rename(self.entries_dir / key, dest)
            except FileNotFoundError:
                return None
            rmtree_force(self.leases_dir / key)
        with contextlib.suppress(OSError):
            (dest / "QUARANTINED.txt").write_text(
                f"quarantined by transformd cache verify at {stamp}Z (pid {os.getpid()}):\n"
                + "".join(f"- {p}\n" for p in problems)
            )
        return dest


def _relocate(obj: Any, old: str, new: str) -> Any:
    """Replace the staging path prefix in the strings of a result summary by the entry's path."""
    if isinstance(obj, str):
        return new + obj[len(old) :] if obj == old or obj.startswith(old + os.sep) else obj
    if isinstance(obj, dict):
        return {k: _relocate(v, old, new) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_relocate(v, old, new) for v in obj]
    return obj


def _du(path: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for n in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_size
    return total
