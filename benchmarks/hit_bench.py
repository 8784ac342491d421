"""The daemon's cached hit, in process: what ``POST /v1/checkpoints`` and ``/files`` spend on a published entry
before any HTTP (``EntryIndex.info(key, touch=True)``: the entry's lookup, its LRU touch and the check that its files
are still as they were first served, timed alone too where the code has it), and the serialised ``/files`` body it
then returns.

One run: write a sample MXFP8 checkpoint with ``--shards`` shards, convert it once into a fresh cache (CPU), serve it
once (the first serve reads the manifest and the headers), then time N more of each and print p50 / p99 / mean in
microseconds.

    python benchmarks/hit_bench.py [-n 20000] [--shards 2] [--layers 2 --experts 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _row(name: str, xs: list[float]) -> str:
    xs = sorted(xs)
    p50 = xs[len(xs) // 2] * 1e6
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e6
    return f"| {name:<34} | {p50:8.1f} | {p99:8.1f} | {statistics.fmean(xs) * 1e6:8.1f} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=20000, help="hits timed per kind")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    args = ap.parse_args()

    from transformd.cache import Cache
    from transformd.daemon import files as files_mod
    from transformd.daemon.files import EntryIndex
    from transformd.sample import write_sample_checkpoint

    check = getattr(files_mod, "_stamp_problems", None)  # (the files' check of a hit; absent before it was added)

    with tempfile.TemporaryDirectory(prefix="td-hit-") as tmp:
        src = write_sample_checkpoint(Path(tmp) / "m", layers=args.layers, experts=args.experts, shards=args.shards)
        cache = Cache(Path(tmp) / "cache", budget_bytes="1T", device="cpu")
        key = cache.get_or_convert(src).key
        index = EntryIndex(cache)
        info = index.info(key, touch=True)
        assert info is not None
        index.body(info)
        files = len(info.files)
        hits, bodies, checks = [], [], []
        for _ in range(args.n):
            t = time.perf_counter()
            info = index.info(key, touch=True)
            hits.append(time.perf_counter() - t)
            assert info is not None
            t = time.perf_counter()
            index.body(info)
            bodies.append(time.perf_counter() - t)
            if check is not None:
                t = time.perf_counter()
                problems = check(info.stamps)
                checks.append(time.perf_counter() - t)
                assert not problems, problems
    print(f"{args.n} hits of one entry ({files} files, {args.shards} shards), microseconds")
    print("| what                               |      p50 |      p99 |     mean |")
    print("|------------------------------------|---------:|---------:|---------:|")
    print(_row("EntryIndex.info(key, touch=True)", hits))
    print(_row("EntryIndex.body(info) (remembered)", bodies))
    if checks:
        print(_row("  of info: the files' check alone", checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
