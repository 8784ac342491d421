"""A source the cache must read to key is converted while it is hashed (read once), and published under its key.

``hash_alongside_min_bytes`` is set to 0 here so that the small checkpoints of the tests take that path (real
checkpoints do from 256 MiB on).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from transformd.cache import Cache, Recipe, TransformdConverter, alongside, keys
from transformd.cache.errors import ConversionFailedError, SourceChangedError
from transformd.checkpoint import convert_checkpoint
from transformd.safetensors_io import CheckpointError
from transformd.sample import write_sample_checkpoint

from .support.waiting import wait_for


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


class _Counting(TransformdConverter):
    """The real converter on the CPU, counting its calls; ``gate``: each call waits for it first."""

    def __init__(self, gate: threading.Event | None = None):
        super().__init__("cpu")
        self.calls, self.gate = 0, gate

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.gate is not None:
            assert self.gate.wait(30)
        return super().__call__(*args, **kwargs)


@pytest.fixture
def hashes(monkeypatch) -> list[str]:
    """The names of the files hashed by BLAKE3 (the key's reads)."""
    seen: list[str] = []
    real = keys.hash_file
    monkeypatch.setattr(keys, "hash_file",
                        lambda p, *a, **k: seen.append(os.path.basename(os.readlink(p))) or real(p, *a, **k))
    return seen


def _cache(root: Path, converter: TransformdConverter | None = None) -> Cache:
    cache = Cache(root, budget_bytes="1G", converter=converter or _Counting())
    cache.hash_alongside_min_bytes = 0
    return cache


def test_a_source_written_moments_ago_is_hashed_first(tmp_path, hashes):
    """Files inside the stat cache's racy window are never remembered: converting such a source alongside its
    hashing would let a later request convert it again, so it is keyed first (and a copy of it is a hit)."""
    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2)
    cache = _cache(tmp_path / "cache")
    entry = cache.get_or_convert(src, Recipe(target="ocp"))
    assert entry.outcome == "converted" and "identify" in entry.manifest.timings
    assert "hash_alongside" not in entry.manifest.timings
    assert cache.get_or_convert(src, Recipe(target="ocp")).outcome == "hit"
    assert cache.converter.calls == 1


def _old(src: Path) -> Path:
    """Age the files past the stat cache's racy window, so that what is hashed once is remembered."""
    for f in src.iterdir():
        os.utime(f, (f.stat().st_atime - 60, f.stat().st_mtime - 60))
    return src


def test_converted_while_hashed_under_the_key_hashing_first_gives(tmp_path, hashes):
    src = _old(write_sample_checkpoint(tmp_path / "src", layers=1, experts=2))
    cache = _cache(tmp_path / "cache")
    entry = cache.get_or_convert(src, Recipe(target="ocp"))
    assert entry.outcome == "converted" and cache.converter.calls == 1
    assert sorted(hashes) == sorted(p.name for p in src.iterdir()), "each source file hashed exactly once"
    manifest = entry.manifest
    assert "hash_alongside" in manifest.timings and "identify" not in manifest.timings
    direct = convert_checkpoint(src, tmp_path / "direct", target="ocp", device="cpu")
    assert _tree(entry.path) == _tree(direct.out)
    # the key is the content's: an independent identify (its own stat cache) gives the same one
    assert entry.key == Cache(tmp_path / "other", budget_bytes="1G").key_for(src, Recipe(target="ocp"))
    assert [r.ok for r in cache.verify()] == [True]
    hashes.clear()
    again = cache.get_or_convert(src, Recipe(target="ocp"))
    assert (again.outcome, again.path, hashes) == ("hit", entry.path, [])
    assert os.listdir(cache.staging_dir) == []


