"""ASGI middleware: bearer-token check for TCP listeners, request body limit, request counting.

Requests that arrive on the daemon's own unix socket are trusted (the socket's permissions, 0660,
decide who may connect); every other request must carry ``Authorization: Bearer <token>``, compared
in constant time. A listener the middleware cannot identify is treated as TCP (fail closed).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import anyio

from .metrics import Metrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Largest request body accepted (every request body is a small JSON object).
MAX_BODY_BYTES = 64 * 1024


async def _send_error(send: Send, status: int, code: str, message: str, headers: Iterable[tuple[bytes, bytes]] = ()):
    body = json.dumps({"error": {"status": status, "code": code, "message": message}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class BearerAuth:
    """401 for requests not from ``unix_paths`` without the right ``Authorization: Bearer`` token."""

    def __init__(self, app: ASGIApp, token: bytes, unix_paths: Iterable[str] = ()):
        self.app = app
        self._token_digest = _digest(token)
        self.unix_paths = frozenset(unix_paths)

    def _valid(self, header: bytes | None) -> bool:
        """``Bearer <token>`` (scheme case-insensitive), the token compared in constant time.

        Both sides are SHA-256 digests, so ``hmac.compare_digest`` always compares 32 bytes with 32 bytes: its time
        depends neither on where the given token first differs nor on its length (comparing the raw tokens would
        return at once on a length mismatch, telling an attacker the token's length).
        """
        scheme, _, given = (header or b"").strip().partition(b" ")
        ok = hmac.compare_digest(_digest(given.strip()), self._token_digest)
        return ok and scheme.lower() == b"bearer"

    def _trusted(self, scope: Scope) -> bool:
        server = scope.get("server")
        return (
            isinstance(server, (tuple, list))
            and len(server) == 2
            and server[1] is None
            and str(server[0]) in self.unix_paths
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._trusted(scope):
            await self.app(scope, receive, send)
            return
        given = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        if not self._valid(given):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 4401})
                return
            problem = "missing" if not given else "wrong"
            await _send_error(
                send,
                401,
                "unauthorized",
                f"{problem} bearer token: TCP clients must send 'Authorization: Bearer <token>' with the token "
                "from the daemon's --token-file (or use the unix socket)",
                [(b"www-authenticate", b'Bearer realm="transformd"')],
            )
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for request bodies above ``limit`` bytes (declared or streamed); 408 (and close) for one not all
    received within ``timeout_s`` of the headers (a body sent a byte at a time would hold its connection, and one
    uid's many such its share of them, for good)."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES, timeout_s: float = 10.0):
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"request body larger than {self.limit} bytes; requests are small JSON objects"
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = self.limit + 1
                if declared > self.limit:
                    await _send_error(send, 413, "body_too_large", message)
                    return
        # Read the whole body here (bodies are small JSON objects): a streamed (chunked) body past the limit is a
        # 413 before the app sees anything; the app's own body parser would turn any error into a 400.
        chunks: list[bytes] = []
        received = 0
        with anyio.move_on_after(self.timeout_s) as deadline:
            while True:
                msg = await receive()
                if msg["type"] != "http.request":  # the client went away
                    return
                chunk = msg.get("body", b"")
                received += len(chunk)
                if received > self.limit:
                    await _send_error(send, 413, "body_too_large", message, [(b"connection", b"close")])
                    return
                chunks.append(chunk)
                if not msg.get("more_body", False):
                    break
        if deadline.cancelled_caught:
            await _send_error(send, 408, "request_timeout", f"request body not received within {self.timeout_s:g} s",
                              [(b"connection", b"close")])
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


#: The methods HTTP defines (RFC 9110, and PATCH): the label values of a request's method.
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


class RequestCounter:
    """Counts responses in ``transformd_http_requests_total`` by method (``other`` for a method HTTP does not
    define: an attack review grew /metrics to 120 MB with 1,000 made-up 60 kB ones), route template and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_status(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                status[0] = int(msg["status"])
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method")  # any token is a method to uvicorn: each would be a series kept for ever
            method = method if method in _METHODS else "other"
            self.metrics.requests.labels(method, template, str(status[0])).inc()
