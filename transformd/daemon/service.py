"""Conversion jobs of the daemon: single flight per key, a bounded queue, worker threads off the event loop.

One :class:`Job` per cache key at a time. A ``POST /v1/checkpoints`` that misses the cache calls
:meth:`ConversionService.ensure_job`: the first request for a key creates the job and checks the
checkpoint (step 4 of :mod:`transformd.request`, headers only; an invalid checkpoint is a 422 for every
request that waits on that check, and nothing is written); concurrent requests for the same key join the same
job and never start a second thread. Checked jobs wait in a FIFO queue (at most
``max_queued`` of them; more is a 503) for one of ``max_concurrent`` worker threads, which runs
:func:`transformd.request.produce` (the cache adds single flight across processes, the
atomic publish and the eviction). Progress comes back through the cache's progress callback.

The event loop never waits on a conversion, a hash or a directory scan: source checks, identities
and plans run in anyio's worker threads; conversions in the service's own (daemon) threads, which
stop at the next progress update when the daemon shuts down (:class:`ConversionCancelled`); the
cache removes their staging directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio.to_thread

from .. import request
from ..cache import Cache, CacheError, ConversionStatus, Entry, PendingIdentity, Recipe, SourceIdentity
from ..cache.keys import check_as_requested
from ..cache.securefs import SourceReader, reading_as
from ..progress import COUNTERS, Eta, Progress, human_bytes
from .errors import ApiError, error_for_exception
from .metrics import Metrics
from .paths import SourcePolicy
from .shards import ConversionOutline, ShardPriority, plan_of

log = logging.getLogger("transformd.daemon")

#: How long a finished job (its error, its timings) stays visible to ``GET /v1/checkpoints/{key}``.
FINISHED_TTL_S = 3600.0
#: Finished jobs remembered at the most.
MAX_FINISHED_JOBS = 1024
#: Window of the transfer rate estimate (seconds).
RATE_WINDOW_S = 10.0
#: Threads for work on sources (identify, plan, permission checks of an entry's source).
SOURCE_THREADS = 16
#: How often a waiting worker polls another process' conversion (seconds).
POLL_INTERVAL_S = 0.2


def _shutting_down() -> ApiError:
    return ApiError(503, "shutting_down", "the daemon is shutting down; retry against its successor")


class ConversionCancelled(BaseException):
    """Raised from the progress callback to stop a conversion when the daemon shuts down.

    A BaseException, like KeyboardInterrupt: the cache removes the staging directory but records no failure.
    """


class Job:
    """One conversion of one key in this daemon, from the first request to ready or failed.

    Written by one worker thread (``on_status``, ``start``, ``finish``, ``fail``) and read by the event
    loop; every update replaces immutable values, so readers see a consistent snapshot.
    """

    def __init__(self, key: str, source: Path, recipe: Recipe):
        self.key = key
        self.source = source
        self.recipe = recipe
        #: uid of the caller whose request created the job (None: unknown)
        self.uid: int | None = None
        #: the source's identity when the request came (keys the conversion without reading the source again)
        self.identity: SourceIdentity | None = None
        #: who the request that created the job opened the source for: the job's opens of it are that reader's
        self.reader: SourceReader | None = None
        #: the repo id and full commit the request named (recorded with the entry in the remote tier)
        self.alias: tuple[str, str] | None = None
        #: a job that only downloads ``key`` from the remote tier (a repo id and commit with no snapshot here: its
        #: ``source`` names them, nothing of it is on this node to plan or convert)
        self.fetch_only = False
        #: the plan of the source the request read for its engine check (:func:`transformd.request.plan`), for the
        #: job's check and its conversion (the headers are read once per request)
        self.planned: Any = None
        self.priority = ShardPriority()
        self.outline: ConversionOutline | None = None
        self.state = "queued"
        self.error: ApiError | None = None
        self.outcome: str | None = None
        self.created_at = time.time()
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.entry_path: Path | None = None
        self.staging_dir: str | None = None
        self.cancel = threading.Event()
        self.validation: asyncio.Task[None] | None = None
        self._progress = Progress("validating", updated_at=self.created_at)
        self._eta = Eta()
        #: the provisional name of a job started before its key was known (its source is hashed as it converts,
        #: read once); ``key`` is that name until :meth:`ConversionService.keyed` has the real one
        self.slot: str | None = None
        self.keyed: asyncio.Future[str] | None = None  #: the key, for a job with a slot (event loop)
        #: called (from the worker thread) with the content key once the conversion's status names it
        self.on_key: Callable[[str], None] | None = None
        #: called (from any thread) with the error when the job fails
        self.on_fail: Callable[[ApiError], None] | None = None
        #: set once the job is ready or failed, for requests that wait for that (:meth:`wait_ended`; event loop)
        self._ended: tuple[asyncio.Event, asyncio.AbstractEventLoop] | None = None

    @property
    def active(self) -> bool:
        return self.state in ("queued", "converting")

    @property
    def progress(self) -> Progress:
        return self._progress

    def _set_progress(self, **changes: Any) -> None:
        self._progress = self._progress.replace(**changes, updated_at=time.time())

    def queued(self, outline: ConversionOutline | None) -> None:
        self.outline = outline
        totals = {}
        if outline is not None:
            totals = {"tensors_total": outline.tensors_total, "bytes_total": outline.bytes_total}
        self._set_progress(phase="queued", tensors_done=0, bytes_done=0, **totals)

    def start(self) -> None:
        self.started_at = time.time()
        self.state = "converting"
        self._set_progress(phase="converting")

    def on_status(self, status: ConversionStatus) -> None:
        """The cache's progress callback (worker thread). Stops the conversion once the job is cancelled."""
        if self.cancel.is_set():
            raise ConversionCancelled(self.key)
        if status.staging_dir:
            self.staging_dir = status.staging_dir
        if self.slot is not None and self.on_key is not None and status.key != self.slot:
            self._tell_key(status.key)  # the hashing beside the conversion has the key
        phase = "waiting" if status.waiting else status.state if status.state in ("publishing", "downloading") \
            else "converting"
        changes: dict[str, Any] = {"phase": phase}
        update = status.progress
        if phase != "publishing" and update is not None:  # publishing reports output bytes hashed, not progress
            changes.update({n: getattr(update, n) for n in COUNTERS if getattr(update, n) is not None})
            if update.shard is not None:
                changes["shard"] = update.shard
        if "bytes_done" in changes:
            progress = self._progress.replace(**changes)
            eta = self._eta.update(progress)  # from the bytes still to convert, not from fast copies
            rate = self._eta.rate
            changes["rate_bytes_per_s"] = None if rate is None else round(rate, 1)
            if eta is not None and progress.bytes_total is not None:
                changes["eta_s"] = round(eta, 1)
        self._set_progress(**changes)

    def finish(self, entry: Entry) -> None:
        self.entry_path = entry.path
        self.outcome = entry.outcome
        p = self._progress
        self._set_progress(
            phase="done",
            tensors_done=p.tensors_total if p.tensors_total is not None else p.tensors_done,
            bytes_done=p.bytes_total if p.bytes_total is not None else p.bytes_done,
            eta_s=0.0,
        )
        self.finished_at = time.time()
        self.state = "ready"
        self._tell_ended()
        if self.slot is not None and self.on_key is not None:
            self._tell_key(entry.key)  # (a content already cached is found before any status names its key)

    async def wait_ended(self, timeout_s: float) -> None:
        """Return once the job is ready or failed, or after ``timeout_s`` seconds (event loop; a status request that
        waits answers the moment the job ends, instead of at the client's next poll)."""
        if self._ended is None:
            self._ended = (asyncio.Event(), asyncio.get_running_loop())
        if not self.active:  # (ended before the event existed: its end did not set it)
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ended[0].wait(), timeout_s)

    def _tell_ended(self) -> None:
        """Wake the requests in :meth:`wait_ended` (any thread; the state is already final)."""
        if self._ended is not None:
            event, loop = self._ended
            with contextlib.suppress(RuntimeError):  # (a loop already closed: nobody waits)
                loop.call_soon_threadsafe(event.set)

    def _tell_key(self, key: str) -> None:
        tell, self.on_key = self.on_key, None  # once
        if tell is not None:
            tell(key)

    def fail(self, error: ApiError, outcome: str) -> None:
        self.error = error
        self.outcome = outcome
        self._set_progress(phase="failed", eta_s=None, rate_bytes_per_s=None)
        self.finished_at = time.time()
        self.state = "failed"
        self._tell_ended()
        if self.on_fail is not None:
            self.on_fail(error)


