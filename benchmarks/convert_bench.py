"""End-to-end conversion benchmark: a multi-GB sample checkpoint, converted cold, against ``cp -r`` + ``sync``.

One run, the same files, prints one table:

* ``cp -r`` of the source checkpoint followed by ``sync`` (the floor: the same bytes read and written);
* a cold :func:`transformd.checkpoint.convert_checkpoint` into a fresh directory (its fsyncs included), on the
  device (``cuda`` when there is one, else ``cpu``), and its ratio to the copy;
* when :mod:`transformd.cache` can be imported (it needs ``blake3``): a cold conversion through the cache
  (hashing the source, converting, digesting and publishing the entry) and the latency of warm lookups;
* peak host RSS of each measurement, each in a fresh process so the peaks are separate, for two checkpoint
  sizes (``--gib`` and ``--small-gib``): it must not grow with the checkpoint;
* peak GPU memory (``torch.cuda.max_memory_allocated``) and what is still held after the job
  (``torch.cuda.memory_reserved``, pinned host memory).

Before every cold measurement everything is synced and the source's pages are dropped from the page cache
(``posix_fadvise(DONTNEED)``, no root needed; ``--keep-page-cache`` skips that), so every reader starts cold.

    python benchmarks/convert_bench.py                      # 4 GiB on a GPU machine, 1 GiB on the CPU
    python benchmarks/convert_bench.py --gib 0.5 --json out.json
    python benchmarks/convert_bench.py --dir /nvme/bench --reuse   # keep and reuse the samples
    python benchmarks/convert_bench.py --whole-process --gib 16 --rounds 2   # what users run, as root

``--whole-process`` times whole processes instead, alternated in rounds on the same files: ``cp -r`` +
``sync``; ``python -m transformd convert SRC --out D``; ``convert SRC --cache-dir C`` cold, then again (a
warm hit); with ``--daemon``, a daemon's first resolve and ``convert --cache-dir`` while a daemon serves that
cache (it converts); and, with the source in the page cache, ``convert --out``, ``convert --cache-dir`` (and with
``--daemon`` the daemon's first resolve) against ``cp -r`` + ``sync`` (the time to write and fsync the same
bytes). Cold means ``echo 3 > /proc/sys/vm/drop_caches`` (as root), else ``posix_fadvise(DONTNEED)`` on the
source; ``--cold-source-only``: only the source, as on a node whose torch and CUDA libraries are in the page cache
from an earlier run (the whole drop is the first run on a fresh node). The sample stores experts as per-expert 2-D
tensors (thousands) unless ``--fused``.

Needs torch, safetensors and numpy; psutil, blake3 (the cache) and a GPU are optional.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable, Iterator, Sequence
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _child_env() -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH (keeping what was there)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}
sys.path.insert(0, str(REPO))

GiB = 1 << 30
MiB = 1 << 20

# Layer shapes of Qwen3-30B-A3B (hidden 2048, MoE intermediate 768); experts and layers scale the size.
HIDDEN, MOE_INTERMEDIATE, HEAD_DIM, KV_HEADS = 2048, 768, 128, 4


# ---------------------------------------------------------------------------------------------------------------------
# The sample checkpoint


def sample_shape(target_bytes: int) -> dict[str, int]:
    """Knobs of :func:`write_sample_checkpoint` for about ``target_bytes`` of tensors.

    ~160 MiB per layer (2 to 94 layers), experts filling each layer, a vocabulary of ~3% of the bytes, and
    about one shard per 512 MiB after the BF16 one (at least 3 shards).
    """
    mx = 33 / 32  # bytes per code with its E8M0 scale
    layers = min(94, max(2, round(target_bytes / (160 * MiB))))
    vocab = min(151936, max(512, int(0.03 * target_bytes / (4 * HIDDEN)) // 64 * 64))
    per_layer = (target_bytes - 4 * vocab * HIDDEN) / layers
    attention = (2 * HIDDEN * HIDDEN + 2 * KV_HEADS * HEAD_DIM * HIDDEN) * mx
    experts = max(1, round((per_layer - attention) / (3 * HIDDEN * MOE_INTERMEDIATE * mx)))
    shards = min(layers + 1, max(3, round(target_bytes / (512 * MiB)) + 1))
    return {"layers": layers, "experts": experts, "vocab": vocab, "shards": shards}


def write_sample(path: Path, target_bytes: int, *, fused: bool, reuse: bool) -> dict[str, Any]:
    """Write the sample into ``path`` (or reuse one written with the same knobs); return its description."""
    from transformd.sample import write_sample_checkpoint

    knobs = {**sample_shape(target_bytes), "hidden": HIDDEN, "moe_intermediate": MOE_INTERMEDIATE,
             "head_dim": HEAD_DIM, "kv_heads": KV_HEADS, "fused_experts": fused}
    marker = path.parent / f"{path.name}.knobs.json"
    seconds = 0.0
    if not (reuse and marker.exists() and json.loads(marker.read_text()) == knobs and path.is_dir()):
        shutil.rmtree(path, ignore_errors=True)
        started = time.monotonic()
        write_sample_checkpoint(path, **knobs)
        seconds = time.monotonic() - started
        marker.write_text(json.dumps(knobs))
    files = [f for f in path.rglob("*") if f.is_file()]
    shards = [f for f in files if f.suffix == ".safetensors"]
    return {"path": str(path), "bytes": sum(f.stat().st_size for f in files), "files": len(files),
            "shards": len(shards), "knobs": knobs, "write_seconds": seconds}


# ---------------------------------------------------------------------------------------------------------------------
# Cold starts


def byte_compile(*roots: Path) -> None:
    """Byte-compile the ``transformd`` package under each root, as pip does when it installs one, before timing whole
    processes: with PYTHONDONTWRITEBYTECODE set (as on some machines) every process would compile the sources again
    (0.09 s of a 0.2 s warm hit on the 2-core machine)."""
    for root in roots:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(root / "transformd")], check=True)


def drop_from_page_cache(path: Path) -> None:
    """Write back everything dirty, then drop ``path``'s file pages from the page cache (clean pages only)."""
    os.sync()
    for f in [path] if path.is_file() else path.rglob("*"):
        if f.is_file() and hasattr(os, "posix_fadvise"):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def file_system(path: Path) -> str:
    """``type device`` of the file system holding ``path`` (a tmpfs would make every figure meaningless)."""
    best = ("?", "?", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mount, fstype = line.split()[:3]
                if str(path.resolve()).startswith(mount.rstrip("/") + "/") and len(mount) > len(best[2]):
                    best = (fstype, dev, mount)
    except OSError:
        pass
    free = shutil.disk_usage(path).free
    return f"{best[0]} {best[1]} at {best[2] or '?'}, {free / GiB:.0f} GiB free"


def remove(path: Path) -> None:
    if path.is_dir():
        for p in [path, *path.rglob("*")]:  # cache entries are read-only
            if p.is_dir() and not p.is_symlink():
                os.chmod(p, 0o755)
        shutil.rmtree(path)
    os.sync()


def copy_and_sync(src: Path, dst: Path) -> dict[str, float]:
    started = time.monotonic()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    copied = time.monotonic()
    subprocess.run(["sync"], check=True)
    done = time.monotonic()
    return {"seconds": done - started, "cp_seconds": copied - started, "sync_seconds": done - copied}


# ---------------------------------------------------------------------------------------------------------------------
# Measurements in a fresh process each (the child side)


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_now() -> int:
    rss = _status_bytes("VmRSS")
    if rss is None:
        try:
            import psutil

            rss = psutil.Process().memory_info().rss
        except ImportError:
            rss = 0
    return rss


def _rss_peak() -> int:
    peak = _status_bytes("VmHWM")
    if peak is None:  # ru_maxrss: KiB on Linux, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return peak


def _reset_rss_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # the peak then includes start-up, which is before the baseline anyway


class AnonPeak:
    """Peak anonymous RSS (RssAnon), sampled every few ms: VmHWM also counts mapped file pages (e.g. a
    digest over an mmap of the file), which are page cache rather than memory the process holds."""

    def __init__(self, interval: float = 0.005):
        import threading

        self.peak = _status_bytes("RssAnon") or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, _status_bytes("RssAnon") or 0)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status_bytes("RssAnon") or 0)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    device = spec["device"]
    gpu = device != "cpu" and torch.cuda.is_available()
    if gpu:  # the CUDA contexts are part of the baseline, not of the conversion
        torch.cuda.init()
        for i in range(torch.cuda.device_count()):
            torch.empty(1, device=f"cuda:{i}")
            torch.cuda.reset_peak_memory_stats(i)
    from transformd.checkpoint import convert_checkpoint

    _reset_rss_peak()
    baseline, anon_baseline = _rss_now(), _status_bytes("RssAnon")
    anon = AnonPeak() if anon_baseline is not None else None
    out: dict[str, Any] = {"rss_baseline": baseline}
    started = time.monotonic()
    if spec["kind"] == "convert":
        result = convert_checkpoint(spec["src"], spec["out"], target=spec["target"], scale_mode=spec["scale_mode"],
                                    device=device, host_memory_bytes=spec["host_memory_bytes"])
        out.update(seconds=time.monotonic() - started, device=result.device, bytes_read=result.bytes_read,
                   bytes_written=result.bytes_written, host_buffer_bytes=result.host_buffer_bytes)
    elif spec["kind"] == "cache-cold":
        from transformd.cache import Cache, Recipe

        cache = Cache(spec["cache_root"], device=device)
        entry = cache.get_or_convert(spec["src"], Recipe(target=spec["target"], scale_mode=spec["scale_mode"]))
        out.update(seconds=time.monotonic() - started, outcome=entry.outcome, entry=str(entry.path),
                   timings=entry.manifest.timings)
    elif spec["kind"] == "cache-warm":
        from transformd.cache import Cache, Recipe

        recipe = Recipe(target=spec["target"], scale_mode=spec["scale_mode"])
        cache = Cache(spec["cache_root"], device=device)
        out["open_seconds"] = time.monotonic() - started
        for name, call in (("lookup", cache.lookup), ("get_or_convert", cache.get_or_convert)):
            latencies = []
            for _ in range(spec["lookups"] + 1):
                t = time.perf_counter()
                entry = call(spec["src"], recipe)
                latencies.append(time.perf_counter() - t)
                assert entry is not None and entry.outcome == "hit"
            out[name] = {"first": latencies[0], "median": statistics.median(latencies[1:]),
                         "p99": _percentile(latencies[1:], 99), "max": max(latencies[1:])}
    else:
        raise ValueError(spec["kind"])
    out["rss_peak"] = _rss_peak()
    out["rss_growth"] = out["rss_peak"] - baseline
    if anon is not None and anon_baseline is not None:
        out["anon_growth"] = anon.stop() - anon_baseline
    if gpu:
        count = torch.cuda.device_count()
        out["gpu_peak_allocated"] = sum(torch.cuda.max_memory_allocated(i) for i in range(count))
        out["gpu_reserved_after"] = sum(torch.cuda.memory_reserved(i) for i in range(count))
        out["gpu_allocated_after"] = sum(torch.cuda.memory_allocated(i) for i in range(count))
        stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        out["pinned_host_after"] = stats.get("allocated_bytes.current")
        out["pinned_host_peak"] = stats.get("allocated_bytes.peak")
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['kind']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


