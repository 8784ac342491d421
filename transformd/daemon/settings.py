"""Settings of ``transformd serve``: command-line flags > ``TRANSFORMD_*`` environment variables > defaults.

=====================================  ==========================================  =============================
setting (flag)                         environment variable                        default
=====================================  ==========================================  =============================
``socket`` (``--socket``)              ``TRANSFORMD_SOCKET``                       see :func:`default_socket_path`
``host`` (``--host``)                  ``TRANSFORMD_HOST``                         ``127.0.0.1`` (with a port)
``port`` (``--port``)                  ``TRANSFORMD_PORT``                         none: no TCP listener
``token_file`` (``--token-file``)      ``TRANSFORMD_TOKEN_FILE``                   none (required with a port)
``cache_dir`` (``--cache-dir``)        ``TRANSFORMD_CACHE_DIR``                    the cache's default root
``cache_budget`` (``--cache-budget``)  ``TRANSFORMD_CACHE_BUDGET``                 the cache's ``config.json``
``allow_roots`` (``--allow-root``)     ``TRANSFORMD_ALLOW_ROOTS`` (``os.pathsep``)  none: every source is refused
``device`` (``--device``)              ``TRANSFORMD_DEVICE``                       ``auto``
``hub_cache`` (``--hub-cache``)        ``TRANSFORMD_HUB_CACHE``                    ``HF_HUB_CACHE``, ``HF_HOME/hub``
``allow_hub_cache``                    ``TRANSFORMD_ALLOW_HUB_CACHE``              off: repo ids need a root
``allow_download``                     ``TRANSFORMD_ALLOW_DOWNLOAD``               off: never downloads
``max_concurrent_conversions``         ``TRANSFORMD_MAX_CONCURRENT_CONVERSIONS``   1
``max_queued_conversions``             ``TRANSFORMD_MAX_QUEUED_CONVERSIONS``       16
``max_lease_ttl_s``                    ``TRANSFORMD_MAX_LEASE_TTL_S``              7 days (an admin's leases)
``max_caller_lease_ttl_s``             ``TRANSFORMD_MAX_CALLER_LEASE_TTL_S``       1 day (anyone else's)
``admin_uids`` (``--admin-uid``)       ``TRANSFORMD_ADMIN_UIDS`` (commas)          the daemon's own uid
``remote`` (``--remote``)              ``TRANSFORMD_REMOTE``                       none: no remote tier
``remote_read_only``                   ``TRANSFORMD_REMOTE_READ_ONLY``             off: uploads what it converts
``log_level`` (``--log-level``)        ``TRANSFORMD_LOG_LEVEL``                    ``info``
=====================================  ==========================================  =============================

Repo ids (``org/Model``, :mod:`transformd.hub`) are looked up in ``hub_cache`` only when it is an allowed
root: inside an ``--allow-root``, or added by ``--allow-hub-cache``. ``--allow-download`` lets the daemon
fetch a repo that is not cached (into ``hub_cache``, which must then be writable); without it, it never does.

``remote`` (``s3://BUCKET[/PREFIX]`` or ``file:///PATH``, :mod:`transformd.remote`) is the remote tier many nodes
share: a request that misses the local cache downloads the entry from it before converting, and an entry this
daemon converts is uploaded to it in the background (never with ``remote_read_only``). Credentials and endpoint
come from the standard AWS variables and profiles (:mod:`transformd.request`, ``Tier``).

No environment variable changes what the daemon does beyond these settings: tests that need a slowed or fake
converter inject it (``create_app(converter=...)``, ``serve(settings, converter=...)``; tests/support/daemon.py).

Callers (see :mod:`.peers`): on the unix socket, the peer's uid and groups from the kernel; every TCP token holder
is one identity, ``tcp_uid``/``tcp_gids`` (``TRANSFORMD_TCP_UID``, ``TRANSFORMD_TCP_GIDS``: comma-separated),
by default the daemon's own user and groups (so the token grants what the daemon may read). ``admin_uids``
(``--admin-uid``, repeatable; ``TRANSFORMD_ADMIN_UIDS``; default the daemon's own uid only: root is no one's admin
unless named, engine containers often run as root) may see, release and delete every lease and entry.
``max_leases_per_caller`` (64) and ``max_queued_per_caller`` (4) bound what one uid can hold and queue, an admin's
and root's too; a lease of a caller who is not an admin lasts at most ``max_caller_lease_ttl_s`` (renew it).

Listeners: a unix socket by default. ``--port`` opens a TCP listener (on ``--host``, loopback by
default) and then requires ``--token-file``; with a port, the unix socket is opened too only
when a socket path is given explicitly (flag or ``TRANSFORMD_SOCKET``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ..client import DEFAULT_SOCKET
from ..client import default_socket_path as client_socket_path
from ..errors import BadRequestError
from .peers import Caller, daemon_identity

#: Environment variable prefix of every setting.
ENV_PREFIX = "TRANSFORMD_"
#: The socket of a daemon run as root when nothing else is configured.
SYSTEM_SOCKET = Path(DEFAULT_SOCKET)
#: Longest unix socket path the kernel accepts (sun_path is 108 bytes with the terminating NUL).
MAX_SOCKET_PATH_BYTES = 107
#: Upper bound of a bearer token file (it is one line).
MAX_TOKEN_BYTES = 4096
#: Shortest accepted bearer token.
MIN_TOKEN_CHARS = 16


class SettingsError(BadRequestError):
    """The settings cannot work (e.g. TCP without a token); the message says what to change."""

    code = "bad_settings"


def default_socket_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Where the daemon listens: the client's rule (:func:`transformd.client.default_socket_path`), so a client
    and a daemon started in one environment meet."""
    return client_socket_path(explicit=explicit, listening=True)


