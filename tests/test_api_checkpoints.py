"""The daemon over HTTP on a unix socket: resolve, status, the mmap file tables, leases, cache, health, metrics.

Every test starts the real daemon (uvicorn on a temporary unix socket, in a thread) and converts the
sample checkpoint with the real converter on the CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from transformd.sample import write_sample_checkpoint

from .support.daemon import DaemonThread, Daemons, metric_value, raw_request, wait_ready

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_sample_checkpoint(root / "sample", layers=2, experts=4, shards=2)
    return root


@pytest.fixture
def start(daemons: Daemons, tmp_path: Path, models: Path) -> Callable[..., DaemonThread]:
    """A daemon with the real converter over ``models``, its socket in a sub-directory the daemon creates."""
    defaults = {"cache_dir": tmp_path / "cache", "allow_roots": [models], "socket_name": "sub/td.sock"}
    return lambda **settings: daemons.start(**{**defaults, **settings})


def _resolve(http, source: Path, **recipe: object) -> dict:
    r = http.post("/v1/checkpoints", json={"source": str(source), **recipe})
    assert r.status_code in (200, 202), r.text
    body = r.json()
    if r.status_code == 202:
        body = wait_ready(http, body["key"])
    assert body["state"] == "ready", body
    return body


def test_cold_request_is_accepted_then_ready_then_a_cache_hit(start, models: Path) -> None:
    daemon = start()
    src = models / "sample"
    with daemon.client() as http:
        r = http.post("/v1/checkpoints", json={"source": str(src)})
        assert r.status_code == 202, r.text
        body = r.json()
        assert len(body["key"]) == 32 and body["state"] in ("queued", "converting")
        assert r.headers["location"] == f"/v1/checkpoints/{body['key']}"
        assert set(body["progress"]) >= {
            "tensors_done",
            "tensors_total",
            "bytes_done",
            "bytes_total",
            "rate_bytes_per_s",
            "eta_s",
        }
        ready = wait_ready(http, body["key"])
        assert ready["state"] == "ready" and ready["error"] is None
        assert Path(ready["path"]).is_dir() and (Path(ready["path"]) / "config.json").is_file()
        assert ready["recipe"]["target"] == "ocp", "target auto: ocp for a raw consumer on a node without FNUZ GPUs"
        assert ready["source"] == str(src)
        assert ready["progress"]["tensors_done"] == ready["progress"]["tensors_total"] > 0

        r = http.post("/v1/checkpoints", json={"source": str(src), "target": "ocp", "scale_mode": "exact"})
        assert r.status_code == 200, r.text
        hit = r.json()
        assert hit["key"] == body["key"] and hit["state"] == "ready" and hit["path"] == ready["path"]
        assert hit["files_url"] == f"/v1/checkpoints/{body['key']}/files" and hit["size_bytes"] > 0

        other = http.post("/v1/checkpoints", json={"source": str(src), "target": "fnuz"})
        assert other.status_code == 202 and other.json()["key"] != body["key"]
        assert wait_ready(http, other.json()["key"])["state"] == "ready"

        metrics = http.get("/metrics").text
    assert metric_value(metrics, "transformd_cache_hits_total") == 1
    assert metric_value(metrics, "transformd_cache_misses_total") == 2
    assert metric_value(metrics, "transformd_conversions_total", {"outcome": "converted"}) == 2
    assert metric_value(metrics, "transformd_conversion_seconds_count") == 2
    assert metric_value(metrics, "transformd_converted_bytes_total") > 0
    assert metric_value(metrics, "transformd_cache_bytes") > 0
    assert metric_value(metrics, "transformd_conversions_in_progress") == 0


def _independent_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def test_files_tables_agree_with_the_safetensors_headers_and_bytes(start, models: Path) -> None:
    daemon = start()
    with daemon.client() as http:
        entry = _resolve(http, models / "sample", target="fnuz")
        r = http.get(entry["files_url"])
        assert r.status_code == 200
        files = r.json()
        one = http.get(f"{entry['files_url']}/model-00002-of-00002.safetensors")
        assert one.status_code == 200 and one.json()["name"] == "model-00002-of-00002.safetensors"
    assert files["key"] == entry["key"] and files["state"] == "ready"
    names = sorted(f["name"] for f in files["files"])
    assert names == sorted(p.name for p in Path(entry["path"]).glob("*.safetensors")) and len(names) == 2
    manifest = json.loads((Path(entry["path"]).parent / "manifest.json").read_text())
    digests = {f["name"]: f["digest"] for f in manifest["output"]["files"]}
    for f in files["files"]:
        path = Path(f["path"])
        assert path.is_absolute() and path.parent == Path(entry["path"]) and f["ready"] is True
        assert f["final_path"] == f["path"] and f["size"] == path.stat().st_size and f["digest"] == digests[f["name"]]
        data_start, header = _independent_header(path)
        assert set(f["tensors"]) == set(header)
        raw = path.read_bytes()
        with safe_open(str(path), framework="pt") as st:
            assert set(st.keys()) == set(header)
            for name, t in f["tensors"].items():
                begin, end = header[name]["data_offsets"]
                assert t["dtype"] == header[name]["dtype"] and t["shape"] == header[name]["shape"]
                assert t["offsets"] == [data_start + begin, data_start + end]
                tensor = st.get_tensor(name)
                assert list(tensor.shape) == t["shape"]
                view = raw[t["offsets"][0] : t["offsets"][1]]
                assert tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == view, name
    assert any(t["dtype"] == "F8_E4M3FNUZ" for f in files["files"] for t in f["tensors"].values())
    assert one.json() == next(f for f in files["files"] if f["name"] == "model-00002-of-00002.safetensors")


def test_status_and_unknown_keys_files_and_bad_names(start, models: Path) -> None:
    daemon = start()
    with daemon.client() as http:
        entry = _resolve(http, models / "sample")
        key = entry["key"]
        assert http.get(f"/v1/checkpoints/{key}").json()["state"] == "ready"
        unknown = "0" * 32
        for url in (
            f"/v1/checkpoints/{unknown}",
            f"/v1/checkpoints/{unknown}/files",
            f"/v1/checkpoints/{unknown}/files/model.safetensors",
        ):
            r = http.get(url)
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_key", url
        for bad in ("../../etc", "ABCDEF" * 6, "0" * 31, "0" * 33, "%2e%2e"):
            r = http.get(f"/v1/checkpoints/{bad}")
            assert r.status_code in (400, 404), (bad, r.text)
            assert "error" in r.json()
        for name in (
            "..",
            "...",
            ".hidden",
            "a..b",
            "config.json",
            "%2e%2e",
            "..%2Fmanifest.json",
            "..%2f..%2fmanifest.json",
            "%2e%2e%2fmanifest.json",
            "nothere.safetensors",
            "model-00001-of-00002.safetensors%00",
        ):
            status, payload = raw_request(daemon.socket_path, "GET", f"/v1/checkpoints/{key}/files/{name}")
            assert status == 404, (name, payload)
            assert json.loads(payload)["error"]["status"] == 404
        for target in (
            f"/v1/checkpoints/{key}/files/../../../../etc/passwd",
            f"/v1/checkpoints/../{key}/files",
            f"/v1/checkpoints/{key}%2F..%2F..%2Fentries/files",
            "/v1/checkpoints/%2e%2e/files",
        ):
            status, payload = raw_request(daemon.socket_path, "GET", target)
            assert status in (400, 404), (target, payload)
            assert b"root:" not in payload
        r = http.delete(f"/v1/checkpoints/{unknown}")
        assert r.status_code == 404


def test_leases_block_eviction_and_delete(start, models: Path) -> None:
    daemon = start()
    cache = daemon.daemon.cache
    with daemon.client() as http:
        key = _resolve(http, models / "sample")["key"]
        r = http.post(f"/v1/checkpoints/{key}/leases", json={"ttl_s": 60, "holder": "vllm rank 0"})
        assert r.status_code == 201, r.text
        lease = r.json()
        assert lease["key"] == key and len(lease["id"]) == 16 and lease["expires_at"] > 0
        held = cache.leases(key)
        assert [x.id for x in held] == [lease["id"]] and held[0].owner is None  # expiry only, no pid liveness

        r = http.delete(f"/v1/checkpoints/{key}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "entry_leased"
        message = r.json()["error"]["message"]
        assert "vllm rank 0" in message
        # the API has no force parameter: say what works (wait, release, or the CLI on the node)
        assert "use force" not in message and "force=True" not in message, message
        assert f"DELETE /v1/checkpoints/{key}/leases/ID" in message and f"transformd cache rm --force {key}" in message
        report = cache.gc(budget_bytes=0)
        assert report.evicted == [] and cache.get(key, touch=False) is not None
        listing = http.get("/v1/cache").json()
        assert [e["key"] for e in listing["entries"]] == [key]
        assert listing["entries"][0]["leases"][0]["id"] == lease["id"]
        assert listing["usage_bytes"] == listing["entries"][0]["size_bytes"] > 0
        assert listing["budget_bytes"] > 0 and listing["free_bytes"] > 0 and listing["root"] == str(cache.root)

        assert http.post(f"/v1/checkpoints/{key}/leases", json={"ttl_s": 10 * 24 * 3600}).status_code == 400
        assert http.post(f"/v1/checkpoints/{key}/leases", json={"ttl_s": -1}).status_code == 400
        assert http.post(f"/v1/checkpoints/{'1' * 32}/leases", json={}).status_code == 404
        assert http.delete(f"/v1/checkpoints/{key}/leases/{'0' * 16}").status_code == 404
        assert http.delete(f"/v1/checkpoints/{key}/leases/../x").status_code == 404
        assert http.delete(f"/v1/checkpoints/{key}/leases/{lease['id']}").status_code == 204
        assert http.delete(f"/v1/checkpoints/{key}/leases/{lease['id']}").status_code == 404

        assert http.delete(f"/v1/checkpoints/{key}").status_code == 204
        assert http.get(f"/v1/checkpoints/{key}").status_code == 404
        assert http.get("/v1/cache").json()["entries"] == []
        # A default lease body works too, and the entry comes back from a new conversion.
        key2 = _resolve(http, models / "sample")["key"]
        assert key2 == key
        assert http.post(f"/v1/checkpoints/{key}/leases").status_code == 201


def test_socket_permissions_health_and_metrics(start) -> None:
    daemon = start()
    path = daemon.socket_path
    assert path is not None
    assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o750
    with daemon.client() as http:
        health = http.get("/healthz")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "ok" and body["version"] and body["device"] == "cpu"
        assert body["cache_root"] == str(daemon.daemon.cache.root)
        r = http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        for name in (
            "transformd_conversions_total",
            "transformd_cache_hits_total",
            "transformd_cache_misses_total",
            "transformd_cache_bytes",
            "transformd_conversion_seconds",
            "transformd_converted_bytes_total",
            "transformd_conversions_in_progress",
        ):
            assert name in r.text, name
        assert (
            metric_value(
                r.text, "transformd_http_requests_total", {"method": "GET", "route": "/healthz", "status": "200"}
            )
            == 1
        )
        schema = http.get("/openapi.json").json()
        assert {
            "/v1/checkpoints",
            "/v1/checkpoints/{key}",
            "/v1/checkpoints/{key}/files",
            "/v1/checkpoints/{key}/files/{name}",
            "/v1/checkpoints/{key}/leases",
            "/v1/checkpoints/{key}/leases/{lease_id}",
            "/v1/cache",
            "/healthz",
            "/metrics",
        } <= set(schema["paths"])
    daemon.stop()
    assert not path.exists()


def test_made_up_methods_share_one_metrics_series(start) -> None:
    """Every method token was a label value kept for ever: 1,000 made-up 60 kB methods grew /metrics to 120 MB
    and the daemon by 69 MB (an attack review). They are counted as one ``other``."""
    daemon = start()
    with daemon.client() as http:
        for i in range(40):
            assert http.request(f"M{i:04d}" + "Z" * 2000, "/healthz").status_code == 405
        text = http.get("/metrics").text
        assert metric_value(text, "transformd_http_requests_total",
                            {"method": "other", "route": "/healthz", "status": "405"}) == 40
        assert "M0001" not in text and len(text) < 100_000
    daemon.stop()


def test_files_of_an_entry_another_process_converts_are_waited_for_never_empty(start, models: Path) -> None:
    """/files of an entry that another process converts (`convert --cache-dir C --no-daemon` into the daemon's
    cache) was a 200 with no files: load_from_daemon returned no tensors and no error (an attack review). It is a
    202 now; files() says so, and files(wait=True) and load_from_daemon wait for the entry."""
    import threading

    from transformd.cache import Cache
    from transformd.cache.converter import TransformdConverter
    from transformd.cache.keys import Recipe, cache_key
    from transformd.client import ConflictError, TransformdClient
    from transformd.loader import load_from_daemon

    daemon = start()
    cache, recipe, src = Cache(daemon.daemon.cache.root), Recipe(target="ocp"), models / "sample"
    key = cache_key(cache.identity(src), recipe)  # (keyed first: the other conversion goes by this key)
    begun, release, entries, loaded = threading.Event(), threading.Event(), [], []

    def held(*args):
        begun.set()
        assert release.wait(60)
        return TransformdConverter("cpu")(*args)

    other = threading.Thread(target=lambda: entries.append(cache.get_or_convert(src, recipe, converter=held)))
    other.start()
    try:
        assert begun.wait(30)
        with TransformdClient(socket=daemon.socket_path) as td:
            with pytest.raises(ConflictError, match="converting and its files are not known yet"):
                td.files(key)
            waiter = threading.Thread(target=lambda: loaded.append(load_from_daemon(td, key, timeout=60)))
            waiter.start()
            waiter.join(0.5)
            assert waiter.is_alive() and not loaded, "it waits for the entry"
            release.set()
            waiter.join(60)
    finally:
        release.set()
        other.join(60)
    (entry,) = entries
    expected = {}
    for shard in sorted(entry.path.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            expected.update({name: f.get_tensor(name) for name in f.keys()})
    (tensors,) = loaded
    assert expected and tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[n].reshape(-1).view(torch.uint8), expected[n].reshape(-1).view(torch.uint8))
               for n in expected)
    daemon.stop()


def test_files_of_a_job_that_knows_no_shard_yet_are_waited_for(start, models: Path) -> None:
    """The same for the daemon's own job before its converter planned the shards (a converter without a plan):
    its /files was a 200 with no files, and load_from_daemon raised at once (a review of the fix above)."""
    from transformd.client import TransformdClient
    from transformd.loader import load_from_daemon

    from .support.fakes import CopyConverter

    daemon = start(converter=CopyConverter(delay=0.3, steps=3))
    with daemon.client() as http:
        r = http.post("/v1/checkpoints", json={"source": str(models / "sample")})
        assert r.status_code == 202, r.text
        key = r.json()["key"]
        files = http.get(f"/v1/checkpoints/{key}/files")
        assert files.status_code == 202 and files.json()["files"] == [], files.text
    with TransformdClient(socket=daemon.socket_path) as td:
        tensors = load_from_daemon(td, key, timeout=60)
        assert td.status(key).ready and len(tensors) > 10
    daemon.stop()


def test_a_request_the_server_cannot_parse_gets_a_json_error(start) -> None:
    """A bad Content-Length or chunk framing got uvicorn's text/plain "Invalid HTTP request received." (an attack
    review); every error of the daemon is JSON."""
    import socket

    daemon = start()
    for raw in (b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
                b"POST /v1/checkpoints HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(daemon.socket_path))
            sock.sendall(raw)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower(), answer
        assert json.loads(body)["error"]["code"] == "bad_request", answer
    daemon.stop()


def test_docs_work_offline(start) -> None:
    """/docs and /redoc reference only this daemon's URLs (no CDN), and every asset they name is served."""
    import re

    daemon = start()
    with daemon.client() as http:
        for page in ("/docs", "/redoc"):
            r = http.get(page)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), (page, r.text[:300])
            html = r.text
            urls = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html)
            urls += re.findall(r"""(?:url|spec-url)\s*[:=]\s*["']([^"']+)["']""", html)
            assert urls and "/openapi.json" in urls, (page, urls)
            for url in urls:
                assert url.startswith("/") and not url.startswith("//"), (page, url)
            assert "http://" not in html and "https://" not in html, (page, html)
            for url in urls:
                got = http.get(url)
                assert got.status_code == 200 and len(got.content) > 100, (page, url, got.status_code)
        assets = {u: http.get(u) for u in ("/docs/static/swagger-ui-bundle.js", "/docs/static/swagger-ui.css")}
        assert "javascript" in assets["/docs/static/swagger-ui-bundle.js"].headers["content-type"]
        assert assets["/docs/static/swagger-ui.css"].headers["content-type"].startswith("text/css")
        assert b"SwaggerUIBundle" in assets["/docs/static/swagger-ui-bundle.js"].content
        assert '"validatorUrl": null' in http.get("/docs").text  # the validator badge would call out
        assert http.get("/docs/oauth2-redirect").status_code == 200
        assert "/docs" not in http.get("/openapi.json").json()["paths"]


