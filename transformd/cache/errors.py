"""The cache's errors: leaves of the one tree in :mod:`transformd.errors`. Every message names the cache directory
or key an operator must look at."""

from __future__ import annotations

from pathlib import Path

from ..errors import (
    EXIT_FAILURE,
    BadRequestError,
    CacheError,
    CacheFullError,
    CacheTimeoutError,
    ConflictError,
    ConversionFailedError,
    DiskFullError,
    NotFoundError,
    SourceChangedError,
    SourceError,
)

__all__ = [
    "CacheError", "CacheFullError", "CacheTimeoutError", "ConversionFailedError", "DiskFullError",
    "EntryLeasedError", "EntryNotFoundError", "InvalidKeyError", "NotACacheError", "SourceChangedError",
    "SourceError",
]


class InvalidKeyError(BadRequestError, CacheError):
    """A string that is not a cache key (32 lowercase hex digits) was given as one."""

    code = "invalid_key"


class NotACacheError(BadRequestError, CacheError):
    """A command that only reads or maintains a cache was pointed at a directory that is not one (missing, or
    not created by transformd): a mistyped ``--cache-dir`` must not silently become a new, empty cache."""

    code = "not_a_cache"


class EntryNotFoundError(NotFoundError, CacheError):
    """No entry with this key is in the cache (never converted, evicted, removed or quarantined)."""

    code = "unknown_key"
    exit_code = EXIT_FAILURE  # for the cache commands, as before the one tree: an entry gone is not bad input

    def __init__(self, key: str, root: Path | str):
        self.key = key
        self.root = Path(root)
        super().__init__(f"no cache entry {key} in {self.root}")


class EntryLeasedError(ConflictError, CacheError):
    """The entry is leased by a live holder; it cannot be removed without ``force``.

    ``key`` and ``holders`` (the live leases' holder names, or their pids) let a caller word its own
    advice: the daemon's ``DELETE`` has no force, the CLI has ``--force``.
    """

    code = "entry_leased"
    exit_code = EXIT_FAILURE

    def __init__(self, message: str, *, key: str | None = None, holders: tuple[str, ...] = ()):
        super().__init__(message)
        self.key = key
        self.holders = tuple(holders)

    def api_message(self) -> str:
        key = self.key or "KEY"
        holders = f" ({', '.join(self.holders)})" if self.holders else ""
        return (
            f"checkpoint {key} is leased{holders}: it cannot be deleted while a lease is live. Wait for the "
            f"leases to expire or for their holders to release them (DELETE /v1/checkpoints/{key}/leases/ID), "
            f"or, on the node, remove it anyway with: transformd cache rm --force {key}"
        )
