"""Exceptions of the cache. Every message names the cache directory or key an operator must look at."""

from __future__ import annotations

from pathlib import Path


class CacheError(Exception):
    """Base class of every error the cache raises itself."""


class InvalidKeyError(CacheError, ValueError):
    """A string that is not a cache key (32 lowercase hex digits) was given as one."""


class NotACacheError(CacheError, ValueError):
    """A command that only reads or maintains a cache was pointed at a directory that is not one (missing, or
    not created by transformd): a mistyped ``--cache-dir`` must not silently become a new, empty cache."""


class EntryNotFoundError(CacheError, LookupError):
    """No entry with this key is in the cache (never converted, evicted, removed or quarantined)."""

    def __init__(self, key: str, root: Path | str):
        self.key = key
        self.root = Path(root)
        super().__init__(f"no cache entry {key} in {self.root}")

    def __str__(self) -> str:  # LookupError would otherwise quote the message like a KeyError
        return self.args[0]


class SourceError(CacheError, ValueError):
    """The source checkpoint directory is missing, empty, unreadable or changed while it was converted."""


class EntryLeasedError(CacheError):
    """The entry is leased by a live holder; it cannot be removed without ``force``.

    ``key`` and ``holders`` (the live leases' holder names, or their pids) let a caller word its own
    advice: the daemon's ``DELETE`` has no force, the CLI has ``--force``.
    """

    def __init__(self, message: str, *, key: str | None = None, holders: tuple[str, ...] = ()):
        super().__init__(message)
        self.key = key
        self.holders = tuple(holders)


class CacheFullError(CacheError):
    """A conversion needs more room than the cache can make without evicting leased entries.

    Raised before anything was evicted or written: the cache is left as it was.
    The numbers are attributes, so the daemon can report them (HTTP 507).
    """

    def __init__(
        self,
        message: str,
        *,
        root: Path,
        needed_bytes: int,
        budget_bytes: int,
        used_bytes: int,
        leased_bytes: int = 0,
        free_bytes: int | None = None,
    ):
        super().__init__(message)
        self.root = root
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes
        self.used_bytes = used_bytes
        self.leased_bytes = leased_bytes
        self.free_bytes = free_bytes


class DiskFullError(CacheFullError):
    """The file system of the cache ran out of space (ENOSPC/EDQUOT) during a conversion or its publish.

    The staging directory was removed; every existing entry is intact.
    """


class ConversionFailedError(CacheError):
    """Another process' conversion of the same key, which this process waited for, failed.

    ``error_type`` is the class name of the original exception (e.g. ``MxFormatError``), so a caller
    can tell invalid input from an infrastructure failure.
    """

    def __init__(self, key: str, error_type: str, message: str):
        self.key = key
        self.error_type = error_type
        self.message = message
        super().__init__(f"conversion of cache key {key} failed in another process: {error_type}: {message}")


class CacheTimeoutError(CacheError, TimeoutError):
    """Waiting for another process' conversion took longer than the caller's timeout."""
