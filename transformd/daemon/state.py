"""What the daemon's routes share: the cache, the conversion service, the callers and their grants, the
readiness of entries, the metrics' gauges (:class:`Daemon`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from fastapi import Request

from ..cache import Cache
from ..checkpoint import readiness_of_dir
from ..engines import Platform
from ..hub import HubResolver
from ..selectre import SelectError, compile_select
from .errors import error_for_exception
from .files import EntryIndex
from .metrics import Metrics
from ..cache.securefs import reading_as
from .fscreds import Reader
from .paths import SourcePolicy
from .peers import SCOPE_KEY, Caller
from .service import ConversionService
from .settings import Settings

log = logging.getLogger("transformd.daemon")

#: A uid's requests that work on their sources at once (:meth:`Daemon.source_slot`); the rest of its requests wait.
SOURCE_WORK_PER_CALLER = 4


@dataclass
class Daemon:
    """Everything the routes share."""

    settings: Settings
    cache: Cache
    service: ConversionService
    entries: EntryIndex
    metrics: Metrics
    policy: SourcePolicy
    device: str
    platform: Platform
    gauges_at: float = 0.0
    #: Engine readiness of published entries, by key (entries never change once published).
    readiness: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    #: uids that passed the read check for a key (a POST of a source they could read): key -> uids
    readers: dict[str, set[int]] = dataclasses.field(default_factory=dict)
    #: the uid whose request started the conversion of a key (it may delete the entry): key -> uid
    creators: dict[str, int] = dataclasses.field(default_factory=dict)
    #: repo ids (transformd.hub): the lookups, and the repo id a key was last asked for by (shown by /files)
    hub: HubResolver | None = None
    hub_origins: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    _health_limiter: anyio.CapacityLimiter | None = None
    _select_limiter: anyio.CapacityLimiter | None = None
    _source_slots: dict[int, anyio.CapacityLimiter] = dataclasses.field(default_factory=dict)
    _lease_turns: dict[int, anyio.Lock] = dataclasses.field(default_factory=dict)

    def entry_readiness(self, key: str, path: Path) -> dict[str, Any] | None:
        """Blocking: readiness of a published entry (from its config and headers), remembered per key; None when
        the entry is no block-FP8 checkpoint directory (a test converter's output): readiness is a report, never
        a reason to fail a lookup."""
        found = self.readiness.get(key)
        if found is None:
            try:
                found = {name: r.as_dict() for name, r in readiness_of_dir(path).items()}
            except Exception:  # noqa: BLE001 - see above
                log.debug("no readiness for entry %s", key, exc_info=True)
                return None
            if len(self.readiness) > 4096:
                self.readiness.clear()
            self.readiness[key] = found
        return found

    def caller(self, request: Request) -> Caller:
        """The request's caller: the unix peer's credentials, or the configured identity of TCP token holders."""
        caller = request.scope.get(SCOPE_KEY)
        if isinstance(caller, Caller):
            return caller
        if request.scope.get("server") and request.scope["server"][1] is not None:  # TCP (the token was checked)
            return self.settings.tcp_caller()
        return Caller(-1, frozenset(), None, "unix (credentials unknown)")

    def reader(self, caller: Caller) -> Reader:
        """What the opens of a source done for ``caller`` are checked by (:mod:`.fscreds`)."""
        return Reader(caller)

    def health_limiter(self) -> anyio.CapacityLimiter:
        """Threads of /healthz only: its answer never waits behind other work."""
        if self._health_limiter is None:
            self._health_limiter = anyio.CapacityLimiter(4)
        return self._health_limiter

    async def check_select(self, pattern: str | None) -> None:
        """Compile a request's ``select`` (RE2 only, :mod:`transformd.selectre`); a refused one is a 422 naming what
        RE2 lacks. RE2 holds the GIL while it compiles (up to some 30 ms for the largest pattern accepted, a
        Unicode class repeated 1000 times), so one worker thread compiles them one at a time: a burst of such
        requests holds the event loop and /healthz for one compile at a time, never for their sum."""
        if pattern is None:
            return
        if self._select_limiter is None:
            self._select_limiter = anyio.CapacityLimiter(1)
        try:
            await anyio.to_thread.run_sync(compile_select, pattern, limiter=self._select_limiter)
        except SelectError as e:
            raise error_for_exception(e) from None

    def is_admin(self, caller: Caller) -> bool:
        """Whether ``caller`` may act on others' leases and entries (``--admin-uid``; root only when named). Admin
        rights lift no cap on what a caller holds: leases and queued conversions are counted for everyone."""
        return caller.uid in self.settings.admins()

    def grant(self, key: str, caller: Caller) -> None:
        uids = self.readers.setdefault(key, set())
        if len(uids) < 4096:
            uids.add(caller.uid)

    def may_see(self, key: str, caller: Caller) -> bool | None:
        """True when ``caller`` may be served ``key`` without another check; None: check the source (blocking)."""
        if self.is_admin(caller) or caller.uid in self.readers.get(key, ()):
            return True
        return None

    def check_source_of(self, key: str, caller: Caller) -> bool:
        """Blocking: whether ``caller`` could read the source this entry (or job) was made from."""
        job = self.service.job(key)
        source: str | None = str(job.source) if job is not None else None
        if source is None:
            info = self.entries.info(key)
            source = info.source if info is not None else None
        if not source:
            return False
        reader = self.reader(caller)
        try:
            with reading_as(reader), self.cache.open_source(source) as tree:
                ok = reader.denied(tree.facts()) is None
        except Exception:  # noqa: BLE001 - a source that cannot be opened proves nothing: refuse
            return False
        if ok:
            self.grant(key, caller)
        return ok

    def source_slot(self, caller: Caller) -> contextlib.AbstractAsyncContextManager[Any]:
        """Held (``async with``) by a caller's request while it works on its source (the hub lookup, the hashing,
        the checks): at most :data:`SOURCE_WORK_PER_CALLER` of a uid's requests at once, so that one uid's slow
        sources (fresh 20 GiB files to hash, say) keep the others' cached lookups from none of the source threads
        (:data:`.service.SOURCE_THREADS`); an admin's are not counted (root's are, unless named an admin)."""
        if self.is_admin(caller):
            return contextlib.nullcontext()
        slots = self._source_slots.get(caller.uid)
        if slots is None:
            slots = self._source_slots[caller.uid] = anyio.CapacityLimiter(SOURCE_WORK_PER_CALLER)
        return slots

    def lease_turn(self, caller: Caller) -> contextlib.AbstractAsyncContextManager[Any]:
        """Held (``async with``) while a caller's lease request counts the caller's live leases and takes one: one
        request of a uid at a time, so its cap holds under any concurrency (the count and the lease were two awaits
        apart: an attack review's 100 concurrent requests left 99-100 live leases under a cap of 64); an admin's
        and root's too. Other uids never wait for it."""
        turn = self._lease_turns.get(caller.uid)
        if turn is None:
            turn = self._lease_turns[caller.uid] = anyio.Lock()
        return turn

    def converted(self, key: str, uid: int | None) -> None:
        """A job converted ``key`` at ``uid``'s request: that caller may delete it. Only a conversion makes a
        creator: a request that found the entry (a copy of cached content, after a restart too) made nothing."""
        if uid is not None:
            self.creators.setdefault(key, uid)

    def refresh_gauges(self) -> None:
        """Blocking: scan the entries for the size gauges."""
        usage = self.cache.usage()
        self.metrics.cache_bytes.set(usage.used_bytes)
        self.metrics.cache_budget.set(usage.budget_bytes)
        self.gauges_at = time.monotonic()


# Path parameters as the OpenAPI schema documents them. The patterns are documentation only (json_schema_extra):
# the handlers check them (check_key, check_file_name, LEASE_ID_RE) and answer with an error that says what is
# wrong, which FastAPI's own pattern validation would not.