def test_bad_requests_are_400_with_a_message(start, models: Path) -> None:
    daemon = start()
    src = str(models / "sample")
    with daemon.client() as http:
        cases = [
            http.post("/v1/checkpoints", content=b"{not json", headers={"content-type": "application/json"}),
            http.post("/v1/checkpoints", content=b"[1, 2]", headers={"content-type": "application/json"}),
            http.post("/v1/checkpoints", json={}),
            http.post("/v1/checkpoints", json={"source": src, "target": "e5m2"}),
            http.post("/v1/checkpoints", json={"source": src, "scale_mode": "max"}),
            http.post("/v1/checkpoints", json={"source": src, "colour": "blue"}),
            http.post("/v1/checkpoints", json={"source": src, "select": "x" * 2000}),
            http.post("/v1/checkpoints", json={"source": "relative/dir/path"}),  # org/name is a repo id (hub)
            http.post("/v1/checkpoints", json={"source": "/x\u0000y"}),
            http.post("/v1/checkpoints", json={"source": 42}),
        ]
        for r in cases:
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["status"] == 400 and err["code"] and len(err["message"]) > 10
        for pattern in ("(", "(?=a)b", "(a)\\1"):  # what RE2 cannot compile: 422, before the source is looked at
            r = http.post("/v1/checkpoints", json={"source": str(models / "missing"), "select": pattern})
            assert r.status_code == 422 and r.json()["error"]["code"] == "bad_select", r.text
        r = http.post("/v1/checkpoints", json={"source": str(models / "missing")})
        assert r.status_code == 404 and r.json()["error"]["code"] == "source_not_found"
        r = http.post("/v1/checkpoints", content=b"x" * (1 << 20), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert http.put("/v1/checkpoints").status_code == 405
        assert http.get("/v2/nothing").status_code == 404
        assert http.get("/healthz").status_code == 200


def _corrupt_copy(models: Path, name: str, how: str) -> Path:
    dst = models / name
    if dst.exists():
        return dst
    shutil.copytree(models / "sample", dst)
    if how == "truncate":
        shard = dst / "model-00001-of-00002.safetensors"
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
        return dst
    # a NaN e4m3fn code (0x7F) in an MXFP8 weight: the headers are fine, it is found only while converting
    for shard in sorted(dst.glob("*.safetensors")):
        data_start, header = _independent_header(shard)
        weights = [n for n, t in header.items() if t["dtype"] == "F8_E4M3" and n.endswith(".weight")]
        if weights:
            with open(shard, "r+b") as f:
                f.seek(data_start + header[weights[0]]["data_offsets"][0])
                f.write(b"\x7f")
            return dst
    raise AssertionError("the sample has no MXFP8 weight")


def _cache_is_empty(root: Path) -> bool:
    return not any((root / "entries").iterdir()) and not any((root / "staging").iterdir())


def test_corrupt_checkpoints_are_422_and_the_daemon_keeps_serving(start, models: Path, caplog) -> None:
    """... and its log says what each conversion came to (an operator's record: before, at the default level it
    said nothing of conversions but those failing with a 5xx)."""
    caplog.set_level("INFO", logger="transformd.daemon")
    truncated = _corrupt_copy(models, "truncated", "truncate")
    nan = _corrupt_copy(models, "nan-code", "nan")
    daemon = start()
    root = daemon.daemon.cache.root
    with daemon.client() as http:
        r = http.post("/v1/checkpoints", json={"source": str(truncated)})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_checkpoint" and "model-00001-of-00002.safetensors" in err["message"]
        assert _cache_is_empty(root)

        r = http.post("/v1/checkpoints", json={"source": str(nan)})
        assert r.status_code == 202, r.text  # the header is fine: the NaN code is found while converting
        failed = wait_ready(http, r.json()["key"])
        assert failed["state"] == "failed" and failed["error"]["status"] == 422
        assert "NaN" in failed["error"]["message"] or "nan" in failed["error"]["message"].lower()
        again = http.post("/v1/checkpoints", json={"source": str(nan)})
        assert again.status_code == 422 and again.json()["error"]["code"] == "invalid_checkpoint"
        assert http.get(f"{failed['files_url']}").status_code == 409
        assert _cache_is_empty(root)

        assert http.get("/healthz").status_code == 200
        assert _resolve(http, models / "sample")["state"] == "ready"
        metrics = http.get("/metrics").text
    assert metric_value(metrics, "transformd_conversions_total", {"outcome": "invalid"}) == 2
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "transformd.daemon"]
    assert any(level == "WARNING" and f"conversion of {nan} " in m and "422 invalid_checkpoint" in m
               for level, m in said), said
    assert any(level == "INFO" and m.startswith(f"converted {models / 'sample'} (key ") for level, m in said), said


