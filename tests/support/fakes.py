"""Fake converters and a worker process for testing the cache and the daemon (injected, never switched on).

The fakes copy the source files (so an entry's size equals the source's), can log each run to a
file (to count conversions across processes), sleep between files (to be killed mid-way),
fail, or fill the disk; :class:`OrderedCopyConverter` copies shards in the order the daemon asks for.
They are importable top-level callables, so they work across processes.

Run a worker: ``python -m tests.support.fakes --root R --src S [--log L] [--delay D]
[--pause-at PHASE --marker M]`` (from the repository root, or with it on ``PYTHONPATH``: :func:`worker_command`);
it prints one JSON line ``{"key", "path", "outcome", "pid"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformd._durable import copy_file
from transformd.cache.keys import Recipe, iter_source_files

if TYPE_CHECKING:
    from transformd.checkpoint import ShardOrder
    from transformd.daemon.shards import ConversionOutline

#: The repository root: ``python -m tests.support.X`` runs from here (or with it on ``PYTHONPATH``).
REPO = Path(__file__).resolve().parents[2]


def append_line(path: str | os.PathLike[str], line: str) -> None:
    """Append ``line`` to ``path`` in one O_APPEND write (runs in several processes are counted exactly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


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
            append_line(self.log, f"{os.getpid()}")
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


class OrderedCopyConverter:
    """A fake converter: copies the source, the ``*.safetensors`` shards one at a time in the order
    ``shard_order`` picks (index order without one), sleeping ``delay`` seconds before each and reporting
    each finished shard (``shard_order.done``); then every other file. ``log``: one line per run."""

    def __init__(self, delay: float = 0.0, log: str | os.PathLike[str] | None = None):
        self.delay = delay
        self.log = None if log is None else os.fspath(log)

    @staticmethod
    def _shards(src: Path) -> list[str]:
        return sorted(p.name for p in Path(src).iterdir() if p.suffix == ".safetensors" and not p.name.startswith("."))

    def plan(self, src: Path, recipe: Recipe) -> ConversionOutline:
        from transformd.daemon.shards import ConversionOutline

        shards = self._shards(src)
        return ConversionOutline(tuple(shards), None, sum(os.path.getsize(Path(src) / n) for n in shards))

    def __call__(
        self,
        src: Path,
        out: Path,
        recipe: Recipe,
        progress: Callable[[Any], None],
        *,
        shard_order: ShardOrder | None = None,
    ) -> dict[str, Any]:
        if self.log is not None:
            append_line(self.log, f"{os.getpid()}")
        src = Path(src)
        out.mkdir()
        pending = self._shards(src)
        total = sum(os.path.getsize(src / n) for n in pending)
        done = 0
        order = []
        while pending:
            name = shard_order.next(list(pending)) if shard_order is not None else pending[0]
            pending.remove(name)
            order.append(name)
            if self.delay:
                time.sleep(self.delay)
            shutil.copyfile(src / name, out / name)
            with open(out / name, "rb") as f:
                os.fsync(f.fileno())
            done += os.path.getsize(out / name)
            if shard_order is not None:
                shard_order.done(name, out / name)
            progress({"shard": name, "bytes_done": done, "bytes_total": total})
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(src)
            for n in filenames:
                if n.startswith(".") or (rel == Path(".") and n.endswith(".safetensors")):
                    continue
                (out / rel).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(dirpath) / n, out / rel / n)
        return {"order": order}


def worker_command(*args: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a cache worker process with ``args`` (see the module docstring)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-m", "tests.support.fakes", *args], {**os.environ, "PYTHONPATH": path}


def _worker(argv: list[str] | None = None) -> int:
    from transformd.cache.store import Cache

    ap = argparse.ArgumentParser(prog="python -m tests.support.fakes")
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
    ap.add_argument("--alongside", action="store_true", help="convert while hashing whatever the source's size")
    args = ap.parse_args(argv)
    cache = Cache(args.root, budget_bytes=args.budget, converter=CopyConverter(args.log, args.delay, args.steps))
    if args.alongside:
        cache.hash_alongside_min_bytes = 0
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
