"""Trust class 4: leases and deletions belong to the caller that made them.

Real daemon (root, in a thread) and a real second caller (a child process that ``setuid``s to 65534 and speaks
HTTP on the unix socket), both allowed to read the same world-readable checkpoint:

* root's lease id is not listed to uid 65534 by ``GET /v1/cache``, and uid 65534 cannot release it (404, the
  lease stays); before, any caller could list and release any lease;
* uid 65534 cannot DELETE an entry converted at root's request (403; before: 204);
* uid 65534 can take at most ``max_leases_per_caller`` live leases (then 429; before: unlimited), and can
  release its own.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from transformd.sample import write_sample_checkpoint

from .support.daemon import Daemons, short_tempdir, wait_ready
from .support.callers import NOBODY, as_uid

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid"),
]

CATEGORY = "trust 4: unowned shared state (leases, deletions)"
CAP = 5


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, Any]]:
    base = short_tempdir("tdlb-")
    os.chmod(base, 0o755)
    allowed = base / "models"
    src = write_sample_checkpoint(allowed / "m", layers=1, experts=2)
    for p in [allowed, src, *src.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    try:
        with Daemons() as daemons:
            daemon = daemons.start(cache_dir=base / "cache", allow_roots=[allowed], prefix="tdl-",
                                   log_level="critical", max_leases_per_caller=CAP)
            sock = daemon.socket_path
            os.chmod(sock.parent, 0o755)
            os.chmod(sock, 0o666)
            with daemon.client(timeout=60) as http:
                r = http.post("/v1/checkpoints", json={"source": str(src)})
                key = r.json()["key"]
                assert wait_ready(http, key, timeout=120)["state"] == "ready"
                yield {"http": http, "sock": sock, "src": src, "key": key}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_leases_and_entries_belong_to_their_caller(world: dict[str, Any], fault_log) -> None:
    http, key, sock = world["http"], world["key"], world["sock"]
    mine = http.post(f"/v1/checkpoints/{key}/leases", json={"ttl_s": 600}).json()["id"]
    answers = as_uid(sock, NOBODY, [
        ("POST", "/v1/checkpoints", {"source": str(world["src"])}),  # it may read the source: served
        ("GET", "/v1/cache", None),
        ("DELETE", f"/v1/checkpoints/{key}/leases/{mine}", None),
    ])
    assert answers[0][0] == 200, answers
    listing = answers[1]
    assert listing[0] == 200 and mine not in str(listing[1]), listing
    assert answers[2][0] == 404, answers
    assert any(lease["id"] == mine for lease in http.get("/v1/cache").json()["entries"][0]["leases"])
    assert http.delete(f"/v1/checkpoints/{key}/leases/{mine}").status_code == 204
    (status, body), = as_uid(sock, NOBODY, [("DELETE", f"/v1/checkpoints/{key}", None)])
    assert status == 403, (status, body)
    assert http.get(f"/v1/checkpoints/{key}").json()["state"] == "ready"
    fault_log.record(CATEGORY, "uid 65534 lists, releases root's lease; deletes root's entry", 3,
                     "lease id not listed; release 404 (lease kept); delete 403 (entry kept)")


def test_a_caller_holds_a_bounded_number_of_leases(world: dict[str, Any], fault_log) -> None:
    key, sock = world["key"], world["sock"]
    tries = CAP + 3
    answers = as_uid(sock, NOBODY, [("POST", "/v1/checkpoints", {"source": str(world["src"])})]
                     + [("POST", f"/v1/checkpoints/{key}/leases", {"ttl_s": 600})] * tries)
    codes = [status for status, _ in answers[1:]]
    assert codes == [201] * CAP + [429] * (tries - CAP), codes
    own = answers[1][1]["id"]
    (status, _), = as_uid(sock, NOBODY, [("DELETE", f"/v1/checkpoints/{key}/leases/{own}", None)])
    assert status == 204
    fault_log.record(CATEGORY, f"one uid takes {tries} leases (cap {CAP})", tries,
                     f"{CAP} granted, then 429 too_many_leases; its own lease releasable")


def test_finding_an_entry_makes_no_one_its_creator(fault_log) -> None:
    """Only a conversion makes its caller the entry's creator (who may DELETE it). Before, any request answered
    with an entry did, when none was recorded: after a restart, uid 65534 asked for a copy of root's checkpoint,
    was served root's entry (found while its conversion hashed it), and could then delete it (204). Its own
    conversions it may delete."""
    base = short_tempdir("tdlc-")
    os.chmod(base, 0o755)
    allowed = base / "models"
    src = write_sample_checkpoint(allowed / "m", layers=1, experts=2)
    copy = allowed / "copy"
    shutil.copytree(src, copy)
    own = write_sample_checkpoint(allowed / "own", layers=1, experts=2, seed=1)
    for p in [allowed, *allowed.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
        if p.is_file():  # settled: a source new to the cache is then hashed while it is converted
            os.utime(p, (p.stat().st_atime - 60, p.stat().st_mtime - 60))
    try:
        with Daemons() as daemons:
            def daemon() -> Any:
                d = daemons.start(cache_dir=base / "cache", allow_roots=[allowed], prefix="tdc-", log_level="critical")
                d.daemon.cache.hash_alongside_min_bytes = 0  # (the path of a large source: found while converting)
                os.chmod(d.socket_path.parent, 0o755)
                os.chmod(d.socket_path, 0o666)
                return d

            first = daemon()
            with first.client(timeout=60) as http:
                key = http.post("/v1/checkpoints", json={"source": str(src)}).json()["key"]
                assert wait_ready(http, key, timeout=120)["state"] == "ready"
            first.stop()  # the creators are the daemon's memory: a restart forgets them
            second = daemon()
            answers = as_uid(second.socket_path, NOBODY, [
                ("POST", "/v1/checkpoints", {"source": str(copy)}),  # the same content: root's entry, found
                ("DELETE", f"/v1/checkpoints/{key}", None),
                ("POST", "/v1/checkpoints", {"source": str(own)}),
            ])
            assert answers[0][0] == 200 and answers[0][1]["key"] == key, answers[0]
            assert answers[1][0] == 403, answers[1]
            with second.client(timeout=60) as http:
                assert http.get(f"/v1/checkpoints/{key}").json()["state"] == "ready", "the entry is still there"
                mine = answers[2][1]["key"]
                assert wait_ready(http, mine, timeout=120)["state"] == "ready"
            (status, _), = as_uid(second.socket_path, NOBODY, [("DELETE", f"/v1/checkpoints/{mine}", None)])
            assert status == 204, "a caller may delete what its request converted"
    finally:
        shutil.rmtree(base, ignore_errors=True)
    fault_log.record(CATEGORY, "after a restart, uid 65534 asks for a copy of root's entry, then deletes it", 1,
                     "served (200), delete 403: finding an entry makes no one its creator")
