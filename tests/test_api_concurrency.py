"""The daemon under concurrent requests and slow conversions: single flight, a responsive event loop, the bounded
queue, shard-level just-in-time, and shutdown in the middle of a conversion."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from transformd.daemon.shards import ShardPriority, TransformdShardConverter
from transformd.sample import write_sample_checkpoint

from .support.daemon import DaemonThread, Daemons, metric_value, wait_ready
from .support.fakes import CopyConverter, OrderedCopyConverter, write_source

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def models(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    return root


@pytest.fixture
def start(daemons: Daemons, tmp_path: Path, models: Path) -> Callable[..., DaemonThread]:
    """``start(converter, **settings)``: a daemon over ``models`` (5 s shutdown grace unless given)."""
    defaults = {"cache_dir": tmp_path / "cache", "allow_roots": [models], "shutdown_grace_s": 5.0}
    return lambda converter=None, **settings: daemons.start(converter, **{**defaults, **settings})


def _four_shards(models: Path, name: str = "m", size: int = 256 * 1024) -> Path:
    """Four valid safetensors shards of ``size`` data bytes each (random uint8 tensors)."""
    files = {}
    for i in range(1, 5):
        tensors = {f"layer{i}.{j}.weight": torch.randint(0, 255, (size // 4,), dtype=torch.uint8) for j in range(4)}
        files[f"model-0000{i}-of-00004.safetensors"] = save(tensors)
    files["config.json"] = b'{"model_type": "fake"}'
    return write_source(models / name, files)


def test_concurrent_identical_requests_convert_once(start, models: Path, tmp_path: Path) -> None:
    src = write_source(models / "m", seed=1)
    log = tmp_path / "runs.log"
    daemon = start(CopyConverter(log=log, delay=0.2, steps=2))

    async def burst() -> list[tuple[int, dict]]:
        async with daemon.async_client() as http:
            rs = await asyncio.gather(*(http.post("/v1/checkpoints", json={"source": str(src)}) for _ in range(16)))
            return [(r.status_code, r.json()) for r in rs]

    results = asyncio.run(burst())
    assert {code for code, _ in results} <= {200, 202}, results
    keys = {body["key"] for _, body in results}
    assert len(keys) == 1
    with daemon.client() as http:
        assert wait_ready(http, keys.pop())["state"] == "ready"
        more = [http.post("/v1/checkpoints", json={"source": str(src)}) for _ in range(3)]
        assert all(r.status_code == 200 for r in more)
        metrics = http.get("/metrics").text
    assert log.read_text().count("\n") == 1  # one conversion ran
    assert metric_value(metrics, "transformd_conversions_total", {"outcome": "converted"}) == 1
    assert metric_value(metrics, "transformd_cache_hits_total") == 3 + sum(c == 200 for c, _ in results)
    assert metric_value(metrics, "transformd_cache_misses_total") == sum(c == 202 for c, _ in results)


def test_event_loop_stays_responsive_during_a_slow_conversion(start, models: Path) -> None:
    src = _four_shards(models)
    daemon = start(OrderedCopyConverter(delay=0.4))
    with daemon.client() as http:
        r = http.post("/v1/checkpoints", json={"source": str(src)})
        assert r.status_code == 202
        key = r.json()["key"]
        latencies = []
        states = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            status = http.get(f"/v1/checkpoints/{key}")
            health = http.get("/healthz")
            latencies.append((time.perf_counter() - t0) / 2)
            assert status.status_code == 200 and health.status_code == 200
            states.add(status.json()["state"])
            if status.json()["state"] == "ready":
                break
        progress = http.get("/v1/cache").json()
    assert "converting" in states and "ready" in states
    assert len(latencies) > 20
    p50, worst = statistics.median(latencies), max(latencies)
    assert p50 < 0.05 and worst < 0.5, (p50, worst)
    assert progress["conversions"] == []


def test_progress_is_reported_while_converting(start, models: Path) -> None:
    src = _four_shards(models)
    daemon = start(OrderedCopyConverter(delay=0.3))
    with daemon.client() as http:
        key = http.post("/v1/checkpoints", json={"source": str(src)}).json()["key"]
        seen = []
        while True:
            body = http.get(f"/v1/checkpoints/{key}").json()
            seen.append(body["progress"])
            if body["state"] == "ready":
                break
            time.sleep(0.05)
    mid = [p for p in seen if p["phase"] == "converting" and p["bytes_done"]]
    assert mid, seen
    assert all(p["bytes_total"] == sum(f.stat().st_size for f in src.glob("*.safetensors")) for p in mid)
    assert any(p["rate_bytes_per_s"] and p["eta_s"] is not None for p in mid), mid
    assert seen[-1]["phase"] == "done" and seen[-1]["bytes_done"] == seen[-1]["bytes_total"]


def test_the_queue_is_bounded(start, models: Path) -> None:
    sources = [write_source(models / f"m{i}", seed=10 + i) for i in range(3)]
    daemon = start(CopyConverter(delay=0.25), max_concurrent_conversions=1, max_queued_conversions=1)
    with daemon.client() as http:
        first = http.post("/v1/checkpoints", json={"source": str(sources[0])})
        second = http.post("/v1/checkpoints", json={"source": str(sources[1])})
        third = http.post("/v1/checkpoints", json={"source": str(sources[2])})
        assert first.status_code == 202 and second.status_code == 202
        assert third.status_code == 503 and third.json()["error"]["code"] == "queue_full"
        assert third.headers["retry-after"]
        again = http.post("/v1/checkpoints", json={"source": str(sources[0])})
        assert again.status_code == 202 and again.json()["key"] == first.json()["key"]  # joins, is not refused
        assert http.get("/v1/cache").json()["conversions"][0]["key"] == first.json()["key"]
        for r in (first, second):
            assert wait_ready(http, r.json()["key"])["state"] == "ready"
        third = http.post("/v1/checkpoints", json={"source": str(sources[2])})
        assert third.status_code == 202
        assert wait_ready(http, third.json()["key"])["state"] == "ready"


def test_a_shard_requested_early_is_served_before_the_whole_entry_fake_converter(start, models: Path) -> None:
    """The daemon's half of shard-level just-in-time, with a converter that honours ShardPriority."""
    src = _four_shards(models)
    daemon = start(OrderedCopyConverter(delay=0.5))
    last = "model-00004-of-00004.safetensors"
    with daemon.client() as http:
        r = http.post("/v1/checkpoints", json={"source": str(src)})
        key = r.json()["key"]
        r = http.get(f"/v1/checkpoints/{key}/files/{last}")
        assert r.status_code == 202 and r.json()["ready"] is False and r.json()["path"] is None
        early = None
        for _ in range(200):
            r = http.get(f"/v1/checkpoints/{key}/files/{last}")
            if r.status_code == 200:
                early = r.json()
                break
            time.sleep(0.02)
        assert early is not None and early["ready"] is True
        state = http.get(f"/v1/checkpoints/{key}").json()["state"]
        assert state == "converting"  # the shard is ready before the whole entry
        assert early["path"] != early["final_path"] and "/staging/" in early["path"]
        with open(early["path"], "rb") as f:  # open at once, as documented
            mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            ino = os.fstat(f.fileno()).st_ino
        listing = http.get(f"/v1/checkpoints/{key}/files").json()
        assert listing["state"] == "converting" and len(listing["files"]) == 4
        assert {f["name"] for f in listing["files"] if f["ready"]} >= {last}
        done = wait_ready(http, key)
        final = http.get(f"/v1/checkpoints/{key}/files/{last}").json()
    assert done["state"] == "ready" and final["path"] == early["final_path"]
    assert os.stat(final["path"]).st_ino == ino and mapped[:] == Path(final["path"]).read_bytes()
    mapped.close()
    order = json.loads((Path(done["path"]).parent / "manifest.json").read_text())["result"]["order"]
    assert order.index(last) <= 1 and order != sorted(order)  # at most the shard already started went first