@pytest.mark.parametrize("engine", [None, "vllm"])
def test_a_request_reads_a_fresh_source_once_to_key_it_and_plans_it_once(start, tmp_path: Path, models: Path,
                                                                         monkeypatch, engine: str | None) -> None:
    """A source written just now (inside the stat cache's racy window, so nothing is remembered) is hashed once
    per file and planned once per request: the conversion reuses the request's identity and plan, and so does the
    job of a request whose engine's check read the plan (it planned twice, a review)."""
    from transformd import checkpoint
    from transformd.cache import keys

    src = write_sample_checkpoint(models / f"fresh-{engine}", layers=1, experts=2, shards=2)
    hashed: list[str] = []
    real_hash, real_plan = keys.hash_file, checkpoint.plan_conversion
    plans: list[str] = []
    monkeypatch.setattr(keys, "hash_file", lambda path, *a, **k: hashed.append(str(path)) or real_hash(path, *a, **k))
    monkeypatch.setattr(checkpoint, "plan_conversion",
                        lambda path, *a, **k: plans.append(str(path)) or real_plan(path, *a, **k))
    daemon = start()
    with daemon.client() as http:
        body = _resolve(http, src, **({} if engine is None else {"engine": engine}))
    files = sorted(p.name for p in src.iterdir())
    assert len(hashed) == len(files), (hashed, files)
    assert len(plans) == 1, plans
    shards = {p.name for p in src.glob("*.safetensors")}
    assert len(shards) == 2 and shards <= {p.name for p in Path(body["path"]).iterdir()}


