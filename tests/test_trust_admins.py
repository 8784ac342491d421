"""Trust class 4 (second round): root is no one's admin, and no one is above the caps.

Engine containers often run as root without a user namespace, so root on the socket was every caller's admin (it
saw, released and deleted every lease and entry) and had no lease or queue cap. Now:

* admin rights (others' leases and entries) belong to the uids named with ``--admin-uid`` /
  ``TRANSFORMD_ADMIN_UIDS``, by default the daemon's own uid alone (root only when named or when it runs the daemon);
* the lease cap and the queue cap count every caller, an admin and root too;
* a lease of a caller who is not an admin pins an entry for ``max_caller_lease_ttl_s`` at most (it was 7 days).

Real daemon (root, in a thread) and real other callers (child processes that ``setuid`` and speak HTTP on the unix
socket).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from transformd.sample import write_sample_checkpoint

from .support.callers import NOBODY, as_uid
from .support.daemon import Daemons, short_tempdir, wait_ready

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid"),
]

CATEGORY = "trust 4: unowned shared state (leases, deletions)"
CAP = 3
#: The uid named admin (not root) in the daemon of test_root_acts_on_its_own_leases_and_entries_only.
ADMIN = 4242
DAY = 24 * 3600.0


def test_the_admins_are_the_named_uids_else_the_daemons_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the default was root and the daemon's uid; there was no ``--admin-uid`` flag."""
    from transformd.cli import build_parser
    from transformd.cli.serve import _settings_from_args
    from transformd.daemon import settings as settings_mod
    from transformd.daemon.settings import Settings

    monkeypatch.setattr(settings_mod.os, "geteuid", lambda: ADMIN)  # a daemon run by a service user
    assert Settings().admins() == frozenset({ADMIN})
    assert Settings(admin_uids=[0, 7]).admins() == frozenset({0, 7})
    monkeypatch.setenv("TRANSFORMD_ADMIN_UIDS", "7,8")
    assert Settings().admins() == frozenset({7, 8})
    monkeypatch.delenv("TRANSFORMD_ADMIN_UIDS")
    args = build_parser().parse_args(["serve", "--admin-uid", "7", "--admin-uid", "0"])
    assert _settings_from_args(args).admins() == frozenset({0, 7})
    s = Settings()
    assert s.max_ttl_of(True) == 7 * DAY and s.max_ttl_of(False) == DAY


def _world(base: Path) -> tuple[Path, Path, Path]:
    allowed = base / "models"
    first = write_sample_checkpoint(allowed / "m", layers=1, experts=2)
    second = write_sample_checkpoint(allowed / "n", layers=1, experts=2, seed=1)
    for p in [allowed, *allowed.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return allowed, first, second


@pytest.fixture
def base() -> Iterator[Path]:
    path = short_tempdir("tdad-")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_caps_count_the_admins_and_root_too(base: Path, fault_log) -> None:
    """The daemon runs as root here, so root is its admin: its leases were not counted (it took any number) nor
    its queued conversions (its 1000 requests could fill the whole queue)."""
    allowed, src, _ = _world(base)
    with Daemons() as daemons:
        daemon = daemons.start(cache_dir=base / "cache", allow_roots=[allowed], prefix="tdad-",
                               log_level="critical", max_leases_per_caller=CAP)
        with daemon.client(timeout=60) as http:
            key = http.post("/v1/checkpoints", json={"source": str(src)}).json()["key"]
            assert wait_ready(http, key, timeout=120)["state"] == "ready"
            codes = [http.post(f"/v1/checkpoints/{key}/leases", json={"ttl_s": 600}).status_code
                     for _ in range(CAP + 2)]
            assert codes == [201] * CAP + [429] * 2, codes
            real = daemon.daemon.service.queued_by
            daemon.daemon.service.queued_by = lambda uid: 99  # every caller's queue is full
            try:
                r = http.post("/v1/checkpoints", json={"source": str(allowed / "n")})
            finally:
                daemon.daemon.service.queued_by = real
            assert r.status_code == 429 and r.json()["error"]["code"] == "caller_queue_full", r.text
    fault_log.record(CATEGORY, f"root, the daemon's admin, takes {CAP + 2} leases (cap {CAP}) and queues past its cap",
                     2, f"{CAP} leases granted, then 429 too_many_leases; 429 caller_queue_full")


def test_root_acts_on_its_own_leases_and_entries_only(base: Path, fault_log) -> None:
    """With ``--admin-uid 4242``, root on the socket is a caller like any other: it neither lists, releases nor
    deletes uid 65534's lease and entry; uid 4242 does. A reader's lease lasts a day at most, an admin's a week."""
    allowed, _, own = _world(base)
    with Daemons() as daemons:
        daemon = daemons.start(cache_dir=base / "cache", allow_roots=[allowed], prefix="tdad-",
                               log_level="critical", admin_uids=[ADMIN])
        sock = daemon.socket_path
        os.chmod(sock.parent, 0o755)
        os.chmod(sock, 0o666)
        (status, body), = as_uid(sock, NOBODY, [("POST", "/v1/checkpoints", {"source": str(own)})])
        assert status in (200, 202), body
        key = body["key"]
        with daemon.client(timeout=60) as http:
            assert wait_ready(http, key, timeout=120)["state"] == "ready"
            answers = as_uid(sock, NOBODY, [
                ("POST", f"/v1/checkpoints/{key}/leases", {"ttl_s": 2 * DAY}),
                ("POST", f"/v1/checkpoints/{key}/leases", {"ttl_s": DAY}),
            ])
            assert answers[0][0] == 400 and answers[0][1]["error"]["code"] == "bad_ttl", answers
            assert answers[1][0] == 201, answers
            lease = answers[1][1]["id"]
            assert lease not in http.get("/v1/cache").text
            assert http.delete(f"/v1/checkpoints/{key}/leases/{lease}").status_code == 404
            r = http.delete(f"/v1/checkpoints/{key}")
            assert r.status_code == 403 and r.json()["error"]["code"] == "not_owner", r.text
            assert http.get(f"/v1/checkpoints/{key}").json()["state"] == "ready"
        answers = as_uid(sock, ADMIN, [
            ("GET", "/v1/cache", None),
            ("POST", f"/v1/checkpoints/{key}/leases", {"ttl_s": 2 * DAY}),
            ("DELETE", f"/v1/checkpoints/{key}/leases/{lease}", None),
        ])
        assert answers[0][0] == 200 and lease in str(answers[0][1]), answers
        assert answers[1][0] == 201 and answers[2][0] == 204, answers
        admin_lease = answers[1][1]["id"]
        answers = as_uid(sock, ADMIN, [
            ("DELETE", f"/v1/checkpoints/{key}/leases/{admin_lease}", None),
            ("DELETE", f"/v1/checkpoints/{key}", None),
        ])
        assert [status for status, _ in answers] == [204, 204], answers
    fault_log.record(CATEGORY, "root (not named admin) lists, releases uid 65534's lease and deletes its entry; "
                     "uid 65534 leases for 2 days", 4,
                     "lease not listed, release 404, delete 403; 400 bad_ttl (a day at most); the named admin may")