# ---------------------------------------------------------------------------------------------------------------------
# The run (the parent side)


# ---------------------------------------------------------------------------------------------------------------------
# Whole processes (--whole-process)


def read_into_page_cache(src: Path) -> None:
    """Read ``src``'s shards once, so that a step finds them in the page cache."""
    subprocess.run(["cat", *map(str, sorted(src.rglob("*.safetensors")))], stdout=subprocess.DEVNULL, check=True)


def drop_caches(path: Path, only: bool = False) -> str:
    """Everything written back, then the page cache dropped: all of it as root (unless ``only``), else ``path``'s
    pages."""
    os.sync()
    if only:
        drop_from_page_cache(path)
        return "fadvise, the source only"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        drop_from_page_cache(path)
        return "fadvise"


def timed(cmd: list[str], package: str | None = None, env: dict[str, str] | None = None) -> float:
    """Seconds the whole process ``cmd`` took; its last line on standard error (the CLI's summary) is printed.
    ``package``: a directory holding another ``transformd`` package (``--baseline``) to run instead of this one;
    ``env``: variables to set for it."""
    env = {**_child_env(), **(env or {})}
    if package is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH", "")) if p)
    # run from the package's directory: ``python -m``/``-c`` put the working directory first on sys.path, so
    # from the repository's root its own package would shadow the one asked for
    started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, cwd=package or REPO)
    seconds, after = time.monotonic() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"#   {(proc.stderr.strip().splitlines() or [''])[-1][:300]}", file=sys.stderr, flush=True)
    # the CPU its processes took (their children included: the head start's worker), beside the wall time
    print(f"#   cpu: user {after.ru_utime - before.ru_utime:.1f} s, system {after.ru_stime - before.ru_stime:.1f} s",
          file=sys.stderr, flush=True)
    return seconds


