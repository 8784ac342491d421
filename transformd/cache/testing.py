"""Fake converters and a worker process for testing the cache (and, later, the daemon).

The fakes copy the source files (so an entry's size equals the source's), can log each run to a
file (to count conversions across processes), sleep between files (to be killed mid-way),
fail, or fill the disk. They are importable top-level callables, so they work across processes.

Run a worker: ``python -m transformd.cache.testing --root R --src S [--log L] [--delay D]
[--pause-at PHASE --marker M]``; it prints one JSON line ``{"key", "path", "outcome", "pid"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._durable import copy_file
from .keys import Recipe, iter_source_files


def write_source(
    path: str | os.PathLike[str],
    files: dict[str, bytes] | None = None,
    *,
    seed: int = 0,
    shard_bytes: int = 64 * 1024,
    backdate_s: float = 60.0,
) -> Path:
    """Write a fake source checkpoint directory (random shards by default) and return its path.

    ``backdate_s`` sets every file's mtime that far in the past, so the stat cache trusts it
    at once (files modified within the last 2 s are re-hashed on every request).
    """
    import random

    path = Path(path)
    if files is None:
        rng = random.Random(seed)
        files = {
            "config.json": json.dumps({"model_type": "fake", "seed": seed}).encode(),
            "model-00001-of-00002.safetensors": rng.randbytes(shard_bytes),
            "model-00002-of-00002.safetensors": rng.randbytes(shard_bytes),
            "tokenizer.json": b'{"version": "1.0"}',
        }
    t = time.time() - backdate_s
    for rel, data in files.items():
        f = path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
        if backdate_s:
            os.utime(f, (t, t))
    return path


class CopyConverter:
    """Copies every source file into ``out`` and adds ``recipe.json``.

    ``log``: append one line (``pid``) per run to this file (O_APPEND, so concurrent runs are
    counted exactly). ``delay``: seconds to sleep after each file, calling progress each time.
    """

    def __init__(self, log: str | os.PathLike[str] | None = None, delay: float = 0.0, steps: int = 1):
        self.log = None if log is None else os.fspath(log)
        self.delay = delay
        self.steps = steps

    def __call__(self, src: Path, out: Path, recipe: Recipe, progress: Callable[[Any], None]) -> dict[str, Any]:
        if self.log is not None:
            fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, f"{os.getpid()}\n".encode())
            finally:
                os.close(fd)
        files = list(iter_source_files(Path(src)))
        out.mkdir()
        for done, (rel, path, _) in enumerate(files, 1):
            dest = out / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            copy_file(path, dest)  # fsynced: a converter makes its own files durable
            for _ in range(self.steps):
                progress({"files_done": done, "files_total": len(files)})
                if self.delay:
                    time.sleep(self.delay / self.steps)
        with open(out / "recipe.json", "x") as f:
            f.write(json.dumps(recipe.as_dict(), sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        return {"files": len(files), "error_report": {"relative_l2": 0.0}}


class FailingConverter:
    """Writes a partial file, then raises ``exc``."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def __call__(self, src: Path, out: Path, recipe: Recipe, progress: Callable[[Any], None]) -> None:
        out.mkdir()
        (out / "partial.safetensors").write_bytes(b"\0" * 4096)
        raise self.exc


class FillingConverter:
    """Writes ``nbytes`` of data in 64 KiB writes (on a small file system this raises ENOSPC)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def __call__(self, src: Path, out: Path, recipe: Recipe, progress: Callable[[Any], None]) -> None:
        out.mkdir()
        chunk = b"\x5a" * 65536
        with open(out / "model.safetensors", "wb") as f:
            left = self.nbytes
            while left > 0:
                f.write(chunk[: min(left, len(chunk))])
                left -= len(chunk)
                progress({"bytes_done": self.nbytes - max(left, 0)})
            f.flush()
            os.fsync(f.fileno())


def _worker(argv: list[str] | None = None) -> int:
    from .store import Cache

    ap = argparse.ArgumentParser(prog="python -m transformd.cache.testing")
    ap.add_argument("--root", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--log")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--budget", default="1G")
    ap.add_argument("--target", default="fnuz")
    ap.add_argument("--pause-at", help="phase of the conversion at which to write --marker and sleep forever")
    ap.add_argument("--marker")
    ap.add_argument("--start-file", help="wait until this file exists before starting")
    ap.add_argument("--ready-file", help="create this file when ready to start (before waiting for --start-file)")
    args = ap.parse_args(argv)
    cache = Cache(args.root, budget_bytes=args.budget, converter=CopyConverter(args.log, args.delay, args.steps))
    if args.pause_at:

        def hook(phase: str) -> None:
            if phase == args.pause_at:
                Path(args.marker).write_text(phase)
                while True:
                    time.sleep(60)

        cache._fault_hook = hook
    if args.ready_file:
        Path(args.ready_file).touch()
    if args.start_file:
        while not os.path.exists(args.start_file):
            time.sleep(0.01)
    entry = cache.get_or_convert(args.src, Recipe(target=args.target), poll_interval=0.05)
    print(json.dumps({"key": entry.key, "path": str(entry.path), "outcome": entry.outcome, "pid": os.getpid()}))
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
