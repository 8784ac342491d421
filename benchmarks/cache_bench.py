"""End-to-end cache benchmark: cold conversion into the cache vs ``cp -r`` + ``sync``; warm lookup latency.

One run, same files:
  1. write a sample MXFP8 checkpoint (``transformd.sample``; size set by the flags),
  2. ``cp -r SRC COPY && sync`` (the floor: reading and durably writing the same bytes),
  3. cold ``Cache.get_or_convert(SRC)`` in a fresh process (hash the source, convert, digest,
     fsync, publish), with that process' peak RSS and peak GPU memory,
  4. warm ``Cache.lookup(SRC)`` and ``Cache.get_or_convert(SRC)`` latency (p50/p99) in this process,
     and a cold-start lookup in a fresh process (``transformd`` import not counted).

    python benchmarks/cache_bench.py [--workdir DIR] [--layers 8 --experts 16 --hidden 2048 --inter 1024]
                                     [--device auto] [--drop-caches] [--json results.json]

Targets (issue 3), on the GPU machine: cold conversion <= 1.25x the copy time, warm lookup
< 10 ms, peak RSS independent of the checkpoint's size (run two sizes to see it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _drop_caches(enabled: bool) -> None:
    if not enabled:
        return
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        print(f"(cannot drop the page cache: {e}; measuring with a warm page cache)", file=sys.stderr)


def _child(args: argparse.Namespace) -> None:
    """Run in a fresh process: the cold conversion, with its peak memory."""
    import torch

    from transformd.cache import Cache

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    cache = Cache(args.cache, budget_bytes="1T", device=args.device)
    t = time.perf_counter()
    entry = cache.get_or_convert(args.src)
    wall = time.perf_counter() - t
    m = entry.manifest
    out = {
        "wall_s": wall,
        "timings": m.timings,
        "output_bytes": m.total_bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "device": (m.result or {}).get("device") if isinstance(m.result, dict) else None,
        "path": str(entry.path),
    }
    print(json.dumps(out))


def _lookup_child(args: argparse.Namespace) -> None:
    from transformd.cache import Cache

    t = time.perf_counter()
    entry = Cache(args.cache, budget_bytes="1T").lookup(args.src)
    print(json.dumps({"cold_process_lookup_s": time.perf_counter() - t, "hit": entry is not None}))


def _percentiles(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--workdir", type=Path, help="where to put the sample, the copy and the cache (default: a temp dir)"
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1024, help="MoE intermediate size")
    ap.add_argument("--shards", type=int, default=0, help="safetensors shards (default: layers + 1)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each cold step (root)")
    ap.add_argument("--lookups", type=int, default=200)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lookup-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return 0
    if args.lookup_child:
        _lookup_child(args)
        return 0

    from transformd.cache import Cache
    from transformd.sample import write_sample_checkpoint

    work = args.workdir or Path(tempfile.mkdtemp(prefix="cache_bench."))
    work.mkdir(parents=True, exist_ok=True)
    src, copy, cache_dir = work / "src", work / "copy", work / "cache"
    for p in (src, copy, cache_dir):
        shutil.rmtree(p, ignore_errors=True)
    results: dict[str, object] = {"workdir": str(work)}
    try:
        t = time.perf_counter()
        write_sample_checkpoint(
            src,
            layers=args.layers,
            experts=args.experts,
            hidden=args.hidden,
            moe_intermediate=args.inter,
            shards=args.shards or args.layers + 1,
        )
        src_bytes = _du(src)
        results["source_bytes"] = src_bytes
        print(f"sample: {src_bytes / 1e9:.3f} GB in {time.perf_counter() - t:.1f} s ({src})")

        _drop_caches(args.drop_caches)
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(copy)], check=True)
        subprocess.run(["sync"], check=True)
        copy_s = time.perf_counter() - t
        results["copy_s"] = copy_s
        print(f"cp -r + sync: {copy_s:.2f} s ({src_bytes / copy_s / 1e9:.2f} GB/s)")
        shutil.rmtree(copy)

        _drop_caches(args.drop_caches)
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                "--src",
                str(src),
                "--cache",
                str(cache_dir),
                "--device",
                args.device,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        cold = json.loads(child.stdout.strip().splitlines()[-1])
        results["cold"] = cold
        tm = cold["timings"]
        print(
            f"cold get_or_convert: {cold['wall_s']:.2f} s = {cold['wall_s'] / copy_s:.2f}x the copy "
            f"(identify {tm.get('identify', 0):.2f} s, convert {tm.get('convert', 0):.2f} s, "
            f"publish {tm.get('publish', 0):.2f} s) on {cold['device']}; "
            f"peak RSS {cold['peak_rss_bytes'] / 2**20:.0f} MiB"
            + (f", peak GPU {cold['peak_gpu_bytes'] / 2**20:.0f} MiB" if cold["peak_gpu_bytes"] is not None else "")
        )

        cache = Cache(cache_dir, budget_bytes="1T")
        cache.lookup(src)  # warm the stat cache of this process' file system view
        lat = []
        for _ in range(args.lookups):
            t = time.perf_counter()
            assert cache.lookup(src) is not None
            lat.append(time.perf_counter() - t)
        p50, p99 = _percentiles(lat)
        lat2 = []
        for _ in range(args.lookups):
            t = time.perf_counter()
            cache.get_or_convert(src)
            lat2.append(time.perf_counter() - t)
        q50, q99 = _percentiles(lat2)
        lc = subprocess.run(
            [sys.executable, __file__, "--lookup-child", "--src", str(src), "--cache", str(cache_dir)],
            check=True,
            capture_output=True,
            text=True,
        )
        fresh = json.loads(lc.stdout.strip().splitlines()[-1])
        results["warm_lookup_ms"] = {"p50": p50 * 1e3, "p99": p99 * 1e3}
        results["warm_get_or_convert_ms"] = {"p50": q50 * 1e3, "p99": q99 * 1e3}
        results["fresh_process_lookup_ms"] = fresh["cold_process_lookup_s"] * 1e3
        print(
            f"warm lookup: p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms; warm get_or_convert: p50 "
            f"{q50 * 1e3:.2f} ms, p99 {q99 * 1e3:.2f} ms; first lookup in a fresh process "
            f"{fresh['cold_process_lookup_s'] * 1e3:.2f} ms ({len(list(src.iterdir()))} files)"
        )
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
