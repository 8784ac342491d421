"""Trust class 5: no request freezes the daemon for others.

* a ``select`` with nested repetition through alternation (``(.|.)*X``): matched by RE2 in linear time, or refused
  (422) where RE2 lacks the syntax; before, Python's ``re`` froze the whole daemon (GIL held, healthz timed out). Run
  against a daemon *process* so that a frozen one can be killed;
* FIFOs where ``hf download --local-dir`` records (``.cache/huggingface/download/*.metadata``) should be, in more
  sources than the worker pool has threads: never opened blocking, and health answers throughout;
* idle TCP connections past the TCP listener's limit: the next TCP client gets a JSON 503, the unix socket keeps
  answering, and connections that send no request are closed (JSON 408) after the header deadline.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import socket
import threading
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
                assert r.status_code in (200, 202, 422), (pattern, r.status_code, r.text)  # RE2, or refused
                assert _health_ok(http) < 2.0
    finally:
        daemon.kill()
        shutil.rmtree(run, ignore_errors=True)
    fault_log.record(CATEGORY, "select regex with nested repetition through alternation", len(patterns),
                     "answered at once (RE2, or 422), healthz fast")


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


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_one_callers_slow_sources_leave_the_others_source_threads(monkeypatch: pytest.MonkeyPatch, fault_log) -> None:
    """Every request's source work (the hub lookup, the hashing, the checks) runs on one pool of source threads.
    Before, one uid that asked for as many fresh sources as the pool has threads, each slow to hash (a helper
    used sixteen sparse 20 GiB files), held them all: another caller's lookup of a cached checkpoint waited 54 s.
    A uid's requests now take at most ``SOURCE_WORK_PER_CALLER`` of them at once (here 2 of 4)."""
    from transformd.daemon import service, state

    from .support.callers import NOBODY, as_uid
    from .support.daemon import wait_ready

    monkeypatch.setattr(service, "SOURCE_THREADS", 4)
    monkeypatch.setattr(state, "SOURCE_WORK_PER_CALLER", 2)
    release = _hashing_held(monkeypatch, "/slow")  # the slow sources' hashing waits (an endless file, say)
    base = short_tempdir("tdf-")
    os.chmod(base, 0o755)
    models = base / "models"
    cached = write_sample_checkpoint(models / "cached", layers=1, experts=1, shards=1)
    slows = [write_sample_checkpoint(models / f"slow{i}", layers=1, experts=1, shards=1, seed=i + 1) for i in range(4)]
    for p in [models, *models.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    pool = concurrent.futures.ThreadPoolExecutor(len(slows))
    try:
        with Daemons() as daemons:
            daemon = daemons.start(cache_dir=base / "cache", allow_roots=[models], prefix="tdf-", log_level="critical")
            os.chmod(daemon.socket_path.parent, 0o755)
            os.chmod(daemon.socket_path, 0o666)
            with daemon.client(timeout=60) as http:
                key = http.post("/v1/checkpoints", json={"source": str(cached)}).json()["key"]
                assert wait_ready(http, key)["state"] == "ready"
                asked = [pool.submit(as_uid, daemon.socket_path, NOBODY, [("POST", "/v1/checkpoints",
                                                                            {"source": str(s)})]) for s in slows]
                time.sleep(1.0)  # (the other uid's requests are in: two hashing, two waiting for its slots)
                t = time.monotonic()
                r = http.post("/v1/checkpoints", json={"source": str(cached)}, timeout=10)
                took = time.monotonic() - t
                release.set()
                assert r.status_code == 200 and r.json()["key"] == key, r.text
                assert took < 5.0, took
                assert [a.result()[0][0] for a in asked] == [202] * len(slows)
    finally:
        release.set()
        pool.shutdown()
        shutil.rmtree(base, ignore_errors=True)
    fault_log.record(CATEGORY, "one uid's fresh sources, slow to hash, as many as the source threads", len(slows),
                     f"another caller's cached lookup answered in {took:.2f} s")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_request_waiting_for_its_key_holds_none_of_its_callers_source_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large source new to the cache is answered once the hashing beside its conversion has the key (minutes for
    a real model). That wait is not source work: the caller's other requests, a cached lookup here, go on with
    their slots (``SOURCE_WORK_PER_CALLER`` is 1 here)."""
    from transformd.daemon import state

    from .support.callers import NOBODY, as_uid
    from .support.daemon import wait_ready

    monkeypatch.setattr(state, "SOURCE_WORK_PER_CALLER", 1)
    release = _hashing_held(monkeypatch, "/big")  # the big source's hashing (beside its conversion): its key too
    base = short_tempdir("tdk-")
    os.chmod(base, 0o755)
    models = base / "models"
    cached = write_sample_checkpoint(models / "cached", layers=1, experts=1, shards=1)
    big = write_sample_checkpoint(models / "big", layers=1, experts=1, shards=1, seed=1)
    for p in [models, *models.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
        if p.is_file():  # settled: the big one is hashed beside its conversion, the cached one is remembered
            os.utime(p, (p.stat().st_atime - 60, p.stat().st_mtime - 60))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        with Daemons() as daemons:
            daemon = daemons.start(cache_dir=base / "cache", allow_roots=[models], prefix="tdk-", log_level="critical")
            daemon.daemon.cache.hash_alongside_min_bytes = 0  # (small samples take the large sources' path)
            os.chmod(daemon.socket_path.parent, 0o755)
            os.chmod(daemon.socket_path, 0o666)
            with daemon.client(timeout=60) as http:
                key = http.post("/v1/checkpoints", json={"source": str(cached)}).json()["key"]
                assert wait_ready(http, key)["state"] == "ready"
            waiting = pool.submit(as_uid, daemon.socket_path, NOBODY, [("POST", "/v1/checkpoints",
                                                                         {"source": str(big)})])
            time.sleep(1.0)  # (its POST waits for the key)
            assert not waiting.done()
            t = time.monotonic()
            (status, body), = as_uid(daemon.socket_path, NOBODY, [("POST", "/v1/checkpoints", {"source": str(cached)})])
            took = time.monotonic() - t
            release.set()
            assert status == 200 and body["key"] == key and took < 5.0, (status, took)
            assert waiting.result()[0][0] in (200, 202)
    finally:
        release.set()
        pool.shutdown()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_callers_engine_checks_take_its_source_slots_and_its_own_conversion_is_not_deleted_under_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine check of a new source (``engine`` in the request: the output's readiness from its headers) is
    source work too: a uid's run at most ``SOURCE_WORK_PER_CALLER`` at once (before, all of them ran together, on
    the thread pool of cached lookups), after its limit of queued conversions. And a caller that DELETEs its own
    conversion while it runs hears 409 conversion_in_progress (before: 403 not_owner, as its creator is known only
    once it is converted)."""
    from transformd.daemon import app as app_module
    from transformd.daemon import state

    from .support.callers import NOBODY, as_uid
    from .support.fakes import CopyConverter

    monkeypatch.setattr(state, "SOURCE_WORK_PER_CALLER", 2)
    running, peak, lock = [0], [0], threading.Lock()
    real = app_module.plan_readiness

    def counted(*args, **kwargs):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.3)
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(app_module, "plan_readiness", counted)
    base = short_tempdir("tde-")
    os.chmod(base, 0o755)
    models = base / "models"
    sources = [write_sample_checkpoint(models / f"m{i}", layers=1, experts=1, shards=1, seed=i) for i in range(6)]
    for p in [models, *models.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    pool = concurrent.futures.ThreadPoolExecutor(len(sources))
    try:
        with Daemons() as daemons:
            daemon = daemons.start(CopyConverter(delay=3.0), cache_dir=base / "cache", allow_roots=[models],
                                   prefix="tde-", log_level="critical", max_queued_per_caller=8)
            os.chmod(daemon.socket_path.parent, 0o755)
            os.chmod(daemon.socket_path, 0o666)
            asked = [pool.submit(as_uid, daemon.socket_path, NOBODY, [
                ("POST", "/v1/checkpoints", {"source": str(s), "engine": "transformers"})]) for s in sources]
            answers = [a.result()[0] for a in asked]
            assert [status for status, _ in answers] == [202] * len(sources), answers
            assert peak[0] == 2, peak
            ((status, deleted),) = as_uid(daemon.socket_path, NOBODY, [
                ("DELETE", f"/v1/checkpoints/{answers[-1][1]['key']}", None)])  # (3 s a conversion: still on)
            assert status == 409 and deleted["error"]["code"] == "conversion_in_progress", (status, deleted)
    finally:
        pool.shutdown()
        shutil.rmtree(base, ignore_errors=True)


def _hashing_held(monkeypatch: pytest.MonkeyPatch, fragment: str) -> threading.Event:
    """Make the daemon's hashing (in this process) of any file whose real path holds ``fragment`` wait until the
    event returned is set (at most 60 s)."""
    from transformd.cache import keys

    release, real = threading.Event(), keys.hash_file

    def held(path, *args, **kwargs):
        if fragment in os.readlink(path):
            release.wait(60)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(keys, "hash_file", held)
    return release


#: As uid argv[2]: open argv[3] connections to the unix socket argv[1], each sending a POST's headers and one byte
#: of its body; say how many there are, wait for a line on stdin, then print what each got back (its status, or 0
#: while it is still open and silent).
_TRICKLER = """
import json, os, socket, sys
os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))
conns = []
for _ in range(int(sys.argv[3])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    try:  # (a connection past the limit may be answered and closed before this is sent)
        s.sendall(b"POST /v1/checkpoints HTTP/1.1\\r\\nHost: td\\r\\nContent-Type: application/json\\r\\n"
                  b"Content-Length: 60000\\r\\n\\r\\n{")
    except OSError:
        pass
    conns.append(s)
print(len(conns), flush=True)
sys.stdin.readline()
got = []
for s in conns:
    s.settimeout(5)  # (on a loaded machine the daemon's 408 may come late)
    try:
        data = s.recv(65536)
        got.append(int(data.split()[1]) if data else -1)
    except (TimeoutError, socket.timeout):
        got.append(0)
    except ConnectionResetError:
        got.append(-1)
print(json.dumps(got), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_one_uids_connections_with_trickling_bodies_do_not_lock_out_the_others(tmp_path: Path, daemons: Daemons,
                                                                               fault_log) -> None:
    """A review's attack: one uid opened more connections than the unix listener takes (2048), each a POST whose
    body came a byte at a time; the header deadline no longer applied, nothing limited the body, and every other
    caller got 503 for as long as it liked. Now a uid holds at most ``max_unix_connections_per_uid`` (root's are
    not counted), and a body not all received within the deadline is a JSON 408 and a close."""
    import subprocess
    import sys

    from .support.callers import NOBODY

    (tmp_path / "models").mkdir()
    limit, per_uid, n = 24, 8, 30
    daemon = daemons.start(cache_dir=tmp_path / "cache", allow_roots=[tmp_path / "models"], prefix="tdt-",
                           log_level="critical", max_unix_connections=limit, max_unix_connections_per_uid=per_uid,
                           header_timeout_s=1.5)
    os.chmod(daemon.socket_path.parent, 0o755)
    os.chmod(daemon.socket_path, 0o666)
    child = subprocess.Popen([sys.executable, "-c", _TRICKLER, str(daemon.socket_path), str(NOBODY), str(n)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert int(child.stdout.readline()) == n
        time.sleep(0.3)
        with daemon.client(timeout=10) as http:
            _health_ok(http, within=10)  # another caller is answered (before: 503) while that uid holds its connections
        time.sleep(2.0)  # past the deadline
        got = json.loads(child.communicate("go\n", timeout=60)[0])
    finally:
        child.kill()
        child.wait()
    # past the limit: the JSON 503 (or, had it closed before the request was sent, a reset); none still open
    assert got.count(408) == per_uid and sorted(set(got) - {408}) in ([503], [-1, 503], [-1]), got
    assert got.count(503) + got.count(-1) == n - per_uid, got
    fault_log.record(CATEGORY, f"one uid opens {n} unix connections, each a POST whose body trickles (listener "
                     f"limit {limit}, {per_uid} per uid)", n,
                     f"past {per_uid}: JSON 503 for that uid only; others answered; the rest JSON 408 after 1.5 s")


def test_a_kept_alive_connections_next_request_has_a_header_deadline_too(tmp_path: Path, daemons: Daemons,
                                                                         fault_log) -> None:
    """The header deadline was armed once, for a connection's first request: a complete request, then a few bytes
    of a second one, held the connection for good (the first byte stops uvicorn's keep-alive timer; a review held
    one 20 s past a 1 s deadline). Many such connections would fill the listener."""
    (tmp_path / "models").mkdir()
    daemon = daemons.start(cache_dir=tmp_path / "cache", allow_roots=[tmp_path / "models"], prefix="tdk-",
                           log_level="critical", header_timeout_s=1.0)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(str(daemon.socket_path))
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: td\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost:")  # and nothing more
        t0 = time.monotonic()
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        waited = time.monotonic() - t0
    finally:
        s.close()
    assert b"408" in got.split(b"\r\n")[0] and b'"request_timeout"' in got, got
    assert waited < 5, waited
    fault_log.record(CATEGORY, "a kept-alive connection's second request sends part of its headers, then nothing",
                     1, f"JSON 408 and closed after {waited:.1f} s (deadline 1 s)")
