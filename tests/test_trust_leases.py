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
