"""Listeners and the uvicorn server of ``transformd serve``.

The unix socket is created by the daemon itself, so its permissions never depend on the umask:
its directory is created 0750 when missing, the socket is bound, set to 0660 and only then listens
(a client cannot connect in between). A socket file left by a dead daemon is replaced; a live one
(something accepts connections on it) or a path that is not a socket stops the start with an error.
The file is removed at exit if it is still the one this daemon created.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import ipaddress
import logging
import os
import signal
import socket
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from .peers import peer_protocol
from .settings import Settings, SettingsError

log = logging.getLogger("transformd.daemon")

SOCKET_MODE = 0o660
SOCKET_DIR_MODE = 0o750
#: Pending connections the kernel queues per listener.
BACKLOG = 1024
#: Connections and in-flight requests uvicorn serves at once; more get 503.
MAX_CONCURRENCY = 2048
#: Seconds an idle keep-alive connection stays open.
KEEP_ALIVE_S = 5


def bind_unix_socket(path: Path) -> socket.socket:
    """A listening unix socket at ``path`` with permissions 0660 (directory 0750 if this creates it)."""
    parent = path.parent
    if not parent.exists():
        try:
            parent.mkdir(parents=True, mode=SOCKET_DIR_MODE)
            os.chmod(parent, SOCKET_DIR_MODE)
        except FileExistsError:
            pass
        except OSError as e:
            raise SettingsError(
                f"cannot create the socket directory {parent}: {e.strerror}; choose another --socket "
                "(or set TRANSFORMD_SOCKET / XDG_RUNTIME_DIR)"
            ) from e
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise SettingsError(f"{path} exists and is not a socket; refusing to replace it: choose another --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # left by a daemon that died
        except OSError as e:
            raise SettingsError(f"cannot check the existing socket {path}: {e.strerror}") from e
        else:
            raise SettingsError(f"another daemon is already listening on {path}; stop it or choose another --socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(path))
        os.chmod(path, SOCKET_MODE)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise SettingsError(f"cannot listen on unix socket {path}: {e.strerror}") from e
    sock.setblocking(False)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SettingsError(f"cannot resolve --host {host}: {e}") from e
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        hint = " (another process uses the port)" if e.errno == errno.EADDRINUSE else ""
        raise SettingsError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from e
    sock.setblocking(False)
    return sock


@dataclass
class Listeners:
    """The daemon's listening sockets."""

    sockets: list[socket.socket] = field(default_factory=list)
    unix_path: Path | None = None
    tcp_address: tuple[str, int] | None = None
    _unix_id: tuple[int, int] | None = None

    def urls(self) -> list[str]:
        out = []
        if self.unix_path is not None:
            out.append(f"unix:{self.unix_path}")
        if self.tcp_address is not None:
            host, port = self.tcp_address
            out.append(f"http://{'[' + host + ']' if ':' in host else host}:{port}")
        return out

    def close(self) -> None:
        for s in self.sockets:
            s.close()
        self.sockets = []
        if self.unix_path is not None and self._unix_id is not None:
            with contextlib.suppress(OSError):
                st = os.lstat(self.unix_path)
                if (st.st_dev, st.st_ino) == self._unix_id:
                    os.unlink(self.unix_path)


def open_listeners(settings: Settings) -> Listeners:
    """Bind what ``settings`` asks for (raises :class:`SettingsError` with what to change)."""
    settings.check()
    out = Listeners()
    try:
        path = settings.socket_path()
        if path is not None:
            out.sockets.append(bind_unix_socket(path))
            st = os.lstat(path)
            out.unix_path, out._unix_id = path, (st.st_dev, st.st_ino)
        if settings.port is not None:
            sock = bind_tcp(settings.tcp_host(), settings.port)
            out.sockets.append(sock)
            host, port = sock.getsockname()[:2]
            out.tcp_address = (str(host), int(port))
            if not ipaddress.ip_address(str(host)).is_loopback:
                log.warning(
                    "listening on %s:%s, which is not a loopback address: the bearer token and the traffic are "
                    "not encrypted; put a TLS proxy in front or keep it on a private network",
                    host,
                    port,
                )
    except BaseException:
        out.close()
        raise
    return out


