"""Who is asking: the caller's uid and groups, and whether that caller could read a source itself.

The daemon reads sources with its own rights; it must not hand a caller a conversion of files the caller could
not read (a confused deputy). So every request carries a :class:`Caller`:

* on the unix socket: the peer credentials of the connection, taken by the kernel when the client connected
  (``SO_PEERCRED``: pid, uid, gid; ``SO_PEERGROUPS``: the supplementary groups, Linux >= 4.13; else the
  ``Groups:`` line of ``/proc/PID/status``, kept only when that process still has the same uid);
* on TCP: one configured identity for every holder of the token (``tcp_uid``/``tcp_gids`` settings; by default
  the daemon's own user, i.e. the rights the daemon has).

:func:`denied` decides from the stat facts that the source walk collected (:class:`AccessFacts`): read
permission on every file, read and search permission on every directory of the source, search permission on
every directory above each of them, evaluated like the kernel does from owner, group and mode bits (uid 0
may read everything). POSIX ACLs are not evaluated: a file readable only through an ACL entry is refused.
:func:`path_denied` checks the way to a source the same way before anything of it is looked at, so that what
lies where the caller cannot look is never told by an answer.

The uvicorn protocol classes of :func:`peer_protocol` put the caller of a unix connection into the ASGI scope
under :data:`SCOPE_KEY`, once per connection.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..cache.securefs import MAX_SOURCE_FILES, AccessFacts, Fact, real_path
from .errors import ApiError

#: ASGI scope key of the :class:`Caller` of a request.
SCOPE_KEY = "transformd.caller"
#: ``SO_PEERGROUPS`` (Linux asm-generic value; Python does not export it everywhere).
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_R, _X = 4, 1


@dataclass(frozen=True)
class Caller:
    """One identity asking: uid, primary and supplementary gids, where it came from."""

    uid: int
    gids: frozenset[int]
    pid: int | None = None
    via: str = "unix"

    def describe(self) -> str:
        return f"uid {self.uid}" + (f" (pid {self.pid})" if self.pid else "") + f" via {self.via}"


def daemon_identity(via: str = "self") -> Caller:
    return Caller(os.geteuid(), frozenset({os.getegid(), *os.getgroups()}), os.getpid(), via)


def _proc_groups(pid: int, uid: int) -> set[int] | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            text = f.read(16384)
    except OSError:
        return None
    groups: set[int] | None = None
    uid_ok = False
    for line in text.splitlines():
        if line.startswith("Uid:"):
            uid_ok = line.split()[1:2] == [str(uid)]
        elif line.startswith("Groups:"):
            groups = {int(g) for g in line.split()[1:] if g.isdigit()}
    return groups if uid_ok else None


def peer_caller(sock: socket.socket) -> Caller | None:
    """The :class:`Caller` at the other end of a connected unix socket, or None when it cannot be told."""
    try:
        pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (OSError, struct.error, AttributeError):
        return None
    groups: set[int] | None = None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 1024)
        groups = set(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError:
        groups = _proc_groups(pid, uid)
    return Caller(uid, frozenset({gid, *(groups or ())}), pid, "unix")


# ---------------------------------------------------------------------------------------------------- permissions

def _bits(fact: Fact, caller: Caller) -> int:
    _, uid, gid, mode = fact
    if uid == caller.uid:
        return (mode >> 6) & 7
    if gid in caller.gids:
        return (mode >> 3) & 7
    return mode & 7


def denied(caller: Caller, facts: AccessFacts, shown: Any = None) -> str | None:
    """None when ``caller`` may read every file of the source; else which kind of permission is missing (no path
    outside the source is named)."""
    if caller.uid == 0:
        return None
    for fact in facts.ancestors:
        if not _bits(fact, caller) & _X:
            return "search permission on a directory above the source"
    for fact in facts.dirs:
        if _bits(fact, caller) & (_R | _X) != (_R | _X):
            return "read permission on a directory of the source"
    for fact in facts.files:
        if not _bits(fact, caller) & _R:
            return "read permission on a file of the source"
    return None


def path_denied(caller: Caller, path: str, allowed: Callable[[str], bool] | None = None, *,
                listed: bool = True) -> str | None:
    """Before anything of ``path`` is looked at for ``caller``: the right it lacks to reach it itself, or None.

    Every directory the kernel searches to resolve it must let the caller search it (:func:`way_facts`: each
    component opened on the descriptor of the one before, a symbolic link followed where the kernel would follow it,
    so the way as written and the way it leads are one walk and nothing is checked by name and then reopened), and
    the source itself, a directory, must let it read and search it (``listed``; else search it). With ``allowed``
    (the policy's test of a real path), so must every directory in the source that lies inside the allowed roots
    (names starting with ``.`` aside, as the conversion leaves them). A missing component ends the walk: the caller
    could see that itself. Before this, what the daemon found with its own rights answered a caller who could not
    look: 404, "is not a directory", "contains no files", the name of a link out of the roots, and the size of another
    user's private checkpoint in a 507 (two attack reviews); then a directory swapped for a link between the check by
    name and the next look (an attack review: a size in a 507, names in a 403, a 500 from ``realpath``)."""
    if caller.uid == 0:
        return None
    missing = _way_denied(caller, path, listed)
    if missing is not None or allowed is None:
        return missing
    return _inside_denied(caller, path, allowed)


_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
#: Most symbolic links followed in one walk (the kernel's own limit).
MAX_LINKS = 40


def way_facts(path: str) -> tuple[list[Fact], bool]:
    """The directories the kernel searches to resolve absolute ``path`` (each fact from ``fstat`` of the descriptor
    the walk opened, relative to the one before, with ``O_PATH | O_NOFOLLOW``; a link read from its own descriptor
    and followed), and whether the whole path resolved to a directory (its fact is the last). Stops at a missing
    component, a file before the end, or more than :data:`MAX_LINKS` links."""
    facts: list[Fact] = []
    todo = [name for name in reversed(path.split(os.sep)) if name]
    fd = os.open(os.sep, _PATH_FLAGS | os.O_DIRECTORY)
    current, links = os.sep, 0
    try:
        st = os.fstat(fd)
        facts.append((current, st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)))
        while todo:
            name = todo.pop()
            if name == ".":
                continue
            try:
                nfd = os.open(name, _PATH_FLAGS, dir_fd=fd)
            except OSError:
                return facts, False  # missing (or not even the daemon may look): the request's own checks say so
            try:
                st = os.fstat(nfd)
                if stat.S_ISLNK(st.st_mode):
                    links += 1
                    target = os.readlink("", dir_fd=nfd) if links <= MAX_LINKS else ""
                    if not target:
                        return facts, False
                    todo.extend(n for n in reversed(target.split(os.sep)) if n)
                    if target.startswith(os.sep):
                        os.close(fd)
                        fd, current = os.open(os.sep, _PATH_FLAGS | os.O_DIRECTORY), os.sep
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    return facts, False
                current = os.path.dirname(current) if name == ".." else os.path.join(current, name)
                facts.append((current, st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)))
                fd, nfd = nfd, fd
            finally:
                os.close(nfd)
        return facts, True
    except OSError:
        return facts, False
    finally:
        os.close(fd)


def _way_denied(caller: Caller, walked: str, listed: bool = True) -> str | None:
    """:func:`denied` for the directories the kernel searches to resolve ``walked`` (as far as they exist): each
    searched, the last read and searched when ``listed`` and the whole path is a directory."""
    facts, whole = way_facts(walked)
    if listed and whole:  # (it exists: it is listed, the rest passed)
        return denied(caller, AccessFacts((), (facts[-1],), tuple(facts[:-1])))
    return denied(caller, AccessFacts((), (), tuple(facts)))


def hides(caller: Caller, path: str) -> str | None:
    """The right ``caller`` lacks to search the way to ``path`` (followed like the kernel does), or None."""
    return None if caller.uid == 0 else _way_denied(caller, path, listed=False)


def _inside_denied(caller: Caller, top: str, allowed: Callable[[str], bool]) -> str | None:
    """A directory of the source at ``top`` that the caller may not read and search, each walked from ``/`` as
    :func:`_way_denied` does (a link in it: the way to where it leads too); only sources inside the allowed roots are
    listed (one out of them is the conversion's own refusal, naming what the caller can see)."""
    real = real_path(top)
    if real is None or not allowed(real):
        return None
    stack, seen, budget = [top], set(), MAX_SOURCE_FILES
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                paths = [entry.path for entry in entries if not entry.name.startswith(".")]
        except OSError:
            continue
        for path in paths:
            budget -= 1
            if budget < 0:
                return None  # (the conversion refuses a source this large)
            try:
                st = os.stat(path)
            except OSError:
                continue
            real = real_path(path)
            if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) in seen or real is None or not allowed(real):
                continue  # (a file or a missing name: the conversion's open decides)
            seen.add((st.st_dev, st.st_ino))
            missing = _way_denied(caller, path)
            if missing is not None:
                return missing
            stack.append(path)
    return None


def unreadable(caller: Caller, source: str, missing: str) -> ApiError:
    """403 for a source ``caller`` could not read itself (``missing``: the right it lacks, and where)."""
    return ApiError(403, "permission_denied", f"{caller.describe()} may not read source {source} ({missing} is "
                    "missing); the daemon converts and serves a source only for callers who could read every file of "
                    "it themselves")


# ---------------------------------------------------------------------------------------------------- uvicorn


def _raw_error(status: int, reason: str, code: str, message: str, *, retry: bool = True) -> bytes:
    body = json.dumps({"error": {"status": status, "code": code, "message": message}}).encode()
    retry_after = "retry-after: 5\r\n" if retry else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n{retry_after}\r\n"
    )
    return head.encode() + body


