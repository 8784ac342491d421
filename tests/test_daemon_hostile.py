"""Hostile and broken checkpoints POSTed to the running daemon: a clear JSON error, the daemon serving, an empty cache.

The corpus is tests/support/hostile.py's (``CORPUS``: truncated shards, header length past the file, headers
that are not JSON or are huge, overlapping and out-of-range offsets, unknown dtypes, shape/byte-count mismatches,
NaN codes, E8M0 0xFF, scale shape mismatches, indexes naming missing files or paths outside, symlinks escaping,
FIFOs, broken configs, ...); tests/test_faults_hostile.py feeds it to the library, the cache and the command line,
this module to the daemon.
Every case is built in its own directory ``c<i>/work/src`` with ``c<i>/work/outside`` beside it; the daemon (the
real app under uvicorn on a unix socket, real converter) allows only the ``src`` directories, so ``outside`` is
outside every allowed root.

The documented answer for each case (``ANSWERS``: one status and code per case, asserted exactly):

* a symlink whose target lies outside the allowed roots: 403 ``source_not_allowed`` naming the link;
* anything wrong in the files' structure (headers, index, configs, links that cannot be followed): 422 at once
  (``invalid_checkpoint`` from the converter's check, or ``invalid_source`` from the source scan), naming the file,
  the tensor where there is one, and the problem;
* bad *values* (NaN codes, E8M0 0xFF), found only while converting: 202, then the entry's state is ``failed`` with a
  422 ``invalid_checkpoint`` error naming file, tensor and problem; the next POST of the same content is 422 at once.

After every case: nothing in ``entries/`` or ``staging/`` (the documented ``failures/<key>.json`` record may be
there), ``/healthz`` is 200; after the whole corpus a valid checkpoint still converts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from transformd.sample import write_sample_checkpoint

from .support.daemon import Daemons
from .support.hostile import CORPUS, Expect, build_case, check_message
from .support.entries import entry_dir

pytestmark = pytest.mark.timeout(60)

CATEGORY = "hostile input via the daemon"
NAMES = list(CORPUS)

#: The one right answer for each case that is not ``(422, "invalid_checkpoint", at once)``: the status of the POST,
#: and the error code (of the POST, or of the failed conversion when the POST is 202).
ANSWERS: dict[str, tuple[int, str]] = {
    "NaN code 0x7F": (202, "invalid_checkpoint"),
    "NaN code 0xFF": (202, "invalid_checkpoint"),
    "E8M0 scale 0xFF": (202, "invalid_checkpoint"),
    "symlinked shard escaping to a non-safetensors file": (403, "source_not_allowed"),
    "dangling symlinked shard": (403, "source_not_allowed"),
    "shard symlinked to a directory": (403, "source_not_allowed"),
    "broken symlink among the carried files": (403, "source_not_allowed"),
    "symlink loop as a shard": (422, "invalid_source"),
}
assert set(ANSWERS) <= set(CORPUS), set(ANSWERS) - set(CORPUS)


def expected_answer(name: str) -> tuple[int, str]:
    return ANSWERS.get(name, (422, "invalid_checkpoint"))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("hostile")
    cases: dict[str, tuple[Path, Expect]] = {}
    for i, name in enumerate(NAMES):
        src, _, expect = build_case(root / f"c{i}", name)
        cases[name] = (src, expect)
    good = write_sample_checkpoint(root / "good" / "sample", layers=1, experts=2)
    with Daemons() as daemons:
        daemon = daemons.start(cache_dir=root / "cache", allow_roots=[src for src, _ in cases.values()] + [good.parent],
                               prefix="tdh-", log_level="critical")
        with daemon.client(timeout=30) as http:
            yield {"daemon": daemon, "http": http, "cases": cases, "good": good, "cache": root / "cache"}


def _wait_failed(http: httpx.Client, key: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        body = http.get(f"/v1/checkpoints/{key}").json()
        if body["state"] in ("ready", "failed") or time.monotonic() > deadline:
            return body
        time.sleep(0.02)


def _cache_holds_nothing(cache: Path) -> None:
    for d in ("entries", "staging", "trash", "quarantine", "leases"):
        assert os.listdir(cache / d) == [], f"{d}/: {os.listdir(cache / d)}"
    assert set(os.listdir(cache / "locks")) <= {"gc.lock"}
    assert all(n.endswith(".json") for n in os.listdir(cache / "failures"))


@pytest.mark.parametrize("name", NAMES)
def test_corpus_case_is_refused_by_the_daemon(world: dict[str, Any], name: str, fault_log) -> None:
    http: httpx.Client = world["http"]
    src, expect = world["cases"][name]
    r = http.post("/v1/checkpoints", json={"source": str(src)})
    assert r.headers["content-type"].startswith("application/json")
    status, code = expected_answer(name)
    assert r.status_code == status, (r.status_code, r.text)
    if r.status_code == 202:  # found only while converting (values)
        body = _wait_failed(http, r.json()["key"])
        assert body["state"] == "failed", body
        err = body["error"]
        assert err["status"] == 422 and err["code"] == code, err
        check_message(err["message"], src, expect)
        again = http.post("/v1/checkpoints", json={"source": str(src)})
        assert again.status_code == 422 and again.json()["error"]["message"] == err["message"]
        how = "202 then failed with 422 invalid_checkpoint; a second POST is 422 at once"
    elif r.status_code == 403:
        err = r.json()["error"]
        assert err["status"] == 403 and err["code"] == code, err
        assert "outside the allowed roots" in err["message"] and str(src) in err["message"], err
        assert "symlink" in err["message"], err
        how = "403 source_not_allowed"
    else:
        assert r.status_code == 422, (r.status_code, r.text)
        err = r.json()["error"]
        assert err["status"] == 422 and err["code"] == code, err
        check_message(err["message"], src, expect, cache=err["code"] == "invalid_source")
        how = f"422 {err['code']}"
    assert len(err["message"]) < 4100
    _cache_holds_nothing(world["cache"])
    assert http.get("/healthz").status_code == 200
    if r.status_code == 403:
        what = "the link"
    elif err["code"] == "invalid_source":
        what = "the path and problem"
    else:
        what = "file, tensor and problem" if expect.tensor else "file and problem"
    fault_log.record(
        f"{CATEGORY}: {CORPUS[name].group}", name, 1, f"{how}, message names {what}; daemon serving; cache empty"
    )


def test_the_daemon_still_converts_after_the_corpus(world: dict[str, Any], fault_log) -> None:
    http: httpx.Client = world["http"]
    for name in NAMES:  # every case again, all at once on one connection: still refused the same way
        src, _ = world["cases"][name]
        status, code = expected_answer(name)
        again = http.post("/v1/checkpoints", json={"source": str(src)})
        if status == 202 and again.status_code == 202:  # (this test alone: the corpus test has not converted it)
            assert _wait_failed(http, again.json()["key"])["state"] == "failed", name
            again = http.post("/v1/checkpoints", json={"source": str(src)})
        # a value defect was found by the first conversion: its cached failure answers 422 at once now
        assert (again.status_code, again.json()["error"]["code"]) == (422 if status == 202 else status, code), name
    r = http.post("/v1/checkpoints", json={"source": str(world["good"])})
    assert r.status_code in (200, 202), r.text
    body = _wait_failed(http, r.json()["key"])
    assert body["state"] == "ready", body
    assert Path(body["path"]).is_dir()
    assert os.listdir(world["cache"] / "entries") == [entry_dir(world["cache"], body["key"]).name]
    assert os.listdir(world["cache"] / "staging") == []
    metrics = http.get("/metrics").text
    assert 'status="500"' not in metrics
    fault_log.record(
        CATEGORY,
        f"the whole corpus ({len(NAMES)} cases) again, then a valid checkpoint",
        len(NAMES) + 1,
        "every case refused again with its own status and code (403 source_not_allowed / 422); the valid checkpoint converted; no 500 in the daemon's metrics",
    )


def test_a_cached_refusal_is_not_reported_for_another_path_with_the_same_key(tmp_path: Path, daemons: Daemons,
                                                                             fault_log) -> None:
    """Regression: the key covers regular files only, so a checkpoint without config.json and one whose config.json
    is a FIFO have the same key. The daemon used to answer the second with the first's cached 422, naming the
    first directory's file and the wrong problem."""
    root = tmp_path / "models"
    missing, _, _ = build_case(root / "a", "config.json missing")
    fifo, _, fifo_expect = build_case(root / "b", "FIFO as config.json")
    daemon = daemons.start(cache_dir=tmp_path / "cache", allow_roots=[missing, fifo], prefix="tdh-",
                           log_level="critical")
    with daemon.client() as http:
        first = http.post("/v1/checkpoints", json={"source": str(missing)})
        second = http.post("/v1/checkpoints", json={"source": str(fifo)})
        third = http.post("/v1/checkpoints", json={"source": str(missing)})
    assert first.status_code == second.status_code == third.status_code == 422
    assert first.json()["error"]["message"] == third.json()["error"]["message"]
    message = second.json()["error"]["message"]
    assert str(missing) not in message
    check_message(message, fifo, fifo_expect)
    fault_log.record(
        CATEGORY,
        "two sources with the same content key but different defects (missing config.json / FIFO config.json)",
        3,
        "each refused with its own file and problem (was: the first one's cached message)",
    )
