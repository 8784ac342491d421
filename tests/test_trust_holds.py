"""Trust, second round (issue 42, item 1): nothing a caller sends holds the daemon.

A real daemon *process* (a frozen one can be killed), attacked by an unprivileged uid while another thread asks
``/healthz`` every 50 ms and keeps the slowest answer:

* ``select`` patterns that RE2 refuses (lookahead with bounded repeats, lookbehind, backreferences, atomic groups,
  possessive repeats): a 422 ``bad_select`` naming what RE2 lacks, never a fallback to Python's ``re`` (which
  matched ``(?!!).{0,9}...!`` against the sample's tensor names for seconds per name, holding the GIL: /healthz
  froze) and never a 500 (``(?<=a*)b``: Python's compile error was not caught);
* a burst of patterns that RE2 compiles slowest (a Unicode class repeated 1000 times, ~30 ms each with the GIL
  held): compiled one at a time, so /healthz waits for one compile, not for the burst;
* a deeply nested JSON body and a body of 6,000 keys: a 400 at once; headers of 1 MiB: refused at 16 KiB (the
  daemon always speaks h11, which bounds them, also where httptools is installed).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from transformd.sample import write_sample_checkpoint

from .support.callers import NOBODY, as_uid
from .support.daemon import DaemonProcess, short_tempdir

pytestmark = pytest.mark.timeout(240)

CATEGORY = "trust, round 2: one request holds the daemon"
#: The slowest /healthz answer accepted while a caller attacks (a frozen daemon took 25 s).
HEALTH_BOUND_S = 1.0
#: Lookahead and bounded repeats: Python's ``re`` took ~1.3 s per tensor name, holding the GIL (RE2 refuses it).
LOOKAHEAD_REPEATS = "(?!!)" + ".{0,9}" * 7 + "!"


class HealthWatch:
    """``/healthz`` every 50 ms in a thread, each on a new connection; :attr:`slowest` answer (s), failures."""

    def __init__(self, sock: Path) -> None:
        self.sock = sock
        self.slowest = 0.0
        self.failures: list[str] = []
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        transport = httpx.HTTPTransport(uds=os.fspath(self.sock))
        with httpx.Client(transport=transport, base_url="http://td", timeout=30) as http:
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    status = http.get("/healthz", headers={"Connection": "close"}).status_code
                    if status != 200:
                        self.failures.append(f"status {status}")
                except httpx.HTTPError as err:
                    self.failures.append(repr(err))
                self.slowest = max(self.slowest, time.monotonic() - t)
                self.count += 1
                self._stop.wait(0.05)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, Any]]:
    base = short_tempdir("tdho-")  # not under pytest's 0700 root: the unprivileged caller must reach its copy
    os.chmod(base, 0o755)
    src = write_sample_checkpoint(base / "models" / "m", layers=1, experts=2)
    for p in [base / "models", *(base / "models").rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    (base / "run").mkdir()
    daemon = DaemonProcess(base / "run" / "td.sock", base / "cache", [base / "models"]).start(timeout=180)
    try:
        os.chmod(daemon.socket_path.parent, 0o755)
        os.chmod(daemon.socket_path, 0o666)  # let the unprivileged process connect (the test's choice)
        yield {"daemon": daemon, "sock": daemon.socket_path, "src": src}
    finally:
        daemon.kill()
        shutil.rmtree(base, ignore_errors=True)


def test_select_is_re2_only_and_holds_nobody(world: dict[str, Any], fault_log) -> None:
    refused = {
        LOOKAHEAD_REPEATS: "lookahead",
        "(?<=a*)b": "lookbehind",
        "(?<!x)weight": "lookbehind",
        r"(proj)\1": "backreferences",
        "(?P<n>a)(?P=n)": "backreferences",
        "(?>a+)b": "atomic groups",
        "experts.++": "possessive",
        "x{1001}": "above 1000",
        "(": "not a valid regular expression",
    }
    requests = [("POST", "/v1/checkpoints", {"source": str(world["src"]), "select": p}) for p in refused]
    with HealthWatch(world["sock"]) as watch:
        answers = as_uid(world["sock"], NOBODY, requests, timeout=200)
        time.sleep(3.0)  # (what a request left running in the daemon would freeze it now)
    assert watch.count > 10 and not watch.failures, (watch.count, watch.failures[:3])
    assert watch.slowest < HEALTH_BOUND_S, f"/healthz took {watch.slowest:.1f} s while a caller sent select patterns"
    for (pattern, named), (status, body) in zip(refused.items(), answers):
        assert status == 422, (pattern, status, body)
        assert body["error"]["code"] == "bad_select", (pattern, body)
        assert named in body["error"]["message"], (pattern, body)
    fault_log.record(CATEGORY, "select patterns RE2 refuses (lookaround, backreferences, atomic, possessive)",
                     len(refused), f"422 bad_select naming the syntax; /healthz at most {watch.slowest:.2f} s")


def test_a_burst_of_slow_compiling_patterns_holds_nobody(world: dict[str, Any], fault_log) -> None:
    heavy = [r"\pL{1000}", r"[\p{L}\p{N}]{1000}", r"(?:\p{Greek}{30}){30}", r"[^\x{1}]{1000}"] * 4
    requests = [("POST", "/v1/checkpoints", {"source": str(world["src"]), "select": p}) for p in heavy]
    with HealthWatch(world["sock"]) as watch:
        answers = as_uid(world["sock"], NOBODY, requests, parallel=True, timeout=200)
        time.sleep(1.0)
    assert not watch.failures, watch.failures[:3]
    assert watch.slowest < HEALTH_BOUND_S, f"/healthz took {watch.slowest:.1f} s during a burst of {len(heavy)}"
    assert {status for status, _ in answers} <= {200, 202, 422}, answers
    fault_log.record(CATEGORY, f"{len(heavy)} select patterns RE2 compiles slowest, at once", len(heavy),
                     f"compiled one at a time; /healthz at most {watch.slowest:.2f} s")


def test_deep_and_wide_json_bodies_hold_nobody(world: dict[str, Any], fault_log) -> None:
    deep = "[" * 60_000 + "]" * 0
    wide = "{" + ",".join(f'"k{i}":0' for i in range(6000)) + "}"
    nested_select = {"source": str(world["src"]), "select": {"a": [[[[[[[[[[0]]]]]]]]]]}}
    with HealthWatch(world["sock"]) as watch, httpx.Client(
        transport=httpx.HTTPTransport(uds=os.fspath(world["sock"])), base_url="http://td", timeout=30
    ) as http:
        codes = [http.post("/v1/checkpoints", content=body.encode(), headers={"content-type": "application/json"})
                 .status_code for body in (deep, wide) for _ in range(5)]
        codes.append(http.post("/v1/checkpoints", json=nested_select).status_code)
    assert set(codes) == {400}, codes
    assert watch.slowest < HEALTH_BOUND_S, watch.slowest
    fault_log.record(CATEGORY, "JSON bodies 60,000 deep, 6,000 keys wide", len(codes),
                     f"400 at once; /healthz at most {watch.slowest:.2f} s")


def test_a_megabyte_of_headers_is_refused_at_once(world: dict[str, Any], fault_log) -> None:
    import socket

    from transformd.daemon.server import _http_protocol
    from transformd.daemon.settings import Settings
    from uvicorn.protocols.http.h11_impl import H11Protocol

    assert issubclass(_http_protocol(Settings()), H11Protocol)  # (whatever else is installed)
    with HealthWatch(world["sock"]) as watch, socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(world["sock"]))
        head = b"GET /healthz HTTP/1.1\r\nHost: td\r\nX-Pad: "
        try:
            s.sendall(head + b"a" * (1 << 20) + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # (refused before it was all sent)
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert watch.slowest < HEALTH_BOUND_S, watch.slowest
    fault_log.record(CATEGORY, "1 MiB of request headers", 1, "400 at 16 KiB (h11), /healthz answering")