def _http_protocol(settings: Settings) -> type:
    """uvicorn's h11 HTTP protocol with the unix peer's credentials, connection limits per listener kind and
    deadlines for request headers and answers (see :func:`.peers.peer_protocol`). Always h11, also where httptools
    is installed (uvicorn's "auto" would take it, as an engine's environment often has it): h11 refuses a request
    whose headers pass 16 KiB (uvicorn's ``h11_max_incomplete_event_size``), httptools is given no such bound, so a
    caller could have the event loop parse headers for as long as its header deadline lasts. (Every measurement
    of the daemon was made with h11.)"""
    from uvicorn.protocols.http.h11_impl import H11Protocol as base

    limits = {"unix": settings.max_unix_connections, "tcp": settings.max_tcp_connections}
    return peer_protocol(base, max_connections=limits, header_timeout_s=settings.header_timeout_s,
                         max_per_uid=settings.max_unix_connections_per_uid,
                         privileged=frozenset({0, os.geteuid(), *settings.admins()}),
                         write_timeout_s=settings.write_timeout_s)


class DaemonServer(uvicorn.Server):
    """uvicorn's server, which tells the app that it stops (``on_stopping``) before it waits for the requests in
    flight: a request waiting for the key of a conversion is answered 503 at once, instead of being cut off (500)
    when the grace period ends."""

    def __init__(self, config: uvicorn.Config, on_stopping: Callable[[], None] | None = None):
        super().__init__(config)
        self._on_stopping = on_stopping

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._on_stopping is not None:
            self._on_stopping()
        await super().shutdown(sockets)


def build_server(app: Any, settings: Settings) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        http=_http_protocol(settings),
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        lifespan="on",
        proxy_headers=False,
        server_header=False,
        limit_concurrency=None,  # per listener instead (peers.peer_protocol): a TCP flood never blocks the socket
        timeout_keep_alive=KEEP_ALIVE_S,
        backlog=BACKLOG,
        timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_s)),
    )
    daemon = getattr(getattr(app, "state", None), "daemon", None)
    return DaemonServer(config, on_stopping=daemon.service.stopping if daemon is not None else None)


async def run_server(
    server: uvicorn.Server, listeners: Listeners, on_started: Callable[[], None] | None = None
) -> bool:
    """Serve until shut down; ``on_started`` runs once the app has started. False if it never started."""
    task = asyncio.ensure_future(server.serve(sockets=listeners.sockets))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started and on_started is not None:
        on_started()
    await task
    return server.started


