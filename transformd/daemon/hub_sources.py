"""Repo ids as sources: a repo id looked up in the daemon's hub cache for a caller (who must be able to search that
cache itself), and which repo id each key was asked for by (its ``/files`` says so)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import anyio

from .errors import ApiError, error_for_exception
from .peers import path_denied, unreadable

if TYPE_CHECKING:
    from .fscreds import Reader
    from .state import Daemon


async def hub_source(d: Daemon, source: str, revision: str | None, reader: Reader) -> dict[str, Any]:
    """``{"hub": {repo_id, revision, commit, snapshot}}`` when ``source`` is a repo id (looked up in a source
    thread: 400 malformed, 403 hub cache not an allowed root or not one the caller may search, 404 not cached);
    ``{}`` for a path. The lookup reads the hub cache as the caller (``reader``: its own credentials, or the daemon's
    with every link and the snapshot checked for the caller first); whatever lies where the caller cannot look is
    the one 403, whether or not something is there."""
    if d.hub is None or not d.hub.wants(source, revision):
        return {}
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
