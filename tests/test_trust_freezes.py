"""Trust class 5: no request freezes the daemon for others.

* a ``select`` with nested repetition through alternation (``(.|.)*X``): matched by RE2 in linear time; before,
  Python's ``re`` froze the whole daemon (GIL held, healthz timed out). Run against a daemon *process* so that a
  frozen one can be killed;
* FIFOs where ``hf download --local-dir`` records (``.cache/huggingface/download/*.metadata``) should be, in more
  sources than the worker pool has threads: never opened blocking, and health answers throughout;
* idle TCP connections past the TCP listener's limit: the next TCP client gets a JSON 503, the unix socket keeps
  answering, and connections that send no request are closed (JSON 408) after the header deadline.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import socket
import time
from pathlib import Path

import httpx
import pytest

from transformd.sample import write_sample_checkpoint

from .support.daemon import DaemonProcess, Daemons, short_tempdir

pytestmark = pytest.mark.timeout(240)

CATEGORY = "trust 5: one request freezes everything"
TOKEN = "freeze-token-0123456789abcdef0123456789"


def _health_ok(http: httpx.Client, within: float = 5.0) -> float:
    t = time.monotonic()
    r = http.get("/healthz", timeout=within)
    assert r.status_code == 200, r.text
    return time.monotonic() - t


def test_catastrophic_select_regex_does_not_freeze(tmp_path: Path, fault_log) -> None:
    models = tmp_path / "models"
    src = write_sample_checkpoint(models / "m", layers=1, experts=2)
    run = short_tempdir("tdz-")
    daemon = DaemonProcess(run / "td.sock", tmp_path / "cache", [models]).start()
    try:
        with daemon.client(timeout=15) as http:
            patterns = ["(.|.)*X", "(a|a)*b", "((.|.)*)*Z", "(x+x+)+y", "(?=(.|.)*X)", "(?!(a|a)*b).*.*"]
            for pattern in patterns:
                try:
                    r = http.post("/v1/checkpoints", json={"source": str(src), "select": pattern})
                except httpx.TimeoutException:
                    pytest.fail(f"select {pattern!r} froze the daemon")
                assert r.status_code in (400, 422), (pattern, r.status_code, r.text)
                assert _health_ok(http) < 2.0
    finally:
        daemon.kill()
        shutil.rmtree(run, ignore_errors=True)
    fault_log.record(CATEGORY, "select regex with nested repetition through alternation", len(patterns),
                     "answered at once (RE2, or 400), healthz fast")


def test_fifo_download_records_do_not_block_anyone(tmp_path: Path, fault_log) -> None:
    models = tmp_path / "models"
    n = 48  # more than anyio's 40 worker threads
    for i in range(n):
        src = models / f"s{i}"
        meta = src / ".cache" / "huggingface" / "download"
        meta.mkdir(parents=True)
        (src / "config.json").write_text("{}")
        (src / "model.safetensors").write_bytes(b"\0" * 16)
        os.mkfifo(meta / "config.json.metadata")
        os.mkfifo(meta / "model.safetensors.metadata")
    good = write_sample_checkpoint(models / "good", layers=1, experts=2)
    run = short_tempdir("tdf-")
    daemon = DaemonProcess(run / "td.sock", tmp_path / "cache", [models]).start()
    try:
        with daemon.client(timeout=15) as http:
            def post(i: int) -> int:
                with daemon.client(timeout=15) as c:
                    try:
                        return c.post("/v1/checkpoints", json={"source": str(models / f"s{i}")}).status_code
                    except httpx.TimeoutException:
                        return -1
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                futures = [pool.submit(post, i) for i in range(n)]
                time.sleep(1.0)
                assert _health_ok(http) < 3.0
                codes = [f.result() for f in futures]
            assert -1 not in codes, codes
            assert set(codes) <= {422, 503}, codes
            assert _health_ok(http) < 2.0
            assert http.post("/v1/checkpoints", json={"source": str(good)}).status_code in (200, 202)
    finally:
        daemon.kill()
        shutil.rmtree(run, ignore_errors=True)
    fault_log.record(CATEGORY, f"FIFO download records in {n} sources at once", n,
                     "never opened blocking: 422 each, healthz and lookups answer")


def test_idle_tcp_connections_cannot_starve_the_unix_socket(tmp_path: Path, daemons: Daemons, fault_log) -> None:
    (tmp_path / "models").mkdir()
    token = tmp_path / "token"
    token.write_text(TOKEN)
    os.chmod(token, 0o600)
    limit, idle_n = 20, 30
    daemon = daemons.start(port=0, token_file=token, cache_dir=tmp_path / "cache", allow_roots=[tmp_path / "models"],
                           prefix="tdi-", log_level="critical", max_tcp_connections=limit, header_timeout_s=1.5)
    idle: list[socket.socket] = []
    try:
        assert daemon.listeners.tcp_address is not None
        host, port = daemon.listeners.tcp_address
        for _ in range(idle_n):
            s = socket.create_connection((host, port), timeout=5)
            idle.append(s)
        time.sleep(0.3)
        with daemon.client(timeout=5) as http:
            assert _health_ok(http) < 1.0  # the unix socket answers while TCP is full
        r = httpx.get(f"http://{host}:{port}/healthz", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections", r.text
        time.sleep(2.5)  # past the header deadline: the idle connections are closed by the daemon
        closed = 0
        for s in idle:
            s.settimeout(2)
            try:
                data = s.recv(4096)
                while data and not data.endswith(b"}"):
                    more = s.recv(4096)
                    if not more:
                        break
                    data += more
                closed += 1 if (data == b"" or b'"status": 408' in data or b'"status": 503' in data) else 0
            except (TimeoutError, socket.timeout):
                pass
            except ConnectionResetError:
                closed += 1
        assert closed == idle_n, f"{closed} of {idle_n} idle connections closed"
        r = httpx.get(f"http://{host}:{port}/healthz", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
        assert r.status_code == 200, r.text
    finally:
        for s in idle:
            s.close()
        daemon.stop()
    fault_log.record(CATEGORY, f"{idle_n} idle TCP connections without a request (TCP limit {limit})", idle_n,
                     "unix socket answers; TCP past the limit: JSON 503; idle ones closed (JSON 408) after 1.5 s")
