"""One route from a request to a cache entry: the steps that ``transformd convert`` into the cache and the daemon's
``POST /v1/checkpoints`` both take, in this order, written once.

1. **target** (:func:`transformd.engines.choose_target`): the target the engine and the platform call for, and
   why; None when nothing is to be converted (native MX instructions: the engine loads the source itself). With
   the scale mode and the selection it makes the request's :class:`~transformd.cache.Recipe`.
2. **source** (:func:`identify`): the source's content identity, or, for a large source new to the cache, a
   :class:`~transformd.cache.PendingIdentity` (its conversion hashes it as it reads it, once). With a remote tier
   (:func:`key_first`), a source named by a repo id and a full commit is looked up by the tier's alias record
   first: on a miss it is converted while it is hashed, as without a tier (the first node pays one small request);
   when the tier has it, and for a path (the tier is asked by key), the source is hashed first.
3. **look up** (:func:`find`): the local entry of that identity and recipe, if there is one (nothing converts).
4. **plan and check** (:func:`plan`, :func:`check_engine`): the checkpoint's headers, read once through checked
   descriptors of the files the request identified; with an engine named, what it could not load is refused
   before anything is converted. The same plan is handed to the conversion, which does not read them again.
5. **produce** (:func:`produce`): with a remote tier (:class:`Tier`, ``--remote``), first the tier's entry of the
   key, downloaded and checked into a private staging directory and published by one rename; else the entry
   converted under the cache's single flight (one process per key, the others wait for it) in a private staging
   directory, published by one rename, then uploaded to the tier in the background (the answer never waits for
   the upload). Any failure of the tier is logged once, counted, and the request goes on as without a tier.

A node with a repo id and a full commit but no snapshot of it asks the tier by its alias record
(:meth:`Tier.fetch_alias`; the daemon: :meth:`Tier.alias_key`, then a job that only downloads) instead of steps
2-5.

A hub repo id is turned into its snapshot's path before step 1 (:mod:`transformd.hub`; the daemon also checks
that its caller may read it). The CLI (:mod:`transformd.cli.convert`) runs the steps one after the other, with
the daemon that serves the same cache as its producer when one answers (:mod:`transformd.cli.delegate`); the
daemon runs steps 2-4 in its source threads and step 5 in a worker of its job queue
(:mod:`transformd.daemon.service`), which adds what only a server needs around them: one job per key, a
bounded queue, progress and status for every caller, and the callers' permissions.

No torch: the CLI's and the daemon's request paths import this before they know whether they convert.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cache import Cache, ConversionStatus, Entry, PendingIdentity, Recipe, SourceIdentity, cache_key
from .cache.keys import check_as_requested
from .errors import CacheError

if TYPE_CHECKING:
    from .cache.securefs import AccessFacts
    from .checkpoint.plan import ConversionPlan
    from .engines import EngineReadiness
    from .remote import Remote

__all__ = ["Tier", "bind", "check_engine", "find", "identify", "key_first", "plan", "produce", "readiness",
           "recorded_readiness", "unnamed_refusal"]


def identify(cache: Cache, src: str | os.PathLike[str], *, defer: bool = False) -> SourceIdentity | PendingIdentity:
    """Step 2: the content identity of ``src`` (files the stat cache knows are not read again). ``defer``: a source
    that its conversion would hash as it reads it (:meth:`~transformd.cache.Cache.hashes_alongside`) is not read
    here, and a :class:`~transformd.cache.PendingIdentity` comes back. Raises what
    :meth:`~transformd.cache.Cache.identity` raises (a missing or unreadable source, a cache it cannot fit in)."""
    return cache.identity_unless_alongside(src) if defer else cache.identity(src)


def key_first(tier: Tier | None, identity: SourceIdentity | PendingIdentity | None, alias: tuple[str, str] | None,
              recipe: Recipe) -> bool:
    """Step 2 with a remote tier: whether a source whose conversion would hash it as it reads it (``identity`` pending)
    is hashed first instead, so that the tier can be asked by its key: a path, or a repo id at a full commit
    (``alias``) whose alias record the tier holds. A repo id the tier has no record of is converted while it is
    hashed, as without a tier (its entry is uploaded with the record). Asks the tier (blocking)."""
    if tier is None or not isinstance(identity, PendingIdentity):
        return False
    return alias is None or tier.alias_key(*alias, recipe) is not None


def find(cache: Cache, identity: SourceIdentity | PendingIdentity | None, recipe: Recipe) -> Entry | None:
    """Step 3: the local entry of ``identity`` with ``recipe`` (marked as used), or None (also for an identity that
    is pending or unknown: its key is known only once the source is read)."""
    if identity is None or isinstance(identity, PendingIdentity):
        return None
    return cache.get(cache_key(identity, recipe))


def plan(cache: Cache, src: str | os.PathLike[str], recipe: Recipe, *, identity: SourceIdentity | None = None,
         slot: str | None = None, allow: Callable[[AccessFacts], None] | None = None) -> ConversionPlan:
    """Step 4: the conversion plan of ``src`` (every header checked, nothing of the tensors read), read through the
    cache's checked descriptors (:meth:`~transformd.cache.Cache.open_source`), so from the files the request
    identified: with ``slot`` (its pending identity's :meth:`~transformd.cache.PendingIdentity.slot`) or
    ``identity``, a directory or files other than those raise :class:`~transformd.cache.keys.SourceChangedError`.
    ``allow(facts)``: raises unless the caller may read those files (checked first). Errors name ``src``, never the
    descriptors' private view. Raises ``CheckpointError`` / ``MxFormatError`` for an invalid checkpoint."""
    from .checkpoint import plan_conversion  # (headers only, no torch)

    with cache.open_source(src) as tree:
        if allow is not None:
            allow(tree.facts())
        check_as_requested(tree, recipe, src, slot=slot, identity=identity)
        view = tree.view()
        try:
            return plan_conversion(view, select=recipe.select, layout=recipe.layout)
        except BaseException as exc:
            raise tree.relocate(exc, view)  # noqa: B904 - the same exception, naming the source


def check_engine(readiness: Mapping[str, EngineReadiness], engine: str | None, src: str | os.PathLike[str],
                 planned: ConversionPlan | None = None, target: str | None = None) -> None:
    """Step 4's refusal: a ``CheckpointError`` naming ``src`` when ``engine`` could not load the output at any
    tensor-parallel size; with no engine named (None), when any engine would load it wrong without an error
    (``planned`` and ``target``, when given, let the message say whether another layout loads); ``raw``: no check."""
    from .checkpoint import check_engine as check

    check(dict(readiness), engine, Path(src), planned, target)


def unnamed_refusal(cache: Cache, src: str | os.PathLike[str],
                    allow: Callable[[AccessFacts], bool] | None = None) -> str | None:
    """Step 4 for a request that names no engine: why it is refused (None: it is not) because an engine would load
    the output wrong without an error, from ``src``'s config.json and tensor names alone
    (:func:`transformd.checkpoint.plan.misloads_of_source`: the conversion plans every header once). A source that
    cannot be read, or that ``allow(facts)`` says the caller may not read, is None: the request's own checks and its
    conversion say what is wrong, as before."""
    from .checkpoint.plan import misloads_of_source
    from .engines import unnamed_refusal as refusal_of

    try:
        with cache.open_source(src) as tree:
            if allow is not None and not allow(tree.facts()):
                return None
            report = misloads_of_source(tree.view())
    except Exception:  # noqa: BLE001 - see above
        return None
    return refusal_of(report, shapes=False)


def readiness(planned: ConversionPlan, recipe: Recipe) -> dict[str, EngineReadiness]:
    """The engines' readiness of the output ``planned`` converts to with ``recipe`` (from its headers)."""
    from .checkpoint import plan_readiness

    return plan_readiness(planned, recipe.target)


def recorded_readiness(entry: Entry) -> dict[str, EngineReadiness] | None:
    """The engine readiness the conversion recorded in the entry's manifest (the report of its output, computed
    before it was written), or None (an entry of an older version: then it is computed from the headers)."""
    from .engines import CHECKED_ENGINES, EngineReadiness

    try:
        recorded = entry.manifest.result["readiness"]  # (in the engines' order, not the manifest's sorted keys)
        if any("misloads" not in r for r in recorded.values()):  # an older version's: computed again
            return None
        return {e.value: EngineReadiness(**recorded[e.value]) for e in CHECKED_ENGINES if e.value in recorded} or None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def produce(cache: Cache, src: str | os.PathLike[str], recipe: Recipe, *, identity: SourceIdentity | None = None,
            key: str | None = None, slot: str | None = None, planned: Any = None, shard_order: Any = None,
            converter: Any = None, progress: Callable[[ConversionStatus], None] | None = None,
            poll_interval: float = 0.1, tier: Tier | None = None, alias: tuple[str, str] | None = None) -> Entry:
    """Step 5: the entry of ``src`` with ``recipe``, converted into staging and published by
    :meth:`~transformd.cache.Cache.get_or_convert` unless it is there or another process makes it (then this
    waits for it, reporting its progress).

    ``identity``: the request's identity of ``src`` (files unchanged since are not read again to key it).
    ``key`` / ``slot``: what the request was keyed by (its key, or its pending identity's slot): the source must
    still be that content, in those files, else :class:`~transformd.cache.keys.SourceChangedError` and nothing is
    converted; give one whenever a ``planned`` (step 4's plan, or a converter's own from its ``plan``) is handed to
    the converter, which reads only the tensors then. ``shard_order``: the daemon's order of the shards. Both are
    passed to a converter that takes them (:func:`bind`).

    ``tier``: asked first for the key (``key``, else ``identity``'s; a pending identity's key is known only once
    its conversion has read the source: such a request is not asked for, give the tier an identity), and given
    the entry converted here (``alias``: the repo id and full commit it was asked by, recorded with it).
    ``entry.outcome`` is ``fetched`` for an entry downloaded from the tier."""
    wanted = key if key is not None and slot is None else cache_key(identity, recipe) if identity is not None else None
    if tier is not None and wanted is not None:
        fetched = tier.fetch(cache, wanted, source=os.fspath(src), progress=progress)
        if fetched is not None:
            return fetched
    entry = cache.get_or_convert(
        src,
        recipe,
        progress=progress,
        converter=bind(converter if converter is not None else cache.converter, shard_order=shard_order,
                       plan=planned),
        identity=identity,
        expect_key=None if slot is not None else key,
        expect_slot=slot,  # (the provisional key of the tree the request checked)
        expect_files=identity if slot is None and key is not None else None,  # (the files it identified)
        poll_interval=poll_interval,
    )
    if tier is not None and entry.outcome == "converted":
        tier.upload(cache, entry, alias=None if alias is None else (*alias, recipe))
    return entry


class _Bound(functools.partial):  # type: ignore[type-arg]
    """A converter with some keyword arguments given, which keeps its ``prepare`` (the cache calls it)."""

    def prepare(self, recipe: Recipe) -> None:
        prepare = getattr(self.func, "prepare", None)
        if prepare is not None:
            prepare(recipe)


def bind(converter: Any, **extra: Any) -> Any:
    """``converter`` with each of ``extra`` that is not None and that it takes (a keyword argument of that name, or
    ``**kwargs``) given; ``converter`` itself when none is."""
    try:
        params = inspect.signature(converter).parameters
    except (TypeError, ValueError):
        return converter
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    given = {name: value for name, value in extra.items() if value is not None and (takes_any or name in params)}
    return _Bound(converter, **given) if given else converter


log = logging.getLogger("transformd.remote")

#: Seconds a tier that did not answer (unreachable, or silent past its timeouts) is not asked again for downloads:
#: the requests meanwhile convert at once instead of each waiting the timeouts out.
HOLD_OFF_S = 60.0
#: What a :class:`Tier` counts (``/v1/cache``'s ``remote``, ``/metrics``'s ``transformd_remote_*_total``).
TIER_COUNTS = ("hits", "misses", "bytes", "verification_failures", "failures", "uploads", "upload_failures")


class Tier:
    """The remote tier (:class:`transformd.remote.Remote`) as the route uses it: a download published into the
    local cache as a conversion is (:func:`transformd.cache.fetched.get_or_fetch`), an upload in the background
    under a lease (the entry cannot be evicted while it is read), and what it did, counted (:data:`TIER_COUNTS`).
    Its failures are never the request's: each is counted, its cause logged (a cause once at warning, again at
    debug), and the request converts locally (or answers the local error) as without a tier; after a tier that did
    not answer, downloads are not tried for :data:`HOLD_OFF_S` (uploads still are, in the background).
    Thread-safe."""

    def __init__(self, remote: Remote, *, on_count: Callable[[str, int], None] | None = None):
        self.remote = remote
        self.counts = dict.fromkeys(TIER_COUNTS, 0)
        #: called with ``(name, amount)`` on every count (the daemon's Prometheus counters)
        self.on_count = on_count
        self._lock = threading.Lock()
        self._said: set[tuple[str, str]] = set()  #: kinds of failure logged since the tier last worked
        self._uploads: list[threading.Thread] = []
        self._held_until = 0.0  #: (time.monotonic) no download is tried before this, after an unanswered one

    @classmethod
    def from_url(cls, url: str, *, read_only: bool = False,
                 on_count: Callable[[str, int], None] | None = None) -> Tier:
        """A tier on ``url`` (``s3://BUCKET[/PREFIX]``, ``file:///PATH``); raises ``RemoteConfigError``."""
        from .remote import Remote

        return cls(Remote.from_url(url, read_only=read_only), on_count=on_count)

    @property
    def read_only(self) -> bool:
        return bool(self.remote.read_only)

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counts[name] += amount
        if self.on_count is not None:
            self.on_count(name, amount)

    def _failed(self, doing: str, err: BaseException) -> None:
        """Count a failure and log its cause: at warning the first time this kind of failure (what was done, the
        error's class) comes since the tier last worked, at debug after (a tier that is down would otherwise say
        so on every request)."""
        from .remote import RemoteCorruptError, RemoteUnavailableError

        if isinstance(err, RemoteCorruptError):
            self._count("verification_failures")
        if isinstance(err, RemoteUnavailableError) and doing != "upload":
            with self._lock:
                self._held_until = time.monotonic() + HOLD_OFF_S
        self._count("upload_failures" if doing == "upload" else "failures")
        said = f"{type(err).__name__}: {err}"
        with self._lock:
            first = (doing, type(err).__name__) not in self._said
            self._said.add((doing, type(err).__name__))
        (log.warning if first else log.debug)("remote tier %s: %s failed (%s); %s", self.remote.url, doing, said,
                                              {"download": "converting locally", "upload": "the entry stays local"}
                                              .get(doing, "answering as without a tier"))

    def no_answer(self, doing: str, waited_s: float) -> None:
        """A request gave up waiting for the tier after ``waited_s`` seconds: a failure of the tier that did not answer
        (counted, logged once, the tier held off as after a timeout)."""
        from .remote import RemoteUnavailableError

        self._failed(doing, RemoteUnavailableError(f"remote {self.remote.url}: no answer within {waited_s:g} s"))

    def _worked(self) -> None:
        with self._lock:
            self._said.clear()

    def fetch(self, cache: Cache, key: str, *, source: str,
              progress: Callable[[ConversionStatus], None] | None = None, wait: bool = False,
              timeout: float | None = None, poll_interval: float = 0.1) -> Entry | None:
        """The entry ``key`` downloaded from the tier into ``cache`` (``outcome`` ``fetched``), or the local one if it
        appeared meanwhile; None on a miss, a failure of the tier (counted, logged), or when another process of
        this cache holds the key (it converts or downloads it; the caller's conversion waits for it).

        ``wait`` (a caller with nothing to convert: a repo id and commit with no snapshot here): another process
        that holds the key is waited for as a conversion waits for one (``timeout``, ``poll_interval``:
        :func:`~transformd.cache.fetched.get_or_fetch`), and its entry returned (``outcome`` ``waited``); if it
        published none, the tier is asked here."""
        from .cache.fetched import get_or_fetch
        from .remote import RemoteError

        held = time.monotonic() < self._held_until
        if held:  # (it did not answer moments ago: not waited for again)
            self._count("failures")
            log.debug("remote tier %s: not asked for %s (it did not answer within the last %.0f s); converting "
                      "locally", self.remote.url, key, HOLD_OFF_S)
            if not wait:
                return None
        asked: list[bool] = []

        def fill(stage: Path, report: Callable[[Any], None], reserve: Callable[[int], None]) -> bool:
            if held:  # (waited only for another process of this cache)
                return False
            asked.append(True)

            def update(p: Any) -> None:
                report({"bytes_done": p.bytes_done, "bytes_total": p.bytes_total})

            try:  # (room for the entry is made from its manifest's size before its first byte comes)
                found = bool(self.remote.fetch(key, stage, update, before=lambda m: reserve(m.total_bytes)))
                self._worked()
                return found
            except (RemoteError, CacheError):  # (a cache that cannot hold it: the request's error, as a conversion's)
                raise
            except Exception as e:  # noqa: BLE001 - a failure of the tier's client is the tier's, never the request's
                raise RemoteError(f"remote {self.remote.url}: {type(e).__name__}: {str(e)[:300]}") from e

        try:
            entry = get_or_fetch(cache, key, fill, source=f"{self.remote.url} ({source})", progress=progress,
                                 wait=wait, timeout=timeout, poll_interval=poll_interval)
        except RemoteError as e:
            self._failed("download", e)
            return None
        if entry is None:
            if asked:  # (not asked: another process of this cache converts or downloads it)
                self._count("misses")
        elif entry.outcome == "fetched":
            self._count("hits")
            try:
                self._count("bytes", entry.manifest.total_bytes)
            except (OSError, ValueError, KeyError, TypeError):
                pass
        return entry

    def fetch_alias(self, cache: Cache, repo_id: str, commit: str, recipe: Recipe, *,
                    progress: Callable[[ConversionStatus], None] | None = None,
                    timeout: float | None = None) -> Entry | None:
        """The entry that the tier's alias record of ``repo_id`` at full ``commit`` with ``recipe`` names, local
        already or downloaded (for a node without that snapshot; another process of this cache that holds the key
        is waited for, as :meth:`fetch` ``wait``); None when the tier has none or fails."""
        key = self.alias_key(repo_id, commit, recipe)
        if key is None:
            return None
        entry = cache.get(key)
        if entry is not None:
            entry.outcome = "hit"
            return entry
        return self.fetch(cache, key, source=f"{repo_id}@{commit}", progress=progress, wait=True, timeout=timeout)

    def alias_key(self, repo_id: str, commit: str, recipe: Recipe) -> str | None:
        """The key the tier's alias record of ``repo_id`` at full ``commit`` with ``recipe`` names; None when it has
        none (a miss) or fails (counted, logged)."""
        from .remote import RemoteError

        if time.monotonic() < self._held_until:  # (it did not answer moments ago: not waited for again)
            self._count("failures")
            return None
        try:
            key = self.remote.lookup_alias(repo_id, commit, recipe)
        except RemoteError as e:
            self._failed("alias lookup", e)
            return None
        if key is None:
            self._count("misses")
        return key

    def upload(self, cache: Cache, entry: Entry, alias: tuple[str, str, Recipe] | None = None) -> None:
        """Upload ``entry`` (and its alias record) in a background thread; nothing for a read-only tier."""
        if self.read_only:
            return
        t = threading.Thread(target=self._upload, args=(cache, entry, alias), name=f"transformd-upload-{entry.key}",
                             daemon=True)
        with self._lock:
            self._uploads = [u for u in self._uploads if u.is_alive()] + [t]
        t.start()

    def _upload(self, cache: Cache, entry: Entry, alias: tuple[str, str, Recipe] | None) -> None:
        from .remote import RemoteError

        lease = None
        try:
            lease = cache.acquire_lease(entry.key, 3600.0, holder="transformd upload")
            if self.remote.publish(entry.key, entry.root, alias):
                self._count("uploads")
            self._worked()
        except (RemoteError, CacheError, OSError) as e:
            self._failed("upload", e)
        except Exception as e:  # noqa: BLE001 - see fetch
            self._failed("upload", e)
        finally:
            if lease is not None:
                try:
                    cache.release_lease(lease)
                except (CacheError, OSError):
                    pass

    def wait_uploads(self, timeout: float | None = None) -> bool:
        """Wait for the uploads started so far (a command that ends after its answer); whether all ended."""
        with self._lock:
            uploads = list(self._uploads)
        for t in uploads:
            t.join(timeout)
        return not any(t.is_alive() for t in uploads)

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"url": self.remote.url, "read_only": self.read_only, **self.counts}
