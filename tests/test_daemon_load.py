"""The real daemon process under load: many concurrent clients, a steady stream of status queries, real conversions.

The daemon runs in a subprocess (its own event loop and GIL, as in production; ``python -m tests.support.daemon
serve``: ``transformd serve``'s flags and server) with the real converter on the CPU, two conversion workers and a
short queue. For a bounded time, 32 client threads resolve seeded picks among five (checkpoint, target) pairs (three
checkpoints share their weights but differ in content, so their keys differ), while two probe threads query
/healthz, a checkpoint's status, /v1/cache and /metrics without pause. The injected converter hook
(tests/support/daemon.py) only logs when each converter run starts and ends (no slow-down), which gives the number
of runs per key and how many overlapped.

Asserted: every resolve returned the right converted directory (a 503 ``queue_full`` is documented backpressure
with ``Retry-After``, which the client honours; nothing else may fail), one conversion per key (log and
``transformd_conversions_total``), no 5xx but those 503s, the number of overlapping converter runs never above
``max_concurrent_conversions``, the probe latency while conversions run (p50, p99: the event loop is never blocked
by conversion work), and the daemon's resident memory (VmRSS of /proc/PID/status, sampled) bounded.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from transformd.client import TransformdClient
from transformd.sample import write_sample_checkpoint

from .support.daemon import DaemonProcess, metric_value, short_tempdir
from .support.entries import entry_dir

pytestmark = pytest.mark.timeout(120)

CATEGORY = "daemon load"
SEED = 7
CLIENTS = 32
PROBES = 2
DURATION_S = 10.0
MAX_CONCURRENT = 2
MAX_QUEUED = 1
#: Bounds asserted (2-core CI machine, real converter): probe latency while converting, daemon memory.
#: The latency bound is for a loop never blocked by a conversion (each takes 4-7 s here), not for the machine's
#: speed: 0.25 s failed on a slow shared 2-core machine (p99 0.29-0.53 s, on the code before the change it was
#: run for too, with every client doing only one resolve in 10 s where others did three).
P99_LIMIT_S = 0.5
RSS_LIMIT_BYTES = 1536 << 20
RSS_GROWTH_LIMIT_BYTES = 768 << 20


@pytest.fixture
def run_dir() -> Iterator[Path]:
    run = short_tempdir("tdl-")
    yield run
    shutil.rmtree(run, ignore_errors=True)


def _models(root: Path) -> list[Path]:
    """Three checkpoints of ~40 MB: one sample and two copies whose config differs (other content, other key)."""
    first = write_sample_checkpoint(root / "m0", layers=3, experts=8, shards=3, hidden=1024, moe_intermediate=512)
    out = [first]
    for i in (1, 2):
        copy = root / f"m{i}"
        shutil.copytree(first, copy)
        config = json.loads((copy / "config.json").read_text())
        config["load_test_copy"] = i
        (copy / "config.json").write_text(json.dumps(config))
        out.append(copy)
    return out


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def test_many_clients_and_status_queries_during_real_conversions(
    tmp_path: Path, run_dir: Path, fault_log
) -> None:
    models = _models(tmp_path / "models")
    pairs = [(models[0], "fnuz"), (models[0], "ocp"), (models[1], "fnuz"), (models[2], "fnuz"), (models[2], "ocp")]
    conv_log = tmp_path / "conversions.log"
    daemon = DaemonProcess(
        run_dir / "td.sock",
        tmp_path / "cache",
        [tmp_path / "models"],
        args=["--max-concurrent-conversions", str(MAX_CONCURRENT), "--max-queued-conversions", str(MAX_QUEUED)],
        hooks={"log": str(conv_log)},
        log_path=run_dir / "daemon.log",
        env={"TRANSFORMD_MAX_QUEUED_PER_CALLER": "64"},  # (one uid, root, asks for all: a load test, not a cap test)
    ).start()

    stop = threading.Event()
    rss: list[tuple[float, int]] = []
    probes: list[tuple[float, float, str, int]] = []  # (time, seconds, what, status)
    results: list[tuple[int, str, Path]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def sample_rss() -> None:
        while not stop.is_set():
            value = daemon.rss_bytes()
            if value is not None:
                rss.append((time.time(), value))
            time.sleep(0.05)

    def probe(i: int) -> None:
        urls = ["/healthz", "/v1/cache", "/metrics", "/healthz"]
        n = 0
        with daemon.client(timeout=10) as http:
            while not stop.is_set() and n < 20_000:
                url = urls[n % len(urls)]
                if n % 5 == 4 and results:
                    url = f"/v1/checkpoints/{results[-1][1]}"
                t0 = time.perf_counter()
                try:
                    status = http.get(url).status_code
                except httpx.HTTPError as e:
                    with lock:
                        errors.append(f"probe {url}: {e!r}")
                    status = -1
                dt = time.perf_counter() - t0
                with lock:
                    probes.append((time.time(), dt, url, status))
                n += 1
                time.sleep(0.01)

    def client(i: int) -> None:
        rng = random.Random(SEED * 1000 + i)
        deadline = time.monotonic() + DURATION_S
        n = 0
        with TransformdClient(socket=daemon.socket_path, timeout=30) as td:
            while (time.monotonic() < deadline or n < 3) and n < 500:  # at least 3 each, however slow the machine
                src, target = pairs[rng.randrange(len(pairs))]
                try:
                    path = td.resolve(src, target=target, poll_interval=0.1, timeout=60)
                    key = td.last_key or ""
                    with lock:
                        results.append((i, key, path))
                    assert path == entry_dir(daemon.cache_dir, key) / "checkpoint", (path, key)
                except Exception as e:  # noqa: BLE001 - collected and asserted below
                    with lock:
                        errors.append(f"client {i} {src.name}/{target}: {e!r}")
                n += 1
                time.sleep(rng.uniform(0.0, 0.05))

    threads = [threading.Thread(target=sample_rss, daemon=True)]
    threads += [threading.Thread(target=probe, args=(i,), daemon=True) for i in range(PROBES)]
    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    rss_before = daemon.rss_bytes()
    try:
        for t in threads + clients:
            t.start()
        for t in clients:
            t.join(DURATION_S + 90)
        stop.set()
        for t in threads:
            t.join(15)
        assert not any(t.is_alive() for t in clients + threads), "a client or probe did not finish"
        with daemon.client() as http:
            metrics = http.get("/metrics").text
            listing = http.get("/v1/cache").json()
        rss_after = daemon.rss_bytes()
    finally:
        stop.set()
        status = daemon.stop(30)
    assert status == 0, daemon.log_text()[-2000:]

    assert errors == [], errors[:10]
    keys = {key for _, key, _ in results}
    assert len(keys) == len(pairs), keys  # every pair was resolved
    assert len(results) >= CLIENTS * 3
    assert {e["key"] for e in listing["entries"]} == keys

    # one conversion per key
    events = [line.split() for line in conv_log.read_text().splitlines()]
    starts = [e for e in events if e[0] == "start"]
    assert sorted(e[1] for e in starts) == sorted(keys), starts
    assert metric_value(metrics, "transformd_conversions_total", {"outcome": "converted"}) == len(keys)
    assert metric_value(metrics, "transformd_conversions_total", {"outcome": "failed"}) == 0

    # the queue limits concurrency
    timeline = sorted((float(e[4]), 1 if e[0] == "start" else -1) for e in events)
    running = peak = 0
    for _, step in timeline:
        running += step
        peak = max(peak, running)
    assert running == 0 and 1 <= peak <= MAX_CONCURRENT, peak
    intervals = {}
    for e in events:
        intervals.setdefault(e[1], {})[e[0]] = float(e[4])
    busy = [(v["start"], v["end"]) for v in intervals.values()]

    # no request failed but documented backpressure
    by_status: dict[str, float] = {}
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == "transformd_http_requests_total":
                by_status[s.labels["status"]] = by_status.get(s.labels["status"], 0) + s.value
    server_errors = {k: v for k, v in by_status.items() if k.startswith("5") and k != "503"}
    assert server_errors == {}, by_status
    rejected = by_status.get("503", 0)
    # Retry-After (5 s) is honoured: each client can have been refused at most once per 5 s of the run (+1)
    assert rejected <= CLIENTS * (DURATION_S / 5 + 2), rejected
    assert all(s in (200, 503) for _, _, url, s in probes if url == "/healthz"), "healthz failed"
    assert not [p for p in probes if p[3] == 503 and p[2] == "/healthz"]

    # status latency while conversions run
    during = [dt for t, dt, _, _ in probes if any(b <= t - dt and t <= e for b, e in busy)]
    overall = [dt for _, dt, _, _ in probes]
    assert len(during) >= 20, (len(during), busy)
    p50, p99 = statistics.median(during), _percentile(during, 0.99)
    assert p99 < P99_LIMIT_S, (p50, p99, max(during))

    # memory
    peak_rss = max(v for _, v in rss)
    assert rss_before is not None and rss_after is not None
    assert peak_rss < RSS_LIMIT_BYTES and peak_rss - rss_before < RSS_GROWTH_LIMIT_BYTES, (rss_before, peak_rss)

    per_url: dict[str, list[float]] = {}
    for t, dt, url, _ in probes:
        if any(b <= t - dt and t <= e for b, e in busy):
            name = "/v1/checkpoints/{key}" if url.startswith("/v1/checkpoints/") else url
            per_url.setdefault(name, []).append(dt)
    breakdown = ", ".join(
        f"{u} p50 {statistics.median(v) * 1e3:.1f} / p99 {_percentile(v, 0.99) * 1e3:.1f} ms"
        for u, v in sorted(per_url.items())
    )
    print(breakdown)
    summary = (
        f"{len(results)} resolves over {DURATION_S:.0f} s, {len(probes)} probes; status p50 {p50 * 1e3:.1f} ms, "
        f"p99 {p99 * 1e3:.1f} ms ({len(during)} probes) during {len(busy)} real conversions of "
        f"{sum(e - b for b, e in busy):.1f} s in all (max {max(during) * 1e3:.0f} ms; all probes "
        f"p99 {_percentile(overall, 0.99) * 1e3:.1f} ms); {rejected:.0f} 503 queue_full honoured; "
        f"peak {peak} concurrent conversions (limit {MAX_CONCURRENT}); RSS {rss_before / 2**20:.0f} -> peak "
        f"{peak_rss / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB"
    )
    print(summary)
    (tmp_path / "summary.txt").write_text(summary)
    fault_log.record(
        CATEGORY,
        f"{CLIENTS} concurrent clients resolving 5 keys (3 checkpoints) + status/health/cache/metrics probes "
        f"for {DURATION_S:.0f} s, real converter, {MAX_CONCURRENT} workers, queue {MAX_QUEUED}",
        len(results) + len(probes),
        f"no failure; one conversion per key; 503+Retry-After only; {summary}",
    )