class ConversionService:
    """Jobs by key, the queue and the workers. Methods without ``async`` must be called on the event loop
    unless they say otherwise."""

    def __init__(
        self,
        cache: Cache,
        converter: Any,
        policy: SourcePolicy,
        metrics: Metrics,
        *,
        tier: request.Tier | None = None,
        max_concurrent: int = 1,
        max_queued: int = 16,
        on_change: Callable[[], None] | None = None,
        on_converted: Callable[[str, int | None], None] | None = None,
    ):
        self.cache = cache
        self.converter = converter
        self.policy = policy
        self.metrics = metrics
        #: the remote tier (``--remote``), asked before a conversion and given what this daemon converts
        self.tier = tier
        self.max_concurrent = max(1, max_concurrent)
        self.max_queued = max(0, max_queued)
        self._on_change = on_change
        #: told ``(key, uid)`` of each entry a job converted (not found or waited for), before its job is ready
        self._on_converted = on_converted
        self._jobs: dict[str, Job] = {}
        #: keys that requests of a uid have reserved on their way to starting a job (:meth:`reserve`)
        self._reserved: dict[int, dict[str, int]] = {}
        self._identifying: dict[tuple[str, bool], asyncio.Future[SourceIdentity | PendingIdentity]] = {}
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._closing = False
        #: worker threads for work on sources (listing, hashing, planning): they may block on a slow or hostile
        #: source, so they get their own pool; health, status and cached lookups never wait for it
        self._source_limiter: anyio.CapacityLimiter | None = None

    def source_limiter(self) -> anyio.CapacityLimiter:
        if self._source_limiter is None:
            self._source_limiter = anyio.CapacityLimiter(SOURCE_THREADS)
        return self._source_limiter

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for i in range(self.max_concurrent):
            t = threading.Thread(target=self._worker, name=f"transformd-conversion-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    async def close(self, grace_s: float = 10.0) -> None:
        """Refuse new jobs, cancel running and queued ones, wait up to ``grace_s`` for the workers to clean up."""
        self._closing = True
        for job in self._jobs.values():
            if job.active:
                job.cancel.set()
        for _ in self._workers:
            self._queue.put(None)
        deadline = time.monotonic() + grace_s

        def join() -> None:
            for t in self._workers:
                t.join(max(0.0, deadline - time.monotonic()))

        await anyio.to_thread.run_sync(join)

    def stopping(self) -> None:
        """The server begins to stop (event loop): no new jobs; a request waiting for a job's key gets 503 now
        (the job goes on until :meth:`close` cancels it, and is published if it finishes before)."""
        self._closing = True
        for job in self._jobs.values():
            if job.keyed is not None and not job.keyed.done():
                job.keyed.set_exception(_shutting_down())

    @property
    def closing(self) -> bool:
        return self._closing

    # ------------------------------------------------------------------ lookups (event loop, no I/O)

    def job(self, key: str) -> Job | None:
        return self._jobs.get(key)

    def active_jobs(self) -> list[Job]:
        return [j for j in self._jobs.values() if j.active]

    def queued_count(self) -> int:
        return sum(1 for j in self._jobs.values() if j.state == "queued")

    def known_invalid(self, key: str, source: Path | None = None) -> ApiError | None:
        """The 422 of a recent check or conversion of this key that found the checkpoint invalid.

        The key names the content, so the same content fails the same way again: it is not retried (until the
        daemon restarts or an hour passes). Other failures (I/O, disk full, permissions) are retried. With
        ``source`` (the real path now asked for), only a failure of that same path counts: the message names the
        files of the path it was found in, and the key covers regular files only (a FIFO or a missing file
        give the same key but different errors).
        """
        job = self._jobs.get(key)
        if (
            job is not None
            and (source is None or job.source == source)
            and job.state == "failed"
            and job.error is not None
            and job.error.code == "invalid_checkpoint"
            and time.time() - (job.finished_at or 0) < FINISHED_TTL_S
        ):
            return job.error
        return None

    # ------------------------------------------------------------------ identify (coalesced, in a thread)

    async def identify(self, source: str, *, defer: bool = False,
                       reader: SourceReader | None = None) -> SourceIdentity | PendingIdentity:
        """Check ``source`` against the allowed roots and compute its content identity.

        ``defer``: a source that its conversion would hash as it reads it (large and unknown to the stat cache,
        :meth:`~transformd.cache.Cache.hashes_alongside`) is not hashed here: a :class:`PendingIdentity` comes
        back, for :meth:`ensure_job` with ``provisional=True``.

        ``reader``: who the source is opened for (:func:`~transformd.cache.securefs.reading_as`).

        Concurrent calls for the same source by readers who see the same files share one thread. Raises
        :class:`ApiError`.
        """
        ident = (source, defer, getattr(reader, "ident", None))
        fut = self._identifying.get(ident)
        if fut is None:
            fut = asyncio.ensure_future(
                anyio.to_thread.run_sync(self._identify_blocking, source, defer, reader, limiter=self.source_limiter())
            )
            self._identifying[ident] = fut

            def forget(f: asyncio.Future[SourceIdentity | PendingIdentity]) -> None:
                self._identifying.pop(ident, None)
                if not f.cancelled():
                    f.exception()  # retrieved here, so a caller that went away leaves no warning

            fut.add_done_callback(forget)
        try:
            return await asyncio.shield(fut)
        except ApiError:
            raise
        except Exception as exc:
            raise error_for_exception(exc) from exc

    def _identify_blocking(self, source: str, defer: bool,
                           reader: SourceReader | None = None) -> SourceIdentity | PendingIdentity:
        self.policy.check_allowed(source)
        with reading_as(reader):
            return request.identify(self.cache, source, defer=defer)

    def _plan_blocking(self, job: Job) -> ConversionOutline | None:
        """The converter's check of the job's source, reading only the checked descriptors (a view) of the tree the
        request checked (:func:`.keys.check_as_requested`: its errors name no other files), opened for the job's
        reader: transformd's converter takes the plan of :func:`transformd.request.plan` (the request's own, when
        its engine check read one); another converter (a test's) makes its own. Nothing for a job that only
        downloads."""
        if job.fetch_only:
            return None
        outline_of = getattr(self.converter, "outline", None)
        if outline_of is not None:
            planned = job.planned
            if planned is None:
                with reading_as(job.reader):
                    planned = request.plan(self.cache, job.source, job.recipe, slot=job.slot, identity=job.identity)
            return outline_of(planned)
        with reading_as(job.reader), self.cache.open_source(job.source) as tree:
            check_as_requested(tree, job.recipe, job.source, slot=job.slot, identity=job.identity)
            view = tree.view()
            try:
                return plan_of(self.converter, view, job.recipe)
            except BaseException as exc:
                raise tree.relocate(exc, view)  # noqa: B904 - the same exception, naming the source

    # ------------------------------------------------------------------ jobs

    def queued_by(self, uid: int) -> int:
        """Active (queued or converting) jobs started by ``uid``, and the keys reserved for ``uid``'s requests that
        are on their way to starting one (:meth:`reserve`); a key counts once."""
        keys = {j.key for j in self._jobs.values() if j.active and j.uid == uid}
        return len(keys | self._reserved.get(uid, {}).keys())

    @contextlib.contextmanager
    def reserve(self, uid: int, key: str, cap: int, who: str) -> Iterator[None]:
        """Hold a place of ``uid``'s ``cap`` for the job of ``key`` while a request checks it and starts it (event
        loop; the check and the reservation happen together, before any await): a concurrent burst of one uid's
        requests cannot all pass the count before any of them has made its job (an attack review had 12 of
        a uid's concurrent requests accepted under a cap of 4). A place is given back on leaving; by then the job
        (if the request made one) counts itself. Raises the 429 ``caller_queue_full`` when the cap is reached."""
        if self.queued_by(uid) >= cap:
            raise ApiError(429, "caller_queue_full", f"{who} already has {cap} conversions queued or running; wait "
                           "for them", headers={"Retry-After": "5"})
        keys = self._reserved.setdefault(uid, {})
        keys[key] = keys.get(key, 0) + 1  # (two requests of one uid for one key: one place, held until both left)
        try:
            yield
        finally:
            keys[key] -= 1
            if not keys[key]:
                del keys[key]
            if not keys:
                self._reserved.pop(uid, None)

    async def ensure_job(self, key: str, source: Path, recipe: Recipe, *, uid: int | None = None,
                         identity: SourceIdentity | None = None, provisional: bool = False,
                         reader: SourceReader | None = None, planned: Any = None,
                         alias: tuple[str, str] | None = None, fetch_only: bool = False) -> Job | None:
        """The active job of ``key``, or a new one; returns once the checkpoint was checked and queued.

        ``identity``: the request's identity of the source (:meth:`identify`), so the conversion does not read
        the source again to key it; ``reader``: the request's reader, for whom the job opens the source.
        ``provisional``: ``key`` is a :class:`PendingIdentity`'s slot; the job converts the source while hashing it
        (:meth:`keyed` waits for the key). It is started only when a worker
        is free for it at once (else None: the caller hashes first, so that its answer does not wait for the
        queue). ``planned``: the plan the request read of the same files (:func:`transformd.request.plan`), if it
        read one: a new job does not read it again. ``alias``: the repo id and commit the request named.
        ``fetch_only``: the job downloads ``key`` from the remote tier (found by ``alias``), nothing else.

        Raises :class:`ApiError`: 422 invalid checkpoint (for every request waiting on the check), 503 queue
        full or shutting down.
        """
        job = self._jobs.get(key)
        if job is None or not job.active:
            if self._closing:
                raise _shutting_down()
            running = sum(1 for j in self._jobs.values() if j.state == "converting")
            free_workers = max(0, self.max_concurrent - running)
            if provisional and self.queued_count() >= free_workers:  # (jobs being checked count as queued)
                return None
            if self.queued_count() >= self.max_queued + free_workers:
                raise ApiError(
                    503,
                    "queue_full",
                    f"{self.queued_count()} conversions are already waiting for one of {self.max_concurrent} "
                    "workers; retry later (or raise --max-concurrent-conversions)",
                    headers={"Retry-After": "5"},
                )
            self._prune()
            prepare = getattr(self.converter, "prepare", None)
            if prepare is not None:  # torch's import and the GPU's start-up overlap the check and the hashing
                prepare(recipe)
            job = Job(key, source, recipe)
            job.uid = uid
            job.identity = identity
            job.reader = reader
            job.planned = planned
            job.alias = alias
            job.fetch_only = fetch_only
            if provisional:
                self._provisional(job)
            self._jobs[key] = job
            job.validation = asyncio.ensure_future(self._validate(job))
        assert job.validation is not None
        await asyncio.shield(job.validation)
        return job

    def _provisional(self, job: Job) -> None:
        """Make ``job`` one that learns its key as it converts (event loop)."""
        loop = asyncio.get_running_loop()
        job.slot = job.key
        keyed: asyncio.Future[str] = loop.create_future()
        keyed.add_done_callback(lambda f: f.cancelled() or f.exception())  # (retrieved: a caller may have left)
        job.keyed = keyed

        def found(key: str) -> None:  # event loop
            if keyed.done():
                return
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            current = self._jobs.get(key)
            if current is None or not current.active:  # (else: a request that hashed first runs it too; the
                self._jobs[key] = job  # cache's lock makes one of them wait for the other)
            job.key = key
            keyed.set_result(key)

        def failed(error: ApiError) -> None:  # event loop
            if not keyed.done():
                keyed.set_exception(error)

        job.on_key = lambda key: loop.call_soon_threadsafe(found, key)
        job.on_fail = lambda error: loop.call_soon_threadsafe(failed, error)

    async def keyed(self, job: Job) -> str:
        """The content key of a ``provisional`` job, once the hashing beside its conversion has it (or the
        conversion ended); raises the job's :class:`ApiError` if it failed first."""
        assert job.keyed is not None, "not a provisional job"
        return await asyncio.shield(job.keyed)

    async def _validate(self, job: Job) -> None:
        try:
            outline = await anyio.to_thread.run_sync(self._plan_blocking, job, limiter=self.source_limiter())
        except Exception as exc:  # noqa: BLE001 - every failure of the check is reported as an API error
            err = error_for_exception(exc)
            outcome = "invalid" if err.status == 422 else "failed"
            job.fail(err, outcome)
            self.metrics.conversions.labels(outcome).inc()
            raise err from None
        if self._closing:
            err = _shutting_down()
            job.fail(err, "cancelled")
            raise err
        job.queued(outline)
        self.metrics.queued.inc()
        self._queue.put(job)

    def _prune(self) -> None:
        now = time.time()
        finished = [j for j in self._jobs.values() if not j.active]
        finished.sort(key=lambda j: j.finished_at or 0)
        excess = len(finished) - MAX_FINISHED_JOBS
        for i, j in enumerate(finished):
            if i < excess or now - (j.finished_at or 0) > FINISHED_TTL_S:
                self._jobs.pop(j.key, None)

    # ------------------------------------------------------------------ workers (their own threads)

    def _worker(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.metrics.queued.dec()
            if job.cancel.is_set():
                job.fail(ApiError(503, "cancelled", "the daemon stopped before this conversion started"), "cancelled")
                self.metrics.conversions.labels("cancelled").inc()
                continue
            try:
                self._run(job)
            except BaseException:
                log.exception("conversion worker: unexpected error in job %s", job.key)

    def _fetch_only(self, job: Job) -> Entry:
        """A fetch-only job's entry, downloaded from the tier, or made by another process of this cache (waited for
        as a conversion waits for one)."""
        entry = None if self.tier is None else self.tier.fetch(self.cache, job.key, source=str(job.source),
                                                               progress=job.on_status, wait=True,
                                                               poll_interval=POLL_INTERVAL_S)
        if entry is None:
            entry = self.cache.get(job.key)  # (another process of this cache may have had it)
        if entry is None:
            raise CacheError(f"the remote tier no longer gives entry {job.key} of {job.source}, and no snapshot of it "
                             "is here to convert; see the daemon's log")
        return entry

    def _run(self, job: Job) -> None:
        job.start()
        self.metrics.in_progress.inc()
        t0 = time.monotonic()
        outcome = "failed"
        try:
            with reading_as(job.reader):  # (its opens of the source: the requester's)
                entry = self._fetch_only(job) if job.fetch_only else request.produce(
                    self.cache,
                    job.source,
                    job.recipe,
                    identity=job.identity,
                    key=job.key,  # (the files and content the request checked, or the tree of its slot)
                    slot=job.slot,
                    planned=job.outline.plan if job.outline else None,
                    shard_order=job.priority,
                    converter=self.converter,
                    progress=job.on_status,
                    poll_interval=POLL_INTERVAL_S,
                    tier=self.tier,
                    alias=job.alias,
                )
            outcome = {"converted": "converted", "waited": "waited", "fetched": "fetched"}.get(entry.outcome, "hit")
            if outcome == "fetched":  # downloaded from the remote tier: made for this request as a conversion is
                log.info("downloaded %s (key %s, %s) from the remote tier: %.1f s", job.source, entry.key,
                         human_bytes(entry.manifest.total_bytes), time.monotonic() - t0)
                if self._on_converted is not None:
                    self._on_converted(entry.key, job.uid)
            if outcome == "converted":
                self.metrics.conversion_seconds.observe(time.monotonic() - t0)
                self.metrics.converted_bytes.inc(entry.manifest.total_bytes)
                log.info("converted %s (key %s, %s): %.1f s", job.source, entry.key,
                         human_bytes(entry.manifest.total_bytes), time.monotonic() - t0)
                if self._on_converted is not None:
                    self._on_converted(entry.key, job.uid)
            job.finish(entry)
        except ConversionCancelled:
            outcome = "cancelled"
            job.fail(ApiError(503, "cancelled", "the daemon stopped during this conversion; POST it again"), outcome)
        except BaseException as exc:
            err = error_for_exception(exc)
            outcome = "invalid" if err.status == 422 else "failed"
            (log.error if err.status >= 500 else log.warning)(
                "conversion of %s (key %s) failed: %s %s: %s", job.source, job.key, err.status, err.code, err.message)
            job.fail(err, outcome)
            if not isinstance(exc, Exception):
                raise
        finally:
            self.metrics.in_progress.dec()
            if outcome != "hit":
                self.metrics.conversions.labels(outcome).inc()
            if self._on_change is not None:
                try:
                    self._on_change()
                except Exception:
                    log.debug("cache gauge refresh failed", exc_info=True)
