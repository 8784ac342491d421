"""A small synchronous client for the transformd daemon (httpx, over a unix socket or loopback TCP).

This is what an engine's start-up hook uses::

    from transformd.client import TransformdClient

    with TransformdClient() as td:                       # $TRANSFORMD_SOCKET, ... (see below)
        path = td.resolve("/models/X", target="ocp")     # waits for the conversion; a Path
        entry = td.status(td.last_key)                   # or any key: state, progress, error
        with td.lease(entry.key, ttl_s=3600, holder="vllm-0"):
            ...                                          # the entry cannot be evicted meanwhile

Transport, first that applies:

* ``url=`` (``http://127.0.0.1:PORT``): TCP, with ``Authorization: Bearer <token>``; the token is
  ``token=``, else the first line of ``token_file=``, else of ``$TRANSFORMD_TOKEN_FILE``;
* ``socket=`` (a path): that unix socket;
* ``$TRANSFORMD_SOCKET``;
* ``$XDG_RUNTIME_DIR/transformd.sock`` when it exists (or when ``/run/transformd/transformd.sock``
  does not), else ``/run/transformd/transformd.sock``.

Every failure is a :class:`~transformd.errors.TransformdError` carrying ``status`` (the HTTP status, or
``None`` when the daemon could not be reached), ``code`` (the daemon's error code) and ``message`` (one
line a person can act on). The classes are those of :mod:`transformd.errors`, the same the library and the
daemon raise, so callers ``except`` them by case (``CacheFullError``, ``InvalidCheckpointError``, ...).

This module imports no torch (and nothing of the daemon): engines call it at every start.
"""

from __future__ import annotations

import os
import socket as _socket
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import (
    BadRequestError,
    CacheFullError,
    ConflictError,
    ConversionFailedError,
    DaemonUnavailableError,
    InvalidCheckpointError,
    NotAllowedError,
    NotFoundError,
    ResolveTimeoutError,
    ServerError,
    TransformdError,
    UnauthorizedError,
    error_class,
)
from .answers import CheckpointStatus, LeaseInfo, ShardFile, TensorEntry
from ._lazy import import_httpx  # httpx is imported where a client is made and used, without its command line
from .progress import Progress

if TYPE_CHECKING:
    import httpx

__all__ = [
    "DEFAULT_RECONNECT_S", "DEFAULT_SOCKET", "ENV_SOCKET", "ENV_TOKEN_FILE", "BadRequestError", "CacheFullError",
    "CheckpointStatus", "ConflictError", "ConversionFailedError", "DaemonUnavailableError", "NotAllowedError",
    "InvalidCheckpointError", "LeaseInfo", "NotFoundError", "Progress", "ResolveTimeoutError", "ServerError",
    "ShardFile", "TensorEntry", "TransformdClient", "TransformdError", "UnauthorizedError", "default_socket_path",
    "error_for_status",
]

ENV_SOCKET = "TRANSFORMD_SOCKET"
ENV_TOKEN_FILE = "TRANSFORMD_TOKEN_FILE"
#: The system-wide socket (the sidecar's); a per-user daemon listens in $XDG_RUNTIME_DIR instead.
DEFAULT_SOCKET = "/run/transformd/transformd.sock"
_SOCKET_NAME = "transformd.sock"
#: Host name used in URLs sent over a unix socket (httpx needs one; the daemon ignores it).
_UDS_BASE_URL = "http://transformd"
#: Seconds :meth:`TransformdClient.resolve` waits, by default, for a daemon that went away mid-conversion.
DEFAULT_RECONNECT_S = 60.0
#: Bytes of one answer the client reads at the most: a daemon's (or whatever listens there) larger answer is a
#: ServerError, not a process grown without bound. A legitimate answer is far smaller: the tensor table of a
#: 1T-parameter MoE (``/files``; 61 layers of 384 experts, 140k tensors with their scales) is 18 MiB.
MAX_ANSWER_BYTES = 256 << 20
#: Error codes of a conversion the daemon cancelled because it was stopping (not a failure of the checkpoint).
_DAEMON_STOPPING_CODES = frozenset({"cancelled", "shutting_down"})
_API = "/v1"


