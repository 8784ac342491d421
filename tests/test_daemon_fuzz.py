"""Schemathesis fuzzing of the running daemon from its own OpenAPI schema: no 5xx, every answer as the schema says.

The daemon (the real app under uvicorn, real converter) listens on 127.0.0.1 with a bearer token (and on its
unix socket); the schema is fetched from the running daemon's ``/openapi.json`` and every operation is fuzzed over
TCP with the token: schema-valid and schema-violating requests (schemathesis' positive and negative modes),
``MAX_EXAMPLES`` per operation, derandomized (the same examples on every run) and without a database. A sample
checkpoint is converted first, so the daemon holds an entry, a lease and a cached refusal while it is fuzzed.

Checks (schemathesis' defaults, from ``case.call_and_validate``): ``not_a_server_error`` (no 5xx),
``status_code_conformance``, ``content_type_conformance``, ``response_headers_conformance``,
``response_schema_conformance``, ``negative_data_rejection`` and ``positive_data_acceptance``, with the
documented answers accepted as such (unknown keys are 404, a key or lease in the wrong form 400/404).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from transformd.daemon.settings import Settings
from transformd.sample import write_sample_checkpoint

from .support.daemon import DaemonThread, Daemons, wait_ready

pytestmark = pytest.mark.timeout(180)

CATEGORY = "API fuzzing (schemathesis, derandomized)"
TOKEN = "fuzz-token-0123456789abcdef0123456789"
MAX_EXAMPLES = 30
MAX_LEASE_TTL_S = 3600.0

_counts: dict[str, int] = {}
_statuses: dict[str, set[int]] = {}
_lock = threading.Lock()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with pytest.MonkeyPatch.context() as mp:  # settings from the environment must not leak in; restored after
        for k in list(os.environ):
            if k.startswith("TRANSFORMD_"):
                mp.delenv(k)
        yield from _daemon(tmp_path_factory)


def _daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("fuzz-daemon")
    models = root / "models"
    sample = write_sample_checkpoint(models / "sample", layers=1, experts=2)
    broken = write_sample_checkpoint(models / "broken", layers=1, experts=2, seed=1)
    (broken / "config.json").write_text("{not json")
    token = root / "token"
    token.write_text(TOKEN)
    os.chmod(token, 0o600)  # the daemon refuses a token file others can read
    with Daemons() as daemons:
        d = daemons.start(
            port=0,
            token_file=token,
            cache_dir=root / "cache",
            allow_roots=[models],
            prefix="tdf-",
            log_level="critical",
            max_lease_ttl_s=MAX_LEASE_TTL_S,
            max_queued_conversions=1000,
        )
        with d.client() as http:
            key = wait_ready(http, http.post("/v1/checkpoints", json={"source": str(sample)}).json()["key"])["key"]
            assert http.post(f"/v1/checkpoints/{key}/leases", json={"ttl_s": 600}).status_code == 201
            assert http.post("/v1/checkpoints", json={"source": str(broken)}).status_code == 422
        shard = max(p.name for p in sample.glob("*.safetensors"))
        yield {"daemon": d, "url": d.base_url, "key": key, "cache": root / "cache", "source": str(sample),
               "shard": shard}


def _openapi_document() -> dict[str, Any]:
    """The daemon's OpenAPI document, built at import (pytest parametrizes at collection time).

    ``schemathesis.pytest.from_fixture`` (fetching it from the running daemon) does not work with pytest 9
    (schemathesis 4.32: ``'Function' object has no attribute '_nodeid'``), so the document comes from the same
    ``create_app`` here, and :func:`test_the_running_daemon_serves_this_schema` checks that the running
    daemon serves exactly this document.
    """
    import tempfile

    from transformd.daemon.app import create_app

    with tempfile.TemporaryDirectory(prefix="tdf-schema-") as d:
        settings = Settings(socket=Path(d) / "s.sock", cache_dir=Path(d) / "c", device="cpu",
                            max_lease_ttl_s=MAX_LEASE_TTL_S)
        return create_app(settings).openapi()


OPENAPI = _openapi_document()
#: 422 is the documented answer to a schema-valid POST whose checkpoint cannot be converted with the generated
#: recipe (e.g. a ``select`` matching no weight); schemathesis' default accepted list lacks it.
CONFIG = schemathesis.Config.from_dict(
    {
        "checks": {
            "positive_data_acceptance": {
                "expected-statuses": ["2xx", "3xx", "401", "403", "404", "409", "422", "429"]
            }
        }
    }
)
schema = schemathesis.openapi.from_dict(OPENAPI, config=CONFIG)


def test_the_running_daemon_serves_this_schema(daemon: dict[str, Any]) -> None:
    import httpx

    r = httpx.get(f"{daemon['url']}/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200 and r.json() == OPENAPI


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_fuzz_the_api_from_its_schema(case: Any, daemon: dict[str, Any]) -> None:
    documented = case.method.lower() in OPENAPI["paths"].get(case.operation.path, {})
    name = f"{case.method} {case.operation.path}" if documented else "methods a path does not have (405 expected)"
    with _lock:
        n = _counts.get(name, 0)
        _counts[name] = n + 1
    steered = _steer(case, daemon, n)
    response = case.call_and_validate(base_url=daemon["url"], headers={"Authorization": f"Bearer {TOKEN}"},
                                      timeout=30)
    assert response.status_code < 500, (case.method, case.formatted_path, response.status_code, response.text)
    with _lock:
        _statuses.setdefault(name, set()).add(response.status_code)
        if steered:
            _steered[name] = _steered.get(name, 0) + 1


_steered: dict[str, int] = {}


def _steer(case: Any, daemon: dict[str, Any], n: int) -> bool:
    """Every other schema-valid case is pointed at what exists (the converted entry's key, one of its shards, the
    sample's source path), so the fuzz reaches past "unknown key": files, leases, deletes of a leased entry,
    conversions with generated recipes. Schema-violating cases are left as generated."""
    meta = getattr(case, "meta", None)
    if meta is None or meta.generation.mode != GenerationMode.POSITIVE or n % 2:
        return False
    steered = False
    params = case.path_parameters or {}
    if "key" in params:
        params["key"] = daemon["key"]
        steered = True
    if "name" in params:
        params["name"] = daemon["shard"]
    if case.method == "POST" and case.operation.path == "/v1/checkpoints" and isinstance(case.body, dict):
        case.body["source"] = daemon["source"]
        steered = True
    return steered


def test_fuzzing_left_the_daemon_healthy_and_is_recorded(daemon: dict[str, Any], fault_log) -> None:
    """Runs after the fuzz test (file order): the daemon still serves and its entry is intact; records the rows."""
    d: DaemonThread = daemon["daemon"]
    with d.client() as http:
        assert http.get("/healthz").status_code == 200
        assert http.get(f"/v1/checkpoints/{daemon['key']}").json()["state"] == "ready"
        metrics = http.get("/metrics").text
    assert 'status="500"' not in metrics and 'status="502"' not in metrics
    assert d.daemon.cache.verify(daemon["key"], quarantine=False)[0].ok
    assert _counts, "the fuzz test did not run"
    for name, n in sorted(_counts.items()):
        codes = ", ".join(str(c) for c in sorted(_statuses[name]))
        steered = f"; {_steered[name]} pointed at the real entry/source" if _steered.get(name) else ""
        fault_log.record(CATEGORY, f"{name}: requests generated from the OpenAPI schema (TCP + token)", n,
                         f"no 5xx; answers conform to the schema (statuses seen: {codes}{steered})")


def test_findings_of_the_fuzzing_stay_fixed(daemon: dict[str, Any], fault_log) -> None:
    """What schemathesis found (no 500s; contract mismatches), checked directly:

    * ``Allow`` of a 405 named only the first route's methods of a path served by two routes (GET and DELETE
      ``/v1/checkpoints/{key}``);
    * the schema allowed what the daemon refuses with 400: an empty or relative ``source``, keys and lease ids of
      any form, ``ttl_s`` above the daemon's maximum (a setting, now written into its schema).
    """
    import httpx

    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=daemon["url"], headers=headers, timeout=10) as http:
        r = http.request("OPTIONS", f"/v1/checkpoints/{daemon['key']}")
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", r.headers
        r = http.put("/v1/checkpoints")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        live = http.get("/openapi.json").json()
    source = live["components"]["schemas"]["CheckpointRequest"]["properties"]["source"]
    assert source["minLength"] == 1 and source["pattern"].startswith("^/")
    assert live["components"]["schemas"]["LeaseRequest"]["properties"]["ttl_s"]["maximum"] == MAX_LEASE_TTL_S
    params = {p["name"]: p["schema"] for p in live["paths"]["/v1/checkpoints/{key}/leases/{lease_id}"]["delete"][
        "parameters"]}
    assert params["key"]["pattern"] == "^[0-9a-f]{32}$" and params["lease_id"]["pattern"] == "^[0-9a-f]{16}$"
    fault_log.record(CATEGORY, "regressions of the fuzzing's findings: 405 Allow header, schema vs. 400 refusals",
                     2, "Allow lists every method of the path; the schema states the checked limits")
