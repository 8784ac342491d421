"""What the daemon reads of a source for the engine that will load it (issue 44): the layout of ``--engine
sglang``'s output, and whether a request that names no engine is refused. Both read through the cache's checked
descriptors (:meth:`transformd.cache.Cache.open_source`) and never fail a request themselves: a source that cannot
be read is reported by the request's own checks and its conversion, as before."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..cache.securefs import reading_as
from ..checkpoint.layout import Layout

if TYPE_CHECKING:
    from .fscreds import Reader

__all__ = ["source_layout_of", "unnamed_refusal_of"]


def unnamed_refusal_of(cache: Any, source: str, reader: Reader) -> str | None:
    """Blocking: :func:`transformd.request.unnamed_refusal` of ``source``, read for ``reader`` (a source it may not
    read: None, its own checks refuse it)."""
    from ..request import unnamed_refusal

    with reading_as(reader):
        return unnamed_refusal(cache, source, allow=lambda facts: reader.denied(facts) is None)


def source_layout_of(cache: Any, source: str, engine: str | None, reader: Reader) -> Layout:
    """Blocking: :func:`transformd.checkpoint.plan.source_layout` of ``source``, read for ``reader`` (as-is when it
    cannot be read, or the caller may not read it: the request's own checks say why)."""
    from ..checkpoint.plan import source_layout

    try:
        with reading_as(reader), cache.open_source(source) as tree:
            if reader.denied(tree.facts()) is not None:
                return Layout.AS_IS
            return source_layout(tree.view(), engine)
    except Exception:
        return Layout.AS_IS