def error_for_status(status: int, message: str, code: str | None = None) -> TransformdError:
    """The error the client raises for the daemon's answer: its class by HTTP status (:mod:`transformd.errors`),
    the daemon's ``code`` and ``message`` on it."""
    return error_class(status).from_answer(message, status=status, code=code)


# ---------------------------------------------------------------------------------------------------------------------
# Where the daemon is


def default_socket_path(
    environ: Mapping[str, str] | None = None, *, explicit: str | os.PathLike[str] | None = None,
    listening: bool = False,
) -> Path:
    """The daemon's unix socket: ``explicit`` > ``$TRANSFORMD_SOCKET`` > ``$XDG_RUNTIME_DIR/transformd.sock`` >
    ``/run/transformd/transformd.sock``; the one rule for the daemon (``listening``) and its clients.

    A client skips ``$XDG_RUNTIME_DIR`` when no socket is there but the system-wide one exists, so a user
    session on a node whose daemon is the system one (or a sidecar's) still finds it; a daemon listens there. It
    also skips one that is not its own user's (an ``XDG_RUNTIME_DIR`` inherited through ``su`` or ``sudo -E``):
    whoever owns that directory could answer there with any path (an attack review's fake daemon did). And it
    takes a socket there only from a uid it trusts (:func:`trusted_socket`): where the directory lets others write
    (a world-writable sticky one, say), a socket another uid planted is skipped for the system-wide one, and
    refused (:class:`~transformd.errors.NotAllowedError`) where there is none.
    """
    env = os.environ if environ is None else environ
    chosen = explicit if explicit is not None and os.fspath(explicit) != "" else env.get(ENV_SOCKET)
    if chosen:
        return Path(chosen).expanduser().absolute()
    system = Path(DEFAULT_SOCKET)
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        user = Path(runtime) / _SOCKET_NAME
        theirs = os.path.isdir(runtime) and os.stat(runtime).st_uid != os.geteuid()
        if listening:
            return user
        if not theirs and (user.exists() or not system.exists()):
            planter = untrusted_owner(user)
            if planter is None:
                return user
            if not system.exists():
                raise NotAllowedError(
                    f"the socket {user} belongs to uid {planter}, neither you (uid {os.geteuid()}) nor root, in a "
                    f"directory others may write: whoever planted it would answer with paths of his choosing; not "
                    f"used (name a socket you trust with ${ENV_SOCKET} or socket=)")
    return system


def untrusted_owner(path: Path) -> int | None:
    """The owner of the socket at ``path`` when a client should not trust it, else None: one of another uid than
    the caller's and root's, in a directory that others than its owner may write (a world-writable sticky
    ``XDG_RUNTIME_DIR``: anyone may plant a socket there and answer as the daemon). Nothing at ``path``: None (the
    connection fails with its own message)."""
    try:
        st = os.lstat(path)
        parent = os.stat(path.parent)
    except OSError:
        return None
    if st.st_uid in (os.geteuid(), 0) or not parent.st_mode & 0o022:
        return None
    return st.st_uid


def _read_token_file(path: str | os.PathLike[str]) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise TransformdError(f"cannot read the token file {path}: {err.strerror or err}") from err
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not token:
        raise TransformdError(f"the token file {path} is empty")
    return token


def _parsed(response: httpx.Response) -> Any:
    """The answer's JSON; a ValueError for anything that is not JSON a client can take, also JSON nested deeper than
    the parser's recursion limit (a 20,000-deep answer was a RecursionError out of every call)."""
    try:
        return response.json()
    except RecursionError as err:
        raise ValueError("JSON nested too deeply") from err


def _default_holder() -> str:
    return f"{_socket.gethostname()}:{os.getpid()}"


# ---------------------------------------------------------------------------------------------------------------------
# The client