class Settings(BaseSettings):
    """Everything ``transformd serve`` can be told. Build with keyword arguments (flags); the rest comes from
    ``TRANSFORMD_*`` variables."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_default=True)

    socket: Path | None = Field(None, description="unix socket path (see default_socket_path)")
    host: str | None = Field(None, description="TCP address to bind; 127.0.0.1 unless set")
    port: int | None = Field(None, ge=0, le=65535, description="TCP port (0: any free port); enables TCP")
    token_file: Path | None = Field(None, description="file holding the bearer token TCP clients must send")
    cache_dir: Path | None = Field(None, description="cache root")
    cache_budget: str | None = Field(None, description="cache byte budget: bytes, 500G, 1.5TiB, 80%")
    allow_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list, description="directories sources must be under (after resolving symlinks)"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    hub_cache: Path | None = Field(None, description="Hugging Face hub cache for repo ids (default: huggingface_hub's)")
    allow_hub_cache: bool = Field(False, description="add the hub cache to the allowed roots")
    allow_download: bool = Field(False, description="download repo ids that are not in the hub cache")
    max_concurrent_conversions: int = Field(1, ge=1, le=64)
    max_queued_conversions: int = Field(16, ge=0, le=100_000, description="conversions waiting for a worker")
    max_lease_ttl_s: float = Field(7 * 24 * 3600.0, gt=0, description="longest lease of an admin")
    #: longest lease of a caller who is not an admin: a reader pins an entry against eviction for this long at most
    max_caller_lease_ttl_s: float = Field(24 * 3600.0, gt=0, description="longest lease of a caller not an admin")
    default_lease_ttl_s: float = Field(3600.0, gt=0)
    #: uid and gids every TCP token holder acts as (default: the daemon's own user and groups)
    tcp_uid: int | None = Field(None, ge=0, description="uid of TCP token holders (default: the daemon's)")
    tcp_gids: Annotated[list[int], NoDecode] = Field(
        default_factory=list, description="gids of TCP token holders (default: the daemon's)"
    )
    #: uids that may act on every lease and entry (default: the daemon's own uid; root only when named)
    admin_uids: Annotated[list[int], NoDecode] = Field(default_factory=list, description="admin uids")
    max_leases_per_caller: int = Field(64, ge=1, le=100_000, description="live leases one uid may hold")
    max_queued_per_caller: int = Field(4, ge=1, le=100_000, description="queued conversions of one uid")
    #: open connections per listener kind; past them a JSON 503 (a TCP flood never takes the unix socket's)
    max_unix_connections: int = Field(2048, ge=1, le=1_000_000)
    max_tcp_connections: int = Field(256, ge=1, le=1_000_000)
    #: open unix connections of one uid (root's are not counted): past them a JSON 503 for that uid only; the last
    #: eighth of max_unix_connections (64 at most) is kept for root, the daemon's uid and the admins
    max_unix_connections_per_uid: int = Field(128, ge=1, le=1_000_000)
    #: seconds a new connection has to send its first request's headers, and a request its body (else a JSON 408
    #: and close)
    header_timeout_s: float = Field(10.0, gt=0)
    #: seconds an answer's unsent bytes may stay unsent without shrinking (a peer that reads nothing): then the
    #: connection is cut
    write_timeout_s: float = Field(30.0, gt=0)
    remote: str | None = Field(None, description="remote tier: s3://BUCKET[/PREFIX] or file:///PATH (none: no tier)")
    remote_read_only: bool = Field(False, description="only read the remote tier, never upload to it")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    #: seconds the daemon waits for cancelled conversions to clean up when it stops
    shutdown_grace_s: float = Field(10.0, ge=0)

    @field_validator("allow_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [p for p in value.split(os.pathsep) if p]
        return value

    @field_validator("tcp_gids", "admin_uids", mode="before")
    @classmethod
    def _split_ints(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [int(p) for p in value.replace(",", " ").split() if p]
        return value

    @field_validator("allow_roots")
    @classmethod
    def _absolute_roots(cls, value: list[Path]) -> list[Path]:
        out = []
        for p in value:
            p = p.expanduser()
            if not p.is_absolute():
                raise ValueError(f"allowed root {p} is not an absolute path")
            out.append(p)
        return out

    @field_validator("socket", "token_file", "cache_dir", "hub_cache", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    # ------------------------------------------------------------------ derived

    @property
    def tcp_enabled(self) -> bool:
        return self.port is not None

    @property
    def socket_enabled(self) -> bool:
        """A unix socket unless TCP was asked for without naming a socket."""
        return not self.tcp_enabled or self.socket is not None

    def socket_path(self) -> Path | None:
        return default_socket_path(self.socket) if self.socket_enabled else None

    def tcp_host(self) -> str:
        return self.host or "127.0.0.1"

    def tcp_caller(self) -> Caller:
        """The identity of every TCP token holder."""
        me = daemon_identity("tcp")
        uid = me.uid if self.tcp_uid is None else self.tcp_uid
        gids = frozenset(self.tcp_gids) if self.tcp_gids else (me.gids if self.tcp_uid is None else frozenset())
        return Caller(uid, gids, None, "tcp")

    def admins(self) -> frozenset[int]:
        """uids that may act on every lease and entry: ``admin_uids``, else the daemon's own uid alone (root is not
        an admin by being root: engine containers often run as root without a user namespace)."""
        return frozenset(self.admin_uids) if self.admin_uids else frozenset({os.geteuid()})

    def max_ttl_of(self, admin: bool) -> float:
        """The longest lease a caller may take: ``max_lease_ttl_s`` for an admin, else the shorter of it and
        ``max_caller_lease_ttl_s``."""
        return self.max_lease_ttl_s if admin else min(self.max_lease_ttl_s, self.max_caller_lease_ttl_s)

    def resolved_allow_roots(self) -> list[Path]:
        """The allowed roots with symlinks resolved (roots that do not exist yet are resolved as far as they do)."""
        return [Path(os.path.realpath(p)) for p in self.allow_roots]

    def hub_cache_dir(self) -> Path:
        """Where repo ids are looked up: ``hub_cache``, else huggingface_hub's cache (HF_HUB_CACHE, HF_HOME)."""
        from ..hub import default_hub_cache

        return (self.hub_cache.expanduser() if self.hub_cache is not None else default_hub_cache()).absolute()

    def source_roots(self) -> list[Path]:
        """The allowed roots, and the hub cache with ``allow_hub_cache``."""
        return [*self.allow_roots, *([self.hub_cache_dir()] if self.allow_hub_cache else [])]

    def check(self) -> None:
        """Raise :class:`SettingsError` for combinations that cannot work."""
        if self.host is not None and self.port is None:
            raise SettingsError(f"--host {self.host} needs --port (TCP is off without a port)")
        if self.remote_read_only and not self.remote:  # (else a node meant to read a bucket starts without one)
            raise SettingsError("--remote-read-only (TRANSFORMD_REMOTE_READ_ONLY) needs a remote tier: pass --remote "
                                "s3://BUCKET[/PREFIX] (or TRANSFORMD_REMOTE), or drop it")
        if self.tcp_enabled and self.token_file is None:
            raise SettingsError(
                "TCP (--port) requires a bearer token: pass --token-file FILE (or TRANSFORMD_TOKEN_FILE) holding "
                f"one line of at least {MIN_TOKEN_CHARS} characters, e.g. from `openssl rand -hex 32`"
            )
        path = self.socket_path()
        if path is not None and len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
            raise SettingsError(
                f"unix socket path {path} is {len(os.fsencode(path))} bytes; the limit is {MAX_SOCKET_PATH_BYTES}: "
                "choose a shorter --socket"
            )

    def load_token(self) -> bytes | None:
        """The bearer token (TCP only), read from ``token_file``; None without TCP."""
        if not self.tcp_enabled:
            return None
        self.check()
        assert self.token_file is not None
        return read_token_file(self.token_file)


