"""Real daemons for tests: in a thread of this process (:class:`DaemonThread`, :class:`Daemons`) or as a process
(:class:`DaemonProcess`), plus helpers to talk to them.

::

    with DaemonThread(Settings(socket=sock, cache_dir=cache, allow_roots=[models])) as daemon:
        with daemon.client() as http:                      # over the unix socket
            http.post("/v1/checkpoints", json={"source": str(models / "m")})

:class:`DaemonThread` runs exactly what ``transformd serve`` runs (:func:`transformd.daemon.server.open_listeners`,
:func:`transformd.daemon.app.create_app`, uvicorn), on the same sockets, only in a thread instead of the main
thread; fakes are injected (``converter=``). :class:`Daemons` starts several, each on a socket in its own short
directory, and stops them all at the end (the ``daemons`` fixture of tests/conftest.py is one per test; a
module-scoped fixture uses ``with Daemons() as d``).

:class:`DaemonProcess` runs ``python -m transformd serve`` in a subprocess, as operators run it. With ``hooks``
(where a test cannot reach into the objects of another process) it runs ``python -m tests.support.daemon serve
--hooks JSON ...`` instead: the same flags and the daemon's own :func:`transformd.daemon.server.serve`, with the
real converter wrapped by :class:`HookedConverter` and the cache's phase hook set. Keys of ``hooks``, all optional::

    {"progress_delay_s": 0.02,                      # sleep this long at every progress update of the converter
     "phase_delay_s": {"sealed": 0.3, ...},         # sleep at these phases of the cache's publish (the names of
                                                    # transformd.cache.store's fault hook: reserved, converted,
                                                    # sealed, manifest-written, before-rename, published)
     "log": "/path/conversions.log"}                # append "start|end <key> <pid> <thread> <time>" per converter run

Tests use them to kill a daemon at random points of a slowed-down real conversion and to count how many
converter runs overlap (``max_concurrent_conversions``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from transformd.cache import Cache, Recipe
from transformd.daemon.app import create_app
from transformd.daemon.state import Daemon
from transformd.daemon.server import Listeners, build_server, open_listeners, run_server
from transformd.daemon.settings import Settings
from transformd.daemon.shards import ConversionOutline, bind_shard_order, plan_of

from .fakes import REPO, append_line

if TYPE_CHECKING:
    from transformd.checkpoint import ShardOrder

log = logging.getLogger("transformd.daemon")


class Hooks:
    """What a hooked daemon process does besides serving (see the module docstring)."""

    def __init__(
        self,
        progress_delay_s: float = 0.0,
        phase_delay_s: dict[str, float] | None = None,
        log: str | os.PathLike[str] | None = None,
    ):
        self.progress_delay_s = float(progress_delay_s)
        self.phase_delay_s = {str(k): float(v) for k, v in (phase_delay_s or {}).items()}
        self.log = None if log is None else os.fspath(log)

    def write_log(self, event: str, key: str) -> None:
        if self.log is None:
            return
        append_line(self.log, f"{event} {key} {os.getpid()} {threading.get_ident()} {time.time():.6f}")

    def phase(self, name: str) -> None:
        """The cache's fault hook: sleep at the configured phases."""
        delay = self.phase_delay_s.get(name)
        if delay:
            time.sleep(delay)

    def wrap(self, converter: Any) -> HookedConverter:
        return HookedConverter(converter, self)


class HookedConverter:
    """``inner`` with :class:`Hooks` applied: slowed progress updates and a start/end log per run."""

    def __init__(self, inner: Any, hooks: Hooks):
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


class Daemons:
    """Real daemons started by one test (or module); a context manager that stops them all on exit."""

    def __init__(self) -> None:
        self._daemons: list[DaemonThread] = []
        self._runs: list[Path] = []

    def start(
        self,
        converter: Any = None,
        *,
        cache_dir: str | Path,
        allow_roots: list[Path] | tuple[Path, ...] = (),
        prefix: str = "td-",
        socket_name: str = "td.sock",
        platform: Any = None,
        **settings: Any,
    ) -> DaemonThread:
        """A started daemon with ``settings`` (as ``transformd serve`` takes them) over these defaults: a socket
        ``socket_name`` in a new short directory (``settings["socket"]`` replaces it, None for TCP only), the CPU,
        log level warning. ``converter``: the cache's converter (default: the real one); ``platform``: the GPU
        that target ``auto`` decides for (default: detected)."""
        run = short_tempdir(prefix)
        self._runs.append(run)
        base: dict[str, Any] = {
            "socket": run / socket_name,
            "cache_dir": cache_dir,
            "allow_roots": list(allow_roots),
            "device": "cpu",
            "log_level": "warning",
        }
        base.update(settings)
        daemon = DaemonThread(Settings(**base), converter=converter, platform=platform).start()
        self._daemons.append(daemon)
        return daemon

    def close(self) -> None:
        for daemon in self._daemons:
            daemon.stop()
        for run in self._runs:
            shutil.rmtree(run, ignore_errors=True)
        self._daemons.clear()
        self._runs.clear()

    def __enter__(self) -> Daemons:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    SIGTERM. Standard error goes to ``log_path`` (read it with :meth:`log_text`). ``hooks``: a :class:`Hooks`
    object's keys; the process is then ``python -m tests.support.daemon serve`` (see the module docstring).
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
        self.socket_path = Path(socket_path)
        self.cache_dir = Path(cache_dir)
        serve = ["tests.support.daemon", "serve", "--hooks", json.dumps(hooks)] if hooks else ["transformd", "serve"]
        self.cmd = [sys.executable, "-m", *serve, "--socket", os.fspath(socket_path), "--cache-dir",
                    os.fspath(cache_dir), "--device", "cpu", "--log-level", "warning"]
        for root in allow_roots:
            self.cmd += ["--allow-root", os.fspath(root)]
        self.cmd += list(args or [])
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMD_")}
        self.env.update(env or {})
        if hooks:
            self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH", "")) if p)
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


def serve_main(argv: list[str] | None = None) -> int:
    """``python -m tests.support.daemon serve --hooks JSON [transformd serve's flags]``: the daemon's own
    :func:`transformd.daemon.server.serve` with the real converter wrapped by :class:`HookedConverter`."""
    import argparse

    from transformd.cli.serve import _settings_from_args, add_commands
    from transformd.daemon.server import serve
    from transformd.daemon.shards import TransformdShardConverter

    parser = argparse.ArgumentParser(prog="python -m tests.support.daemon")
    add_commands(parser.add_subparsers(dest="command", required=True)).add_argument(
        "--hooks", required=True, type=json.loads, help="a JSON object of Hooks' keyword arguments"
    )
    args = parser.parse_args(argv)
    settings = _settings_from_args(args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    hooks = Hooks(**args.hooks)
    converter = TransformdShardConverter(settings.device)
    cache = Cache(settings.cache_dir, budget_bytes=settings.cache_budget, converter=converter, device=settings.device)
    if hooks.phase_delay_s:
        cache._fault_hook = hooks.phase
    log.warning("test hooks are active: %s", args.hooks)
    return serve(settings, converter=hooks.wrap(converter), cache=cache)


if __name__ == "__main__":
    sys.exit(serve_main())
