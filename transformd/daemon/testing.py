"""The real daemon in a thread of this process, for tests and benchmarks, and a converter that honours shard order.

::

    with DaemonThread(Settings(socket=sock, cache_dir=cache, allow_roots=[models])) as daemon:
        with daemon.client() as http:                      # over the unix socket
            http.post("/v1/checkpoints", json={"source": str(models / "m")})

It runs exactly what ``transformd serve`` runs (:func:`.server.open_listeners`, :func:`.app.create_app`,
uvicorn), on the same sockets, only in a thread instead of the main thread.

Test hooks of a daemon *process* (``transformd serve`` in a subprocess, where a test cannot reach into
the objects): the environment variable :data:`TEST_HOOKS_ENV` (``TRANSFORMD_TEST_HOOKS``), a JSON object,
is read once by :func:`.app.create_app`; it is off (nothing changes) unless set, and the daemon logs a
warning when it is on. Never set it in production. Keys, all optional::

    {"progress_delay_s": 0.02,                      # sleep this long at every progress update of the converter
     "phase_delay_s": {"sealed": 0.3, ...},         # sleep at these phases of the cache's publish (the names of
                                                    # transformd.cache.store's fault hook: reserved, converted,
                                                    # sealed, manifest-written, before-rename, published)
     "log": "/path/conversions.log"}                # append "start|end <key> <pid> <thread> <time>" per converter run

Tests use it to kill a daemon at random points of a slowed-down real conversion and to count how many
converter runs overlap (``max_concurrent_conversions``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from ..cache import Cache, Recipe
from .app import Daemon, create_app
from .server import Listeners, build_server, open_listeners, run_server
from .settings import Settings, SettingsError
from .shards import ConversionOutline, bind_shard_order, plan_of

if TYPE_CHECKING:
    from ..checkpoint import ShardOrder

#: Test-only environment variable (a JSON object, see the module docstring); unset in production.
TEST_HOOKS_ENV = "TRANSFORMD_TEST_HOOKS"

log = logging.getLogger("transformd.daemon")


class TestHooks:
    """The hooks :data:`TEST_HOOKS_ENV` asks for (see the module docstring)."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        progress_delay_s: float = 0.0,
        phase_delay_s: dict[str, float] | None = None,
        log: str | os.PathLike[str] | None = None,
    ):
        self.progress_delay_s = float(progress_delay_s)
        self.phase_delay_s = {str(k): float(v) for k, v in (phase_delay_s or {}).items()}
        self.log = None if log is None else os.fspath(log)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> TestHooks | None:
        """The hooks of ``$TRANSFORMD_TEST_HOOKS``; None when unset or empty. Raises SettingsError when malformed."""
        raw = (os.environ if environ is None else environ).get(TEST_HOOKS_ENV, "")
        if not raw.strip():
            return None
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or set(data) - {"progress_delay_s", "phase_delay_s", "log"}:
                raise ValueError("expected an object with progress_delay_s, phase_delay_s, log")
            return cls(**data)
        except (ValueError, TypeError) as e:
            raise SettingsError(f"{TEST_HOOKS_ENV} is not a valid JSON hook description: {e}") from None

    def write_log(self, event: str, key: str) -> None:
        if self.log is None:
            return
        line = f"{event} {key} {os.getpid()} {threading.get_ident()} {time.time():.6f}\n"
        fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def phase(self, name: str) -> None:
        """The cache's fault hook: sleep at the configured phases."""
        delay = self.phase_delay_s.get(name)
        if delay:
            time.sleep(delay)

    def wrap(self, converter: Any) -> HookedConverter:
        return HookedConverter(converter, self)