def test_a_status_request_that_waits_answers_when_the_conversion_ends(start, models: Path) -> None:
    """``GET /v1/checkpoints/{key}?wait=S`` answers when the job ends (ready), not at the client's next poll and not
    after S; while it goes on, after S with its progress; ``wait`` outside 0..10 is a 400 that names it."""
    import time

    from .support.fakes import CopyConverter

    daemon = start(converter=CopyConverter(delay=0.3, steps=6))  # (a conversion of a few seconds)
    with daemon.client() as http:
        r = http.post("/v1/checkpoints", json={"source": str(models / "sample")})
        assert r.status_code == 202, r.text
        key = r.json()["key"]
        t0 = time.monotonic()
        s = http.get(f"/v1/checkpoints/{key}", params={"wait": 0.3})
        assert s.status_code == 200 and s.json()["state"] in ("queued", "converting"), s.text
        assert time.monotonic() - t0 >= 0.25  # it waited
        t0 = time.monotonic()
        s = http.get(f"/v1/checkpoints/{key}", params={"wait": 10}, timeout=30)
        took = time.monotonic() - t0
        assert s.status_code == 200 and s.json()["state"] == "ready", s.text
        assert took < 9, took  # answered when the conversion ended, not after the 10 s it was allowed
        assert http.get(f"/v1/checkpoints/{key}", params={"wait": 10}).json()["state"] == "ready"  # (at once)
        for bad in (-1, 10.5, "soon"):
            r = http.get(f"/v1/checkpoints/{key}", params={"wait": bad})
            assert r.status_code == 400 and "wait" in r.text, (bad, r.text)
    daemon.stop()