def test_only_a_hashing_nobody_waits_on_is_kept_to_a_few_threads(tmp_path, monkeypatch):
    """BLAKE3 on all cores is for a hashing on someone's path (a source keyed first, the seal); the source's hashing
    beside its conversion, and the output's shards as they are finished, take ``BACKGROUND_HASH_THREADS`` (they need
    no more to keep up, and every core they take is one less for the conversion). The digests are the same."""
    import blake3

    from transformd.cache import seal

    real, threads = blake3.blake3, []

    def recording(*args, max_threads=1, **kwargs):
        if not args:  # (a file's hashing; a key is hashed from a string at once)
            threads.append(max_threads)
        return real(*args, max_threads=max_threads, **kwargs)

    recording.AUTO = real.AUTO
    monkeypatch.setattr(keys, "blake3", type(sys)("blake3"))
    keys.blake3.blake3 = recording
    monkeypatch.setattr(keys, "BACKGROUND_HASH_THREADS", 3)
    monkeypatch.setattr(keys.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(seal, "POLL_S", 0.001)
    src = _old(write_sample_checkpoint(tmp_path / "src", layers=2, experts=2, shards=3))
    files = sorted(p.name for p in src.iterdir())
    entry = _cache(tmp_path / "cache").get_or_convert(src, Recipe(target="ocp"))
    assert "hash_alongside" in entry.manifest.timings
    alongside = [t for t in threads if t != real.AUTO]
    assert set(alongside) == {3} and len(alongside) >= len(files), threads  # every source file, maybe some shards
    threads.clear()
    first = Cache(tmp_path / "first", budget_bytes="1G").identity(src)  # keyed first: the request waits on it
    assert threads and set(threads) == {real.AUTO}, threads
    assert first.files == entry.manifest.source_files
    monkeypatch.setattr(keys.os, "sched_getaffinity", lambda pid: {0})
    shard = next(src.glob("*.safetensors"))
    assert keys.hash_file(shard, background=True) == keys.hash_file(shard)
    assert threads[-2:] == [1, real.AUTO], "one core: one thread"


class _AfterTheHashing(_Counting):
    """Converts once the hashing beside it is done (its thread has ended; it starts with the conversion's first
    progress update); records whether it ran to the end."""

    finished: list[bool]

    def __call__(self, src, out, recipe, progress, *args, **kwargs):
        progress({"bytes_done": 0})
        for _ in range(3000):
            if not any(t.name == "transformd-hash" for t in threading.enumerate()):
                break
            threading.Event().wait(0.01)
        self.finished.append(False)
        result = super().__call__(src, out, recipe, progress, *args, **kwargs)
        self.finished[-1] = True
        return result


def test_a_copy_of_cached_content_returns_that_entry(tmp_path):
    """The copy's key is known while it converts: it has an entry, so the conversion stops at its next progress
    update (not at the end) and that entry is returned."""
    src = _old(write_sample_checkpoint(tmp_path / "src", layers=1, experts=2))
    converter = _AfterTheHashing()
    converter.finished = []
    cache = _cache(tmp_path / "cache", converter)
    first = cache.get_or_convert(src, Recipe(target="ocp"))
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    _old(copy)
    entry = cache.get_or_convert(copy, Recipe(target="ocp"))
    assert (entry.outcome, entry.key, entry.path) == ("hit", first.key, first.path)
    assert converter.finished == [True, False], "the copy's conversion was stopped, not run to the end"
    assert sorted(os.listdir(cache.entries_dir)) == [cache.entry_name(first.key)]
    assert [n for n in os.listdir(cache.staging_dir)] == [] and os.listdir(cache.failures_dir) == []


def test_invalid_input_fails_at_once_and_leaves_nothing(tmp_path):
    src = _old(write_sample_checkpoint(tmp_path / "src", layers=1, experts=2))
    shard = src / "model-00002-of-00002.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 1000)
    _old(src)
    cache = _cache(tmp_path / "cache")
    for _ in range(2):  # the failure is recorded, not a stuck lock: the next request fails the same way
        with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
            cache.get_or_convert(src, Recipe(target="ocp"))
    assert os.listdir(cache.entries_dir) == [] and os.listdir(cache.staging_dir) == []
    assert not any(t.name == "transformd-hash" for t in threading.enumerate()), "the hasher was stopped and joined"


def test_a_source_changed_during_the_conversion_is_not_published(tmp_path):
    src = _old(write_sample_checkpoint(tmp_path / "src", layers=1, experts=2))
    cache = _cache(tmp_path / "cache")

    def hook(phase: str) -> None:
        if phase == "converted":
            with open(src / "config.json", "a") as f:
                f.write(" ")

    cache._fault_hook = hook
    with pytest.raises(SourceChangedError, match="changed while it was converted"):
        cache.get_or_convert(src, Recipe(target="ocp"))
    assert os.listdir(cache.entries_dir) == [] and os.listdir(cache.staging_dir) == []


def test_two_requests_for_one_unseen_source_convert_once(tmp_path):
    src = _old(write_sample_checkpoint(tmp_path / "src", layers=1, experts=2))
    gate = threading.Event()
    converter = _Counting(gate)
    cache = _cache(tmp_path / "cache", converter)
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(cache.get_or_convert(src, Recipe(target="ocp"))))
               for _ in range(2)]
    for t in threads:
        t.start()
    while converter.calls == 0:
        threading.Event().wait(0.01)
    gate.set()
    for t in threads:
        t.join(60)
    assert converter.calls == 1 and len(results) == 2
    assert sorted(e.outcome for e in results) == ["converted", "waited"] or sorted(
        e.outcome for e in results) == ["converted", "hit"]
    assert results[0].path == results[1].path


