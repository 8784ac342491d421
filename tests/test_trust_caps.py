"""Trust, second round (issue 42, item 5): a caller's caps hold under any concurrency.

A real daemon (in a thread) and a real second caller, uid 65534, whose requests all start at once (one connection
each, released by a barrier):

* 12 conversion requests of 12 different sources with a cap of 4 queued conversions per caller: 4 accepted, 8 get
  429 ``caller_queue_full`` (before: the count was taken before the engine check's await and the job made after
  it, so the whole burst was accepted, and one uid could fill the global queue: everyone else got 503);
* 100 lease requests with a cap of 64 live leases: exactly 64 granted (before: the count and the lease were two
  awaits apart, and 99-100 leases were left live).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from transformd.sample import write_sample_checkpoint

from .support.callers import NOBODY, as_uid
from .support.daemon import Daemons, short_tempdir, wait_ready
from .support.fakes import CopyConverter

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid"),
]

CATEGORY = "trust, round 2: caps raced"


def _world(base: Path, n: int) -> list[Path]:
    """``n`` world-readable checkpoints of different content under ``base``/models."""
    os.chmod(base, 0o755)
    sources = [write_sample_checkpoint(base / "models" / f"m{i}", layers=1, experts=2, seed=i) for i in range(n)]
    for p in [base / "models", *(base / "models").rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return sources


def _open_socket(sock: Path) -> None:
    os.chmod(sock.parent, 0o755)
    os.chmod(sock, 0o666)  # let the unprivileged process connect (the test's choice, not the default)


def test_a_burst_of_conversion_requests_is_held_to_the_callers_cap(daemons: Daemons, fault_log) -> None:
    base = short_tempdir("tdcq-")
    try:
        sources = _world(base, 12)
        # conversions that last (6 files, 5 s each): every accepted job is still queued or running at the end
        daemon = daemons.start(CopyConverter(delay=5.0), cache_dir=base / "cache", allow_roots=[base / "models"],
                               prefix="tdcq-", log_level="critical", max_queued_per_caller=4, max_queued_conversions=16,
                               shutdown_grace_s=0.5)
        _open_socket(daemon.socket_path)
        requests = [("POST", "/v1/checkpoints", {"source": str(s), "engine": "vllm"}) for s in sources]
        answers = as_uid(daemon.socket_path, NOBODY, requests, parallel=True)
        codes = sorted(status for status, _ in answers)
        assert codes == [202] * 4 + [429] * 8, answers
        refused = [body for status, body in answers if status == 429]
        assert all(body["error"]["code"] == "caller_queue_full" for body in refused), refused
        mine = [j for j in daemon.daemon.service.active_jobs() if j.uid == NOBODY]
        assert len(mine) == 4, [(j.key, j.state) for j in mine]
        assert daemon.daemon.service.queued_by(NOBODY) == 4
    finally:
        shutil.rmtree(base, ignore_errors=True)
    fault_log.record(CATEGORY, "one uid sends 12 conversion requests at once (cap 4)", 12,
                     "4 accepted, 8 x 429 caller_queue_full")


def test_a_burst_of_lease_requests_is_held_to_the_callers_cap(daemons: Daemons, fault_log) -> None:
    base = short_tempdir("tdlq-")
    cap, tries = 64, 100
    try:
        src, = _world(base, 1)
        daemon = daemons.start(CopyConverter(), cache_dir=base / "cache", allow_roots=[base / "models"],
                               prefix="tdlq-", log_level="critical", max_leases_per_caller=cap)
        _open_socket(daemon.socket_path)
        (status, body), = as_uid(daemon.socket_path, NOBODY, [("POST", "/v1/checkpoints", {"source": str(src)})])
        assert status in (200, 202), body
        key = body["key"]
        with daemon.client(timeout=60) as http:
            assert wait_ready(http, key)["state"] == "ready"
            requests = [("POST", f"/v1/checkpoints/{key}/leases", {"ttl_s": 600})] * tries
            answers = as_uid(daemon.socket_path, NOBODY, requests, parallel=True)
            codes = [status for status, _ in answers]
            assert codes.count(201) == cap and codes.count(429) == tries - cap, sorted(codes)
            live = [lease for entry in http.get("/v1/cache").json()["entries"] for lease in entry["leases"]]
            assert len(live) == cap, len(live)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    fault_log.record(CATEGORY, f"one uid sends {tries} lease requests at once (cap {cap})", tries,
                     f"{cap} granted, {tries - cap} x 429 too_many_leases")