class _SlowedConverter(TransformdShardConverter):
    """The real converter, slowed down per tensor so the early shard can be observed."""

    def __call__(self, src, out, recipe, progress, *, shard_order=None):  # type: ignore[override]
        def slow(update: Any) -> None:
            time.sleep(0.02)
            progress(update)

        return super().__call__(src, out, recipe, slow, shard_order=shard_order)


def test_a_shard_requested_early_is_ready_before_the_whole_entry(start, models: Path) -> None:
    """With the real converter: the last shard, requested first, is served while the entry still converts."""
    src = write_sample_checkpoint(models / "sample4", layers=3, experts=4, shards=4)
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    last = shards[-1]
    daemon = start(_SlowedConverter("cpu"))
    with daemon.client() as http:
        key = http.post("/v1/checkpoints", json={"source": str(src)}).json()["key"]
        r = http.get(f"/v1/checkpoints/{key}/files/{last}")
        assert r.status_code in (200, 202)
        early, early_state, fd = None, None, None
        for _ in range(1500):
            r = http.get(f"/v1/checkpoints/{key}/files/{last}")
            if r.status_code == 200 and r.json()["ready"]:
                early = r.json()
                fd = os.open(early["path"], os.O_RDONLY)  # open at once, as documented
                early_state = http.get(f"/v1/checkpoints/{key}").json()["state"]
                break
            time.sleep(0.02)
        final = wait_ready(http, key)
        published = http.get(f"/v1/checkpoints/{key}/files/{last}").json()
    assert final["state"] == "ready"
    assert early_state == "converting", "the requested shard only became ready with the whole entry"
    assert early is not None and fd is not None
    try:
        assert early["path"] != early["final_path"] == published["path"]
        assert os.fstat(fd).st_ino == os.stat(published["path"]).st_ino  # same file, renamed into place
        assert early["tensors"] == published["tensors"] and early["size"] == published["size"]
    finally:
        os.close(fd)


def test_shard_priority_orders_requests_first() -> None:
    p = ShardPriority()
    pending = ["a", "b", "c", "d"]
    assert p.next(pending) == "a"
    p.request("d")
    p.request("c")
    p.request("d")
    assert p.next(["b", "c", "d"]) == "d"
    assert p.next(["b", "c"]) == "c"
    p.request("zzz")  # not in this checkpoint: ignored by next()
    assert p.next(["b"]) == "b"
    assert p.started() == ["a", "d", "c", "b"]
    p.done("a", Path("/x/a"))
    assert p.finished() == {"a": Path("/x/a")}


def test_shutdown_cancels_a_running_conversion_and_leaves_no_staging(start, models: Path) -> None:
    src = write_source(models / "m", seed=3)
    daemon = start(CopyConverter(delay=2.0, steps=40))
    cache = daemon.daemon.cache
    with daemon.client() as http:
        key = http.post("/v1/checkpoints", json={"source": str(src)}).json()["key"]
        for _ in range(200):
            if http.get(f"/v1/checkpoints/{key}").json()["progress"]["phase"] == "converting" and any(
                cache.staging_dir.iterdir()
            ):
                break
            time.sleep(0.02)
    t0 = time.monotonic()
    daemon.stop()
    assert time.monotonic() - t0 < 5
    assert daemon.daemon.service.job(key).state == "failed"
    assert daemon.daemon.service.job(key).error.code == "cancelled"
    assert list(cache.staging_dir.iterdir()) == [] and list(cache.entries_dir.iterdir()) == []
    assert cache.status(key) is None  # a cancellation is not recorded as a failure of the checkpoint
