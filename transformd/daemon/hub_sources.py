"""Repo ids as sources: a repo id looked up in the daemon's hub cache for a caller (who must be able to search that
cache itself), and which repo id each key was asked for by (its ``/files`` says so)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import anyio

from .errors import ApiError, error_for_exception
from .peers import Caller, path_denied, unreadable

if TYPE_CHECKING:
    from .state import Daemon


async def hub_source(d: Daemon, source: str, revision: str | None, caller: Caller) -> dict[str, Any]:
    """``{"hub": {repo_id, revision, commit, snapshot}}`` when ``source`` is a repo id (looked up in a source
    thread: 400 malformed, 403 hub cache not an allowed root or not one the caller may search, 404 not cached);
    ``{}`` for a path."""
    if d.hub is None or not d.hub.wants(source, revision):
        return {}
    hub = d.hub

    def look_up() -> Any:  # (what the hub cache holds is told only to a caller who could search it)
        if (missing := path_denied(caller, str(hub.cache_dir), listed=False)) is not None:
            raise unreadable(caller, source, missing)
        return hub.resolve(source, revision)

    try:
        found = await anyio.to_thread.run_sync(look_up, limiter=d.service.source_limiter())
    except ApiError:
        raise
    except Exception as e:
        raise error_for_exception(e) from e
    return {"hub": found.as_dict()}


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
