"""Daemon round-trip latency: a cached resolve (``POST /v1/checkpoints`` -> 200) and the mmap file tables.

One run:
  1. write a sample MXFP8 checkpoint (``transformd.sample``; size set by the flags),
  2. start ``transformd serve`` in its own process on a temporary unix socket (so the client does not share
     the daemon's interpreter), convert the sample once,
  3. time N requests of each kind over the unix socket with one keep-alive httpx client, and the cached
     resolve again with a new connection per request (what a one-shot ``transformd resolve`` pays),
  4. print a table of p50 / p99 / mean / max in milliseconds;
  5. time whole processes, alternated round-robin so that a noisy machine weighs on each alike: the interpreter
     alone, ``python -c "import httpx"``, ``import transformd.client``, and a warm ``transformd resolve SRC``
     (what an engine's start-up hook pays on every start, on every rank), with each one's ratio to
     ``import httpx`` (the goal: resolve <= 3x).

    python benchmarks/api_bench.py [-n 500] [--processes 20] [--layers 2 --experts 4 --shards 2] [--device cpu]
                                   [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _start_daemon(sock: Path, cache: Path, models: Path, device: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMD_")}
    cmd = [
        sys.executable,
        "-m",
        "transformd",
        "serve",
        "--socket",
        str(sock),
        "--cache-dir",
        str(cache),
        "--allow-root",
        str(models),
        "--device",
        device,
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if select.select([proc.stderr], [], [], 0.1)[0]:
            line = proc.stderr.readline()
            if "listening on" in line:
                return proc
            if not line:
                break
    proc.kill()
    raise RuntimeError(f"the daemon did not start: {proc.stderr.read()}")


def _time(n: int, call: Callable[[], httpx.Response], expect: int) -> list[float]:
    for _ in range(min(20, n)):  # warm-up (connections, in-memory tables)
        call()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = call()
        out.append(time.perf_counter() - t)
        if r.status_code != expect:
            raise RuntimeError(f"unexpected {r.status_code}: {r.text[:300]}")
    return out


def _row(name: str, samples: list[float], size: int | None = None) -> dict[str, float | str | int]:
    s = sorted(samples)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]
    return {
        "request": name,
        "n": len(s),
        "p50_ms": q(0.50) * 1e3,
        "p99_ms": q(0.99) * 1e3,
        "mean_ms": statistics.fmean(s) * 1e3,
        "max_ms": s[-1] * 1e3,
        "body_bytes": size or 0,
    }


def _whole_processes(runs: int, src: Path, sock: Path) -> list[dict[str, float | str]]:
    """Median and best wall time of each command, the commands alternated ``runs`` times."""
    script = Path(sys.executable).with_name("transformd")
    resolve = [str(script)] if script.exists() else [sys.executable, "-m", "transformd"]
    commands = {
        "python -c pass (interpreter floor)": [sys.executable, "-c", "pass"],
        'python -c "import httpx"': [sys.executable, "-c", "import httpx"],
        'python -c "import transformd.client"': [sys.executable, "-c", "import transformd.client"],
        "transformd resolve SRC (warm: a cache hit)": [*resolve, "resolve", str(src), "--socket", str(sock)],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs + 1):  # the first round warms the page cache and .pyc files: not counted
        for name, cmd in commands.items():
            t = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times['python -c "import httpx"'][1:])
    return [{"command": name, "median_s": statistics.median(ts[1:]), "best_s": min(ts[1:]),
             "vs_httpx": statistics.median(ts[1:]) / base} for name, ts in times.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=500, help="requests per kind")
    ap.add_argument("--processes", type=int, default=20, help="runs of each whole-process command")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()

    from transformd.sample import write_sample_checkpoint

    work = Path(tempfile.mkdtemp(prefix="td-bench-"))
    proc = None
    try:
        models = work / "models"
        src = write_sample_checkpoint(models / "sample", layers=args.layers, experts=args.experts, shards=args.shards)
        old = time.time() - 60  # past the stat cache's 2 s "racy" window, as a checkpoint on disk would be
        for f in src.iterdir():
            os.utime(f, (old, old))
        sock = work / "td.sock"
        proc = _start_daemon(sock, work / "cache", models, args.device)
        transport = httpx.HTTPTransport(uds=str(sock))
        with httpx.Client(transport=transport, base_url="http://transformd", timeout=60) as http:
            body = {"source": str(src)}
            t = time.perf_counter()
            r = http.post("/v1/checkpoints", json=body)
            key = r.json()["key"]
            while http.get(f"/v1/checkpoints/{key}").json()["state"] not in ("ready", "failed"):
                time.sleep(0.01)
            cold = time.perf_counter() - t
            state = http.get(f"/v1/checkpoints/{key}").json()
            assert state["state"] == "ready", state
            files = http.get(f"/v1/checkpoints/{key}/files")
            shard = files.json()["files"][0]["name"]
            tensors = sum(len(f["tensors"]) for f in files.json()["files"])
            one = http.get(f"/v1/checkpoints/{key}/files/{shard}")
            rows = [
                _row("GET /healthz (HTTP floor)", _time(args.n, lambda: http.get("/healthz"), 200)),
                _row(
                    "POST /v1/checkpoints (cached, 200)",
                    _time(args.n, lambda: http.post("/v1/checkpoints", json=body), 200),
                ),
                _row("GET /v1/checkpoints/{key}", _time(args.n, lambda: http.get(f"/v1/checkpoints/{key}"), 200)),
                _row(
                    "GET /v1/checkpoints/{key}/files",
                    _time(args.n, lambda: http.get(f"/v1/checkpoints/{key}/files"), 200),
                    len(files.content),
                ),
                _row(
                    "GET /v1/checkpoints/{key}/files/{name}",
                    _time(args.n, lambda: http.get(f"/v1/checkpoints/{key}/files/{shard}"), 200),
                    len(one.content),
                ),
            ]

        def fresh_connection() -> httpx.Response:
            # verify=False: over a unix socket there is no TLS, and httpx would otherwise build two SSL
            # contexts (~17 ms on the development machine) for every new client
            transport = httpx.HTTPTransport(uds=str(sock), verify=False)
            with httpx.Client(transport=transport, base_url="http://transformd", verify=False) as c:
                return c.post("/v1/checkpoints", json=body)

        rows.append(_row("POST /v1/checkpoints (cached, new client+conn.)", _time(args.n, fresh_connection, 200)))
        processes = _whole_processes(args.processes, src, sock)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"transformd daemon round trips over a unix socket ({args.n} requests each, one keep-alive client "
        f"unless noted); sample: {args.layers} layers x {args.experts} experts, {args.shards} shards, "
        f"{tensors} tensors; cold conversion {cold:.2f} s on {args.device}"
    )
    print()
    head = f"| {'request':<48} | {'p50 ms':>7} | {'p99 ms':>7} | {'mean ms':>7} | {'max ms':>7} | {'body B':>8} |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        print(
            f"| {r['request']:<48} | {r['p50_ms']:7.2f} | {r['p99_ms']:7.2f} | {r['mean_ms']:7.2f} | "
            f"{r['max_ms']:7.2f} | {r['body_bytes'] or '':>8} |"
        )
    print()
    print(f"Whole processes ({args.processes} runs each, alternated; median and best wall time):")
    print()
    head = f"| {'command':<44} | {'median ms':>9} | {'best ms':>8} | {'x import httpx':>14} |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in processes:
        print(f"| {r['command']:<44} | {r['median_s'] * 1e3:9.1f} | {r['best_s'] * 1e3:8.1f} | "
              f"{r['vs_httpx']:14.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "processes": processes, "cold_s": cold, "tensors": tensors},
                                        indent=1))


if __name__ == "__main__":
    main()