class HookedConverter:
    """``inner`` with :class:`TestHooks` applied: slowed progress updates and a start/end log per run."""

    def __init__(self, inner: Any, hooks: TestHooks):
        self.inner = inner
        self.hooks = hooks

    def plan(self, src: Path, recipe: Recipe) -> ConversionOutline | None:
        return plan_of(self.inner, src, recipe)

    def __call__(
        self,
        src: Path,
        out: Path,
        recipe: Recipe,
        progress: Callable[[Any], None],
        *,
        shard_order: ShardOrder | None = None,
    ) -> Any:
        key = Path(out).parent.name[:32]
        delay = self.hooks.progress_delay_s

        def slowed(update: Any) -> None:
            if delay:
                time.sleep(delay)
            progress(update)

        inner = self.inner if shard_order is None else bind_shard_order(self.inner, shard_order)
        self.hooks.write_log("start", key)
        try:
            return inner(src, out, recipe, slowed)
        finally:
            self.hooks.write_log("end", key)

    def __repr__(self) -> str:
        return f"HookedConverter({self.inner!r})"


def apply_test_hooks(converter: Any, cache: Cache) -> Any:
    """``converter`` wrapped as ``$TRANSFORMD_TEST_HOOKS`` asks (and the cache's phase hook set); unchanged if unset."""
    hooks = TestHooks.from_env()
    if hooks is None:
        return converter
    log.warning("%s is set: test hooks are active (%s); never use this in production", TEST_HOOKS_ENV,
                os.environ[TEST_HOOKS_ENV])
    if hooks.phase_delay_s:
        cache._fault_hook = hooks.phase
    return hooks.wrap(converter)


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

    def __init__(self, settings: Settings, *, converter: Any = None, cache: Cache | None = None, platform: Any = None):
        self.settings = settings
        self.app = create_app(settings, converter=converter, cache=cache, platform=platform)
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


class DaemonProcess:
    """``python -m transformd serve ...`` in a subprocess (the real daemon, as operators run it), for tests.

    ``start()`` waits until ``/healthz`` answers over the unix socket; ``kill()`` sends SIGKILL, ``stop()``
    SIGTERM. Standard error goes to ``log_path`` (read it with :meth:`log_text`). ``hooks``: the
    :data:`TEST_HOOKS_ENV` object (see the module docstring).
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        cache_dir: str | os.PathLike[str],
        allow_roots: list[str | os.PathLike[str]],
        *,
        args: list[str] | None = None,
        hooks: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
    ):
        import sys

        self.socket_path = Path(socket_path)
        self.cache_dir = Path(cache_dir)
        self.cmd = [sys.executable, "-m", "transformd", "serve", "--socket", os.fspath(socket_path), "--cache-dir",
                    os.fspath(cache_dir), "--device", "cpu", "--log-level", "warning"]
        for root in allow_roots:
            self.cmd += ["--allow-root", os.fspath(root)]
        self.cmd += list(args or [])
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMD_")}
        self.env.update(env or {})
        if hooks:
            self.env[TEST_HOOKS_ENV] = json.dumps(hooks)
        self.log_path = Path(log_path) if log_path is not None else self.socket_path.with_suffix(".log")
        self.proc: Any = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return int(self.proc.pid)

    def start(self, timeout: float = 60.0) -> DaemonProcess:
        import subprocess

        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=log_file)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}: {self.log_text()[-3000:]}")
            if self.socket_path.exists():
                try:
                    with self.client(timeout=2.0) as http:
                        if http.get("/healthz").status_code in (200, 503):
                            return self
                except httpx.TransportError:
                    pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the daemon did not start in {timeout} s: {self.log_text()[-3000:]}")
            time.sleep(0.05)

    def client(self, *, timeout: float = 30.0) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=os.fspath(self.socket_path))
        return httpx.Client(transport=transport, base_url="http://transformd", timeout=timeout)

    def kill(self) -> None:
        """SIGKILL and reap."""
        import signal

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; returns the exit status (SIGKILL after ``timeout``)."""
        import signal
        import subprocess

        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return int(self.proc.wait(timeout))
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.proc.returncode)

    def rss_bytes(self) -> int | None:
        """Resident set size of the daemon process (``VmRSS`` of /proc/PID/status); None once it exited."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> DaemonProcess:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop(10)
