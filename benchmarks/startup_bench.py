"""What a cold ``transformd convert`` gets done while it imports torch (its first seconds).

Each measurement is a fresh process that starts a way of reading a file ahead (or of starting CUDA), then imports
torch and the package and makes its first CUDA allocation, as the CLI does. The file is dropped from the page cache
before each (``POSIX_FADV_DONTNEED``: no root needed), the ways alternated round by round. Printed per way: the
start-up's seconds, the GiB read by its end, when the reading ended, and how long reading the whole file took
afterwards (what was not read ahead comes from the disk then).

    python3 benchmarks/startup_bench.py --file /tmp/startup.bin --gib 8 --rounds 2

Ways of reading ahead: ``none``; ``preadv8`` / ``preadv64``: a thread reading 8 / 64 MiB slices into a buffer
(``preadv8`` is the read-ahead before 2026-12-03: each slice waits for the GIL the import holds);
``readahead``: :class:`transformd.readahead.ReadAhead` reading the file alone (``sendfile`` into ``/dev/null``,
64 MiB slices); ``fork``: a child process reading (nothing shared with the import: the disk's pace); ``hash``:
:func:`transformd.cache.keys.hash_file` in a thread (the hashing beside a conversion reads ahead this way).
Ways of starting CUDA (``--cuda``, a GPU machine): ``cuda-after`` (torch starts it at the first allocation) and
``cuda-beside`` (:func:`transformd.cuda_start.start_cuda` before the import).

``--cold-torch`` drops torch's and the NVIDIA wheels' files from the page cache too before each start-up, as on a
node where nothing ran yet (the import then reads its shared libraries by page faults, 128 KiB at a time, beside
the read-ahead); with it, the way ``libs+readahead`` is ``readahead`` whose thread first asks the kernel for those
libraries whole (``POSIX_FADV_WILLNEED`` on ``torch/lib/*.so*`` and ``nvidia/*/lib/*.so*``, which reads them in large
requests in the background), ``torchlib+readahead`` the same with torch's own libraries only. Not in the package:
tried there (fcac577), the start-up was shorter but the whole conversion was not
(``benchmarks/results/startup_cold_torch_h100.txt``). ``--survey`` tells which bytes of those libraries a cold
start-up reads (about a quarter of them on the H100 machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READ_WAYS = ["none", "preadv8", "preadv64", "readahead", "fork", "hash"]
CUDA_WAYS = ["cuda-after", "cuda-beside"]
LIB_WAYS = ["libs+readahead", "torchlib+readahead"]


def torch_dirs() -> list[Path]:
    """The package directory of the torch this interpreter would import (found without importing it) and the NVIDIA
    wheels' beside it."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return []
    torch_dir = Path(spec.origin).parent
    return [d for d in (torch_dir, torch_dir.parent / "nvidia") if d.is_dir()]


def torch_libraries() -> list[Path]:
    """The shared libraries of :func:`torch_dirs` (``torch/lib/*.so*``, ``nvidia/*/lib/*.so*``)."""
    return [f for d in torch_dirs() for f in sorted(d.glob("lib/*.so*")) + sorted(d.glob("*/lib/*.so*"))
            if f.is_file()]