@contextlib.contextmanager
def serving(args: argparse.Namespace, root: Path, src: Path, package: str | None = None,
            launcher: Sequence[str] = ("-m", "transformd"), env: dict[str, str] | None = None,
            log: Path | None = None) -> Iterator[tuple[Path, Path]]:
    """A daemon started (not timed) with an empty cache, allowed to read ``src``: its socket and cache directory.
    Stopped at the end, its cache removed after its entries' timings are printed. ``package``: as in :func:`timed`;
    ``launcher``: what runs ``transformd`` after ``python``; ``env``: variables to set for it; ``log``: its output
    (default: appended to ``root/daemon.log``)."""
    sock, cache = root / "td.sock", root / "cache-daemon"
    env = {**_child_env(), **(env or {})}
    if package is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH", "")) if p)
    serve = [sys.executable, *launcher, "serve", "--socket", str(sock), "--cache-dir", str(cache),
             "--allow-root", str(src.parent), "--device", args.device.split(":")[0], "--log-level", "warning"]
    log = log or root / "daemon.log"
    with open(log, "a") as out:
        proc = subprocess.Popen(serve, env=env, cwd=package or REPO, stdout=out, stderr=out)
    try:
        health = [sys.executable, "-m", "transformd", "health", "--socket", str(sock), "-q"]
        deadline = time.monotonic() + 120
        while subprocess.run(health, env=env, cwd=package or REPO, capture_output=True).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the daemon did not start; the end of {log}:\n{tail}")
            time.sleep(0.2)
        yield sock, cache
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        for manifest in cache.glob("entries/*/manifest.json"):  # how the daemon got there
            print(f"#   daemon's timings: {json.loads(manifest.read_text()).get('timings')}", file=sys.stderr)
        remove(cache)