def read_token_file(path: Path) -> bytes:
    """The token in ``path`` (surrounding whitespace removed). Raises :class:`SettingsError` when unusable: not a
    regular file, too long, not one printable line, readable by group or others, or owned by another uid than the
    daemon's (whoever owns it can read it, or make it say what he wants). Checked on the open descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # (a FIFO is never waited on)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise SettingsError(f"token file {path} is not a regular file")
            if st.st_size > MAX_TOKEN_BYTES:
                raise SettingsError(f"token file {path} is {st.st_size} bytes; a token is one short line")
            token = f.read(MAX_TOKEN_BYTES).strip()
    except OSError as e:
        raise SettingsError(f"cannot read token file {path}: {e.strerror or e}") from e
    if len(token) < MIN_TOKEN_CHARS or any(c <= 0x20 or c >= 0x7F for c in token):
        raise SettingsError(
            f"token file {path} must hold one line of at least {MIN_TOKEN_CHARS} printable ASCII characters "
            "without spaces (e.g. `openssl rand -hex 32 > FILE`)"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:  # like ssh with a private key: a shared secret must not be shared
        raise SettingsError(
            f"token file {path} is accessible to group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"anyone who can read it can use the daemon: run `chmod 600 {path}` and start again"
        )
    if st.st_uid != os.geteuid():  # (its owner reads it, and may rewrite it: the token is his, not the daemon's)
        raise SettingsError(
            f"token file {path} is owned by uid {st.st_uid}, not by the daemon's uid {os.geteuid()}: its owner can "
            f"read the token (and change it); run `chown {os.geteuid()} {path}` and start again"
        )
    return token
