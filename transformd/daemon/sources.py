"""The daemon's reads of a request's source before a job exists: its plan and the engines' readiness of the output
(headers only), the layout of ``--engine sglang``'s output, whether a request that names no engine is refused (from
config.json and the tensor names), and the real path of a source served as it is; and the refusal of an engine that
would load the output wrong. Blocking: each runs in a source thread, opening the source through checked descriptors
for the request's :class:`~transformd.daemon.fscreds.Reader`. The layout and the no-engine check never fail a
request themselves: a source that cannot be read is reported by the request's own checks and its conversion."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import request
from ..cache import Cache, Recipe, SourceIdentity
from ..cache.securefs import reading_as
from ..checkpoint.layout import Layout
from ..engines import unnamed_refusal
from .errors import ApiError, error_for_exception
from .peers import unreadable

if TYPE_CHECKING:
    from .fscreds import Reader
    from .state import Daemon


def plan_readiness(d: Daemon, source: str, recipe: Recipe, reader: Reader, *, identity: SourceIdentity | None,
                    slot: str | None) -> tuple[Any, dict[str, Any]]:
    """Blocking: the plan of ``source`` (:func:`transformd.request.plan`: headers only, the files the request
    identified, by ``identity`` or ``slot``, opened for ``reader``) and the readiness of the output a conversion
    would write; 403 unless the caller could read the files opened now (the path may name others by then)."""
    caller = reader.caller

    def allow(facts: Any) -> None:
        missing = reader.denied(facts)
        if missing is not None:
            raise unreadable(caller, source, str(missing))

    try:
        with reading_as(reader):
            planned = request.plan(d.cache, source, recipe, identity=identity, slot=slot, allow=allow)
    except ApiError:
        raise
    except Exception as e:
        raise error_for_exception(e) from e
    return planned, {name: r.as_dict() for name, r in request.readiness(planned, recipe).items()}


def readable_source(d: Daemon, source: str, reader: Reader) -> str:
    """Blocking: the real path of ``source`` when it lies under the allowed roots and the caller could read every
    file of it (as for a conversion; nothing is hashed)."""
    caller = reader.caller
    try:
        d.policy.check_allowed(source)
        with reading_as(reader), d.cache.open_source(source) as tree:  # SourcePolicy.resolve's checks, the caller's
            missing = reader.denied(tree.facts())
            real = tree.real
    except ApiError:
        raise
    except Exception as e:
        raise error_for_exception(e) from e
    if missing is not None:
        raise unreadable(caller, source, missing)
    return real


def check_engine(report: dict[str, Any] | None, engine: str | None) -> None:
    """422 when ``engine`` could not load the checkpoint at any tensor-parallel size; with no engine named, when an
    engine would load it wrong without an error (``engine_needed``: name the engine, or ``raw``)."""
    if engine is None and report is not None:
        refusal = unnamed_refusal(report)
        if refusal is not None:
            raise ApiError(422, "engine_needed", refusal)
    r = report.get(engine) if engine is not None and report is not None else None
    if r is not None and not (r["loads_at"] or r.get("may_load_at")):
        raise ApiError(
            422,
            "engine_cannot_load",
            f"{engine} could not load the converted checkpoint at any tensor-parallel size: "
            + "; ".join(r["problems"][:3]),
        )


def unnamed_refusal_of(cache: Cache, source: str, reader: Reader) -> str | None:
    """Blocking: :func:`transformd.request.unnamed_refusal` of ``source``, read for ``reader`` (a source it may not
    read: None, its own checks refuse it)."""
    with reading_as(reader):
        return request.unnamed_refusal(cache, source, allow=lambda facts: reader.denied(facts) is None)


def source_layout_of(cache: Cache, source: str, engine: str | None, reader: Reader) -> Layout:
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