def admin_room(limit: int) -> int:
    """Connections of a unix listener of ``limit`` that only privileged uids may take (:func:`peer_protocol`)."""
    return max(1, min(64, limit // 8))


def peer_protocol(base: type, *, max_connections: dict[str, int] | None = None, header_timeout_s: float = 10.0,
                  max_per_uid: int | None = None, privileged: frozenset[int] = frozenset({0}),
                  write_timeout_s: float = 30.0) -> type:
    """A subclass of uvicorn's HTTP protocol ``base``: the unix peer's :class:`Caller` in every scope, a limit of
    open connections per listener kind (``{"unix": n, "tcp": m}``; past it, a JSON 503 and close, so a flood of
    TCP connections never takes the unix socket's capacity) and per unix peer uid (``max_per_uid``, root's not
    counted: one uid's flood never takes the others'), of which the last :func:`admin_room` unix connections are
    only for ``privileged`` uids (root, the daemon's, the admins: 16 uids with 128 idle connections each filled the
    whole listener, and root got 503 too), a deadline for each request's headers, the first's from the connection,
    a kept-alive connection's next from its first byte (an idle or trickling connection gets a JSON 408 and is
    closed; uvicorn's keep-alive timeout covers the time between requests, and :class:`.middleware.BodyLimit` a
    request's body), and one for its answer: a connection whose unsent answer has not shrunk for
    ``write_timeout_s`` (a peer that does not read) is cut (it held its connection, and its uid's share, for ever)."""
    limits = dict(max_connections or {})
    counts = {"unix": 0, "tcp": 0}
    per_uid: dict[int, int] = {}

    class PeerProtocol(base):  # type: ignore[misc, valid-type]
        _td_refused = False
        _td_kind: str | None = None
        _td_uid: int | None = None  # a counted unix peer's
        _td_timer: Any = None
        _td_armed_for: Any = None  # the request cycle that was the last when the header deadline was armed
        _td_watch: Any = None  # the write deadline's timer
        _td_unsent: int | None = None  # unsent bytes at its last look (None: none)

        def connection_made(self, transport: Any) -> None:
            sock = transport.get_extra_info("socket")
            kind = "unix" if sock is not None and getattr(sock, "family", None) == socket.AF_UNIX else "tcp"
            caller = peer_caller(sock) if kind == "unix" else None
            uid = caller.uid if caller is not None and caller.uid != 0 and max_per_uid is not None else None
            limit = limits.get(kind)
            if limit is not None and kind == "unix" and (caller is None or caller.uid not in privileged):
                limit -= admin_room(limit)  # (the rest is kept for root, the daemon's uid and the admins)
            if limit is not None and counts[kind] >= limit:
                self._td_refuse(transport, f"this daemon's {kind} listener has {counts[kind]} open connections")
                return
            if uid is not None and per_uid.get(uid, 0) >= max_per_uid:  # type: ignore[operator]
                self._td_refuse(transport, f"uid {uid} has {max_per_uid} open connections to this daemon")
                return
            counts[kind] += 1
            self._td_kind = kind
            if uid is not None:
                per_uid[uid] = per_uid.get(uid, 0) + 1
                self._td_uid = uid
            super().connection_made(transport)
            self._td_timer = self.loop.call_later(header_timeout_s, self._td_header_deadline)
            self._td_watch = self.loop.call_later(write_timeout_s, self._td_write_deadline)
            if kind != "unix":
                return
            app = self.app

            async def with_caller(scope: Any, receive: Any, send: Any) -> None:
                scope[SCOPE_KEY] = caller
                await app(scope, receive, send)

            self.app = with_caller

        def _td_refuse(self, transport: Any, why: str) -> None:
            self._td_refused = True
            transport.write(_raw_error(503, "Service Unavailable", "too_many_connections",
                                       f"{why}; retry later (idle connections are closed after a few seconds)"))
            transport.close()

        def _td_header_deadline(self) -> None:
            self._td_timer = None
            if getattr(self, "cycle", None) is self._td_armed_for and not self.transport.is_closing():
                self.transport.write(_raw_error(408, "Request Timeout", "request_timeout",
                                                f"no complete request within {header_timeout_s:g} s"))
                self.transport.close()

        def _td_write_deadline(self) -> None:
            """Every ``write_timeout_s``: cut the connection when its unsent bytes have not shrunk since the last
            look (the peer reads nothing); uvicorn would wait for it for ever, also in the close after the answer."""
            unsent = self.transport.get_write_buffer_size()
            if unsent and self._td_unsent is not None and unsent >= self._td_unsent:
                self.transport.abort()
                return
            self._td_unsent = unsent or None
            self._td_watch = self.loop.call_later(write_timeout_s, self._td_write_deadline)

        def data_received(self, data: bytes) -> None:
            if self._td_refused:
                return
            cycle = getattr(self, "cycle", None)
            if cycle is not None and cycle.response_complete and self._td_armed_for is not cycle:
                # bytes of a next request on a kept-alive connection (they stopped uvicorn's keep-alive timer):
                # its headers get the same deadline as the first request's, from its first byte
                if self._td_timer is not None:
                    self._td_timer.cancel()
                self._td_armed_for = cycle
                self._td_timer = self.loop.call_later(header_timeout_s, self._td_header_deadline)
            super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            """A request uvicorn cannot parse (a bad Content-Length, chunk framing, method): JSON as every error,
            not its ``text/plain``."""
            self.transport.write(_raw_error(400, "Bad Request", "bad_request", msg, retry=False))
            self.transport.close()

        def eof_received(self) -> None:
            if not self._td_refused:
                super().eof_received()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._td_refused:
                return
            if self._td_timer is not None:
                self._td_timer.cancel()
            if self._td_watch is not None:
                self._td_watch.cancel()
            if self._td_kind is not None:
                counts[self._td_kind] -= 1
                self._td_kind = None
            if self._td_uid is not None:
                per_uid[self._td_uid] -= 1
                if not per_uid[self._td_uid]:
                    del per_uid[self._td_uid]
                self._td_uid = None
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            if not self._td_refused:
                super().pause_writing()

        def resume_writing(self) -> None:
            if not self._td_refused:
                super().resume_writing()

    PeerProtocol.__name__ = PeerProtocol.__qualname__ = f"Peer{base.__name__}"
    return PeerProtocol
