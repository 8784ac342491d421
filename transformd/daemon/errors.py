"""Errors of the HTTP API: one JSON shape, and the mapping from the library's exceptions to status codes.

Every error response is ``{"error": {"status": int, "code": str, "message": str}}``; the message says what
to do. Client mistakes are 4xx, never 500:

=====  =====================================================================================
400    bad request: malformed JSON, unknown or missing fields, unknown target, bad key or lease id
401    missing or wrong bearer token (TCP listener)
403    source outside the allowed roots (also through a symlink), or unreadable by the daemon
404    unknown key, file, lease, or source directory; a repo id not in the hub cache (repo_not_cached)
409    conflict: entry leased (delete), conversion in progress (delete, lease), source changed
413    request body too large
422    invalid checkpoint (the message names the file, the tensor and the problem); a select RE2 cannot compile
502    a repo id could not be downloaded (``--allow-download`` only)
503    conversion queue full, daemon shutting down, cache directory unusable
507    the cache cannot hold the conversion (budget or disk full)
=====  =====================================================================================
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import MAX_MESSAGE_CHARS, TransformdError

log = logging.getLogger("transformd.daemon")



class ApiError(TransformdError):
    """The daemon's answer to a failed request: HTTP status, a stable machine-readable code and a message for a
    person. Raised by the routes for problems of the request itself; every other error becomes one through
    :func:`error_for_exception`."""

    def __init__(self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None):
        super().__init__(message[:MAX_MESSAGE_CHARS])
        self.status = status
        self.code = code
        self.headers = headers

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"status": self.status, "code": self.code, "message": self.message}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body()}, status_code=self.status, headers=self.headers)


def error_for_exception(exc: BaseException) -> ApiError:
    """The API error for an exception raised while identifying, validating or converting a checkpoint.

    transformd's own errors say their status, code and message themselves (:mod:`transformd.errors`); an
    ``OSError`` is an I/O failure (403 for a permission), anything else a 500 that points at the log.
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, TransformdError):
        return ApiError(exc.api_status(), exc.api_code(), exc.api_message())
    if isinstance(exc, PermissionError):
        return ApiError(403, "permission_denied", f"the daemon may not read {exc.filename or 'a file'}: {exc.strerror}")
    if isinstance(exc, OSError):
        return ApiError(
            500, "io_error", f"I/O error{f' on {exc.filename}' if exc.filename else ''}: {exc.strerror or exc}"
        )
    return ApiError(500, "internal_error", f"{type(exc).__name__}: {exc}; see the daemon's log")


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:10]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('msg')}"
        if err.get("type") in ("model_attributes_type", "dict_type") and loc == "body":
            return "bad request: the body must be a JSON object sent with content-type application/json"
        parts.append(f"{loc}: {err.get('msg')}")
    return "bad request: " + "; ".join(parts)


def _allowed_methods(request: Request) -> list[str]:
    """The methods of every route whose path matches the request's (a path served by several routes)."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "\0"})  # a method no route has: path matches only
        if match != Match.NONE and getattr(route, "methods", None):
            methods |= set(route.methods)
    return sorted(methods)


#: Characters of a request's source that a log line quotes.
_LOGGED_SOURCE_CHARS = 300
#: Largest body whose ``source`` a log line quotes (a request's body is a few hundred bytes).
_LOGGED_BODY_BYTES = 64 * 1024


def _source_given(request: Request) -> str | None:
    """The ``source`` of the request's JSON body as the caller gave it, when the route read the body (starlette keeps
    a body it received on the request; one never received is not waited for here)."""
    body = getattr(request, "_body", None)
    if not body or len(body) > _LOGGED_BODY_BYTES:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # (a body nested past the parser's depth is refused too: no source said)
        return None
    source = data.get("source") if isinstance(data, dict) else None
    return source[:_LOGGED_SOURCE_CHARS] if isinstance(source, str) else None


def log_refusal(request: Request, error: ApiError) -> None:
    """One line per refused or failed request (status, code, caller uid, source as given), at the default level: an
    operator sees in the log why an engine's resolve failed (only "converted" lines appeared). 5xx are warnings."""
    daemon = getattr(request.app.state, "daemon", None)
    try:
        uid = daemon.caller(request).uid if daemon is not None else None
    except Exception:  # (the line is worth more than the uid)
        uid = None
    source = _source_given(request)
    path = request.url.path if len(request.url.path) <= 200 else request.url.path[:200] + "..."
    (log.warning if error.status >= 500 else log.info)(
        "refused %s %s: %d %s, uid %s%s: %s", request.method, path, error.status, error.code,
        "unknown" if uid is None or uid < 0 else uid, "" if source is None else f", source {source!r}", error.message)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error, including FastAPI's own, a JSON error object (validation errors are 400, not 422); each is
    one line of the daemon's log (:func:`log_refusal`)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        log_refusal(request, exc)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = ApiError(400, "bad_request", _validation_message(exc))
        log_refusal(request, error)
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = str(exc.detail)
        path = request.url.path if len(request.url.path) <= 200 else request.url.path[:200] + "..."
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {path}; see /docs or /openapi.json"
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            allowed = _allowed_methods(request)
            if allowed:  # every method of the path (starlette names only the first route's)
                headers["Allow"] = ", ".join(allowed)
            message = f"{request.method} is not allowed on {path} (allowed: {headers.get('Allow', '?')}); " \
                "see /docs or /openapi.json"
        error = ApiError(exc.status_code, code, message, headers=headers or None)
        log_refusal(request, error)
        return error.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_for_exception(exc).response()
