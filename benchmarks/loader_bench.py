"""Loader benchmark: map every tensor of a converted checkpoint with ``transformd.loader.load_tensors``
vs ``safetensors.safe_open`` + ``get_tensor`` of the same files.

One run, same files:
  1. write a sample MXFP8 checkpoint (``transformd.sample``, about ``--mb`` MiB) and convert it
     (``convert_checkpoint``; skipped with ``--dir`` pointing at a converted checkpoint),
  2. in a fresh process per measurement (so memory numbers start clean; imports not timed),
     ``--repeat`` times each, interleaved:
     - ``load_tensors``: ``load_tensors(dir)`` returns every tensor (private copy-on-write maps, no
       byte read); ``load_tensors(table)``: the same from the daemon's ``/files`` table (built
       before the clock starts), so no header is read;
     - ``safe_open``: ``safe_open(f).get_tensor(name)`` for every tensor of every file, with
       safetensors' default ``mmap`` backend (since safetensors 0.6 a private copy-on-write map:
       also lazy);
     - ``+touch``: the same, then one byte of every 4 KiB page read, so every page is faulted
       in: the cost of actually reaching the data;
     - ``safe_open(pread)``: safetensors' ``pread`` backend, which reads the bytes into process
       memory (what a copying loader costs);
     and the growth of the process's resident memory, split into file-backed pages (RssFile: the
     page cache, shared by every process mapping the file) and private memory (RssAnon: one copy
     per process, i.e. per rank).

The files were just written, so the page cache is warm for all modes; nothing is dropped.

    python benchmarks/loader_bench.py [--mb 300] [--repeat 5] [--dir CONVERTED] [--workdir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("load_tensors", "load_tensors(table)", "load_tensors+touch", "safe_open", "safe_open+touch", "safe_open(pread)")


def _rss() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of this process in bytes (Linux /proc/self/status)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _touch(tensors: dict) -> None:
    """Read one byte of every 4 KiB page of every tensor: every page is faulted in."""
    import torch

    for t in tensors.values():
        if t.numel():
            int(t.reshape(-1).view(torch.uint8)[::4096].sum())


def _files_table(files: list[Path]) -> dict:
    """The daemon's ``/files`` answer for these files (absolute offsets): the table path parses no header."""
    from transformd.safetensors_io import read_header

    out = []
    for f in files:
        h = read_header(f)
        tensors = {t.name: {"dtype": t.dtype, "shape": list(t.shape), "offsets": [t.begin, t.end]}
                   for t in h.tensors.values()}
        out.append({"name": f.name, "path": str(f.resolve()), "size": h.file_size, "ready": True, "tensors": tensors})
    return {"files": out}


def _worker(mode: str, ckpt: Path) -> dict:
    import torch
    from safetensors import safe_open

    from transformd.loader import load_tensors

    files = sorted(ckpt.glob("*.safetensors"))
    table = _files_table(files) if mode == "load_tensors(table)" else None
    torch.zeros(1).sum()  # start-up allocations and imports happen before the measurement
    before = _rss()
    t0 = time.perf_counter()
    if mode.startswith("load_tensors"):
        tensors = load_tensors(table if table is not None else ckpt)
    else:
        backend = "pread" if "pread" in mode else "mmap"
        tensors = {}
        for f in files:
            with safe_open(str(f), framework="pt", backend=backend) as st:
                for name in st.keys():
                    tensors[name] = st.get_tensor(name)
    if mode.endswith("+touch"):
        _touch(tensors)
    seconds = time.perf_counter() - t0
    after = _rss()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {
        "mode": mode,
        "seconds": seconds,
        "tensors": len(tensors),
        "tensor_bytes": nbytes,
        **{f"{k}_growth": after[k] - before[k] for k in after},
    }


def _run_worker(mode: str, ckpt: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode, "--dir", str(ckpt)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _make_checkpoint(workdir: Path, mb: float, target: str) -> Path:
    from transformd.checkpoint import convert_checkpoint
    from transformd.sample import write_sample_checkpoint

    hidden, inter, experts, head_dim, kv_heads = 2048, 768, 16, 128, 4
    per_layer = 3 * experts * hidden * inter + 2 * hidden * hidden + 2 * kv_heads * head_dim * hidden
    layers = max(1, round(mb * 2**20 / per_layer))
    src, out = workdir / "src", workdir / "converted"
    t0 = time.perf_counter()
    write_sample_checkpoint(src, layers=layers, experts=experts, hidden=hidden, moe_intermediate=inter,
                            head_dim=head_dim, kv_heads=kv_heads, shards=min(layers + 1, 4), vocab=4096)
    t1 = time.perf_counter()
    convert_checkpoint(src, out, target=target, device="auto")
    t2 = time.perf_counter()
    print(f"sample: {layers} layers x {experts} experts, hidden {hidden}, written in {t1 - t0:.1f}s, "
          f"converted ({target}) in {t2 - t1:.1f}s", file=sys.stderr)
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=300.0, help="approximate checkpoint size in MiB (default 300)")
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per mode (default 5; median shown)")
    parser.add_argument("--dir", type=Path, help="an already converted checkpoint to measure instead")
    parser.add_argument("--workdir", type=Path, help="where to write the sample (default: a temporary directory)")
    parser.add_argument("--target", choices=["fnuz", "ocp"], default="fnuz")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(_worker(args.worker, args.dir)))
        return 0

    cleanup = None
    if args.dir is None:
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="loader-bench-"))
        cleanup = None if args.workdir else workdir
        ckpt = _make_checkpoint(workdir, args.mb, args.target)
    else:
        ckpt = args.dir
    try:
        files = sorted(ckpt.glob("*.safetensors"))
        file_bytes = sum(f.stat().st_size for f in files)
        results: dict[str, list[dict]] = {m: [] for m in MODES}
        for _ in range(args.repeat):
            for mode in MODES:  # interleaved, so drift (page cache, CPU clock) hits all modes alike
                results[mode].append(_run_worker(mode, ckpt))
    finally:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)

    first = results[MODES[0]][0]
    print(f"\n{len(files)} files, {_mib(file_bytes)} MiB, {first['tensors']} tensors "
          f"({_mib(first['tensor_bytes'])} MiB of tensor data); page cache warm; median of {args.repeat} "
          f"fresh processes\n")
    header = f"{'mode':<22} {'time (ms)':>10} {'GiB/s':>7} {'RSS +MiB':>9} {'private +MiB':>13} {'page cache +MiB':>16}"
    print(header)
    print("-" * len(header))
    summary = {}
    for mode in MODES:
        runs = results[mode]
        sec = statistics.median(r["seconds"] for r in runs)
        row = {
            "seconds": sec,
            "gib_per_s": first["tensor_bytes"] / sec / 2**30,
            "rss": statistics.median(r["VmRSS_growth"] for r in runs),
            "anon": statistics.median(r["RssAnon_growth"] for r in runs),
            "file": statistics.median(r["RssFile_growth"] for r in runs),
        }
        summary[mode] = row
        print(f"{mode:<22} {sec * 1e3:>10.2f} {row['gib_per_s']:>7.1f} {_mib(row['rss']):>9} {_mib(row['anon']):>13} "
              f"{_mib(row['file']):>16}")
    print("\nprivate memory is paid once per process (per rank); page-cache memory once per node.")
    if args.json:
        args.json.write_text(json.dumps({"files": len(files), "file_bytes": file_bytes, "summary": summary,
                                         "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
