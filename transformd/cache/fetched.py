"""An entry that comes whole from elsewhere (the remote tier, :mod:`transformd.remote`), published as a conversion is.

:func:`get_or_fetch` takes the key's lock (the single flight a conversion takes: a process that converts or fetches
the same key is waited for by the others), reserves room, lets a ``fetch`` fill a private staging directory
(``staging/<entry name>.<pid>.<rand>/``, with the status file a conversion has, so progress and the cleanup of a dead
process's leftovers work the same), checks that what it left there is a sealed entry of that key (a
``manifest.json`` naming it, a ``checkpoint/`` directory), and publishes it with the same fsync and one rename. A
miss, a failure or an interruption leaves nothing in staging, and no entry.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._durable import fsync_path, rmtree_force
from .entry import Entry
from .errors import CacheError
from .lock import FileLock, process_identity
from .manifest import CHECKPOINT_DIR, MANIFEST_NAME, Manifest
from .status import ConversionStatus, Waiter, _StatusWriter

if TYPE_CHECKING:
    from .store import Cache

#: Bytes reserved beyond an entry's files (its manifest, directories): as a conversion's estimate has.
ENTRY_OVERHEAD_BYTES = 64 * 1024

__all__ = ["get_or_fetch"]


def get_or_fetch(cache: Cache, key: str, fetch: Callable[[Path, Callable[[Any], None], Callable[[int], None]], bool],
                 *, source: str, estimate: int = 0, progress: Callable[[ConversionStatus], None] | None = None,
                 state: str = "downloading", wait: bool = False, timeout: float | None = None,
                 poll_interval: float = 0.1) -> Entry | None:
    """The entry ``key`` of ``cache``: there already (``outcome`` ``hit``), or made by ``fetch(stage, report,
    reserve)``, which fills the empty directory ``stage`` with a sealed entry (``manifest.json`` and ``checkpoint/``,
    files read-only and fsynced), calls ``report(update)`` as it goes (a dict of
    :data:`transformd.progress.COUNTERS`) and ``reserve(nbytes)`` once it knows the entry's size, before it writes
    (room is made, or :class:`~transformd.cache.CacheFullError` raised and nothing written), then published
    (``outcome`` ``fetched``). None when ``fetch`` returns False (a miss), or when another process
    holds the key's lock (it converts or fetches it: the caller's conversion waits for it). ``source``: what the
    status names (a path, or where it comes from); ``estimate``: bytes reserved before it starts (the budget is
    enforced again once it is published). Raises what ``fetch`` raises, with nothing of it left.

    ``wait`` (a caller with nothing to convert, e.g. a repo id and commit with no snapshot here): another process
    that holds the key's lock is waited for as a conversion waits for one (:class:`~.status.Waiter`: its progress
    passed on every ``poll_interval`` s, :class:`~transformd.cache.CacheTimeoutError` after ``timeout`` s, a dead
    holder's lock released by the kernel), then its entry is returned (``outcome`` ``waited``), or, if it published
    none (it failed, or missed), ``fetch`` is tried here."""
    waiter = None
    lock = FileLock(cache.locks_dir / f"{key}.lock")
    while True:
        entry = cache.get(key)
        if entry is not None:
            entry.outcome = "hit" if waiter is None else "waited"
            return entry
        cache._ensure_layout()
        try:
            if lock.try_acquire(owner=process_identity()):
                break
        except OSError as e:
            raise cache._unusable(e) from e
        if not wait:
            return None
        if waiter is None:
            waiter = Waiter(cache, key, source, progress, timeout, poll_interval, by_key=True)
        waiter.pause()
    try:
        entry = cache.get(key)
        if entry is not None:
            entry.outcome = "waited"
            return entry
        if not _fetch_locked(cache, key, fetch, source, estimate, progress, state):
            return None
    finally:
        lock.release()
    entry = cache.get(key)
    if entry is not None:
        entry.outcome = "fetched"
    return entry


def _fetch_locked(cache: Cache, key: str, fetch: Callable[[Path, Callable[[Any], None], Callable[[int], None]], bool],
                  source: str, estimate: int, progress: Callable[[ConversionStatus], None] | None, state: str) -> bool:
    cache.cleanup(_held_key=key)
    name = f"{cache.entry_name(key)}.{os.getpid()}.{secrets.token_hex(4)}"  # (named as its entry: not guessable)
    stage = cache.staging_dir / name
    status_path = cache.staging_dir / f"{name}.json"
    writer = _StatusWriter(status_path, key, source, estimate, progress)
    writer.state = state
    final = cache.entry_dir(key)
    try:
        cache._reserve(key, estimate, source, writer)
        writer.set_state(state)  # (its status file says so at once: another process shows it as downloading)
        stage.mkdir()
        os.chmod(stage, 0o755)  # (as a conversion's: engines of other users enter it)
        def reserve(nbytes: int) -> None:
            writer.estimate = nbytes + ENTRY_OVERHEAD_BYTES
            cache._reserve(key, writer.estimate, source, writer)

        if not fetch(stage, writer, reserve):
            rmtree_force(stage)
            return False
        manifest = Manifest.read(stage / MANIFEST_NAME)
        if manifest.key != key or not (stage / CHECKPOINT_DIR).is_dir():
            raise CacheError(f"{source}: what was fetched for key {key} is not that entry (manifest of "
                             f"{manifest.key[:64]!r})")
        writer.set_state("publishing")
        fsync_path(stage)
        try:
            os.rename(stage, final)
        except OSError as e:
            if not (final / MANIFEST_NAME).exists():
                raise
            rmtree_force(stage)  # someone else published this key first (without the lock): theirs stays
            del e
        fsync_path(cache.entries_dir)
        cache._touch(final)
    except BaseException:
        rmtree_force(stage)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(status_path)
    with contextlib.suppress(CacheError, OSError):
        cache._enforce_budget(protect={key})
    return True
