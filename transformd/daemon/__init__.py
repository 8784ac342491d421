"""The transformd daemon: its HTTP API, server side (the client is :mod:`transformd.client`).

Run it with ``transformd serve`` (see :mod:`transformd.cli.serve`, :mod:`.settings`). It listens on a unix socket
(0660) by default; TCP (``--port``) requires a bearer token. Sources must lie under an allowed root.

Endpoints (JSON; errors are ``{"error": {"status", "code", "message"}}``, codes in :mod:`.errors`)::

    POST   /v1/checkpoints                      {source, target, scale_mode, select}
                                                -> 200 ready entry | 202 queued/converting (single flight)
    GET    /v1/checkpoints/{key}                state, progress, error, path (ready)
    DELETE /v1/checkpoints/{key}                204 | 409 leased or converting | 404
    GET    /v1/checkpoints/{key}/files          {"files": [{name, path, final_path, size, digest, ready,
                                                 tensors: {NAME: {dtype, shape, offsets: [begin, end]}}}]}
    GET    /v1/checkpoints/{key}/files/{name}   metadata of one file (not its bytes); 202 while not written
                                                (moves it to the front)
    POST   /v1/checkpoints/{key}/leases         {ttl_s, holder} -> 201 {id, key, expires_at}
    DELETE /v1/checkpoints/{key}/leases/{id}    204
    GET    /v1/cache                            root, usage_bytes, budget_bytes, free_bytes, entries
    GET    /healthz                             {status, version, cache_root, device}
    GET    /metrics                             Prometheus text

The OpenAPI schema is served at ``/openapi.json`` (and ``/docs``).

Modules (server): :mod:`.settings` (flags and ``TRANSFORMD_*``), :mod:`.server` (sockets, uvicorn),
:mod:`.app` (routes), :mod:`.state` (what the routes share: callers, grants, gauges), :mod:`.service` (jobs,
queue, workers), :mod:`.shards` (shard priority and the converter adapter), :mod:`.files` (tensor tables),
:mod:`.views` (state bodies), :mod:`.paths` (allowed roots), :mod:`.middleware` (token, body limit),
:mod:`.errors`, :mod:`.metrics`, :mod:`.schemas`. A daemon in a thread, for tests: tests/support/daemon.py.

Nothing here is imported eagerly: a client that imports ``transformd.client`` does not load
FastAPI or uvicorn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .server import serve
    from .settings import Settings, default_socket_path

__all__ = ["Settings", "create_app", "default_socket_path", "serve"]

_LAZY = {
    "create_app": ".app",
    "serve": ".server",
    "Settings": ".settings",
    "default_socket_path": ".settings",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
