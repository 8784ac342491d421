"""Where a whole conversion's time goes: the disk second by second, and the process's phases.

Runs ``cp -r SRC DST && sync``, ``transformd convert SRC --out D``, ``transformd convert SRC --cache-dir C`` and
(``--daemon``) a daemon's first ``transformd resolve SRC`` one after the other on convert_bench.py's sample, each
after the page cache was dropped (``--page-cache``: after the source was read into it), and prints for each the
read and write throughput and the utilisation of the disk under ``--dir`` (``/proc/diskstats``) per second, and
for the conversions the moments (seconds from the process's start; for the daemon from its start, which the step
includes) at which torch was imported, the plan and the engines' report made, the kernel loaded, the first
batches converted, the first bytes written, the first shards fsynced and the start-up read-ahead stopped (with
how far it had read); the head start's worker started and stopped; into the cache, the warm-up thread and the
hashing beside the conversion.

    python3 benchmarks/disk_timeline.py --gib 16 --dir /tmp/wp --device cuda [--rounds 1] [--cold-source-only]
        [--daemon] [--skip REGEX] [--page-cache] [--baseline DIR]

A diagnostic, Linux only: the phases come from wrapping a few of the package's functions inside the child
process (``--child``), which costs nothing measurable but is not what users run; the whole-process times to
compare are convert_bench.py --whole-process's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import convert_bench as cb

GiB = 1 << 30


class DiskMonitor:
    """Samples ``/proc/diskstats`` of one disk every 0.1 s on a thread until :meth:`stop`."""

    def __init__(self, disk: str):
        self.disk, self._stop = disk, threading.Event()
        self.samples = [self._sample()]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> tuple[float, int, int, int]:
        """(time, bytes read, bytes written, milliseconds the disk was busy) so far."""
        with open("/proc/diskstats") as f:
            for line in f:
                fields = line.split()
                if fields[2] == self.disk:
                    return time.monotonic(), int(fields[5]) * 512, int(fields[9]) * 512, int(fields[12])
        raise RuntimeError(f"{self.disk} is not in /proc/diskstats")

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append(self._sample())

    def stop(self) -> list[str]:
        """The summary line and one line per second."""
        self._stop.set()
        self._thread.join()
        s = [*self.samples, self._sample()]
        t0, lines, at = s[0][0], [], 0
        for second in range(int(s[-1][0] - t0) + 1):
            end = next((i for i in range(at, len(s)) if s[i][0] - t0 >= second + 1), len(s) - 1)
            (ta, ra, wa, ba), (tb, rb, wb, bb) = s[at], s[end]
            if tb > ta:
                lines.append(f"  {second:4d} s  read {(rb - ra) / (tb - ta) / 1e6:6.0f} MB/s  write "
                             f"{(wb - wa) / (tb - ta) / 1e6:6.0f} MB/s  busy {(bb - ba) / 10 / (tb - ta):4.0f}%")
            at = end
        total = s[-1][0] - t0
        return [f"  {total:.2f} s: read {(s[-1][1] - s[0][1]) / GiB:.2f} GiB, written {(s[-1][2] - s[0][2]) / GiB:.2f} "
                f"GiB, disk busy {(s[-1][3] - s[0][3]) / 10 / total:.0f}% of the time", *lines]


def disk_of(path: Path) -> str:
    """The block device name (as in /proc/diskstats) of the file system holding ``path``."""
    st = os.stat(path)
    uevent = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/uevent").read_text()
    return next(line.split("=", 1)[1] for line in uevent.splitlines() if line.startswith("DEVNAME="))


def child(t0: float, argv: list[str]) -> None:
    """Run ``transformd ARGV`` in this process with its phases on standard error (``@ seconds what``)."""

    def log(what: str) -> None:
        sys.stderr.write(f"@ {time.time() - t0:7.3f} {what}\n")  # (one write: stamps come from several threads)
        sys.stderr.flush()

    seen: set[str] = set()

    def once(key: str, what: str) -> None:
        if key not in seen:
            seen.add(key)
            log(what)

    def before(owner: object, name: str, say: Callable[..., None]) -> None:
        """Call ``say(*args)`` before each call of ``owner.name``."""
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            say(*args)
            return real(*args, **kwargs)

        setattr(owner, name, wrapper)

    def around(owner: object, name: str, what: str, first: int = 1) -> None:
        """Log the start and the end of the first ``first`` calls of ``owner.name`` (on any thread)."""
        real, calls = getattr(owner, name), [0]

        def wrapper(*args, **kwargs):
            calls[0] += 1
            n = calls[0]
            label = f"{what} {n}" if first > 1 else what
            if n <= first:
                log(f"{label} started")
            try:
                return real(*args, **kwargs)
            finally:
                if n <= first:
                    log(f"{label} done")

        setattr(owner, name, wrapper)

    log("python started")
    if os.environ.get("TRANSFORMD_TIMELINE_PACKAGE"):  # --baseline: that checkout's package, not this one's
        sys.path.insert(0, os.environ["TRANSFORMD_TIMELINE_PACKAGE"])
    import importlib.abc
    import importlib.util

    import transformd.readahead as readahead

    before(readahead.ReadAhead, "stop",
           lambda ahead: once("ahead", f"read-ahead stopped, {ahead.bytes_read / GiB:.2f} GiB read"))

    def wrap_plan(plan) -> None:  # (the modules that plan import these names from it after this has run)
        around(plan, "plan_conversion", "plan")
        around(plan, "plan_readiness", "readiness report")

    def wrap_convert(convert) -> None:  # (torch-free in trees with a head start, not in older ones)
        before(convert, "write_checkpoint", lambda *a: log("plan made, writing starts"))

    def wrap_pipeline(pipeline) -> None:  # its module imports torch first thing
        log("torch and the pipeline imported")
        from transformd import safetensors_io
        from transformd.checkpoint import pieces, stages

        around(pieces, "warm_up", "kernel warm-up")
        around(stages.SlotPool, "take", "slot taken", first=2)
        around(pieces.KernelConverter, "__call__", "batch converted", first=2)
        around(safetensors_io.SafetensorsWriter, "close", "shard fsynced", first=2)
        before(safetensors_io.SafetensorsWriter, "write", lambda *a: once("write", "first converted bytes written"))
        before(safetensors_io.SafetensorsWriter, "copy_from", lambda *a: once("copy", "first tensor copied"))

    def wrap_head_start(headstart) -> None:
        around(headstart.HeadStart, "start", "head start")
        before(headstart.HeadStart, "claim", lambda *a: once("claim", "pipeline's first claim (head start stops)"))

    def wrap_cache_converter(converter) -> None:  # --cache-dir: the converter the cache calls
        around(converter, "_warm_up", "warm-up thread (torch, then the kernel)")

    def wrap_alongside(alongside) -> None:  # --cache-dir: the hashing beside the conversion
        around(alongside.Hasher, "_run", "hashing (paced by the conversion)")
        before(alongside.Hasher, "_begun", lambda *a: once("begun", "conversion's first progress: the hashing reads"))

    hooks = {"transformd.checkpoint.plan": wrap_plan, "transformd.checkpoint.convert": wrap_convert,
             "transformd.checkpoint.pipeline": wrap_pipeline, "transformd.checkpoint.headstart": wrap_head_start,
             "transformd.cache.converter": wrap_cache_converter, "transformd.cache.alongside": wrap_alongside}

    class Hooks(importlib.abc.MetaPathFinder):
        """Calls ``hooks[name](module)`` once the module ``name`` has run (wherever and whenever it is imported, so
        that timing it imports nothing early)."""

        def find_spec(self, name, path, target=None):
            if name not in hooks:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                hooks.pop(name)(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Hooks())
    import atexit
    import runpy

    atexit.register(log, "exit")
    sys.argv = ["transformd", *argv]
    runpy.run_module("transformd", run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="sample size (default 4)")
    p.add_argument("--dir", required=True, help="work directory (the sample is kept there and reused)")
    p.add_argument("--device", default="auto", help="--device of the conversions (default auto)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--cold-source-only", action="store_true",
                   help="drop only the source from the page cache (default: all of it, as root)")
    p.add_argument("--daemon", action="store_true", help="also a daemon's start and first resolve")
    p.add_argument("--page-cache", action="store_true",
                   help="the source read into the page cache before each step instead of dropped from it")
    p.add_argument("--skip", metavar="REGEX", help="leave out the steps whose name matches")
    p.add_argument("--baseline", metavar="DIR",
                   help="a directory holding another transformd package: its convert --out is timed after each of "
                        "this one's")
    args = p.parse_args(argv)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    sample = cb.write_sample(root / "src", int(args.gib * GiB), fused=False, reuse=True)
    cb.byte_compile(cb.REPO)
    src, disk = Path(sample["path"]), disk_of(root)
    print(f"sample: {sample['bytes'] / GiB:.2f} GiB in {sample['shards']} shards; disk {disk}", flush=True)
    convert = [sys.executable, __file__, "--child", "convert", str(src), "--device", args.device]

    def run(cmd: list[str], package: str | None = None) -> list[str]:
        env = {**cb._child_env(), "TRANSFORMD_TIMELINE_T0": repr(time.time())}
        if package:
            env["TRANSFORMD_TIMELINE_PACKAGE"] = package
            env["PYTHONPATH"] = os.pathsep.join((package, env["PYTHONPATH"]))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cb.REPO, check=False)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return [f"  {line}" for line in proc.stderr.splitlines() if line.startswith("@") or " in " in line]

    def copy() -> list[str]:
        cb.copy_and_sync(src, root / "copy")
        return []

    def daemon() -> list[str]:
        """A daemon started (its phases logged) and its first resolve of the sample, to ready."""
        log, t0 = root / "daemon-timeline.log", time.time()
        log.unlink(missing_ok=True)
        with cb.serving(args, root, src, launcher=[__file__, "--child"], env={"TRANSFORMD_TIMELINE_T0": repr(t0)},
                        log=log) as (sock, _):
            asked = time.time() - t0
            done = subprocess.run([sys.executable, "-m", "transformd", "resolve", str(src), "--socket", str(sock),
                                   "--poll-interval", "0.05"], env=cb._child_env(), cwd=cb.REPO, capture_output=True,
                                  text=True)
            ready = time.time() - t0
            if done.returncode:
                raise RuntimeError(f"resolve failed ({done.returncode}):\n{done.stderr[-3000:]}")
        phases = [f"@ {asked:7.3f} resolve asked (the daemon up)", f"@ {ready:7.3f} ready ({ready - asked:.2f} s)",
                  *(line for line in log.read_text().splitlines() if line.startswith("@"))]
        return [f"  {line}" for line in sorted(phases, key=lambda line: float(line.split()[1]))]

    steps = [("cp -r SRC DST && sync", copy, root / "copy"),
             ("convert SRC --out D", lambda: run([*convert, "--out", str(root / "out")]), root / "out"),
             ("convert SRC --cache-dir C (cold)", lambda: run([*convert, "--cache-dir", str(root / "cache")]),
              root / "cache")]
    if args.baseline:
        base = str(Path(args.baseline).resolve())
        cb.byte_compile(Path(base))
        steps.insert(2, ("baseline: convert SRC --out D", lambda: run([*convert, "--out", str(root / "out")], base),
                         root / "out"))
    if args.daemon:
        steps.append(("daemon: started, then its first resolve (cold)", daemon, root / "cache-daemon"))
    steps = [step for step in steps if not (args.skip and re.search(args.skip, step[0]))]
    for r in range(args.rounds):
        for name, step, output in steps:
            cb.remove(output)
            if args.page_cache:
                cb.read_into_page_cache(src)
            else:
                cb.drop_caches(src, only=args.cold_source_only)
            monitor, started = DiskMonitor(disk), time.monotonic()
            phases = step()
            seconds = time.monotonic() - started
            summary, *per_second = monitor.stop()
            print(f"== round {r + 1}, {name}: {seconds:.2f} s", summary, *phases, *per_second, sep="\n", flush=True)
            cb.remove(output)  # (the disk holds the sample and one output at a time)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(float(os.environ["TRANSFORMD_TIMELINE_T0"]), sys.argv[2:])
    else:
        sys.exit(main())