@pytest.mark.parametrize("by", ["provisional name", "key"])
def test_a_waiter_hears_of_the_failure(tmp_path, by):
    """The second request waits on the first's conversion of the same source; when that fails, it is told (and
    converts nothing). ``provisional name``: it came while the source was being hashed; ``key``: once the hashing
    was over, so it found the key in the stat cache and waited on that (the failure is recorded under both)."""
    src = _old(write_sample_checkpoint(tmp_path / "src", layers=1, experts=2))
    gate = threading.Event()

    class Failing(_Counting):
        def __call__(self, src, out, recipe, progress):
            self.calls += 1
            if by == "key":
                progress({"bytes_done": 0, "bytes_total": 1})  # (the start-up is over: the hashing reads)
            assert gate.wait(30)
            raise RuntimeError("the converter broke")

    converter = Failing()
    cache = _cache(tmp_path / "cache", converter)
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            cache.get_or_convert(src, Recipe(target="ocp"), poll_interval=0.01)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def waited_on() -> bool:
        if by == "key":  # the hashing has told the stat cache the key
            return not isinstance(cache.identity_unless_alongside(src), alongside.PendingIdentity)
        return converter.calls > 0

    first = threading.Thread(target=ask)
    first.start()
    wait_for(waited_on, timeout=30, what=f"the first request's conversion to get to where a second waits on its {by}")
    second = threading.Thread(target=ask)
    second.start()
    threading.Event().wait(0.3)
    gate.set()
    first.join(30)
    second.join(30)
    assert sorted(type(e).__name__ for e in errors) == ["ConversionFailedError", "RuntimeError"], errors
    failed = next(e for e in errors if isinstance(e, ConversionFailedError))
    assert "failed in another process: RuntimeError: the converter broke" in str(failed)
    assert converter.calls == 1


def test_a_failed_hashing_stops_the_conversion_beside_it(tmp_path, monkeypatch):
    """A file that changes while it is hashed fails the hashing; the conversion beside it stops at its next
    progress update instead of running to the end, and nothing is published."""
    from transformd.cache import alongside

    src = _old(write_sample_checkpoint(tmp_path / "src", layers=1, experts=2))

    def changed(*args, **kwargs):
        raise SourceChangedError(f"{src}/config.json changed while it was being read; try again when it is complete")

    monkeypatch.setattr(alongside, "identity_of_tree", changed)
    updates: list = []
    cache = _cache(tmp_path / "cache")
    with pytest.raises(SourceChangedError, match="changed while it was being read"):
        cache.get_or_convert(src, Recipe(target="ocp"), progress=updates.append)
    converting = [u for u in updates if u.state == "converting" and u.detail]
    assert len(converting) <= 1, "stopped at its first progress update"
    assert os.listdir(cache.entries_dir) == [] and os.listdir(cache.staging_dir) == []


