"""The real daemon in a thread of this process, for tests and benchmarks, and a converter that honours shard order.

::

    with DaemonThread(Settings(socket=sock, cache_dir=cache, allow_roots=[models])) as daemon:
        with daemon.client() as http:                      # over the unix socket
            http.post("/v1/checkpoints", json={"source": str(models / "m")})

It runs exactly what ``transformd serve`` runs (:func:`.server.open_listeners`, :func:`.app.create_app`,
uvicorn), on the same sockets, only in a thread instead of the main thread.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from ..cache import Cache, Recipe
from .app import Daemon, create_app
from .server import Listeners, build_server, open_listeners, run_server
from .settings import Settings
from .shards import ConversionOutline, ShardOrder


class OrderedCopyConverter:
    """A fake converter: copies the source, the ``*.safetensors`` shards one at a time in the order
    ``shard_order`` picks (index order without one), sleeping ``delay`` seconds before each and reporting
    each finished shard (``shard_order.done``); then every other file. ``log``: one line per run."""

    def __init__(self, delay: float = 0.0, log: str | os.PathLike[str] | None = None):
        self.delay = delay
        self.log = None if log is None else os.fspath(log)

    @staticmethod
    def _shards(src: Path) -> list[str]:
        return sorted(p.name for p in Path(src).iterdir() if p.suffix == ".safetensors" and not p.name.startswith("."))

    def plan(self, src: Path, recipe: Recipe) -> ConversionOutline:
        shards = self._shards(src)
        return ConversionOutline(tuple(shards), None, sum(os.path.getsize(Path(src) / n) for n in shards))

    def __call__(
        self,
        src: Path,
        out: Path,
        recipe: Recipe,
        progress: Callable[[Any], None],
        *,
        shard_order: ShardOrder | None = None,
    ) -> dict[str, Any]:
        if self.log is not None:
            fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, f"{os.getpid()}\n".encode())
            finally:
                os.close(fd)
        src = Path(src)
        out.mkdir()
        pending = self._shards(src)
        total = sum(os.path.getsize(src / n) for n in pending)
        done = 0
        order = []
        while pending:
            name = shard_order.next(list(pending)) if shard_order is not None else pending[0]
            pending.remove(name)
            order.append(name)
            if self.delay:
                time.sleep(self.delay)
            shutil.copyfile(src / name, out / name)
            with open(out / name, "rb") as f:
                os.fsync(f.fileno())
            done += os.path.getsize(out / name)
            if shard_order is not None:
                shard_order.done(name, out / name)
            progress({"shard": name, "bytes_done": done, "bytes_total": total})
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(src)
            for n in filenames:
                if n.startswith(".") or (rel == Path(".") and n.endswith(".safetensors")):
                    continue
                (out / rel).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(dirpath) / n, out / rel / n)
        return {"order": order}


class DaemonThread:
    """``transformd serve`` with ``settings``, in a daemon thread; a context manager."""

    def __init__(self, settings: Settings, *, converter: Any = None, cache: Cache | None = None):
        self.settings = settings
        self.app = create_app(settings, converter=converter, cache=cache)
        self.listeners: Listeners = open_listeners(settings)
        self.server = build_server(self.app, settings)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def daemon(self) -> Daemon:
        return self.app.state.daemon

    @property
    def socket_path(self) -> Path | None:
        return self.listeners.unix_path

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the TCP listener."""
        assert self.listeners.tcp_address is not None, "the daemon has no TCP listener"
        host, port = self.listeners.tcp_address
        return f"http://{host}:{port}"

    def _run(self) -> None:
        try:
            asyncio.run(run_server(self.server, self.listeners))
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e

    def start(self, timeout: float = 30.0) -> DaemonThread:
        self._thread = threading.Thread(target=self._run, name="transformd-daemon", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.listeners.close()
                raise RuntimeError(f"the daemon did not start: {self._error!r}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.listeners.close()

    def __enter__(self) -> DaemonThread:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def client(self, *, tcp: bool = False, token: str | None = None, timeout: float = 30.0) -> httpx.Client:
        """An httpx client of the unix socket (default) or of the TCP listener (``tcp``, with ``token``)."""
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        if tcp:
            return httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        assert self.socket_path is not None, "the daemon has no unix socket"
        transport = httpx.HTTPTransport(uds=os.fspath(self.socket_path))
        return httpx.Client(transport=transport, base_url="http://transformd", headers=headers, timeout=timeout)

    def async_client(self, *, timeout: float = 30.0) -> httpx.AsyncClient:
        assert self.socket_path is not None, "the daemon has no unix socket"
        transport = httpx.AsyncHTTPTransport(uds=os.fspath(self.socket_path))
        return httpx.AsyncClient(transport=transport, base_url="http://transformd", timeout=timeout)


def wait_ready(http: httpx.Client, key: str, timeout: float = 60.0, interval: float = 0.02) -> dict[str, Any]:
    """Poll ``GET /v1/checkpoints/{key}`` until ready or failed; returns the last body."""
    deadline = time.monotonic() + timeout
    while True:
        r = http.get(f"/v1/checkpoints/{key}")
        body = r.json()
        if r.status_code != 200 or body["state"] in ("ready", "failed"):
            return body
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint {key} not ready after {timeout} s: {body}")
        time.sleep(interval)


def short_tempdir(prefix: str = "td-") -> Path:
    """A new directory under /tmp with a short path (unix socket paths are limited to 107 bytes)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp" if os.path.isdir("/tmp") else None))


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The value of sample ``name`` (with exactly ``labels``) in a Prometheus text exposition; 0 if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and dict(sample.labels) == (labels or {}):
                return float(sample.value)
    return 0.0


def raw_request(
    socket_path: str | os.PathLike[str],
    method: str,
    target: str,
    *,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    timeout: float = 10.0,
) -> tuple[int, bytes]:
    """Send one HTTP/1.1 request with ``target`` exactly as given (no URL normalisation, unlike httpx) over a
    unix socket; returns (status, body)."""
    import socket

    lines = [f"{method} {target} HTTP/1.1", "Host: transformd", "Connection: close", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(os.fspath(socket_path))
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        chunks = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            chunks.append(data)
    response = b"".join(chunks)
    head, _, payload = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, payload
