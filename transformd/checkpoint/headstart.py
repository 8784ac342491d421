"""A head start on the CPU, in a process of its own, for a conversion whose process has yet to import torch.

A process that converts by itself (``transformd convert --out``) spends its first 3-5 s importing torch and loading
the kernel while the disk, which bounds the rest of the conversion, waits: with the source in the page cache that
start-up was the difference between the conversion and ``cp -r`` + ``sync`` of the same bytes. A :class:`HeadStart`
starts a worker process (``python -m transformd.checkpoint.headstart``, which imports no torch) that converts whole
shards meanwhile, from the last one backwards, with NumPy table lookups (:mod:`transformd.numpy_exact`: either
scale mode, bit for bit the reference) on the cores the import leaves idle, and writes them into the output
directory as the pipeline would (:class:`transformd.safetensors_writer.SafetensorsWriter`: the same header and
bytes). A process of its own, because threads would share the interpreter lock with the import: measured on the
H200 machine, 14 threads converted 2.0 GB/s alone but 0.44 GB/s beside ``import torch``, which they slowed by 0.2-2 s.

When the pipeline starts (its first :meth:`HeadStart.claim`) the worker is told to stop: it finishes the shard under
way and takes no other, and tells which shards it took; the pipeline converts every other one. The worker takes
shards from the end only while they are in the page cache (the first that is not stops it: a cold source is left to
the pipeline's reads in order). A source read through checked descriptors (the cache's view of a source, whose
entries are symlinks to ``/proc/self/fd/N``: :mod:`transformd.cache.securefs`) is read by the worker through the
same descriptors, passed to it under the same numbers: it opens no file by the source's names either. Anything
it cannot convert (a value the torch path must judge, a failed read or write) makes it give that shard back and
stop; the pipeline converts the shard, and reports an invalid value there, naming the file and the tensor, as it
always did. If the conversion fails or the caller goes away, the worker is cancelled (its stdin closes): it
abandons the shard under way and removes that file.

Protocol: the parent writes the pickled :class:`.plan.ConversionPlan` (8-byte length first) and then ``stop`` lines to
the worker's stdin; the worker writes ``take NAME``, ``done [NAME, READ, WRITTEN, SECONDS]``, ``left NAME``,
``stopped`` and finally ``end`` lines to its stdout (in JSON after the word).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from .. import _durable
from ..formats import ScaleMode, Target
from ..numpy_exact import converter, table, tile_bands, usable_cores
from ..readahead import in_page_cache
from ..safetensors_header import ShardFiles
from ..safetensors_writer import SafetensorsWriter
from .plan import ConversionPlan, MxPair, ShardPlan, output_groups, output_specs

__all__ = ["Finished", "HeadStart", "head_start_threads", "source_descriptors"]

#: Code bytes converted at once by one thread (a band of whole 128-row tiles of one expert).
UNIT_BYTES = 8 << 20
#: Units read and converted ahead of the writing, per thread.
AHEAD_UNITS = 2
#: Threads at the most: 14 converted 2 GB/s on the H200 machine, about its disk's write rate; each holds about
#: ``AHEAD_UNITS`` units and a unit's temporaries (so at most ~0.5 GiB in all, on a node of any size).
MAX_THREADS = 16
#: Seconds the pipeline waits for the worker to say which shards it took, and for it to end when cancelled.
ANSWER_S = 30.0
#: A view's entry: a link to a descriptor of the process that made the view.
_PROC_FD = re.compile(r"/proc/self/fd/(\d+)")


def head_start_threads() -> int:
    """Threads the worker converts with: the process's cores but two (the import and the writing), at least 1 and at
    most ``MAX_THREADS``."""
    return max(1, min(MAX_THREADS, usable_cores() - 2))


def source_descriptors(plan: ConversionPlan) -> tuple[int, ...]:
    """The descriptors of this process that ``plan``'s files are read through: those of the entries of
    ``plan.src`` that are symlinks to ``/proc/self/fd/N`` (a cache's view of a checked source), passed to the
    worker under the same numbers so that the same links lead to the same open files there. Empty for a plain
    directory."""
    fds = set()
    for name in {*(s.name for s in plan.shards), *(p.scale_shard for s in plan.shards for p in s.pairs)}:
        with contextlib.suppress(OSError):
            match = _PROC_FD.fullmatch(os.readlink(plan.src / name))
            if match:
                fds.add(int(match.group(1)))
    return tuple(sorted(fds))


@dataclass(frozen=True)
class Finished:
    """A shard the head start wrote completely (fsynced) into the output directory."""

    shard: ShardPlan
    read: int
    written: int

    @property
    def converted(self) -> int:
        return sum(p.weight.nbytes for p in self.shard.pairs)


class HeadStart:
    """The parent's side: starts the worker on ``plan`` into ``out``; what the pipeline asks of it. Raises OSError
    when the worker cannot be started (see :meth:`start`)."""

    def __init__(self, plan: ConversionPlan, out: Path, target: Target, scale_mode: ScaleMode, *,
                 threads: int | None = None):
        self.plan, self.out = plan, out
        self.started = time.monotonic()
        self.finished: list[Finished] = []
        self.busy = 0.0  # seconds the worker spent on shards
        self._changed = threading.Condition()
        self._taken: list[str] = []
        self._left: set[str] = set()
        self._stopped = self._ended = False
        self._skipped: set[str] | None = None  # the worker's shards, once it stopped (the pipeline skips them)
        threads = threads if threads is not None else head_start_threads()
        # (the output directory goes with the plan, on stdin: a command line is world-readable in /proc, and a cache
        # entry's staging directory is named to be known only to those the daemon told: transformd.cache.names)
        command = [sys.executable, "-m", __name__, Target(target).value, ScaleMode(scale_mode).value, str(threads)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # (this process's modules)
        fds = source_descriptors(plan)
        if min(fds, default=3) < 3:  # (the worker's own standard streams would take those numbers)
            raise OSError(f"a source descriptor numbered {min(fds)}: not passed to a worker")
        # (its standard error is not the user's: a worker that fails only means the pipeline converts everything)
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, env=env, pass_fds=fds)
        self._listener = threading.Thread(target=self._listen, name="transformd-head-start", daemon=True)
        self._listener.start()
        # The plan is written on a thread: the pipe holds 64 KiB and the worker reads only once it has started (0.2-0.5
        # s), which this thread, about to import torch, should not wait for.
        self._feeder = threading.Thread(target=self._feed, args=(plan,), name="transformd-head-start-plan", daemon=True)
        self._feeder.start()

    @classmethod
    def start(cls, plan: ConversionPlan, out: Path, target: Target, scale_mode: ScaleMode) -> HeadStart | None:
        """A head start, or None where no worker process can be started (then the pipeline converts everything)."""
        try:
            return cls(plan, out, target, scale_mode)
        except OSError:
            return None

    # -- the pipeline's side ------------------------------------------------------------------------------------------

    def claim(self, name: str) -> bool:
        """True: the pipeline converts shard ``name``; False: the worker has it. The first call stops the worker
        (it finishes the shard under way) and waits to learn which shards it took."""
        with self._changed:
            if self._skipped is None:
                self._send(b"stop\n")
                deadline = time.monotonic() + ANSWER_S
                while not (self._stopped or self._ended) and time.monotonic() < deadline:
                    self._changed.wait(0.05)
                if not (self._stopped or self._ended):  # no answer: whatever it took is given back
                    self._changed.release()
                    try:
                        self.cancel()
                    finally:
                        self._changed.acquire()
                self._skipped = set(self._taken) - self._left
            return name not in self._skipped

    def follow(self, told: Callable[[Finished], None], check: Callable[[], None]) -> None:
        """Call ``told`` for each shard the worker finishes, those before included, until it ends. ``check`` is
        called between waits; when it raises, the worker is cancelled first."""
        told_count = 0
        while True:
            with self._changed:
                fresh, ended = self.finished[told_count:], self._ended
                if not fresh and not ended:
                    self._changed.wait(0.05)
            for done in fresh:
                told(done)
            told_count += len(fresh)
            if ended and not fresh:
                return
            try:
                check()
            except BaseException:
                self.cancel()
                raise

    def given_back(self) -> list[ShardPlan]:
        """After the worker ended: the shards the pipeline skipped that the worker did not finish (to convert now;
        a partial file is removed)."""
        self._wait()
        with self._changed:
            done = {f.shard.name for f in self.finished}
            back = [s for s in self.plan.shards if s.name in (self._skipped or set()) and s.name not in done]
        self._remove(shard.name for shard in back)
        return back

    def cancel(self) -> None:
        """Stop the worker now (it abandons the shard under way); returns once it has ended, its partial files
        removed."""
        if self._feeder.is_alive():  # the worker is not reading its plan (yet): end it, so that the writing ends
            self._proc.kill()
            self._feeder.join()
        with contextlib.suppress(OSError):
            self._proc.stdin.close()  # (EOF: cancel)
        self._wait()
        with self._changed:
            done = {f.shard.name for f in self.finished}
            partial = [name for name in self._taken if name not in done and name not in self._left]
        self._remove(partial)

    def _remove(self, names: Iterable[str]) -> None:
        """Remove the worker's unfinished output files of these shards (those it never began are not there)."""
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.out / name)

    @property
    def gave_back(self) -> list[str]:
        """The shards the worker gave back (it could not convert them; the pipeline does)."""
        with self._changed:
            return sorted(self._left)

    def _feed(self, plan: ConversionPlan) -> None:
        raw = pickle.dumps((str(self.out), plan), protocol=pickle.HIGHEST_PROTOCOL)
        with contextlib.suppress(OSError, ValueError):  # (a worker that died or was cancelled: nothing taken)
            self._proc.stdin.write(struct.pack("<Q", len(raw)) + raw)
            self._proc.stdin.flush()

    def _send(self, line: bytes) -> None:
        self._feeder.join(ANSWER_S)  # (after the plan; a worker that never reads it is ended)
        if self._feeder.is_alive():
            self._proc.kill()
            self._feeder.join()
        with contextlib.suppress(OSError, ValueError):
            self._proc.stdin.write(line)
            self._proc.stdin.flush()

    def _wait(self) -> None:
        try:
            self._proc.wait(ANSWER_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._listener.join()
        self._feeder.join()  # (its write ended when the worker did)
        with contextlib.suppress(OSError):
            self._proc.stdin.close()

    def _listen(self) -> None:
        """Read the worker's lines until it ends."""
        shards = {s.name: s for s in self.plan.shards}
        try:
            for line in self._proc.stdout:
                kind, _, rest = line.decode().strip().partition(" ")
                with self._changed:
                    if kind == "take":
                        self._taken.append(json.loads(rest))
                    elif kind == "done":
                        name, read, written, seconds = json.loads(rest)
                        self.finished.append(Finished(shards[name], int(read), int(written)))
                        self.busy += float(seconds)
                    elif kind == "left":
                        self._left.add(json.loads(rest))
                    elif kind == "stopped":
                        self._stopped = True
                    self._changed.notify_all()
        except (OSError, ValueError, KeyError):
            pass  # a worker that says nonsense is treated as one that ended: what it did not finish goes back
        finally:
            self._proc.stdout.close()
            with self._changed:
                self._ended = True
                self._changed.notify_all()


# -- the worker process ------------------------------------------------------------------------------------------------


class _GiveBack(Exception):
    """The worker cannot convert this shard (a value the torch path must judge, an empty weight, a cancel)."""


class _Worker:
    """Converts shards of ``plan`` from the last one backwards into ``out`` until stopped, cancelled or out of shards,
    saying what it does on ``say``."""

    def __init__(self, plan: ConversionPlan, out: Path, target: Target, scale_mode: ScaleMode, threads: int,
                 say: Callable[[str], None]):
        self.plan, self.out, self.target = plan, out, Target(target)
        self._fnuz = self.target is Target.FNUZ
        self._lookups = converter(scale_mode)
        self._threads, self._say = threads, say
        self.stopped, self.cancelled, self.failed = threading.Event(), threading.Event(), threading.Event()
        self.taking = threading.Lock()  # a shard is taken, or the worker stops, not both at once

    def stop(self) -> None:
        """Take no more shards; say so (after this, the parent knows every shard the worker took). A shard being taken
        meanwhile is taken first (its ``take`` line comes before ``stopped``). ``stopped`` is set before the lock is
        waited for: a lock is not fair, and the run, which takes it again as soon as it has written a shard, could
        otherwise take more shards before the stop gets it."""
        self.stopped.set()
        with self.taking:
            self._say("stopped")

    def run(self) -> None:
        """Convert shards from the last one while they are in the page cache; each shard's fsync overlaps the next."""
        table(self._fnuz)  # (built once, before the first shard)
        pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="transformd-head-start")
        syncer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="transformd-head-start-sync")
        with pool, syncer:
            for shard in reversed(self.plan.shards):
                with self.taking:
                    if self.stopped.is_set() or self.cancelled.is_set() or self.failed.is_set():
                        break
                    if not self._in_page_cache(shard):
                        break  # (this shard and those before it are read from the disk by the pipeline, in order)
                    self._say(f"take {json.dumps(shard.name)}")
                started = time.monotonic()
                try:
                    read, finish = self._write_shard(shard, pool)
                except FileExistsError:  # (not ours: left as it is)
                    self._give_back(shard, remove=False)
                    break
                except Exception:  # noqa: BLE001 - given back: the pipeline converts it and reports what is wrong
                    self._give_back(shard)
                    break
                syncer.submit(self._sync, shard, read, finish, started)

    def _sync(self, shard: ShardPlan, read: int, finish: Callable[[], int], started: float) -> None:
        try:
            written = finish()
        except Exception:  # noqa: BLE001 - given back, as above
            self._give_back(shard)
        else:
            self._say(f"done {json.dumps([shard.name, read, written, round(time.monotonic() - started, 3)])}")

    def _give_back(self, shard: ShardPlan, *, remove: bool = True) -> None:
        self.failed.set()
        if remove:
            with contextlib.suppress(OSError):
                os.unlink(self.out / shard.name)
        self._say(f"left {json.dumps(shard.name)}")

    def _in_page_cache(self, shard: ShardPlan) -> bool:
        """Whether the shard's file and the files of its pairs' scales are in the page cache."""
        return all(in_page_cache(self.plan.src / name) for name in {shard.name, *(p.scale_shard for p in shard.pairs)})

    def _write_shard(self, shard: ShardPlan, pool: concurrent.futures.Executor) -> tuple[int, Callable[[], int]]:
        """Write the output shard: (bytes read, what fsyncs and closes it and returns the bytes written)."""
        src, dst = self.plan.src / shard.name, self.out / shard.name
        if not shard.rewrite:
            os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))  # (created here, as the writer does)
            size = _durable.copy_file(src, dst, check=self._check, fsync=False)
            return size, lambda: _durable.fsync_file(dst)
        files = ShardFiles(self.plan.src)
        try:
            with open(src, "rb") as source:
                writer = SafetensorsWriter(dst, output_specs(self.target, shard), shard.header.metadata,
                                           groups=output_groups(shard))
                try:
                    read = self._fill(shard, writer, source, files, pool)
                except BaseException:
                    writer.abort()
                    raise
        finally:
            files.close()

        def finish() -> int:
            writer.close()  # (checks every tensor is complete, fsyncs)
            return writer.bytes_written

        return read, finish

    def _fill(self, shard: ShardPlan, writer: SafetensorsWriter, source, files: ShardFiles,
              pool: concurrent.futures.Executor) -> int:
        """Write the shard's tensors in order: units converted on ``pool`` ahead of the writing, the tensors that do
        not change copied from ``source``. Returns the bytes read."""
        pairs = {p.weight.name: p for p in shard.pairs}
        read = 0
        # (tensor name, its unit's conversion or None for a tensor copied as it is, the copied tensor's TensorInfo or
        # the converted scale's name after a weight's last unit)
        ahead: deque[tuple[str, concurrent.futures.Future | None, Any]] = deque()
        scales: list[np.ndarray] = []  # of the weight being written

        def write_oldest() -> None:
            nonlocal read
            name, future, what = ahead.popleft()
            if future is None:
                writer.copy_from(name, source, what.begin)
                read += what.nbytes
                return
            codes, scale_inv, nbytes = future.result()
            writer.write(name, codes)
            scales.append(scale_inv.reshape(-1))
            read += nbytes
            if what is not None:  # the weight's last unit: its scales follow its codes
                writer.write(what, np.concatenate(scales))
                scales.clear()

        try:
            for t in shard.header.tensors.values():
                if t.name in shard.dropped:
                    continue
                pair = pairs.get(t.name)
                if pair is None:
                    ahead.append((t.name, None, t))
                    continue
                if not pair.weight.nbytes:
                    raise _GiveBack(f"{pair.weight.name} is empty")
                for unit in tile_bands(pair.weight.shape, UNIT_BYTES):
                    self._check()
                    while len(ahead) >= AHEAD_UNITS * self._threads:
                        write_oldest()
                    ahead.append((t.name, pool.submit(self._convert, pair, unit, files), None))
                ahead[-1] = (*ahead[-1][:2], pair.out_scale_name)
            while ahead:
                self._check()
                write_oldest()
        except BaseException:  # nothing may still read the shard's files once they are closed
            pending = [future for _, future, _ in ahead if future is not None]
            for future in pending:
                future.cancel()
            concurrent.futures.wait(pending)
            raise
        return read

    def _convert(self, pair: MxPair, unit: tuple[int, int, int], files: ShardFiles
                 ) -> tuple[np.ndarray, np.ndarray, int]:
        """Convert rows [r0, r1) of expert e of ``pair``: (codes, scale_inv, bytes read)."""
        e, r0, r1 = unit
        *_, n, k = pair.weight.shape
        codes = np.empty((r1 - r0, k), dtype=np.uint8)
        files.read_into(pair.weight_shard, pair.weight.begin + (e * n + r0) * k, codes)
        scales, scale_bytes = _read_scales(pair, e, r0, r1, files)
        converted = self._lookups(codes, scales, fnuz=self._fnuz, out=codes)
        if converted is None:
            raise _GiveBack(f"{pair.weight.name}: a value the conversion refuses, or (amax) too wide a tile")
        return converted[0], converted[1], codes.nbytes + scale_bytes

    def _check(self) -> None:
        if self.cancelled.is_set():
            raise _GiveBack("cancelled")