def test_the_key_is_locked_before_the_stat_cache_tells_other_processes_the_key(tmp_path, monkeypatch):
    """A request that finds the key through the stat cache (cheaply, without hashing) must find the key's lock
    held by this conversion and wait for it; were the lock taken after the digests were saved, it could take the
    lock first and convert a second time (seen as a rare failure of the six-process test)."""
    from transformd.cache.lock import FileLock

    src = _old(write_sample_checkpoint(tmp_path / "src", layers=1, experts=2))
    cache = _cache(tmp_path / "cache")
    key = keys.cache_key(keys.source_identity(src), Recipe(target="ocp"))
    held: list[bool] = []
    real_save = keys.StatCache.save

    def save(self, *args, **kwargs):
        other = FileLock(cache.locks_dir / f"{key}.lock")  # another open file: flock tells holders apart
        if other.try_acquire():
            other.release()
            held.append(False)
        else:
            held.append(True)
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(keys.StatCache, "save", save)
    entry = cache.get_or_convert(src, Recipe(target="ocp"))
    assert entry.key == key and "hash_alongside" in entry.manifest.timings
    assert held == [True], "the key's lock was free when the stat cache learned the digests"


class _PacedCopy:
    """Copies the source's files into ``out`` 4 KiB at a time, reporting ``bytes_done`` after each block (a
    conversion whose pace the hashing beside it must keep to). ``report`` false: it reports nothing, and starts once
    the hashing has read 16 KiB (and 50 ms more, in which an unpaced hashing would read on); so does ``late``, which
    does report, and then waits for ``late`` (an event) too; with ``hashed_first`` false it waits for ``late``
    only, and 0.2 s more (a hashing that must read nothing before the conversion's first update).
    ``fail_after``: raise after reporting that many bytes."""

    def __init__(self, events: list, lock: threading.Lock, report: bool = True, fail_after: int | None = None,
                 late: threading.Event | None = None, hashed_first: bool = True):
        self.events, self.lock, self.report, self.fail_after, self.late = events, lock, report, fail_after, late
        self.hashed_first = hashed_first

    def _hashed(self, n: int) -> None:
        """Wait until the hashing has read ``n`` bytes, and 50 ms more (in which an unpaced one would read on)."""
        for _ in range(1000):
            if ("read", n) in self.events:
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.05)

    def __call__(self, src, out, recipe, progress):
        if (self.late is not None or not self.report) and self.hashed_first:
            self._hashed(16 << 10)
        if self.late is not None:
            assert self.late.wait(30)
            if not self.hashed_first:
                threading.Event().wait(0.2)  # (in which a hashing that did not wait would read its lead)
        out.mkdir()
        done = 0
        for f in sorted(Path(src).iterdir()):
            data = f.read_bytes()
            with open(out / f.name, "wb") as dst:
                for start in range(0, len(data), 4096):
                    dst.write(data[start:start + 4096])
                    done += len(data[start:start + 4096])
                    if self.report:
                        with self.lock:
                            self.events.append(("done", done))
                        progress({"bytes_done": done})
                        if self.fail_after is not None and done >= self.fail_after:
                            self._hashed(done + (16 << 10))  # the hashing now waits on its pace
                            raise RuntimeError("the converter broke")
                        threading.Event().wait(0.001)
                os.fsync(dst.fileno())
        with self.lock:
            self.events.append(("end", done))


def _paced_source(d: Path) -> Path:
    d.mkdir()
    for i in range(3):
        (d / f"part-{i}.safetensors").write_bytes(os.urandom(64 << 10))  # (read ahead as shards: by name)
    return _old(d)


_IOPRIO_GET = {"x86_64": 252, "aarch64": 31}.get(os.uname().machine) if sys.platform.startswith("linux") else None
if _IOPRIO_GET is not None and ctypes.CDLL(None).syscall(_IOPRIO_GET, 1, 0) < 0:  # (refused: a seccomp sandbox)
    _IOPRIO_GET = None


@pytest.fixture
def hash_reads(monkeypatch) -> tuple[list, threading.Lock, dict[int, int | None]]:
    """The hashing's reads of the source (``src``: not the output, which the cache hashes too), as ("read", bytes
    read so far) events, with a lock to add the conversion's, and the I/O class of each read by the bytes read so
    far (None where ioprio_get's number is not known)."""
    events: list = []
    lock = threading.Lock()
    classes: dict[int, int | None] = {}
    real, total = os.preadv, [0]

    def preadv(fd, buffers, offset, *args):
        io_class = None if _IOPRIO_GET is None else ctypes.CDLL(None).syscall(
            _IOPRIO_GET, 1, threading.get_native_id()) >> 13
        n = real(fd, buffers, offset, *args)
        if threading.current_thread().name.startswith("transformd-hash") and "/src/" in os.readlink(
                f"/proc/self/fd/{fd}"):
            with lock:
                total[0] += n
                events.append(("read", total[0]))
                classes[total[0]] = io_class
        return n

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(keys, "HASH_CHUNK_BYTES", 4096)
    return events, lock, classes


