"""``transformd serve`` as a process (flags and TRANSFORMD_* variables), and the settings it reads."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from transformd.cli.serve import add_commands
from transformd.daemon.settings import SYSTEM_SOCKET, Settings, SettingsError, default_socket_path

from .support.daemon import short_tempdir
from .support.fakes import write_source

pytestmark = pytest.mark.timeout(90)

TOKEN = "cli-token-0123456789abcdef0123"


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 60.0) -> str:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.1)
        if ready:
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            if needle in line:
                return line
        elif proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"no {needle!r} from the daemon; stderr: {''.join(seen)}{proc.stderr.read()}")


def test_serve_process_on_socket_and_tcp_with_env_settings(tmp_path: Path) -> None:
    run = short_tempdir()
    models = tmp_path / "models"
    src = write_source(models / "m", seed=5)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    os.chmod(token, 0o600)  # the daemon refuses a token file others can read
    sock = run / "d" / "transformd.sock"
    env = dict(os.environ)
    env.update(
        TRANSFORMD_SOCKET=str(sock),
        TRANSFORMD_CACHE_DIR=str(tmp_path / "cache"),
        TRANSFORMD_ALLOW_ROOTS=os.pathsep.join([str(tmp_path / "nothing"), str(models)]),
        TRANSFORMD_TOKEN_FILE=str(token),
        TRANSFORMD_DEVICE="cpu",
        TRANSFORMD_LOG_LEVEL="warning",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformd", "serve", "--port", "0", "--max-concurrent-conversions", "2"],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = _wait_for_line(proc, "listening on")
        assert f"unix:{sock}" in line
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:")
        assert oct(os.stat(sock).st_mode & 0o777) == oct(0o660)
        with httpx.Client(base_url=url, timeout=10) as tcp:
            assert tcp.get("/healthz").status_code == 401
            r = tcp.get("/healthz", headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200 and r.json()["device"] == "cpu"
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://d", timeout=10) as http:
            r = http.post("/v1/checkpoints", json={"source": str(src)})
            assert r.status_code == 422  # the fake source is not a checkpoint: the real converter refuses it
            assert "config.json" in r.json()["error"]["message"] or "safetensors" in r.json()["error"]["message"]
            assert http.get("/healthz").json()["cache_root"] == str(tmp_path / "cache")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(run, ignore_errors=True)


def test_serve_refuses_tcp_without_a_token(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "transformd", "serve", "--port", "0", "--cache-dir", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2
    assert "token" in r.stderr and "transformd: error:" in r.stderr


def test_settings_from_environment_and_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRANSFORMD_ALLOW_ROOTS", f"/models{os.pathsep}/data/hub{os.pathsep}")
    monkeypatch.setenv("TRANSFORMD_MAX_CONCURRENT_CONVERSIONS", "3")
    monkeypatch.setenv("TRANSFORMD_DEVICE", "cuda")
    monkeypatch.setenv("TRANSFORMD_PORT", "8123")
    monkeypatch.setenv("TRANSFORMD_CACHE_BUDGET", "500G")
    s = Settings()
    assert s.allow_roots == [Path("/models"), Path("/data/hub")]
    assert s.max_concurrent_conversions == 3 and s.device == "cuda" and s.port == 8123
    assert s.cache_budget == "500G" and s.tcp_host() == "127.0.0.1"
    assert s.socket_path() is None  # TCP asked for, no socket named
    with pytest.raises(SettingsError, match="token"):
        s.check()
    flags = Settings(device="cpu", allow_roots=[Path("/other")], max_concurrent_conversions=1)
    assert flags.device == "cpu" and flags.allow_roots == [Path("/other")] and flags.max_concurrent_conversions == 1
    with pytest.raises(ValueError):
        Settings(allow_roots=["relative/dir"])
    with pytest.raises(ValueError):
        Settings(max_concurrent_conversions=0)

    import argparse

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--allow-root", "/a", "--allow-root", "/b", "--socket", "/tmp/x.sock"])
    assert args.allow_root == [Path("/a"), Path("/b")] and args.handler is not None


def test_default_socket_path_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert default_socket_path() == SYSTEM_SOCKET
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket_path() == Path("/run/user/1000/transformd.sock")
    monkeypatch.setenv("TRANSFORMD_SOCKET", "/srv/td.sock")
    assert default_socket_path() == Path("/srv/td.sock")
    assert default_socket_path("/explicit.sock") == Path("/explicit.sock")
    assert Settings().socket_path() == Path("/srv/td.sock")
    with pytest.raises(SettingsError, match="limit"):
        Settings(socket="/tmp/" + "x" * 120).check()


def test_the_daemon_log_escapes_control_characters() -> None:
    """A failed conversion's log line names tensors of an untrusted checkpoint: escaped, tracebacks kept in lines."""
    import logging

    from transformd.cli.serve import VisibleFormatter

    try:
        raise ValueError("tensor x\x1b]0;owned\x07")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("transformd.daemon", logging.ERROR, __file__, 1, "conversion of %s failed: %s",
                               ("/models/m", "tensor a\x1b[2Jb"), exc_info)
    lines = VisibleFormatter("%(levelname)s %(message)s").format(record).split("\n")
    assert lines[0] == "ERROR conversion of /models/m failed: tensor a\\x1b[2Jb"
    assert lines[-1] == "ValueError: tensor x\\x1b]0;owned\\x07" and len(lines) > 2
    # a newline in a caller's source path forged a log line of its own (an attack review): kept on the record's line
    record = logging.LogRecord("transformd.daemon", logging.INFO, __file__, 1, "converted %s (key %s)",
                               ("/models/u/y\n2026-12-07 12:00:00,000 INFO transformd.daemon: converted /models/x", "k"),
                               None)
    assert VisibleFormatter("%(levelname)s %(message)s").format(record) == (
        "INFO converted /models/u/y\\n2026-12-07 12:00:00,000 INFO transformd.daemon: converted /models/x (key k)")