def daemon_first_resolve(args: argparse.Namespace, root: Path, src: Path, package: str | None = None) -> float:
    """Seconds from ``transformd resolve SRC`` to ready (a whole client process) against a daemon started just
    before (not timed) with an empty cache: the first resolve of a source the daemon never saw. ``package``: as
    in :func:`timed`."""
    with serving(args, root, src, package) as (sock, _):
        return timed([sys.executable, "-m", "transformd", "resolve", str(src), "--socket", str(sock), "--target",
                      args.target, "--scale-mode", args.scale_mode, "--poll-interval", "0.05"], package)


def convert_with_daemon(args: argparse.Namespace, root: Path, src: Path, convert: list[str]) -> float:
    """Seconds of a cold ``convert SRC --cache-dir C`` while a daemon (started before, not timed) serves C: the
    daemon converts, the process shows its progress (transformd/cli/delegate.py)."""
    with serving(args, root, src) as (sock, cache):
        return timed([*convert, "--cache-dir", str(cache)], env={"TRANSFORMD_SOCKET": str(sock)})


def whole_process(args: argparse.Namespace, root: Path, sample: dict[str, Any]) -> str:
    """Alternate the whole-process measurements for ``args.rounds`` rounds; return the table."""
    src, dev = Path(sample["path"]), args.device
    convert = [sys.executable, "-m", "transformd", "convert", str(src), "--device", dev, "--target", args.target,
               "--scale-mode", args.scale_mode]
    steps = [
        ("cp -r SRC DST && sync", True, lambda: copy_and_sync(src, root / "copy")["seconds"],
         root / "copy"),
        ("convert SRC --out D", True, lambda: timed([*convert, "--out", str(root / "out")]), root / "out"),
        ("convert SRC --cache-dir C (cold)", True, lambda: timed([*convert, "--cache-dir", str(root / "cache")]), None),
        ("the same again (warm hit)", False, lambda: timed([*convert, "--cache-dir", str(root / "cache")]),
         root / "cache"),
        ("python -c 'import httpx' (a warm path's floor)", False,
         lambda: timed([sys.executable, "-c", "import httpx"]), None),
        ("cp -r + sync, source in page cache", False, lambda: copy_and_sync(src, root / "copy")["seconds"],
         root / "copy"),
        ("convert --out, source in page cache", False, lambda: timed([*convert, "--out", str(root / "out")]),
         root / "out"),
        ("convert --cache-dir, source in page cache", False,
         lambda: timed([*convert, "--cache-dir", str(root / "cache-pc")]), root / "cache-pc"),
    ]
    if args.hash_modes:  # the cache's cold conversion with the source hashed first, then converted
        def cache_with(name: str, settings: str) -> Callable[[], float]:
            code = (f"import sys\nfrom transformd.cache import Cache, Recipe\nfrom transformd.cli.convert import "
                    f"_cached_summary\ncache = Cache({str(root / name)!r}, device={dev!r})\n{settings}\n"
                    f"entry = cache.get_or_convert({str(src)!r}, Recipe(target={args.target!r}, "
                    f"scale_mode={args.scale_mode!r}))\nprint(_cached_summary(entry), file=sys.stderr)")
            return lambda: timed([sys.executable, "-c", code])

        steps[3:3] = [
            ("cache (cold), hashed first, then converted", True,
             cache_with("cache-first", "cache.hash_alongside_min_bytes = 1 << 62"), root / "cache-first"),
        ]
    if args.baseline:  # the cache's cold and warm steps with another checkout's package, alternated with these
        base, base_cache = str(Path(args.baseline).resolve()), str(root / "cache-baseline")
        steps[4:4] = [
            ("baseline: convert --cache-dir C (cold)", True,
             lambda: timed([*convert, "--cache-dir", base_cache], base), None),
            ("baseline: the same again (warm hit)", False,
             lambda: timed([*convert, "--cache-dir", base_cache], base), Path(base_cache)),
        ]
        steps.append(("baseline: convert --cache-dir, page cache", False,
                      lambda: timed([*convert, "--cache-dir", base_cache + "-pc"], base), Path(base_cache + "-pc")))
        if args.baseline_out:
            steps[2:2] = [("baseline: convert SRC --out D", True,
                           lambda: timed([*convert, "--out", str(root / "out")], base), root / "out")]
            steps.append(("baseline: convert --out, page cache", False,
                          lambda: timed([*convert, "--out", str(root / "out")], base), root / "out"))
    if args.daemon:  # the first resolve through a daemon (started, not timed, after the page cache was dropped)
        at = [name for name, *_ in steps].index("the same again (warm hit)") + 1
        steps[at:at] = [("daemon: first resolve (cold), to ready", True,
                         lambda: daemon_first_resolve(args, root, src), None),
                        ("convert --cache-dir (cold), daemon on C", True,
                         lambda: convert_with_daemon(args, root, src, convert), None)]
        steps.append(("daemon: first resolve, source in page cache", False,
                      lambda: daemon_first_resolve(args, root, src), None))
        if args.baseline:
            steps[at + 2:at + 2] = [("baseline: daemon first resolve (cold)", True,
                                     lambda: daemon_first_resolve(args, root, src, str(Path(args.baseline).resolve())),
                                     None)]

    def cli_with(patch: str, *extra: str, before: str = "") -> Callable[[], float]:
        """A step: ``transformd convert SRC`` with ``extra`` arguments, after ``patch`` ran in its process (and
        ``before``, untimed, in one of its own)."""
        code = (f"import sys, runpy\n{patch}\nsys.argv = ['transformd', *sys.argv[1:]]\n"
                f"runpy.run_module('transformd', run_name='__main__')")

        def step() -> float:
            if before:
                subprocess.run([sys.executable, "-c", before], env=_child_env(), check=True, cwd=REPO)
            return timed([sys.executable, "-c", code, *convert[3:], *extra])
        return step

    if args.cache_modes:  # where convert --cache-dir from the page cache spends what convert --out does not
        known = root / "cache-known"
        steps += [
            ("convert --cache-dir, page cache, output hashed at the seal", False,
             cli_with("import transformd.cache.seal as s\ns.DigestsAlongside._run = lambda self: None",
                      "--cache-dir", str(root / "cache-pc")), root / "cache-pc"),
            ("convert --cache-dir, page cache, source keyed before", False,
             cli_with("", "--cache-dir", str(known), before=f"from transformd.cache import Cache\n"
                      f"Cache({str(known)!r}).identity({str(src)!r})"), known),
            ("convert --cache-dir, page cache, hashing alongside on all cores", False,
             cli_with("import transformd.cache.keys as k\nk.BACKGROUND_HASH_THREADS = 1 << 16", "--cache-dir",
                      str(root / "cache-pc")), root / "cache-pc"),
            ("convert --cache-dir, page cache, no head start", False,
             cli_with("", "--cache-dir", str(root / "cache-pc"), "--no-head-start"), root / "cache-pc"),
            ("convert --out, page cache, no head start", False,
             cli_with("", "--out", str(root / "out"), "--no-head-start"), root / "out"),
        ]
    if args.read_ahead_modes:  # convert --out with the start-up read-ahead (transformd/readahead.py) changed
        def out_with(patch: str) -> Callable[[], float]:
            return cli_with(f"import transformd.readahead as r\n{patch}", "--out", str(root / "out"))

        at = [name for name, *_ in steps].index("convert SRC --out D") + 1
        steps[at:at] = [(f"convert --out, read-ahead {mode}", True, out_with(patch), root / "out") for mode, patch in (
            ("off", "r.read_ahead_bytes = lambda most=0: 0"),
            ("after import torch", "init = r.ReadAhead.__init__\ndef late(self, *a, **k):\n    import torch\n"
                                   "    init(self, *a, **k)\nr.ReadAhead.__init__ = late"),
            ("in 1 MiB reads", "r._SLICE_BYTES = 1 << 20"),
            ("at idle I/O priority", "import ctypes, threading\nrun = r.ReadAhead._run\ndef idle(self):\n"
                                     "    ctypes.CDLL(None, use_errno=True).syscall(251, 1, threading.get_native_id(), "
                                     "3 << 13)\n    run(self)\nr.ReadAhead._run = idle"),
        )]
    if args.skip:  # a left-out step's clean-up (a warm hit removes the cold step's cache) goes to the step before
        kept: list[tuple[Any, ...]] = []
        for step in steps:
            if not re.search(args.skip, step[0]):
                kept.append(step)
            elif step[3] is not None and kept and kept[-1][3] is None:
                kept[-1] = (*kept[-1][:3], step[3])
        steps = kept
    byte_compile(REPO, *([Path(args.baseline).resolve()] if args.baseline else []))
    imports = timed([sys.executable, "-c", "import torch, transformd.checkpoint, transformd.cli"])
    times: dict[str, list[float]] = {name: [] for name, *_ in steps}
    how = "?"
    for _ in range(args.rounds):
        for name, cold, step, cleanup in steps:
            if cold:
                how = drop_caches(src, only=args.cold_source_only)
            elif "page cache" in name:
                read_into_page_cache(src)
            print(f"# {name} ...", file=sys.stderr, flush=True)  # (what the step prints comes under it)
            times[name].append(step())
            print(f"#   = {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
            if cleanup is not None:
                remove(cleanup)
    gib = sample["bytes"] / GiB
    lines = [f"whole processes, {args.rounds} rounds alternated on the same files; device {dev}, "
             f"{args.target}/{args.scale_mode}; cold = {how} before the step",
             f"sample: {_describe(sample)}, {_tensor_count(src)} tensors",
             f"in {root} ({file_system(root)})",
             f"python -c 'import torch, transformd.checkpoint, transformd.cli': {imports:.2f} s", ""]
    floors = {"cold": "cp -r SRC DST && sync", "page cache": "cp -r + sync, source in page cache",
              "warm": "python -c 'import httpx' (a warm path's floor)"}
    floors = {kind: min(times[name]) for kind, name in floors.items() if name in times}  # (--skip may drop one)
    header = f"{'what':<46} " + " ".join(f"{f'run {i + 1}':>16}" for i in range(args.rounds)) + f" {'GiB/s (best)':>13}"
    lines.append(header)
    for name, cold, *_ in steps:
        ref = floors.get("warm" if ("warm hit" in name or "httpx" in name) else "cold" if cold else "page cache")
        cells = [f"{t:6.2f} s ({t / ref:4.2f}x)" if ref else f"{t:6.2f} s" for t in times[name]]
        lines.append(f"{name:<46} " + " ".join(f"{c:>16}" for c in cells) + f" {gib / min(times[name]):13.2f}")
    lines.append("ratios: cold steps against the best cold cp -r + sync; page-cache steps against the best cp -r + "
                 "sync with the source in the page cache (writing and fsyncing the same bytes); warm hits against "
                 "python -c 'import httpx' (Python plus an HTTP client)")
    return "\n".join(lines)


def _tensor_count(src: Path) -> int:
    from transformd.safetensors_io import read_header

    return sum(len(read_header(f).tensors) for f in src.glob("*.safetensors"))


def cache_available() -> str | None:
    """None when transformd.cache imports here; else why not."""
    proc = subprocess.run([sys.executable, "-c", "import transformd.cache"], capture_output=True, text=True,
                          cwd=REPO, check=False, env=_child_env())
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["import failed"])[-1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    gib = args.gib if args.gib is not None else (4.0 if device != "cpu" else 1.0)
    small_gib = args.small_gib if args.small_gib is not None else gib / 4
    root = Path(args.dir).resolve() if args.dir else Path(tempfile.mkdtemp(prefix="transformd-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": device, "gpus": torch.cuda.device_count() if device != "cpu" else 0,
                              "gpu_name": torch.cuda.get_device_name(0) if device != "cpu" else None,
                              "cpus": os.cpu_count(), "target": args.target, "scale_mode": args.scale_mode,
                              "host_memory_bytes": args.host_memory, "cold": not args.keep_page_cache,
                              "dir": str(root), "lookups": args.lookups}
    log = print if args.verbose else (lambda *a, **k: None)
    try:
        report["file_system"] = file_system(root)
        log(f"writing samples into {root} ({report['file_system']}) ...", file=sys.stderr)
        big = write_sample(root / "src", int(gib * GiB), fused=args.fused, reuse=args.reuse)
        small = big if args.whole_process else write_sample(root / "src-small", int(small_gib * GiB),
                                                              fused=args.fused, reuse=args.reuse)
        report["samples"] = {"big": big, "small": small}
        if args.whole_process:
            table = whole_process(args, root, big)
            print(table)
            if args.json:
                Path(args.json).write_text(table + "\n")
            return 0

        def cold(path: Path) -> None:
            os.sync()
            if not args.keep_page_cache:
                drop_from_page_cache(path)

        base = {"device": args.device, "target": args.target, "scale_mode": args.scale_mode,
                "host_memory_bytes": args.host_memory}
        log("cp -r + sync ...", file=sys.stderr)
        cold(root / "src")
        report["copy"] = copy_and_sync(root / "src", root / "copy")
        remove(root / "copy")

        for name, sample in (("convert", big), ("convert_small", small)):
            log(f"{name} ...", file=sys.stderr)
            cold(Path(sample["path"]))
            report[name] = run_child({**base, "kind": "convert", "src": sample["path"], "out": str(root / "out")})
            remove(root / "out")

        why_not = cache_available()
        report["cache_skipped"] = why_not
        if why_not is None:
            log("cache ...", file=sys.stderr)
            cold(root / "src")
            cache = {**base, "src": big["path"], "cache_root": str(root / "cache"), "lookups": args.lookups}
            report["cache_cold"] = run_child({**cache, "kind": "cache-cold"})
            report["cache_warm"] = run_child({**cache, "kind": "cache-warm"})
            remove(root / "cache")
    finally:
        if not (args.dir or args.keep):
            shutil.rmtree(root, ignore_errors=True)
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def format_table(r: dict[str, Any]) -> str:
    big, small = r["samples"]["big"], r["samples"]["small"]
    copy_s = r["copy"]["seconds"]
    rows = [["measurement", "time", "GiB/s", "vs copy", "peak RSS", "RSS growth", "anon growth", "GPU peak",
             "GPU held after", "pinned after"]]

    def add(what: str, m: dict[str, Any], nbytes: int, note: str = "") -> None:
        secs = m["seconds"]
        rows.append([what, f"{secs:.2f} s", f"{nbytes / GiB / secs:.2f}", f"{secs / copy_s:.2f}x",
                     _size(m.get("rss_peak")), _size(m.get("rss_growth")), _size(m.get("anon_growth")),
                     _size(m.get("gpu_peak_allocated")),
                     _size(m.get("gpu_reserved_after")), _size(m.get("pinned_host_after")), note])

    copy = r["copy"]
    add("cp -r + sync", copy, big["bytes"], f"cp {copy['cp_seconds']:.2f} s + sync {copy['sync_seconds']:.2f} s")
    add(f"convert_checkpoint {_size(big['bytes'])}", r["convert"], big["bytes"])
    add(f"convert_checkpoint {_size(small['bytes'])}", r["convert_small"], small["bytes"], "(vs copy of the large)")
    if r.get("cache_cold"):
        timings = r["cache_cold"].get("timings", {})
        note = ", ".join(f"{k} {v:.2f} s" for k, v in timings.items() if k != "total")
        add(f"cache, cold {_size(big['bytes'])}", r["cache_cold"], big["bytes"], note)
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(rows[0]))]
    where = f"{r['gpus']}x {r['gpu_name']}" if r["gpu_name"] else f"{r['cpus']} CPU cores"
    source = "dropped from the page cache before each run" if r["cold"] else "left in the page cache"
    lines = [
        (f"transformd convert benchmark: device {r['device']} ({where}), {r['target']}/{r['scale_mode']}, "
        f"host memory budget {_size(r['host_memory_bytes'])}, source {source}"),
        f"samples: {_describe(big)}; {_describe(small)}",
        f"in {r['dir']} ({r.get('file_system')})",
        "",
    ]
    for row in rows:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + row[len(widths):]).rstrip())
    if r.get("cache_warm"):
        warm = r["cache_warm"]
        for name in ("lookup", "get_or_convert"):
            s = warm[name]
            lines.append(f"cache, warm {name} x{r['lookups']}: median {s['median'] * 1e3:.3f} ms, "
                         f"p99 {s['p99'] * 1e3:.3f} ms, max {s['max'] * 1e3:.3f} ms "
                         f"(first call in a new process {s['first'] * 1e3:.2f} ms)")
    else:
        lines.append(f"cache: skipped ({r.get('cache_skipped')})")
    growth = [r[k]["rss_growth"] for k in ("convert", "convert_small")]
    buffers = [r[k].get("host_buffer_bytes") for k in ("convert", "convert_small")]
    lines.append(f"peak RSS growth: {_size(growth[0])} converting {_size(big['bytes'])}, {_size(growth[1])} "
                 f"converting {_size(small['bytes'])} (pipeline host buffers {_size(buffers[0])}, {_size(buffers[1])})")
    lines.append("RSS growth = peak RSS (VmHWM, mapped file pages included) - RSS before the job, in a fresh process; "
                 "anon growth = the same for anonymous memory only")
    return "\n".join(lines)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


