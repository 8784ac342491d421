"""One route from a request to a cache entry: the steps that ``transformd convert`` into the cache and the daemon's
``POST /v1/checkpoints`` both take, in this order, written once.

1. **target** (:func:`transformd.engines.choose_target`): the target the engine and the platform call for, and
   why; None when nothing is to be converted (native MX instructions: the engine loads the source itself). With
   the scale mode and the selection it makes the request's :class:`~transformd.cache.Recipe`.
2. **source** (:func:`identify`): the source's content identity, or, for a large source new to the cache, a
   :class:`~transformd.cache.PendingIdentity` (its conversion hashes it as it reads it, once).
3. **look up** (:func:`find`): the local entry of that identity and recipe, if there is one (nothing converts).
4. **plan and check** (:func:`plan`, :func:`check_engine`): the checkpoint's headers, read once through checked
   descriptors of the files the request identified; with an engine named, what it could not load is refused
   before anything is converted. The same plan is handed to the conversion, which does not read them again.
5. **produce** (:func:`produce`): the entry made under the cache's single flight (one process per key, the others
   wait for it) in a private staging directory, published by one rename.

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
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cache import Cache, ConversionStatus, Entry, PendingIdentity, Recipe, SourceIdentity, cache_key
from .cache.keys import check_as_requested

if TYPE_CHECKING:
    from .cache.securefs import AccessFacts
    from .checkpoint.plan import ConversionPlan
    from .engines import EngineReadiness

__all__ = ["bind", "check_engine", "find", "identify", "plan", "produce", "readiness", "recorded_readiness"]


def identify(cache: Cache, src: str | os.PathLike[str], *, defer: bool = False) -> SourceIdentity | PendingIdentity:
    """Step 2: the content identity of ``src`` (files the stat cache knows are not read again). ``defer``: a source
    that its conversion would hash as it reads it (:meth:`~transformd.cache.Cache.hashes_alongside`) is not read
    here, and a :class:`~transformd.cache.PendingIdentity` comes back. Raises what
    :meth:`~transformd.cache.Cache.identity` raises (a missing or unreadable source, a cache it cannot fit in)."""
    return cache.identity_unless_alongside(src) if defer else cache.identity(src)


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
            return plan_conversion(view, select=recipe.select)
        except BaseException as exc:
            raise tree.relocate(exc, view)  # noqa: B904 - the same exception, naming the source


def check_engine(readiness: Mapping[str, EngineReadiness], engine: str | None, src: str | os.PathLike[str]) -> None:
    """Step 4's refusal: a ``CheckpointError`` naming ``src`` when ``engine`` could not load the output at any
    tensor-parallel size (``raw`` or None: no check)."""
    from .checkpoint import check_engine as check

    check(dict(readiness), engine, Path(src))


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
        return {e.value: EngineReadiness(**recorded[e.value]) for e in CHECKED_ENGINES if e.value in recorded} or None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def produce(cache: Cache, src: str | os.PathLike[str], recipe: Recipe, *, identity: SourceIdentity | None = None,
            key: str | None = None, slot: str | None = None, planned: Any = None, shard_order: Any = None,
            converter: Any = None, progress: Callable[[ConversionStatus], None] | None = None,
            poll_interval: float = 0.1) -> Entry:
    """Step 5: the entry of ``src`` with ``recipe``, converted into staging and published by
    :meth:`~transformd.cache.Cache.get_or_convert` unless it is there or another process makes it (then this
    waits for it, reporting its progress).

    ``identity``: the request's identity of ``src`` (files unchanged since are not read again to key it).
    ``key`` / ``slot``: what the request was keyed by (its key, or its pending identity's slot): the source must
    still be that content, in those files, else :class:`~transformd.cache.keys.SourceChangedError` and nothing is
    converted; give one whenever a ``planned`` (step 4's plan, or a converter's own from its ``plan``) is handed to
    the converter, which reads only the tensors then. ``shard_order``: the daemon's order of the shards. Both are
    passed to a converter that takes them (:func:`bind`)."""
    return cache.get_or_convert(
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
