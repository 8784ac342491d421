"""Hashing a page-cached file: BLAKE3 over a memory map (what the cache used before) against ``keys.hash_file``
(slices read by threads ahead of BLAKE3: a source truncated meanwhile is an error, not a SIGBUS).

    python benchmarks/hash_bench.py [--gib 4] [--rounds 3] [--dir /tmp]

Prints the seconds of each round, alternated, and the best rate of each.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import blake3  # noqa: E402

from transformd.cache import keys  # noqa: E402


def memory_mapped(path: str) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(path)
    return "blake3:" + h.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    fd, path = tempfile.mkstemp(dir=args.dir, suffix=".bin")
    try:
        block = os.urandom(64 << 20)
        with os.fdopen(fd, "wb") as f:
            for _ in range(max(1, int(args.gib * 16))):
                f.write(block)
        size = os.path.getsize(path)
        subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)  # into the page cache
        ways = {"BLAKE3 update_mmap (before)": memory_mapped,
                f"keys.hash_file ({keys._READERS} readers x {keys.HASH_CHUNK_BYTES >> 20} MiB)": keys.hash_file}
        times: dict[str, list[float]] = {name: [] for name in ways}
        digests = set()
        for _ in range(args.rounds):
            for name, fn in ways.items():
                started = time.perf_counter()
                digests.add(fn(path))
                times[name].append(time.perf_counter() - started)
        assert len(digests) == 1, digests
        print(f"{size / 2**30:.2f} GiB, page cache, {os.cpu_count()} CPUs, {args.rounds} rounds alternated")
        for name, ts in times.items():
            print(f"{name:40s} " + " ".join(f"{t:6.3f} s" for t in ts) + f"   best {size / 2**30 / min(ts):6.2f} GiB/s")
    finally:
        os.remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