def _convert_paced(tmp_path: Path, converter: _PacedCopy, events: list):
    """Convert a source of three 64 KiB files with ``converter``, the hashing's lead 16 KiB; the entry, and the
    events until then (keying the source again, to check the entry's key, reads it too)."""
    src = _paced_source(tmp_path / "src")
    cache = _cache(tmp_path / "cache", converter)
    cache.hash_lead_bytes = 16 << 10
    entry = cache.get_or_convert(src, Recipe(target="ocp"))
    seen = list(events)
    assert entry.key == Cache(tmp_path / "other", budget_bytes="1G").key_for(src, Recipe(target="ocp"))
    return entry, seen


def test_the_hashing_keeps_within_its_lead_of_the_conversion(tmp_path, hash_reads):
    """The hashing beside a conversion reads ahead of it by ``hash_lead_bytes`` at the most (a hashing that ran on
    alone took the disk from the conversion's writes, and a source larger than the page cache would be read
    twice), and the key is still the content's."""
    events, lock, _ = hash_reads
    entry, events = _convert_paced(tmp_path, _PacedCopy(events, lock), events)
    assert entry.outcome == "converted" and "hash_alongside" in entry.manifest.timings
    done, paces, ended = 0, set(), False
    for kind, n in events:
        if kind == "done":
            done = n
        elif kind == "end":
            ended = True
        elif not ended:
            assert n <= done + (16 << 10), f"read to byte {n} with the conversion at {done}"
            paces.add(done)
    assert sum(1 for kind, _ in events if kind == "read") == 3 * 16, "every byte hashed once, 4 KiB at a time"
    assert len(paces) > 10, "the hashing went on step by step with the conversion"


@contextlib.contextmanager
def _read_ahead_elsewhere() -> Iterator[None]:
    """Another conversion of the process holds the start-up's read-ahead: the hashing reads its lead meanwhile."""
    from transformd.cache import alongside

    assert alongside._read_ahead_slot.acquire(blocking=False)
    try:
        yield
    finally:
        alongside._read_ahead_slot.release()


@pytest.mark.parametrize("read_ahead", [False, True], ids=["read-ahead-held-elsewhere", "read-ahead"])
def test_a_conversion_that_reports_no_progress_still_gets_its_key(tmp_path, hash_reads, read_ahead):
    """The pace is lifted once the conversion waits for the key: a converter that never reports bytes does not
    leave the hashing stuck at its lead (or, while its read-ahead runs, before its first byte)."""
    events, lock, _ = hash_reads
    with contextlib.nullcontext() if read_ahead else _read_ahead_elsewhere():
        _, events = _convert_paced(tmp_path, _PacedCopy(events, lock, report=False, hashed_first=not read_ahead),
                                   events)
    reads = [n for kind, n in events if kind == "read"]
    end = events.index(("end", 3 * (64 << 10)))
    before = [n for kind, n in events[:end] if kind == "read"]
    assert before == ([] if read_ahead else [4096, 8192, 12288, 16 << 10]), "paced until the conversion's end"
    assert reads[-1] == 3 * (64 << 10)


@pytest.mark.timeout(60)
def test_a_failed_conversion_stops_a_hashing_that_waits_on_its_pace(tmp_path, hash_reads):
    """The conversion fails while the hashing waits for it to go on: the hashing stops at once (no hang), having read
    no further than its lead, and nothing is published."""
    events, lock, _ = hash_reads
    src = _paced_source(tmp_path / "src")
    cache = _cache(tmp_path / "cache", _PacedCopy(events, lock, fail_after=4096))
    cache.hash_lead_bytes = 16 << 10
    with pytest.raises(RuntimeError, match="the converter broke"):
        cache.get_or_convert(src, Recipe(target="ocp"))
    assert max(n for kind, n in events if kind == "read") == 4096 + (16 << 10)
    assert not any(t.name.startswith("transformd-hash") for t in threading.enumerate()), "the hashing was joined"
    assert os.listdir(cache.entries_dir) == [] and os.listdir(cache.staging_dir) == []