def _raise_open_files_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: a conversion holds every source file open (cache.securefs)."""
    import resource

    with contextlib.suppress(OSError, ValueError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _check_cache_not_writable_by_others(root: Path) -> None:
    """Refuse a cache whose directories others may write (made under a umask of 000 or 002, a volume mounted 0777):
    they could put converted files of their own under another checkpoint's key, and the daemon would serve them
    (an attack review planted one; ``cache verify`` passed). The daemon's own directories are mended (``chmod
    go-w``); a root of another owner (but root's, not writable by others), or a sub-directory of another owner,
    stops it."""
    from ..cache import CacheError

    for d in [root, *(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())]:
        st = d.lstat()
        mine = st.st_uid == os.geteuid()
        if mine and st.st_mode & 0o022:
            os.chmod(d, stat.S_IMODE(st.st_mode) & ~0o022)
        elif not mine and (d != root or st.st_mode & 0o022 or st.st_uid != 0):  # (a root's owner renames in it)
            raise CacheError(f"cache directory {d} (mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}) "
                             f"can be written by others than this daemon (uid {os.geteuid()}): they could plant "
                             "converted files it would serve; give the daemon a cache directory of its own, or "
                             f"make {d} its own and 'chmod go-w' it")


def _cache_not_writable(err: PermissionError, settings: Settings) -> Exception:
    """The error for a cache directory the daemon may not write: which uid needs write access, and the command that
    gives it (a Kubernetes hostPath ``DirectoryOrCreate`` makes a root-owned 0755 directory)."""
    from ..cache import CacheError
    from ..cache.store import default_root

    root = default_root(settings.cache_dir)
    uid, gid = os.geteuid(), os.getegid()
    where = err.filename or root
    return CacheError(f"the daemon (uid {uid}, gid {gid}) may not write its cache directory {root} (permission denied "
                      f"on {where}): give it to that user with `install -d -o {uid} -g {gid} {root}` (or `chown "
                      f"{uid}:{gid} {root}`) as root, e.g. in an init container, or choose another --cache-dir")


def _check_source_roots(settings: Settings) -> None:
    """Refuse to start a daemon that would refuse every source (it started, ``health`` said ok, probes passed, and
    the failure showed only at an engine's first resolve): no allowed root at all, or none that is a directory the
    daemon may read. A hub cache added by ``--allow-hub-cache`` counts when it is there, or may be downloaded into.
    Each root that is not usable among usable ones is a warning at start."""
    def unusable(root: Path) -> str | None:
        if not root.is_dir():
            return "does not exist" if not root.exists() else "is not a directory"
        if not os.access(root, os.R_OK | os.X_OK):
            return f"cannot be read by the daemon (uid {os.geteuid()})"
        return None

    if not settings.source_roots():
        raise SettingsError(
            "no allowed root: this daemon would refuse every source; name the directories that hold the checkpoints "
            "with --allow-root DIR (repeatable; TRANSFORMD_ALLOW_ROOTS, separated by ':'), or --allow-hub-cache to "
            "serve the repo ids of its Hugging Face hub cache")
    problems = {root: unusable(root) for root in settings.allow_roots}
    if settings.allow_hub_cache and not settings.allow_download:
        problems[settings.hub_cache_dir()] = unusable(settings.hub_cache_dir())
    bad = {root: why for root, why in problems.items() if why is not None}
    if len(bad) == len(problems) and not (settings.allow_hub_cache and settings.allow_download):
        said = "; ".join(f"{root} {why}" for root, why in bad.items())
        raise SettingsError(f"no allowed root can be used, so this daemon would refuse every source: {said}; mount "
                            "the checkpoints there, or name the right directories with --allow-root "
                            "(TRANSFORMD_ALLOW_ROOTS)")
    for root, why in bad.items():
        log.warning("allowed root %s %s: no source under it can be served until it is a readable directory",
                    root, why)


def serve(settings: Settings, *, converter: Any = None, cache: Any = None, stream: Any = None) -> int:
    """Run the daemon in this process until SIGINT/SIGTERM; returns the exit status. ``converter``, ``cache``: as
    :func:`.app.create_app` takes them (defaults: the real converter, a cache of ``settings``)."""
    from .app import create_app

    stream = stream or sys.stderr
    _raise_open_files_limit()
    os.umask(0o022)  # what it creates in the cache: never group- or world-writable; readable (engines of other users)
    from ..cache import CacheError

    try:
        app = create_app(settings, converter=converter, cache=cache)
    except (PermissionError, CacheError) as e:  # (it said "Permission denied: .../entries", naming no uid nor fix)
        denied = e if isinstance(e, PermissionError) else e.__cause__
        if not isinstance(denied, PermissionError):
            raise
        raise _cache_not_writable(denied, settings) from e
    _check_cache_not_writable_by_others(app.state.daemon.cache.root)
    _check_source_roots(settings)
    listeners = open_listeners(settings)
    server = build_server(app, settings)

    def announce() -> None:
        print(f"transformd: listening on {' and '.join(listeners.urls())}", file=stream, flush=True)

    # uvicorn handles SIGINT/SIGTERM (graceful shutdown), then restores the previous handlers and raises the
    # signal again; these handlers make that second delivery a no-op, so the socket is removed and the exit
    # status is 0 after a requested stop.
    # Move everything loaded so far (torch, the app) out of the collector's view: a full collection of that
    # heap otherwise pauses the event loop for ~100 ms every few hundred requests.
    gc.collect()
    gc.freeze()
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, f: received.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        started = asyncio.run(run_server(server, listeners, announce))
    finally:
        listeners.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        gc.unfreeze()
    return 0 if started else 1
