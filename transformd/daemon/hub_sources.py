"""Repo ids as sources: a repo id looked up in the daemon's hub cache for a caller (who must be able to search that
cache itself), and which repo id each key was asked for by (its ``/files`` says so)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from .errors import ApiError, error_for_exception
from .peers import path_denied, unreadable

if TYPE_CHECKING:
    from .fscreds import Reader
    from .state import Daemon



async def hub_source(d: Daemon, source: str, revision: str | None, reader: Reader, *, recipes: Sequence[Any] = ()
                     ) -> tuple[dict[str, Any], tuple[str, dict[str, Any], Any] | None]:
    """``({"hub": {repo_id, revision, commit, snapshot}}, None)`` when ``source`` is a repo id (looked up in a source
    thread: 400 malformed, 403 hub cache not an allowed root or not one the caller may search, 404 not cached);
    ``({}, None)`` for a path. The lookup reads the hub cache as the caller (``reader``: its own credentials, or the
    daemon's with every link and the snapshot checked for the caller first); whatever lies where the caller cannot
    look is the one 403, whether or not something is there. With a remote tier and ``recipes``, a repo id at a full
    commit that is not cached here gives ``(hub, (key, hub, recipe))`` when the tier's alias record of one of them
    (the first that has one) names its entry (:func:`hub_alias`)."""
    if d.hub is None or not d.hub.wants(source, revision):
        return {}, None
    hub, caller = d.hub, reader.caller

    def look_up() -> Any:  # (what the hub cache holds is told only to a caller who could search it)
        if not reader.kernel and (missing := path_denied(caller, str(hub.cache_dir), listed=False)) is not None:
            raise unreadable(caller, source, missing)
        try:
            if reader.kernel:
                with reader.opening():
                    os.stat(hub.cache_dir)  # (the way to it: the caller's to search)
            return hub.resolve(source, revision, opening=reader.opening,
                               hidden=None if reader.kernel else lambda path: reader.hides(path) is not None)
        except PermissionError:
            raise reader.refusal(source, None if reader.kernel else "search permission on a directory above the "
                                 "source") from None
        except FileNotFoundError:
            return hub.resolve(source, revision, opening=reader.opening)  # (the hub cache is missing: it says so)

    try:
        found = await anyio.to_thread.run_sync(look_up, limiter=d.service.source_limiter())
    except ApiError:
        raise
    except Exception as e:
        err = error_for_exception(e)
        if (aliased := await hub_alias(d, source, revision, recipes, err)) is None:
            raise err from e
        return aliased[1], aliased
    return {"hub": found.as_dict()}, None


#: Longest a request waits for the tier's alias record of a repo id (a bucket answers in milliseconds; one that does
#: not answer costs a request this much at most, and none once that holds the tier off): well inside a client's
#: request timeout.
ALIAS_WAIT_S = 5.0

T = TypeVar("T")


async def _asking_tier(d: Daemon, ask: Callable[[], T], otherwise: T) -> T:
    """``ask()``, a lookup in the tier, in a worker thread, waited for :data:`ALIAS_WAIT_S` at most: then
    ``otherwise``, and the tier is held off for a while (the lookup's own failure is counted and logged when it
    ends)."""
    with anyio.move_on_after(ALIAS_WAIT_S):
        return await anyio.to_thread.run_sync(ask, abandon_on_cancel=True, limiter=d.service.source_limiter())
    if d.service.tier is not None:  # (the next requests do not wait for it again)
        d.service.tier.no_answer("alias lookup", ALIAS_WAIT_S)
    return otherwise


async def hub_alias(d: Daemon, source: str, revision: str | None, recipes: Sequence[Any], error: ApiError
                    ) -> tuple[str, dict[str, Any], Any] | None:
    """With a remote tier, a repo id at a full commit that the hub cache does not hold (``error``: hub_source's 404,
    so the caller may search the hub cache): the key of the tier's alias record of the first of ``recipes`` that has
    one, the answer's ``hub`` (no snapshot) and that recipe; None otherwise (the caller raises ``error``), also when
    the tier does not answer within :data:`ALIAS_WAIT_S`."""
    from ..hub import is_full_commit, is_repo_id

    tier = d.service.tier
    if (tier is None or error.status != 404 or revision is None
            or not is_full_commit(revision) or not is_repo_id(source, paths_exist=False)):
        return None

    def first_alias() -> tuple[str, Any] | None:
        for recipe in recipes:
            key = tier.alias_key(source, revision, recipe)
            if key is not None:
                return key, recipe
        return None

    found = await _asking_tier(d, first_alias, None)  # (None: the hub's own error, as without a tier)
    if found is None:
        return None
    key, recipe = found
    return key, {"hub": {"repo_id": source, "revision": revision, "commit": revision, "snapshot": None}}, recipe


async def key_first(d: Daemon, identity: Any, hub: dict[str, Any], recipe: Any) -> bool:
    """:func:`transformd.request.key_first` for a request, waited for :data:`ALIAS_WAIT_S` at most (then False: the
    source is converted while hashed)."""
    from ..request import key_first as rule

    return await _asking_tier(d, lambda: rule(d.service.tier, identity, alias_of(hub), recipe), False)


def alias_of(hub: dict[str, Any]) -> tuple[str, str] | None:
    """The repo id and full commit a request named (``hub_source``'s answer), recorded with its entry in the tier."""
    found = hub.get("hub") if hub else None
    if isinstance(found, dict) and found.get("repo_id") and found.get("commit"):
        return str(found["repo_id"]), str(found["commit"])
    return None


def remember_hub(d: Daemon, key: str, hub: dict[str, Any]) -> None:
    """Remember the repo id ``key`` was asked for by, for its ``/files``."""
    if hub:
        if len(d.hub_origins) > 4096:
            d.hub_origins.clear()
        d.hub_origins[key] = hub


def with_hub(body: bytes | None, d: Daemon, key: str) -> bytes | None:
    """A serialised ``/files`` body with the repo id its key was asked for by, if any."""
    hub = d.hub_origins.get(key)
    if not hub or body is None:
        return body
    return json.dumps({**json.loads(body), **hub}, separators=(",", ":")).encode()
