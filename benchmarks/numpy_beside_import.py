"""Why the head start converts in a process of its own: NumPy's exact-mode conversion (transformd.numpy_exact) on
threads, alone and beside ``import torch`` in the same process.

    python3 benchmarks/numpy_beside_import.py [--gib 2] [--threads 1,8,14]

Prints the conversion's rate on 1..N threads (a page-cached file of random codes, 8 MiB units read with preadv,
converted, written back with pwrite), then, in fresh processes, how long ``import torch`` takes with 0 or N threads
converting beside it and how much they converted meanwhile. Results: benchmarks/results/
convert_bench_h200_wholeprocess_16g_head_start.txt (part 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from transformd.numpy_exact import convert_exact, table  # noqa: E402

K = 7168  # (a DeepSeek-V3 row)
UNIT = 8 << 20


def make_source(path: Path, gib: float) -> None:
    if path.exists() and path.stat().st_size >= int(gib * (1 << 30)):
        return
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for _ in range(int(gib * 8)):
            q = rng.integers(0, 256, 128 << 20, dtype=np.uint8)
            q[(q & 0x7F) == 0x7F] -= 1
            f.write(q.tobytes())


def start(path: Path, out: Path, nbytes: int, threads: int, stop: threading.Event | None = None):
    """``threads`` threads converting ``nbytes`` of ``path`` in units; returns (threads, bytes done so far)."""
    rows = UNIT // K // 128 * 128
    unit, units = rows * K, nbytes // (rows * K)
    lock, taken, done = threading.Lock(), [0], [0]
    src, dst = os.open(path, os.O_RDONLY), os.open(out, os.O_WRONLY | os.O_CREAT, 0o644)
    scales = np.random.default_rng(1).integers(112, 140, (rows, K // 32), dtype=np.uint8)

    def work() -> None:
        codes = np.empty((rows, K), np.uint8)
        while True:
            with lock:
                i = taken[0]
                taken[0] += 1
            if i >= units or (stop is not None and stop.is_set()):
                return
            os.preadv(src, [memoryview(codes).cast("B")], i * unit)
            convert_exact(codes, scales, fnuz=True, out=codes)
            os.pwrite(dst, memoryview(codes).cast("B"), i * unit)
            with lock:
                done[0] += unit

    workers = [threading.Thread(target=work, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    return workers, done


def beside_import(path: Path, out: Path, threads: int) -> dict:
    """In this (fresh) process: ``import torch`` while ``threads`` threads convert."""
    table(True)
    stop = threading.Event()
    started = time.perf_counter()
    done = [0]
    if threads:
        _, done = start(path, out, 1 << 40, threads, stop)
    import torch  # noqa: F401

    seconds = time.perf_counter() - started
    stop.set()
    return {"import_s": round(seconds, 3), "converted_GB": round(done[0] / 1e9, 2),
            "GB_per_s": round(done[0] / seconds / 1e9, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--threads", default=f"1,{max(1, (os.cpu_count() or 2) // 2)},{max(1, (os.cpu_count() or 2) - 2)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--beside", nargs=3, metavar=("SRC", "OUT", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.beside:
        print(json.dumps(beside_import(Path(args.beside[0]), Path(args.beside[1]), int(args.beside[2]))))
        return 0
    counts = [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "codes", Path(tmp) / "out"
        make_source(src, args.gib)
        Path(src).read_bytes()  # (into the page cache)
        table(True)
        print(f"cores {os.cpu_count()}; {args.gib} GiB of random codes, K = {K}, units of {UNIT >> 20} MiB")
        print(f"{'threads':>8} {'alone GB/s':>11}")
        for n in counts:
            started = time.perf_counter()
            workers, done = start(src, out, int(args.gib * (1 << 30)), n)
            for w in workers:
                w.join()
            print(f"{n:>8} {done[0] / (time.perf_counter() - started) / 1e9:>11.2f}", flush=True)
        print(f"\n{'round':>5} {'threads':>8} {'import torch s':>15} {'converted GB':>13} {'GB/s':>6}")
        for r in range(args.rounds):
            for n in (0, counts[-1]):
                proc = subprocess.run([sys.executable, __file__, "--beside", str(src), str(out), str(n)],
                                      capture_output=True, text=True, check=True)
                got = json.loads(proc.stdout)
                row = f"{got['import_s']:>15.2f} {got['converted_GB']:>13.2f} {got['GB_per_s']:>6.2f}"
                print(f"{r + 1:>5} {n:>8} {row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
