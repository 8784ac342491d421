"""Converting a source while it is hashed: the source is read once, and the key is known when the conversion ends.

A source whose files the stat cache does not know must be read to be keyed. Hashing it first and converting it
afterwards reads it twice (the second time from the page cache at best) and serialises the two. Instead, one thread
hashes while the conversion runs (:meth:`AlongsideMixin._convert_while_hashing`) on the same checked descriptors:
whichever of the two reads a page first reads it from the disk, the other from the page cache, and the key is known
by the time the conversion ends (the hasher starts with the conversion's first progress update, while a read-ahead
reads the source during the conversion's start-up; then they read the files side by side and the key comes near the
end). The entry is published under it, unless an entry already has it (another copy of the same content): the
conversion then stops as soon as the key is known, its staging is removed, and that entry is returned. While the key
is unknown the conversion goes by a provisional, key-shaped name (:func:`.keys.provisional_key`: the directory, its
files' stat signatures, the recipe), so staging, locks, progress, reservations, failure records and cleanup work as
for a key: a second request for the same unchanged directory waits for it and then finds the entry through the stat
cache. That is why only a source whose files are all older than the stat cache's racy window (:func:`.keys.settled`)
goes this way: a file written moments ago is never remembered, and later requests would convert it again instead of
finding it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..readahead import INDEX_NAME, ReadAhead, read_ahead_bytes, read_index, shard_order
from .keys import (
    HashingCancelled,
    Recipe,
    SourceIdentity,
    bytes_to_hash,
    cache_key,
    identity_of_tree,
    provisional_files,
    provisional_key,
    provisional_key_of,
    settled,
)
from .lock import FileLock, process_identity
from .manifest import MANIFEST_NAME
from .status import Waiter

if TYPE_CHECKING:
    from .converter import Converter
    from .entry import Entry
    from .securefs import SourceTree
    from .status import ConversionStatus


class _AlreadyCached(BaseException):
    """Stops a conversion whose source's key, known while it ran, already has an entry or another converter
    (a BaseException, as a cancellation: no failure is recorded)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


class PendingIdentity:
    """A source not hashed yet, because its conversion would hash it as it reads it
    (:meth:`AlongsideMixin.identity_unless_alongside`): what a caller may know of it without its content."""

    def __init__(self, tree: SourceTree):
        self.path = Path(tree.real)
        self.access = tree.facts()  #: the permissions a caller needs to read it (as SourceIdentity.access)
        self._files = provisional_files(tree)

    def slot(self, recipe: Recipe) -> str:
        """The provisional name its conversion with ``recipe`` goes by until the key is known
        (:func:`.keys.provisional_key` of the tree as it was opened here)."""
        return provisional_key_of(str(self.path), self._files, recipe)


class _Deferred(Exception):
    """Breaks out of identity_of_tree before the first byte is hashed (identity_unless_alongside)."""