class TransformdClient:
    """Synchronous client of the transformd HTTP API (``/v1``). Use as a context manager, or call :meth:`close`.

    ``timeout`` bounds each HTTP request (connect, read), not :meth:`resolve`'s wait for a conversion,
    which has its own ``timeout``. ``transport`` replaces the one built from ``socket``/``url``
    (tests, or a custom httpx transport).
    """

    def __init__(
        self,
        socket: str | os.PathLike[str] | None = None,
        url: str | None = None,
        token: str | None = None,
        *,
        token_file: str | os.PathLike[str] | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        httpx = import_httpx()
        headers = {"Accept": "application/json", "User-Agent": "transformd-client"}
        if url is not None:
            if token is None:
                token_file = token_file or os.environ.get(ENV_TOKEN_FILE) or None
                token = _read_token_file(token_file) if token_file else None
            self.socket: Path | None = None
            self.url = url.rstrip("/")
            try:
                httpx.URL(self.url)
            except httpx.InvalidURL as err:  # (else httpx's traceback at the first request)
                raise BadRequestError(f"not a URL: {url!r} ({err})") from err
            base_url = self.url
            transport = transport or httpx.HTTPTransport(retries=0)
        else:
            self.socket = Path(socket) if socket is not None else default_socket_path()
            self.url = None
            base_url = _UDS_BASE_URL
            # Plain HTTP over a local socket: no TLS context to build (that alone costs ~17 ms a client).
            transport = transport or httpx.HTTPTransport(uds=str(self.socket), verify=False)
            if token is None and token_file is not None:
                token = _read_token_file(token_file)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.timeout = timeout
        #: Key of the last checkpoint :meth:`submit`/:meth:`resolve` asked for.
        self.last_key: str | None = None
        self._http = httpx.Client(
            base_url=base_url, transport=transport, headers=headers, timeout=timeout, verify=self.url is not None
        )

    # -- plumbing --------------------------------------------------------------------------------------------------

    @property
    def where(self) -> str:
        """The daemon's address as a person reads it (for messages)."""
        return self.url if self.url is not None else f"unix socket {self.socket}"

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        ok: tuple[int, ...] = (200,),
        timeout: httpx.Timeout | None = None,
    ) -> httpx.Response:
        httpx = import_httpx()
        try:
            if timeout is None:
                request = self._http.build_request(method, path, json=json)
            else:
                request = self._http.build_request(method, path, json=json, timeout=timeout)
            response = self._http.send(request, stream=True)
            try:
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > MAX_ANSWER_BYTES:
                        raise ServerError.from_answer(
                            f"transformd at {self.where} answered {method} {path} with more than "
                            f"{MAX_ANSWER_BYTES >> 20} MiB: not read", status=response.status_code, code=None)
            finally:
                response.close()
            headers = [(k, v) for k, v in response.headers.multi_items()
                       if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
            response = httpx.Response(response.status_code, headers=headers, content=b"".join(chunks), request=request)
        except httpx.TimeoutException as err:
            raise DaemonUnavailableError(f"transformd at {self.where} did not answer {method} {path} in time: "
                                         f"{err or type(err).__name__}") from err
        except (httpx.TransportError, OSError) as err:
            hint = ""
            if self.socket is not None and not self.socket.exists():
                hint = f"; no socket at {self.socket}: is 'transformd serve' running? (--socket, ${ENV_SOCKET})"
            elif self.socket is not None and isinstance(err, ConnectionRefusedError | httpx.ConnectError):
                hint = f"; nothing listens on {self.socket} (a stopped daemon's?): is 'transformd serve' running?"
            raise DaemonUnavailableError(f"cannot reach transformd at {self.where}: {err}{hint}") from err
        if response.status_code not in ok:
            raise self._error(response)
        return response

    @staticmethod
    def _error(response: httpx.Response) -> TransformdError:
        status, code, message = response.status_code, None, None
        try:
            body = _parsed(response)
        except ValueError:
            body = None
        if isinstance(body, Mapping):
            err = body.get("error")
            if isinstance(err, Mapping):
                code = err.get("code")
                message = err.get("message")
            elif "detail" in body:  # FastAPI's own errors (e.g. request validation) before the app's handler
                message = body["detail"] if isinstance(body["detail"], str) else str(body["detail"])
        if not message:
            message = response.text.strip()[:500] or response.reason_phrase or "request failed"
        error = error_for_status(status, message, code)
        try:
            error.retry_after = float(response.headers["retry-after"])
        except (KeyError, ValueError):
            pass
        return error

    @staticmethod
    def _json(response: httpx.Response, build: Callable[[dict[str, Any]], Any] | None = None) -> Any:
        """The answer's JSON object, or ``build(it)``: anything else (not JSON, not an object, a field missing or of
        another type) is the daemon's fault, a ServerError in one line (it was an AttributeError's traceback)."""
        where = response.request.url.path
        try:
            data = _parsed(response)
        except ValueError as err:
            raise ServerError.from_answer(f"transformd answered {where} with non-JSON: {response.text[:200]!r}",
                                          status=response.status_code, code=None) from err
        try:
            if not isinstance(data, dict):
                raise TypeError(f"not a JSON object but {type(data).__name__}")
            return data if build is None else build(data)
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError, RecursionError) as err:
            raise ServerError.from_answer(f"transformd answered {where} with a malformed answer "
                                          f"({type(err).__name__}: {str(err)[:200]})",
                                          status=response.status_code, code=None) from err

    # -- checkpoints -----------------------------------------------------------------------------------------------

    def submit(
        self,
        source: str | os.PathLike[str],
        *,
        target: str = "auto",
        scale_mode: str = "exact",
        select: str | None = None,
        wait_s: float | None = None,
        engine: str | None = None,
        revision: str | None = None,
    ) -> CheckpointStatus:
        """``POST /v1/checkpoints`` once: the entry when cached (state ``ready``), else its queued/converting state.

        ``source`` is made absolute here (the daemon knows nothing of this process's working
        directory); symlinks are left for the daemon to resolve and check against its allowed roots.

        The daemon answers once it has identified the source's content, which for a large checkpoint
        seen for the first time means reading it (minutes for hundreds of GB): the answer is waited
        for ``wait_s`` seconds (``None``: as long as it takes; connecting is still bounded by the
        client's ``timeout``).

        ``target`` ``auto`` lets the daemon choose for ``engine`` (vllm, sglang, transformers, raw) and its GPU; on
        a GPU with native MX instructions the answer is the source itself (``key`` ``passthrough``).

        A Hugging Face repo id (``org/Model``, :func:`transformd.hub.is_repo_id`: not a path here) is sent as it
        is, with ``revision``: the daemon looks it up in its hub cache.
        """
        from .hub import is_repo_id

        body = {
            "source": source if is_repo_id(source) else os.path.abspath(os.path.expanduser(os.fspath(source))),
            "target": str(getattr(target, "value", target)),
            "scale_mode": str(getattr(scale_mode, "value", scale_mode)),
            "select": select,
        }
        if engine is not None:
            body["engine"] = str(getattr(engine, "value", engine))
        if revision is not None:
            body["revision"] = revision
        limit = import_httpx().Timeout(wait_s, connect=self.timeout)
        response = self._request("POST", f"{_API}/checkpoints", json=body, ok=(200, 201, 202), timeout=limit)
        status = self._json(response, CheckpointStatus.from_json)
        self.last_key = status.key
        return status

    def resolve(
        self,
        source: str | os.PathLike[str],
        *,
        target: str = "auto",
        scale_mode: str = "exact",
        select: str | None = None,
        engine: str | None = None,
        progress: Callable[[CheckpointStatus], None] | None = None,
        poll_interval: float = 0.5,
        timeout: float | None = None,
        reconnect_s: float = DEFAULT_RECONNECT_S,
        notice: Callable[[str], None] | None = None,
        revision: str | None = None,
    ) -> Path:
        """The converted checkpoint directory of ``source``: converted now, or taken from the cache.

        Posts the request, then polls ``GET /v1/checkpoints/{key}`` every ``poll_interval`` seconds
        (the first polls come sooner) until the entry is ready, calling ``progress(status)`` after every
        answer; each poll asks the daemon to answer as soon as the conversion ends, so the end is seen
        at once, not at the next poll. Raises
        :class:`ConversionFailedError` (with the daemon's status/code/message) when the conversion
        fails, :class:`ResolveTimeoutError` after ``timeout`` seconds (``None``: wait for as long as
        it takes), and any other :class:`TransformdError` for a refused request.

        Should the daemon forget the key while we wait (it restarted), the request is posted again;
        while it answers 503 (too many conversions queued) the request is retried (``Retry-After``,
        else a growing delay) until ``timeout``: while an answer still fits in the time left, then that 503
        is raised (a :class:`ServerError`).

        A daemon that goes away while we wait (killed, restarted, upgraded) is waited for: once the
        first request was answered, the daemon may stay unreachable for up to ``reconnect_s``
        seconds in a row (and a conversion it cancelled while stopping is not a failure); when it
        answers again the request is posted again, and the new daemon converts afresh (or finds the
        entry, when the old one published it before it died). After ``reconnect_s`` without an
        answer, :class:`DaemonUnavailableError` says so. ``reconnect_s=0``: fail at the first
        unanswered request. The first request is never waited for: a daemon that is not there at
        all fails at once. ``notice(message)`` hears of both events, one line each ("went away ...
        waiting up to 60s", "reconnected ... after 4.2s; progress starts again"), so a caller can say
        why progress jumps back.
        """
        deadline = None if timeout is None else time.monotonic() + timeout

        def submit() -> CheckpointStatus:
            return self._submit_when_accepted(source, target, scale_mode, select, engine, deadline, revision)

        status = submit()
        key = status.key
        delay = min(0.05, poll_interval)
        unreachable_since: float | None = None
        lost: tuple[float, str] | None = None  # (when, how far it was) since the daemon went away, until it answers

        def tell(message: str) -> None:
            if notice is not None:
                notice(message)

        def went_away(why: str, last: CheckpointStatus | None) -> None:
            nonlocal lost
            if lost is not None:
                return
            p = last.progress if last is not None else None
            done = f" at {p.fraction:.0%}" if p is not None and p.fraction else ""
            lost = (time.monotonic(), done)
            tell(f"transformd at {self.where} {why} while entry {key} was converting{done}; waiting up to "
                 f"{reconnect_s:g}s for it to answer again")

        last_seen: CheckpointStatus | None = status
        while True:
            if status is not None:
                if progress is not None:
                    progress(status)
                if status.ready:
                    if status.path is not None:
                        return status.path
                    # A status without the path: the POST answer of a ready entry always carries it.
                    status = submit()
                    if status.ready:
                        if status.path is None:  # (asking again would get the same answer for ever)
                            raise ServerError(f"transformd reported entry {key} ready without its path")
                        return status.path
                if status.failed:
                    err = status.error
                    if not (reconnect_s > 0 and err is not None and err.code in _DAEMON_STOPPING_CODES):
                        raise err or ConversionFailedError.from_answer(
                            f"conversion of {source} failed", status=None, code="failed")
                    went_away("is stopping (it cancelled the conversion)", last_seen)
                    status = None  # the daemon is stopping: wait for its successor and ask it again
            if deadline is not None and time.monotonic() + delay > deadline:
                if status is None:
                    raise ResolveTimeoutError(
                        f"gave up waiting for {source} after {timeout:g}s: the daemon at {self.where} went away "
                        f"while entry {key} was converting and has not answered since",
                    )
                done = f" ({status.progress.fraction:.0%} done)" if status.progress and status.progress.fraction else ""
                raise ResolveTimeoutError(
                    f"gave up waiting for {source} after {timeout:g}s: entry {status.key} is {status.state}{done}; "
                    f"the conversion goes on in the daemon",
                )
            if status is None:
                time.sleep(delay)
            asked, waited = time.monotonic(), delay
            delay = min(poll_interval, delay * 2)
            try:
                if status is None:  # the daemon went away (or was stopping): post again to the one that answers
                    status = submit()
                else:
                    try:  # (the daemon answers when the conversion ends, or after ``waited`` seconds)
                        status = self.status(status.key, wait=waited)
                        if not (status.ready or status.failed):  # (a daemon that answered sooner: older, no wait)
                            time.sleep(max(0.0, waited - (time.monotonic() - asked)))
                    except NotFoundError:
                        if lost is None:  # the daemon forgot the key: it restarted between two polls
                            went_away("restarted (it no longer knew the conversion)", last_seen)
                        status = submit()
                unreachable_since = None
                if lost is not None:
                    since, done = lost
                    lost = None
                    now_at = ""
                    if status.ready:
                        now_at = "; the entry is ready"
                    elif status.progress is not None and status.progress.fraction is not None:
                        now_at = f"; it is at {status.progress.fraction:.0%} now (was{done or ' not started'})"
                    tell(f"reconnected to transformd at {self.where} after {time.monotonic() - since:.1f}s; "
                         f"entry {key} is {status.state}{now_at}")
                last_seen = status
            except DaemonUnavailableError as err:
                now = time.monotonic()
                if unreachable_since is None:
                    unreachable_since = now
                    if reconnect_s > 0:
                        went_away("went away", last_seen)
                if now - unreachable_since >= reconnect_s:
                    raise DaemonUnavailableError.from_answer(
                        f"transformd at {self.where} went away while entry {key} of {source} was converting and did "
                        f"not answer again within {reconnect_s:g}s ({err.message}); the conversion is lost with it: "
                        f"resolve again once the daemon is back",
                        status=None, code="daemon_gone",
                    ) from err
                status = None

    def _submit_when_accepted(
        self, source: str | os.PathLike[str], target: str, scale_mode: str, select: str | None, engine: str | None,
        deadline: float | None, revision: str | None = None,
    ) -> CheckpointStatus:
        """:meth:`submit`, retried while the daemon answers 503 (its conversion queue is full) until ``deadline``."""
        delay = 1.0
        while True:
            sent = time.monotonic()
            left = None if deadline is None else max(0.001, deadline - sent)
            try:
                return self.submit(
                    source, target=target, scale_mode=scale_mode, select=select, wait_s=left, engine=engine,
                    revision=revision,
                )
            except DaemonUnavailableError as err:
                if deadline is not None and time.monotonic() >= deadline - 0.01:
                    raise ResolveTimeoutError(
                        f"gave up waiting for {source}: the daemon was still identifying it (reading the checkpoint "
                        f"to key it) when the timeout ran out; it goes on in the daemon",
                    ) from err
                raise
            except ServerError as err:
                if err.status != 503:
                    raise
                wait = err.retry_after if err.retry_after is not None else delay
                # Retry only with room for its answer (4x this one's, 50 ms to 5 s: a 503 after a long identification
                # is followed by quick ones): one sent with ms left would time out and report "identifying".
                room = min(max(0.05, 4 * (time.monotonic() - sent)), 5.0)
                if deadline is not None and time.monotonic() + wait + room > deadline:
                    raise
                time.sleep(max(0.0, wait))
                delay = min(delay * 2, 10.0)

    def status(self, key: str, *, wait: float = 0.0) -> CheckpointStatus:
        """``GET /v1/checkpoints/{key}``: state, progress, error, path when ready. ``wait``: the daemon answers when
        a queued or converting entry ends, or after that many seconds (at most 10), whichever comes first."""
        if wait <= 0:
            return self._json(self._request("GET", f"{_API}/checkpoints/{key}"), CheckpointStatus.from_json)
        wait = min(wait, 10.0)
        limit = import_httpx().Timeout(None if self.timeout is None else self.timeout + wait, connect=self.timeout)
        return self._json(self._request("GET", f"{_API}/checkpoints/{key}?wait={wait:g}", timeout=limit),
                          CheckpointStatus.from_json)

    def files(self, key: str, *, wait: bool = False, poll_interval: float = 0.25,
              timeout: float | None = None) -> list[ShardFile]:
        """``GET /v1/checkpoints/{key}/files``: every shard with its tensor table (absolute offsets).

        While the daemon knows none of the entry's shards yet (202: another process converts it, or its conversion
        has not planned it yet), ``wait`` polls until it does (:class:`ResolveTimeoutError` after ``timeout``), else
        that is a :class:`ConflictError`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            response = self._request("GET", f"{_API}/checkpoints/{key}/files", ok=(200, 202))
            if response.status_code == 200:
                return self._json(response, lambda data: [ShardFile.from_json(f) for f in data["files"]])
            if not wait:
                raise ConflictError.from_answer(f"entry {key} is converting and its files are not known yet (in "
                                                f"another process, or not planned yet): files(key, wait=True) waits",
                                                status=202, code="converting")
            if deadline is not None and time.monotonic() >= deadline:
                raise ResolveTimeoutError(f"entry {key}: no files known after {timeout:g}s (still converting)")
            time.sleep(poll_interval)

    def file(
        self,
        key: str,
        name: str,
        *,
        wait: bool = False,
        poll_interval: float = 0.25,
        timeout: float | None = None,
    ) -> ShardFile:
        """``GET /v1/checkpoints/{key}/files/{name}``; asking moves the shard to the front of the conversion.

        Without ``wait`` the answer may be a shard that is not ready yet (``ready`` False). With
        ``wait`` it polls until the shard is ready (:class:`ResolveTimeoutError` after ``timeout``;
        :class:`ConversionFailedError` when the entry failed meanwhile).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            response = self._request("GET", f"{_API}/checkpoints/{key}/files/{name}", ok=(200, 202))
            shard = self._json(response, ShardFile.from_json)
            if response.status_code == 202:
                shard = ShardFile(shard.name, shard.path, shard.size, shard.digest, False, shard.tensors,
                                  shard.final_path)
            if shard.ready or not wait:
                return shard
            if deadline is not None and time.monotonic() >= deadline:
                raise ResolveTimeoutError(f"shard {name} of {key} not ready after {timeout:g}s")
            entry = self.status(key)
            if entry.failed:
                raise entry.error or ConversionFailedError(f"conversion of {key} failed")
            time.sleep(poll_interval)

    def delete(self, key: str) -> None:
        """``DELETE /v1/checkpoints/{key}``: remove the entry (409 while leased or converting)."""
        self._request("DELETE", f"{_API}/checkpoints/{key}", ok=(200, 202, 204))

    # -- leases ----------------------------------------------------------------------------------------------------

    def acquire_lease(self, key: str, ttl_s: float = 3600.0, holder: str | None = None) -> LeaseInfo:
        """``POST /v1/checkpoints/{key}/leases``: protect the entry from eviction for ``ttl_s`` seconds."""
        body = {"ttl_s": ttl_s, "holder": holder or _default_holder()}
        response = self._request("POST", f"{_API}/checkpoints/{key}/leases", json=body, ok=(200, 201))
        return self._json(response, LeaseInfo.from_json)

    def release_lease(self, key: str, lease_id: str) -> None:
        """``DELETE /v1/checkpoints/{key}/leases/{id}`` (a lease already gone is not an error)."""
        try:
            self._request("DELETE", f"{_API}/checkpoints/{key}/leases/{lease_id}", ok=(200, 204))
        except NotFoundError:
            pass

    @contextmanager
    def lease(self, key: str, ttl_s: float = 3600.0, holder: str | None = None) -> Iterator[LeaseInfo]:
        """Hold a lease on ``key`` for the ``with`` block: acquired on enter, released on exit.

        A lease expires by itself after ``ttl_s`` seconds, so a process that dies without releasing
        it does not pin the entry for ever; pick a ``ttl_s`` longer than the block (or re-acquire).
        """
        info = self.acquire_lease(key, ttl_s=ttl_s, holder=holder)
        try:
            yield info
        finally:
            self.release_lease(key, info.id)

    # -- daemon ----------------------------------------------------------------------------------------------------

    def cache(self) -> dict[str, Any]:
        """``GET /v1/cache``: usage, budget and entries, as the daemon sends them."""
        return self._json(self._request("GET", f"{_API}/cache"))

    def health(self, *, degraded_ok: bool = False) -> dict[str, Any]:
        """``GET /healthz``; raises unless the daemon answers 200.

        ``degraded_ok``: a 503 that carries the daemon's health body (``status`` ``degraded`` and its
        ``problems``) is returned instead of raised, so a caller can tell "degraded, and why" from "down".
        """
        response = self._request("GET", "/healthz", ok=(200, 503) if degraded_ok else (200,))
        if response.status_code == 503:
            try:
                body = _parsed(response)
            except ValueError:
                body = None
            if not (isinstance(body, dict) and isinstance(body.get("status"), str)):
                raise self._error(response)  # a 503 of another kind (not the health body): an error as before
            return body
        try:
            data = _parsed(response)
        except ValueError:
            data = {"status": response.text.strip() or "ok"}
        return data if isinstance(data, dict) else {"status": data}

    def metrics(self) -> str:
        """``GET /metrics``: the Prometheus text exposition."""
        return self._request("GET", "/metrics").text

    # -- lifetime --------------------------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TransformdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TransformdClient({self.where})"