def _read_scales(pair: MxPair, e: int, r0: int, r1: int, files: ShardFiles) -> tuple[np.ndarray, int]:
    """The E8M0 scales of rows [r0, r1) of expert ``e``, one row per weight row (Rx32 blocks repeated)."""
    *_, rows, per_row = pair.scale.shape
    r = pair.row_block
    first, stop = r0 // r, (r1 - 1) // r + 1
    block = np.empty((stop - first, per_row), dtype=np.uint8)
    files.read_into(pair.scale_shard, pair.scale.begin + (e * rows + first) * per_row, block)
    if r == 1:
        return block, block.nbytes
    return np.repeat(block, r, axis=0)[r0 - first * r : r1 - first * r], block.nbytes


def _serve(argv: list[str]) -> int:
    """The worker: ``TARGET SCALE_MODE THREADS`` on the command line, the output directory and the plan and then
    ``stop`` on stdin (EOF: cancel)."""
    target, scale_mode, threads = Target(argv[0]), ScaleMode(argv[1]), int(argv[2])
    stdin, stdout = sys.stdin.buffer, sys.stdout
    size = struct.unpack("<Q", _read_exactly(stdin, 8))[0]
    where, plan = pickle.loads(_read_exactly(stdin, size))  # (from the parent process, which made it)
    out = Path(where)
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            stdout.write(line + "\n")
            stdout.flush()

    worker = _Worker(plan, out, target, scale_mode, threads, say)

    def listen(commands: IO[bytes]) -> None:
        for line in commands:
            if line.strip() == b"stop":
                worker.stop()
        worker.cancelled.set()

    threading.Thread(target=listen, args=(stdin,), daemon=True).start()
    try:
        worker.run()
    finally:
        say("end")
        # (the listening thread still waits on stdin: end here, every file written is closed and fsynced)
        os._exit(0)


def _read_exactly(stream: IO[bytes], n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise SystemExit(0)  # the parent went away before it sent the plan
    return data


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))