def _describe(sample: dict[str, Any]) -> str:
    k = sample["knobs"]
    made = f", written in {sample['write_seconds']:.1f} s" if sample['write_seconds'] else ", reused"
    return (f"{_size(sample['bytes'])} in {sample['shards']} shards ({k['layers']} layers x {k['experts']} experts"
            f"{', fused' if k['fused_experts'] else ''}){made}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=None, help="sample size (default 4 on a GPU, 1 on the CPU)")
    p.add_argument("--small-gib", type=float, default=None, help="second, smaller sample for RSS (default gib/4)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed at the end)")
    p.add_argument("--reuse", action="store_true", help="reuse samples already in --dir with the same knobs")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--device", default="auto", help="auto (all GPUs, else cpu), cuda, cuda:N or cpu")
    p.add_argument("--target", default="fnuz", choices=["fnuz", "ocp"])
    p.add_argument("--scale-mode", default="exact", choices=["exact", "amax"])
    p.add_argument("--host-memory", type=int, default=2 * GiB, help="host_memory_bytes of the conversion")
    p.add_argument("--fused", action="store_true", help="3-D fused expert tensors instead of one per expert")
    p.add_argument("--lookups", type=int, default=100, help="warm lookups to time")
    p.add_argument("--keep-page-cache", action="store_true", help="do not drop the source from the page cache")
    p.add_argument("--cold-source-only", action="store_true",
                   help="with --whole-process: a cold step drops only the source's pages (Python, torch and the CUDA "
                        "libraries stay in the page cache, as on a node that ran them before); by default, as root, "
                        "the whole page cache")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("-v", "--verbose", action="store_true", help="say what is being measured on stderr")
    p.add_argument("--whole-process", action="store_true", help="time whole CLI processes against cp -r + sync")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the whole-process measurements")
    p.add_argument("--skip", metavar="REGEX", help="with --whole-process: leave out the steps whose name matches")
    p.add_argument("--daemon", action="store_true",
                   help="with --whole-process: also time a daemon's first resolve of the sample (request to ready) "
                        "and convert --cache-dir while a daemon serves that cache (the daemon converts)")
    p.add_argument("--hash-modes", action="store_true",
                   help="with --whole-process: also time the cache's cold conversion with the source hashed first, "
                        "then converted (the default hashes it alongside the conversion)")
    p.add_argument("--read-ahead-modes", action="store_true",
                   help="with --whole-process: also time convert --out with its start-up read-ahead off, started "
                        "after import torch, in 1 MiB reads, at the idle I/O priority")
    p.add_argument("--cache-modes", action="store_true",
                   help="with --whole-process: also time, from the page cache, convert --cache-dir with the output "
                        "hashed only at the seal, with the source keyed before (untimed), with the hashings beside "
                        "the conversion on all cores (BLAKE3's threads), and convert --cache-dir and --out with "
                        "--no-head-start")
    p.add_argument("--baseline-out", action="store_true",
                   help="with --baseline: also time the baseline's convert --out (cold and from the page cache)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="with --whole-process: also time convert --cache-dir (cold, then the warm hit) with the "
                        "transformd package in DIR (e.g. an older checkout: git archive REV transformd | tar -x -C "
                        "DIR), alternated with this one")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
