"""The daemon's reads of a request's source before a job exists: its plan and the engines' readiness of the output
(headers only), and the real path of a source served as it is; and the refusal of an
engine that would load the output wrong. Blocking: each runs in a source thread, opening the source through checked
descriptors for the request's :class:`~transformd.daemon.fscreds.Reader`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import request
from ..cache import Recipe, SourceIdentity
from ..cache.securefs import reading_as
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
