"""Conversions in flight and failed, as every process can read them: ``staging/<name>.json`` and
``failures/<key>.json``."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._durable import (
    read_json,
    write_json_atomic,
)
from ..progress import Progress
from .errors import CacheTimeoutError, ConversionFailedError
from .keys import (
    validate_key,
)
from .lock import process_identity
from .manifest import MANIFEST_NAME, jsonable

#: How often the in-flight status file is rewritten at most (seconds).
STATUS_INTERVAL_S = 0.25
#: How long a failed conversion's record is reported by :meth:`Cache.status` (seconds).
FAILURE_TTL_S = 3600.0




@dataclass(frozen=True)
class ConversionStatus:
    """Where a key stands, as any process can read it.

    ``state``: ``converting`` (a live process converts it), ``downloading`` (a live process downloads it from the
    remote tier, :mod:`.fetched`), ``publishing`` (digests, fsync, rename), ``ready`` (an entry exists),
    ``failed`` (the last attempt failed within the last hour; ``error`` says why). ``detail`` is the converter's
    latest progress update (JSON). ``waiting`` is True in the updates a process receives while another process converts.
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

    @property
    def progress(self) -> Progress | None:
        """The converter's latest :class:`~transformd.progress.Progress`, its phase this status's (``waiting`` when
        another process converts); None when it sent none (a converter may report any JSON object)."""
        progress = Progress.from_json(self.detail)
        return None if progress is None else progress.replace(phase="waiting" if self.waiting else self.state)




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




class Waiter:
    """A caller waiting for another process' conversion of ``name`` (a key, or a source's provisional name):
    passes its progress on when it changed, gives up after ``timeout`` seconds, and raises its failure when it
    failed after the wait began. ``src`` names the source in the messages; ``by_key``: they name the key too."""

    def __init__(
        self,
        cache: StatusMixin,
        name: str,
        src: Any,
        progress: Callable[[ConversionStatus], None] | None,
        timeout: float | None,
        poll_interval: float,
        *,
        by_key: bool,
    ):
        self._cache, self.name, self._src, self._progress = cache, name, src, progress
        self._timeout, self._poll_interval, self._by_key = timeout, poll_interval, by_key
        self.started = time.time()
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._last_update: float | None = None

    def pause(self) -> None:
        """Pass on the other conversion's progress, raise :class:`CacheTimeoutError` past the deadline, sleep."""
        if self._progress is not None:
            st = self._cache._in_flight_status(self.name, waiting=True)
            if st is not None and st.updated_at != self._last_update:
                self._last_update = st.updated_at
                self._progress(st)
        if self._deadline is not None and time.monotonic() > self._deadline:
            where = f"cache key {self.name}, cache {self._cache.root}" if self._by_key else f"cache {self._cache.root}"
            raise CacheTimeoutError(
                f"timed out after {self._timeout:.1f} s waiting for another process to convert {self._src} ({where})"
            )
        time.sleep(self._poll_interval)

    def raise_if_failed(self) -> None:
        """Raise :class:`ConversionFailedError` when the conversion waited for failed after the wait began."""
        failure = self._cache._failure(self.name)
        if failure is not None and failure.get("at", 0) >= self.started:
            error_type, detail = str(failure.get("error_type")), str(failure.get("message"))
            what = f"cache key {self.name}" if self._by_key else str(self._src)
            raise ConversionFailedError(
                f"conversion of {what} failed in another process: {error_type}: {detail}",
                key=self.name, error_type=error_type, detail=detail,
            )


class StatusMixin:
    """The :class:`~transformd.cache.store.Cache` methods that report conversions in flight and failed ones
    (a part of ``Cache``, kept here for size; it uses the cache's directories and locks)."""


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
        if (self.entry_dir(key) / MANIFEST_NAME).exists():
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