def _libraries_first():
    """:class:`transformd.readahead.ReadAhead` whose thread first asks for ``libraries`` whole (WILLNEED, at its
    normal I/O class), then reads the file at the idle class as the package's does (with no libraries: the package's
    read-ahead; tried in the package as fcac577, reverted: no gain in whole processes)."""
    from transformd.readahead import ReadAhead

    class LibrariesFirst(ReadAhead):
        def __init__(self, files, budget, libraries):
            self._libraries = libraries
            super().__init__(files, budget)

        def _run(self) -> None:
            for lib in self._libraries:
                try:
                    fd = os.open(lib, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                os.close(fd)
            super()._run()

    return LibrariesFirst


def child(way: str, path: str) -> dict[str, float]:
    """One start-up with ``way``: the numbers of one row."""
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    done = [0]  # bytes the reader has read (where it can tell)
    wait: list = []  # what to wait for once the start-up is over
    t0 = time.perf_counter()
    if way.startswith("preadv"):
        from transformd.readahead import set_idle_io

        def read(slice_bytes: int = int(way[6:]) << 20) -> None:
            set_idle_io()
            buf, off = memoryview(bytearray(slice_bytes)), 0
            while (n := os.preadv(fd, [buf], off)) > 0:
                off += n
                done[0] = off

        wait.append(_started(read))
    elif way in ("readahead", *LIB_WAYS):
        libraries = torch_libraries() if way in LIB_WAYS else []
        if way == "torchlib+readahead":
            libraries = [lib for lib in libraries if lib.parent.parent.name == "torch"]
        ahead = _libraries_first()([path], size, libraries)
        wait.append(ahead)
        done = None
    elif way == "fork":
        pid = os.fork()
        if pid == 0:
            buf, off = memoryview(bytearray(8 << 20)), 0
            while (n := os.preadv(fd, [buf], off)) > 0:
                off += n
            os._exit(0)
        wait.append(pid)
    elif way == "hash":
        from transformd.cache.keys import hash_file

        wait.append(_started(lambda: (hash_file(path), done.__setitem__(0, size))))
    elif way == "cuda-beside":
        from transformd.cuda_start import start_cuda

        wait.append(start_cuda("cuda", 1))
    import torch

    import transformd.checkpoint  # noqa: F401
    import transformd.cli  # noqa: F401

    t1 = time.perf_counter()
    if torch.cuda.is_available():
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    read_then = ahead.bytes_read if done is None else done[0]
    for w in wait:
        if isinstance(w, int):
            os.waitpid(w, 0)
        elif w is not None:
            w.join()
    t3 = time.perf_counter()
    buf, off = memoryview(bytearray(64 << 20)), 0
    while off < size:
        off += os.preadv(fd, [buf], off)
    return {"import": t1 - t0, "cuda": t2 - t1, "startup": t2 - t0, "gib_read": read_then / 2**30,
            "reader_done": t3 - t0, "read_all_after": time.perf_counter() - t3}


def survey(top: int = 12) -> str:
    """Which bytes of torch's and the NVIDIA wheels' libraries a cold start-up reads: they are dropped from the page
    cache, a fresh process imports torch and allocates on the GPU, then each library's pages in the page cache are
    counted (mincore)."""
    import ctypes
    import mmap

    from convert_bench import drop_from_page_cache

    from transformd.readahead import _libc  # (mmap, mincore and munmap typed)

    libc = _libc()
    if libc is None:
        raise SystemExit("--survey needs mmap and mincore from the C library")

    for d in torch_dirs():
        drop_from_page_cache(d)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch\nif torch.cuda.is_available(): torch.zeros(1, device='cuda')"],
                   check=True)
    seconds = time.perf_counter() - t0
    rows = []
    for lib in torch_libraries():
        size = lib.stat().st_size
        if size == 0:
            continue
        vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
        with open(lib, "rb") as f:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
            if address in (None, ctypes.c_void_p(-1).value):
                continue
            libc.mincore(ctypes.c_void_p(address), size, vec)
            libc.munmap(ctypes.c_void_p(address), size)
        rows.append((sum(b & 1 for b in vec.raw) * mmap.PAGESIZE, size, lib))
    read, total = sum(r[0] for r in rows), sum(r[1] for r in rows)
    lines = [f"a cold `import torch` + first CUDA allocation: {seconds:.2f} s; of {len(rows)} libraries "
             f"({total / 2**30:.2f} GiB) it read {read / 2**30:.2f} GiB; the most read:"]
    lines += [f"{r / 2**20:9.1f} MiB of {size / 2**20:7.1f} MiB  {lib.parent.parent.name}/lib/{lib.name}"
              for r, size, lib in sorted(rows, key=lambda row: -row[0])[:top]]
    return "\n".join(lines)


def _started(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", default="/tmp/transformd-startup.bin", help="the file read ahead (written if missing)")
    p.add_argument("--gib", type=float, default=8, help="its size when it is written")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ways", default=",".join(READ_WAYS),
                   help=f"comma-separated, of {READ_WAYS + CUDA_WAYS + LIB_WAYS}")
    p.add_argument("--cuda", action="store_true", help="also the ways of starting CUDA")
    p.add_argument("--cold-torch", action="store_true",
                   help=f"also drop torch's and the NVIDIA wheels' files before each start-up; adds {LIB_WAYS}")
    p.add_argument("--survey", action="store_true",
                   help="only tell which bytes of torch's libraries a cold start-up reads (torch's files dropped)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.survey:
        print(survey())
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.file)))
        return 0
    if not Path(args.file).exists():
        with open(args.file, "wb") as f:
            for _ in range(int(args.gib * 16)):
                f.write(os.urandom(64 << 20))
    from convert_bench import byte_compile, drop_from_page_cache  # (not in a child: imported before its start-up)

    byte_compile(REPO)

    ways = args.ways.split(",") + (CUDA_WAYS if args.cuda else []) + (LIB_WAYS if args.cold_torch else [])
    cold = torch_dirs() if args.cold_torch else []
    rows: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for r in range(args.rounds):
        for way in ways:
            drop_from_page_cache(Path(args.file))
            for d in cold:
                drop_from_page_cache(d)
            out = subprocess.run([sys.executable, __file__, "--file", args.file, "--child", way], capture_output=True,
                                 text=True, env=env, check=False)
            if out.returncode:
                print(f"# {way} failed: {out.stderr[-1500:]}", file=sys.stderr)
                continue
            rows[way].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"# round {r + 1} {way}: {rows[way][-1]}", file=sys.stderr, flush=True)
    gib = os.path.getsize(args.file) / 2**30
    print(f"start-ups of fresh processes (import torch + transformd, first CUDA allocation); {gib:.1f} GiB file, "
          f"dropped from the page cache before each{' with torch and the NVIDIA wheels' if cold else ''}; "
          f"{args.rounds} rounds alternated; per round: a / b")
    print(f"{'way':<19} {'start-up s':>13} {'of it CUDA s':>13} {'GiB read by then':>17} {'reader done s':>14} "
          f"{'reading all after s':>20}")

    def cells(runs: list[dict[str, float]], key: str) -> str:
        return " / ".join(f"{run[key]:.2f}" for run in runs)

    for way, runs in rows.items():
        print(f"{way:<19} {cells(runs, 'startup'):>13} {cells(runs, 'cuda'):>13} {cells(runs, 'gib_read'):>17} "
              f"{cells(runs, 'reader_done'):>14} {cells(runs, 'read_all_after'):>20}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