class Hasher:
    """The thread that hashes a source beside its conversion, and what it found: the identity, the key, and
    that key's lock, which it takes before the stat cache learns the digests, so that a request which finds the
    key there waits for this conversion instead of starting its own.

    Paced: it reads at most ``lead`` bytes past the input the conversion has finished (the ``bytes_done`` of its
    progress), so it goes at the conversion's pace: a hashing that ran on alone would take the disk from the
    conversion's writes (on the H200 machine it read 16 GiB in 13 s while the writes waited, and the whole
    conversion took 25-28 s against the daemon's 21 s, whose hashing and conversion go side by side), and for a
    source larger than the page cache its pages would be gone before the conversion reads them. Whoever waits for
    the result lifts the pace.

    Until the conversion's first progress update (its start-up: imports, CUDA, the kernel's load) a
    :class:`~transformd.readahead.ReadAhead` (one per process) reads the source into the page cache, and the
    hashing waits: its readers take the GIL for each slice, which the imports hold, and BLAKE3 takes cores
    (:data:`.keys.BACKGROUND_HASH_THREADS`), the read-ahead needs neither (on the H200 machine, with the source in
    the page cache, a ``convert --cache-dir`` whose hashing ran during the start-up imported torch at 5.0 s,
    ``convert --out`` at 3.2-4.4 s); the hashing then finds those pages in the page cache. Without the read-ahead
    (another conversion of the process holds it) the hashing reads during the start-up, in the idle I/O class, so
    that the imports' own reads go first (a cold ``convert --cache-dir`` imported torch in 14.0 s with them at the
    normal class, ``convert --out`` in 11.8 s)."""

    def __init__(self, cache: AlongsideMixin, tree: SourceTree, recipe: Recipe, known: SourceIdentity | None,
                 lead: int):
        self._cache, self._tree, self._recipe, self._known = cache, tree, recipe, known
        self._stop, self._done = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self.identity: SourceIdentity | None = None
        self.key: str | None = None
        self.key_lock: FileLock | None = None  #: held once the key is known, unless another process holds it
        self.seconds = 0.0
        self._lead, self._converted, self._unpaced, self._started = lead, 0, False, False
        self._paced = threading.Condition()
        # one read-ahead at a time in a process (a daemon's concurrent cold starts would each read up to an eighth
        # of the memory ahead); stopped when the conversion begins, and joined before the tree closes
        self._ahead: ReadAhead | None = None
        if _read_ahead_slot.acquire(blocking=False):
            try:
                self._ahead = ReadAhead(_shards(tree))
            except BaseException:
                _read_ahead_slot.release()  # (kept, every later conversion of the process would go without)
                raise
        self._thread = threading.Thread(target=self._run, name="transformd-hash", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self._begun()
            self._join_read_ahead()
            raise

    def _run(self) -> None:
        t0 = time.monotonic()
        key: str | None = None

        def lock_key(ident: SourceIdentity) -> None:  # before the stat cache tells other processes the key
            nonlocal key
            key = cache_key(ident, self._recipe)
            lock = FileLock(self._cache.locks_dir / f"{key}.lock")
            if lock.try_acquire(owner=process_identity()):
                self.key_lock = lock

        try:
            ident = identity_of_tree(self._tree, stat_cache=self._cache.stat_cache, known=self._known,
                                     cancelled=self._stop.is_set, before_saving=lock_key, pace=self._pace)
            self.identity, self.key, self.seconds = ident, key, time.monotonic() - t0
        except BaseException as exc:  # noqa: BLE001 - handed to the converting thread by result()
            self._error = exc
        finally:
            self._done.set()

    def _pace(self, upto: int) -> bool:
        """Wait while reading up to ``upto`` bytes would take the hashing more than ``lead`` past the conversion;
        whether to read at the idle I/O class (the conversion has not started)."""
        with self._paced:
            # (while a read-ahead reads for it, the start-up's hashing would only take the cores from the imports)
            while (upto > self._converted + self._lead or (self._ahead is not None and not self._started)) \
                    and not self._unpaced:
                self._paced.wait()
        if self._stop.is_set():
            raise HashingCancelled(f"hashing {self._tree.src} was stopped")
        return not self._started

    def _unpace(self) -> None:
        self._begun()
        with self._paced:
            self._unpaced = True
            self._paced.notify_all()

    def _begun(self) -> None:
        """The conversion has started (or is over): the start-up's read-ahead stops, the hashing reads at the
        normal I/O class."""
        with self._paced:
            self._started, ahead = True, self._ahead if not self._started else None
            if ahead is not None:
                ahead.stop()  # (told before the hashing wakes to read)
            self._paced.notify_all()
        if ahead is not None:
            _read_ahead_slot.release()  # (another conversion's start may read ahead while this one's last slice ends)

    def _join_read_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.join()

    def converted(self, update: Any) -> None:
        """Hear the conversion's progress: the first update ends the start-up (see the class); its ``bytes_done``
        (input bytes finished) moves the pace on; once it reaches ``bytes_total`` the pace is lifted (files the
        conversion does not read are hashed at once)."""
        if not self._started:
            self._begun()
        get = update.get if isinstance(update, dict) else lambda name: getattr(update, name, None)
        done, total = get("bytes_done"), get("bytes_total")
        if isinstance(total, int) and isinstance(done, int) and done >= total:
            self._unpace()
        elif isinstance(done, int) and done > self._converted:
            with self._paced:
                self._converted = done
                self._paced.notify_all()

    def result(self) -> SourceIdentity:
        """The source's identity (lifts the pace and waits for the hashing to end); raises what the hashing
        raised."""
        self._unpace()
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self.identity is not None
        return self.identity

    def guarded(self, writer: Any) -> Callable[[Any], None]:
        """``writer`` (the conversion's status writer) for the converter: each update paces the hashing; once the
        key is known, the status names it (waiters of the key see the progress), and the conversion stops with
        :class:`_AlreadyCached` when that key has an entry or another process' conversion; it stops with the
        hashing's error (a file that changed while it was read, say) as soon as the hashing fails."""

        def report(update: Any) -> None:
            if self._error is not None:
                raise self._error
            self.converted(update)
            if self._done.is_set() and self.key is not None:
                entry = self._cache.entry_dir(self.key) / MANIFEST_NAME
                if self.key_lock is None or entry.exists():
                    raise _AlreadyCached(self.key)
                writer.key = self.key
            writer(update)

        return report

    def close(self) -> None:
        """Stop at the next slice read and wait (the thread and the read-ahead read the tree's descriptors);
        release the key's lock."""
        self._stop.set()
        self._unpace()
        self._thread.join()
        self._join_read_ahead()
        if self.key_lock is not None:
            self.key_lock.release()


#: Held by the Hasher of this process whose start-up read-ahead runs.
_read_ahead_slot = threading.Lock()


def _shards(tree: SourceTree) -> list[str]:
    """The tree's shards in the order its conversion reads them (:func:`transformd.readahead.shard_order`), as paths
    of their checked descriptors (``/proc/self/fd/N``: the same files, whatever the directory holds by now)."""
    files = {f.rel: f for f in tree.files}
    index = files.get(INDEX_NAME)
    names = shard_order(None if index is None else read_index(index.fd), files)
    return [files[name].proc_path for name in names if name in files]


class AlongsideMixin:
    """The :class:`~transformd.cache.Cache` methods of converting while hashing."""

    #: Bytes to hash from which a conversion runs beside the hashing instead of after it.
    hash_alongside_min_bytes: int = 256 << 20
    #: How far the hashing beside a conversion reads ahead of it at the most (:class:`Hasher`; lowered on a small
    #: machine by :func:`transformd.readahead.read_ahead_bytes`). Less than the start-up's read-ahead
    #: (:data:`transformd.readahead.READ_AHEAD_BYTES`), which stops when the conversion starts: the hashing goes on
    #: reading beside the conversion's writes, and each byte it reads too early takes the disk from them.
    hash_lead_bytes: int = 8 << 30

    def hashes_alongside(self, tree: SourceTree, known: SourceIdentity | None = None) -> bool:
        """Whether a request for ``tree`` that expects no key converts it while hashing it: it has at least
        :attr:`hash_alongside_min_bytes` the stat cache does not know, and every file is settled."""
        if sum(f.st.st_size for f in tree.files) < self.hash_alongside_min_bytes or not settled(tree):
            return False  # (cheap checks first: the stat cache is read only when they pass)
        unknown = bytes_to_hash(tree, self.stat_cache, known)
        return 0 < unknown >= self.hash_alongside_min_bytes

    def identity_unless_alongside(self, src: str | os.PathLike[str]) -> SourceIdentity | PendingIdentity:
        """:meth:`identity`, except for a source that its conversion would hash as it reads it
        (:meth:`hashes_alongside`): that one is not read here, and a :class:`PendingIdentity` comes back.
        Raises :class:`CacheFullError` for a source that cannot fit, as :meth:`identity` does."""
        with self.open_source(src) as tree:

            def before_hashing(total: int) -> None:
                self.check_fits(total)
                if self.hashes_alongside(tree):
                    raise _Deferred

            try:
                return identity_of_tree(tree, stat_cache=self.stat_cache, before_hashing=before_hashing)
            except _Deferred:
                return PendingIdentity(tree)

    def _convert_while_hashing(
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
    ) -> Entry | None:
        """Convert a source whose content is not known yet while a :class:`Hasher` hashes it; publish it under
        its key, or return the entry that key already has. None: another process converted this very source
        meanwhile (or is converting its content), for the caller to look up or wait for by key.

        Single flight per source directory and stat signatures (:func:`.keys.provisional_key`): a second
        request for the same unchanged directory waits for the first, then returns None. Limits first: nothing
        is read before :meth:`check_fits`.
        """
        self.check_fits(sum(f.st.st_size for f in tree.files))
        converter = converter or self.converter
        prepare = getattr(converter, "prepare", None)
        if prepare is not None:  # the imports and the GPU's start-up overlap the first reads
            prepare(recipe)
        slot = provisional_key(tree, recipe)
        lock = FileLock(self.locks_dir / f"{slot}.lock")
        self._ensure_layout()
        try:
            acquired = lock.try_acquire(owner=process_identity())
        except OSError as e:
            raise self._unusable(e) from e
        if not acquired:  # another process converts this very source: wait for it, then look it up by key
            waiter = Waiter(self, slot, src, progress, timeout, poll_interval, by_key=False)
            while not lock.try_acquire(owner=process_identity()):
                waiter.pause()
            lock.release()
            waiter.raise_if_failed()
            return None
        try:
            if not bytes_to_hash(tree, self.stat_cache, known):  # converted by another process since it was asked
                return None
            hasher = Hasher(self, tree, recipe, known, read_ahead_bytes(self.hash_lead_bytes))
            try:
                key = self._convert_locked(slot, Path(src).absolute(), tree, None, recipe, converter, progress, {},
                                           hasher=hasher)
                outcome = "converted"
            except _AlreadyCached as found:
                key, outcome = found.key, "hit"
            finally:
                hasher.close()
        finally:
            lock.release()
        return self._ready(key, lease_ttl, outcome=outcome)