@pytest.mark.skipif(_IOPRIO_GET is None, reason="ioprio_get: Linux on x86_64 or aarch64, not refused")
@pytest.mark.parametrize("slot_free", [True, False], ids=["read-ahead", "read-ahead-held-elsewhere"])
def test_the_hashing_waits_for_the_conversion_to_start(tmp_path, hash_reads, monkeypatch, slot_free):
    """While the conversion starts (a cold process imports torch meanwhile) a read-ahead that takes no GIL reads the
    source, and the hashing reads nothing (its readers would take the GIL from the imports, BLAKE3 every core); from
    the conversion's first progress update on, the read-ahead has stopped and the hashing reads at the normal I/O
    class. When another conversion of the process holds the read-ahead, this one's hashing reads its lead during the
    start-up instead, at the idle class, so that the imports' reads go first. The read-ahead is joined before the
    source is closed."""
    from transformd.cache import alongside

    events, lock, classes = hash_reads
    aheads, finished = [], threading.Event()

    class Ahead(alongside.ReadAhead):
        def __init__(self, files):
            super().__init__(files)
            aheads.append(self)

        def _run(self):
            super()._run()
            finished.set()

        def stop(self):
            with lock:
                events.append(("read-ahead stopped",))
            super().stop()

    monkeypatch.setattr(alongside, "ReadAhead", Ahead)
    if not slot_free:
        finished.set()  # (no read-ahead to wait for: the conversion starts once the hashing has read its lead)
    with contextlib.nullcontext() if slot_free else _read_ahead_elsewhere():
        _, seen = _convert_paced(tmp_path, _PacedCopy(events, lock, late=finished, hashed_first=not slot_free), events)
    first = next(i for i, e in enumerate(seen) if e[0] == "done")
    before, after = seen[:first], seen[first + 1:]
    if slot_free:
        assert before == [], "the hashing read nothing while the conversion started"
        assert after[0] == ("read-ahead stopped",), "stopped by the conversion's first update"
        assert len(aheads) == 1 and aheads[0].bytes_read == 3 * (64 << 10), "the source read ahead through the tree"
    else:
        assert [classes[e[1]] for e in before] == [3] * 4, "16 KiB (the lead) read at the idle class before it began"
        assert aheads == [], "no second read-ahead in the process"
    reads = [e for e in after if e[0] == "read"]
    assert len(reads) == 3 * 16 - len(before), "every byte hashed once"
    assert 3 not in {classes[e[1]] for e in reads}, "the rest at the normal class"
    assert not any(t.name == "transformd-read-ahead" for t in threading.enumerate())


def test_the_read_ahead_is_over_before_the_source_is_closed(tmp_path, monkeypatch):
    """The read-ahead reads the tree's descriptors by their ``/proc/self/fd`` names: it must be over before they are
    closed (a number given to another file then would be read instead), however long its last slice takes; and one
    conversion's start at a time reads ahead."""
    from transformd.cache import alongside, securefs

    alive_at_close: list[bool] = []
    real_close = securefs.SourceTree.close

    def close(self):
        alive_at_close.append(any(t.name == "transformd-read-ahead" for t in threading.enumerate()))
        real_close(self)

    class Slow(alongside.ReadAhead):
        def _read_file(self, read, path):  # a slice that ends 0.5 s after the conversion began
            self._stopped.wait(30)
            threading.Event().wait(0.5)
            return False

    monkeypatch.setattr(securefs.SourceTree, "close", close)
    monkeypatch.setattr(alongside, "ReadAhead", Slow)
    events: list = []
    entry, _ = _convert_paced(tmp_path, _PacedCopy(events, threading.Lock()), events)
    assert entry.outcome == "converted" and alive_at_close and not any(alive_at_close)
    assert alongside._read_ahead_slot.acquire(blocking=False), "given back"
    alongside._read_ahead_slot.release()
