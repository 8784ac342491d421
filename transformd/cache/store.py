"""The cache store: layout, lookup, single-flight conversion and its publish.

:class:`Cache` gathers the parts kept in their own modules: :mod:`.status` (in flight, failed), :mod:`.budget`
(room, eviction, gc, cleanup), :mod:`.lease`, :mod:`.verify`, :mod:`.alongside` (converting while hashing).

See the package docstring (:mod:`transformd.cache`) for the on-disk layout and the rules.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat as stat_mod
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .._durable import (
    dir_with_mode,
    free_bytes,
    fs_size_bytes,
    fsync_path,
    is_no_space,
    read_json,
    rmtree_force,
    temporary_beside,
    write_json_atomic,
)
from ..progress import human_bytes
from .alongside import AlongsideMixin, Hasher, _AlreadyCached
from .budget import ENV_BUDGET, BudgetMixin, parse_size
from .converter import Converter, TransformdConverter
from .entry import Entry
from .errors import (
    CacheError,
    CacheFullError,
    DiskFullError,
    EntryNotFoundError,
    NotACacheError,
    SourceChangedError,
)
from .keys import (
    FileRecord,
    Recipe,
    SourceIdentity,
    StatCache,
    cache_key,
    check_as_requested,
    hash_own_file,
    identity_of_tree,
    source_identity,
)
from .lease import (
    LeaseMixin,
)
from .lock import FileLock, SharedExclusiveLock, process_identity
from .manifest import CHECKPOINT_DIR, MANIFEST_NAME, Manifest, jsonable
from .names import EntryNames, NamesMixin
from .seal import DigestsAlongside
from .securefs import SourceTree, open_source
from .status import ConversionStatus, StatusMixin, Waiter, _StatusWriter
from .verify import VerifyMixin

#: Environment variable naming the cache root.
ENV_CACHE_DIR = "TRANSFORMD_CACHE_DIR"
#: Default budget, fixed when the cache root is created: this share of the free space then.
DEFAULT_BUDGET_FRACTION = 0.9
#: Added to the source size when estimating the size of a new entry (manifest, metadata).
ENTRY_OVERHEAD_BYTES = 64 * 1024

_GC_LOCK = "gc.lock"


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


class Cache(StatusMixin, BudgetMixin, LeaseMixin, VerifyMixin, AlongsideMixin, NamesMixin):
    """A content-addressed cache of converted checkpoints under one root directory.

    A source that must be read to know its key (the stat cache does not know its files) is converted while
    it is hashed when at least :attr:`hash_alongside_min_bytes` are to be read (:mod:`.alongside`): one read
    from the disk instead of a hashing pass and then the conversion's. Below that, hashing first costs nothing
    worth saving, and a copy of cached content is recognised before anything is converted.

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
        self._names = EntryNames(self.root)  # (an entry's directory is named under the cache's secret: .names)
        self._ensure_layout()
        self.stat_cache = StatCache(self.root / "stat-cache")
        #: real paths every source file must resolve inside (checked on the open descriptors); None: no check
        self.allowed_roots: tuple[str, ...] | None = None
        if cleanup and self.written_here():
            self._migrate_entry_names()
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
            ):  # engines pass through entries/ and staging/ to the paths they were given, and list nothing here
                dir_with_mode(d, 0o711 if d in (self.entries_dir, self.staging_dir) else 0o700)
            tag = self.root / "CACHEDIR.TAG"
            if not tag.exists():
                tmp = temporary_beside(tag)
                tmp.write_text(
                    "Signature: 8a477f597d28d172789f06886806bc55\n"
                    "# This directory is a cache of converted checkpoints made by transformd.\n"
                    "# See https://bford.info/cachedir/ and `transformd cache ls`.\n"
                )
                os.replace(tmp, tag)
            if not self.config_path.exists():
                self._create_config()
            if self.written_here():
                self._names.ensure()
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
        tmp = temporary_beside(self.config_path)
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

    def _holds(self, filename: object) -> bool:
        """Whether ``filename`` (an OSError's) names a path inside the cache directory."""
        root = os.path.abspath(self.root)
        return isinstance(filename, str | os.PathLike) and os.path.commonpath([os.path.abspath(filename), root]) == root

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
        d = self.entry_dir(key)
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
        identity: SourceIdentity | None = None,
        expect_key: str | None = None,
        expect_slot: str | None = None,
        expect_files: SourceIdentity | None = None,
    ) -> Entry:
        """The entry of ``src`` converted with ``recipe``, converting it if needed.

        ``identity``: this process' identity of ``src`` from moments ago (:meth:`identity`); files whose stat
        signature is unchanged are not read again to key them. ``expect_key``: the key the caller asked for;
        a source whose content no longer has it raises :class:`SourceChangedError` before anything is converted.
        ``expect_slot`` (its :func:`.keys.provisional_key` when requested) and ``expect_files`` (an identity): other
        files or another directory at its path now raise :class:`SourceChangedError` (a swapped symbolic link).

        Single flight: whatever the number of threads and processes asking for one key, one converts, the others
        poll (every ``poll_interval`` s, calling ``progress`` with the converter's status, ``waiting=True``) and
        return the same entry. If the converting process dies, a waiter takes over; if its conversion fails,
        waiters raise :class:`ConversionFailedError`. ``progress`` also receives this process' own conversion's
        updates. ``lease_ttl`` returns the entry with a lease of this process already held (``entry.lease``), so it
        cannot be evicted between lookup and use.

        Raises :class:`SourceError`, the converter's own errors for invalid input (e.g. ``MxFormatError``),
        :class:`CacheFullError` (the entry cannot fit; nothing changed), :class:`DiskFullError` (the disk filled
        up; staging removed, entries intact), :class:`CacheTimeoutError`.
        """
        recipe = recipe or Recipe()
        with self.open_source(src) as tree:
            check_as_requested(tree, recipe, src, slot=expect_slot, identity=expect_files)
            try:
                return self._get_or_convert(
                    tree, src, recipe, progress, converter, timeout, lease_ttl, poll_interval, identity, expect_key
                )
            except OSError as e:  # a file of the cache it may not write: the cache's fault, not the source's
                if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and self._holds(e.filename):
                    raise self._unusable(e) from e
                raise

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
        known: SourceIdentity | None,
        expect_key: str | None,
    ) -> Entry:
        waited = False  # for another process' conversion of this source (alongside its hashing)
        if expect_key is None and self.hashes_alongside(tree, known):
            entry = self._convert_while_hashing(tree, src, recipe, progress, converter, timeout, lease_ttl,
                                                poll_interval, known)
            if entry is not None:
                return entry
            waited = True  # another process converted this very source: its key is now cheap to know
        t0 = time.monotonic()
        ident = identity_of_tree(tree, stat_cache=self.stat_cache, before_hashing=self.check_fits, known=known)
        key = cache_key(ident, recipe)
        if expect_key is not None and key != expect_key:
            raise SourceChangedError(  # (not naming the new key: it is that of whatever the path now names)
                f"source {src} changed after it was requested (its content is no longer that of key {expect_key})")
        identify_s = time.monotonic() - t0
        waiter = Waiter(self, key, src, progress, timeout, poll_interval, by_key=True) if waited else None
        lock = FileLock(self.locks_dir / f"{key}.lock")
        while True:
            entry = self._ready(key, lease_ttl, outcome="hit" if waiter is None else "waited")
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
                    if waiter is not None:
                        waiter.raise_if_failed()
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
            if waiter is None:
                waiter = Waiter(self, key, src, progress, timeout, poll_interval, by_key=True)
            waiter.pause()

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
        *,
        hasher: Hasher | None = None,
    ) -> str:
        """Convert into staging and publish; return the key published. Called with the key's lock held and no
        entry present. ``hasher``: the source's identity still being computed (``key`` is then the provisional
        name of this conversion, ``ident`` None); the entry is published under the key it gives, and the
        conversion stops with :class:`_AlreadyCached` once that key has an entry or another converter."""
        self.cleanup(_held_key=key)
        name = f"{self.entry_name(key)}.{os.getpid()}.{secrets.token_hex(4)}"  # (named as its entry: not guessable)
        stage = self.staging_dir / name
        status_path = self.staging_dir / f"{name}.json"
        estimate = sum(f.st.st_size for f in tree.files) + ENTRY_OVERHEAD_BYTES
        writer = _StatusWriter(status_path, key, str(src), estimate, progress)
        report: Callable[[Any], None] = writer if hasher is None else hasher.guarded(writer)
        t_start = time.monotonic()
        try:
            self._reserve(key, estimate, str(src), writer)
            self._hook("reserved")
            stage.mkdir()
            os.chmod(stage, 0o755)  # (the entry's own directory, whatever the umask: engines of other users enter it)
            out = stage / CHECKPOINT_DIR
            t = time.monotonic()
            # The converter reads the checked descriptors only (a view of the tree), never the source by name:
            # what it reads is what the key covers, and nothing outside the roots.
            view = tree.view()
            early = DigestsAlongside(out)  # the shards finished meanwhile are hashed as the next are converted
            try:
                with early:
                    result = converter(view, out, recipe, report)
            except BaseException as exc:
                raise tree.relocate(exc, view)  # the same exception, naming the source
            result = _relocate(jsonable(result), str(view), str(src))
            timings["convert"] = time.monotonic() - t
            self._hook("converted")
            changed = tree.changed()
            if changed:
                raise SourceChangedError(
                    f"source checkpoint {src} changed while it was converted ({', '.join(changed[:5])}"
                    f"{' ...' if len(changed) > 5 else ''}); the result was discarded"
                )
            if hasher is not None:  # the content's key, from the reads the conversion shared
                ident = hasher.result()
                assert hasher.key is not None  # (the hasher keyed ``ident`` with this recipe)
                key = hasher.key
                timings["hash_alongside"] = hasher.seconds
            t = time.monotonic()
            writer.set_state("publishing")
            for leftover in os.listdir(stage):  # e.g. a converter's own temporary files beside ``out``
                if leftover != CHECKPOINT_DIR:
                    rmtree_force(stage / leftover)
            files = self._seal(out, writer, early)
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
                result=_relocate(result, str(stage), str(self.entry_dir(key))),
                transformd_version=__version__,
                host=writer.owner["host"],
            )
            manifest.write(stage / MANIFEST_NAME)
            self._hook("manifest-written")
            fsync_path(stage)
            self._hook("before-rename")
            try:
                os.rename(stage, self.entry_dir(key))
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and (self.entry_dir(key) / MANIFEST_NAME).exists():
                    rmtree_force(stage)  # someone else published this key first: theirs stays
                    if hasher is not None:
                        raise _AlreadyCached(key) from None
                else:
                    raise
            fsync_path(self.entries_dir)
            self._hook("published")
            self._touch(self.entry_dir(key))
            with contextlib.suppress(OSError):
                os.unlink(self.failures_dir / f"{key}.json")
        except BaseException as exc:
            rmtree_force(stage)
            with contextlib.suppress(OSError):
                os.unlink(status_path)
            if isinstance(exc, Exception):
                for name in {key, hasher.key if hasher is not None else None} - {None}:  # and the key's waiters
                    self._record_failure(name, exc)
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
        return key

    def _seal(self, out: Path, writer: _StatusWriter, early: DigestsAlongside) -> tuple[FileRecord, ...]:
        """Digest (unless ``early`` did, of the file as it is) and make read-only every file of ``out`` (the converter
        fsynced each); fsync its directories."""
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
            st = os.stat(p)
            digest = early.digest(p, st)
            os.chmod(p, 0o444)
            return FileRecord(rel, st.st_size, digest or hash_own_file(p))

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


def _relocate(obj: Any, old: str, new: str) -> Any:
    """Replace the staging path prefix in the strings of a result summary by the entry's path."""
    if isinstance(obj, str):
        return new + obj[len(old) :] if obj == old or obj.startswith(old + os.sep) else obj
    if isinstance(obj, dict):
        return {k: _relocate(v, old, new) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_relocate(v, old, new) for v in obj]
    return obj


