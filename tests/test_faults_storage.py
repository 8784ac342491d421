"""Storage faults at the cache level, with the real converter: disk full, the cache directory deleted or made
read-only under a live :class:`Cache`, a corrupted entry, eviction of a leased entry, and readers that mapped an
entry's files when it is removed.

Disk full and read-only use a real tmpfs (mounted here when the test runs as root with mount rights; the tests
say "injected" in the report and fall back to an injected ENOSPC where mounting is refused). ``chmod`` cannot
make a directory read-only for root (CAP_DAC_OVERRIDE), so "read-only" is a read-only remount of the tmpfs
holding the cache, which stops root too (EROFS).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import signal
import subprocess
from pathlib import Path

import blake3
import pytest

from transformd import cli
from transformd.cache import (
    Cache,
    CacheError,
    DiskFullError,
    EntryLeasedError,
    EntryNotFoundError,
    TransformdConverter,
)
from transformd.checkpoint import convert as checkpoint_mod
from transformd.checkpoint import OutputError, convert_checkpoint
from transformd.sample import write_sample_checkpoint

from .support.checkpoints import write_checkpoint
from .support.tmpfs import remount, tmpfs

CATEGORY = "storage faults"


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def fill(fs_dir: Path, leave: int) -> Path:
    """Take the free space of the file system holding ``fs_dir`` down to ``leave`` bytes (0: to ENOSPC)."""
    filler = fs_dir / f"filler.{len(list(fs_dir.glob('filler.*')))}"
    st = os.statvfs(fs_dir)
    size = max(0, st.f_bavail * st.f_frsize - leave - (64 << 10))
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
        if leave == 0:  # the rest, a block at a time, until the file system says no
            with contextlib.suppress(OSError):
                while True:
                    os.pwrite(fd, b"\0" * 4096, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return filler


def assert_nothing_in_flight(cache: Cache) -> None:
    assert os.listdir(cache.staging_dir) == [], os.listdir(cache.staging_dir)
    assert set(os.listdir(cache.locks_dir)) <= {"gc.lock"}, os.listdir(cache.locks_dir)
    assert os.listdir(cache.trash_dir) == []


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, bytes]]:
    """(3 MB sample checkpoint, a small second checkpoint, the sample's clean conversion)."""
    root = tmp_path_factory.mktemp("storage")
    src = write_sample_checkpoint(root / "sample", hidden=320, moe_intermediate=224, head_dim=64)  # ~3 MB
    small = write_checkpoint(root / "small")
    return src, small, files(convert_checkpoint(src, root / "reference", device="cpu").out)


# ---------------------------------------------------------------------------------------------------------------------
# Disk full


class _InjectedFull:
    """Where no small file system can be mounted: ENOSPC raised from inside the conversion (after its first tensor)."""

    def __call__(self, src, out, recipe, progress):
        def failing(update):
            progress(update)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out))

        return TransformdConverter("cpu")(src, out, recipe, failing)


def _enospc_at(phase: str):
    def hook(p: str) -> None:
        if p == phase:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    return hook


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["converting", "publishing"])
def test_disk_full_in_the_cache(sample, tmp_path: Path, when: str, fault_log) -> None:
    src, small, expected = sample
    with tmpfs(tmp_path / "fs", "12m") as real:
        cache = Cache(tmp_path / "fs" / "cache", budget_bytes="1G", device="cpu")
        a = cache.get_or_convert(small)
        a_files = files(a.root)
        free_before = os.statvfs(cache.root).f_bavail
        fillers: list[Path] = []
        reached: list[str] = []
        if real:  # another writer takes the space after the conversion reserved it
            phase, leave = ("reserved", 1 << 20) if when == "converting" else ("converted", 0)

            def hook(p: str) -> None:
                reached.append(p)
                if p == phase:
                    fillers.append(fill(tmp_path / "fs", leave))  # must not raise itself: checked below

            cache._fault_hook = hook
            converter = None
        else:
            if when == "publishing":
                cache._fault_hook = _enospc_at("sealed")
            converter = _InjectedFull() if when == "converting" else None
        with pytest.raises(DiskFullError) as info:
            cache.get_or_convert(src, converter=converter)
        cache._fault_hook = None
        if real:  # the file system, not the filler, said no, in the phase under test
            assert len(fillers) == 1
            assert ("converted" in reached) == (when == "publishing") and "manifest-written" not in reached, reached
        err = info.value
        assert str(cache.root) in str(err) and "ran out of disk space" in str(err) and "every existing" in str(err)
        assert err.needed_bytes > 0 and f"({err.needed_bytes} bytes)" in str(err), str(err)  # the bytes needed
        assert isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOSPC
        assert_nothing_in_flight(cache)
        assert [e.key for e in cache.entries()] == [a.key] and files(a.root) == a_files
        assert [r.ok for r in cache.verify()] == [True]
        for f in fillers:
            f.unlink()
        if real:  # the partial conversion's space came back (but for the failure record and a stat-cache file)
            assert os.statvfs(cache.root).f_bavail >= free_before - 4
        entry = cache.get_or_convert(src)
        assert entry.outcome == "converted" and files(entry.path) == expected
    how = "real ENOSPC on a 12 MiB tmpfs filled by another writer" if real else "injected ENOSPC (no mount rights)"
    fault_log.record(
        CATEGORY,
        f"disk full while {when} (cache, real converter; {how})",
        1,
        "DiskFullError naming the cache and the bytes needed; staging removed, "
        + ("space given back, " if real else "")
        + "existing entry intact and verified; the next request converted byte-identical",
    )


@pytest.mark.timeout(120)
def test_disk_full_converting_to_out(sample, tmp_path: Path, capsys, monkeypatch, fault_log) -> None:
    """--out on a file system too small: refused before anything is written, naming --out with the sizes; and a
    disk that fills up while writing (the check passed) gives the same kind of message, never the staging path."""
    src, _, _ = sample
    with tmpfs(tmp_path / "fs", "2m") as real:
        if not real:
            pytest.skip("needs a small file system (mount refused)")
        work = tmp_path / "fs" / "work"
        work.mkdir()
        out = work / "out"
        with pytest.raises(OSError) as info:
            convert_checkpoint(src, out, device="cpu")
        err = info.value
        assert isinstance(err, OutputError) and err.errno == errno.ENOSPC
        assert f"not enough free space for the output directory {out}" in str(err), str(err)
        assert err.needed_bytes > err.free_bytes and f"({err.needed_bytes} bytes)" in str(err)
        assert ".transformd-" not in str(err)
        assert os.listdir(work) == [], "nothing was written"
        code = cli.main(["convert", str(src), "--out", str(out), "--device", "cpu", "--target", "fnuz"])
        lines = capsys.readouterr().err.splitlines()
        assert code == 1 and len(lines) == 1 and lines[0].startswith("transformd: error: not enough free space "), lines
        assert str(out) in lines[0] and "MiB" in lines[0] and ".transformd-" not in lines[0]
        assert os.listdir(work) == []

        # the check passes (another writer fills the disk later, say): ENOSPC while writing, restated about --out
        monkeypatch.setattr(checkpoint_mod, "_check_free_space", lambda out, needed: None)
        with pytest.raises(OutputError) as info:
            convert_checkpoint(src, out, device="cpu")
        message = str(info.value)
        assert info.value.errno == errno.ENOSPC and message.startswith(f"ran out of disk space writing the output "
                                                                        f"directory {out}"), message
        assert "bytes)" in message and ".transformd-" not in message and "partial output was removed" in message
        assert os.listdir(work) == [], "the staging directory is removed"
        st = os.statvfs(work)
        assert st.f_bavail == st.f_blocks, "all the space came back"
    fault_log.record(
        CATEGORY,
        "disk full converting to --out (library and CLI; real ENOSPC on a 2 MiB tmpfs)",
        3,
        "refused before writing (OSError ENOSPC naming --out, bytes needed and free; CLI exit 1, one line); "
        "ENOSPC mid-write restated about --out; staging removed, nothing beside --out, all space back",
    )


@pytest.mark.timeout(120)
def test_read_only_out(sample, tmp_path: Path, capsys, fault_log) -> None:
    """--out on a read-only file system: the error names --out and the read-only file system, not the hidden
    staging directory the conversion would have created beside it."""
    src, _, _ = sample
    fs = tmp_path / "rofs"
    with tmpfs(fs, "32m") as real:
        if not real:
            pytest.skip("a read-only file system needs mount rights (chmod does not stop root)")
        (fs / "work").mkdir()
        remount(fs, "ro")
        out = fs / "work" / "out"
        with pytest.raises(OutputError) as info:
            convert_checkpoint(src, out, device="cpu")
        assert info.value.errno == errno.EROFS
        assert str(info.value).startswith(f"cannot write the output directory {out}: {fs / 'work'} is on a "
                                          "read-only file system"), str(info.value)
        code = cli.main(["convert", str(src), "--out", str(out), "--device", "cpu"])
        lines = capsys.readouterr().err.splitlines()
        assert code == 1 and len(lines) == 1 and str(out) in lines[0] and "read-only" in lines[0], lines
        assert ".transformd-" not in lines[0] and "[Errno" not in lines[0]
    fault_log.record(CATEGORY, "--out on a read-only file system (library and CLI)", 2,
                     "OSError EROFS naming --out and the read-only file system (not the staging path); CLI exit 1")


# ---------------------------------------------------------------------------------------------------------------------
# The cache directory deleted or made read-only under a live Cache


@pytest.mark.timeout(120)
def test_cache_directory_deleted_under_a_live_cache(sample, tmp_path: Path, fault_log) -> None:
    src, small, expected = sample
    cache = Cache(tmp_path / "cache", budget_bytes="1G", device="cpu")
    a = cache.get_or_convert(small)
    shard = next(p for p in a.path.iterdir() if p.suffix == ".safetensors")
    data = shard.read_bytes()
    with open(shard, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)

    shutil.rmtree(cache.root)  # an operator's rm -rf while the daemon runs
    assert mapped[:] == data, "a mapping of a file of the deleted cache stays valid"
    mapped.close()
    assert cache.lookup(small) is None and cache.get(a.key) is None and cache.status(a.key) is None
    assert cache.entries() == [] and cache.usage().entries == 0 and cache.verify() == []
    with pytest.raises(EntryNotFoundError):
        cache.acquire_lease(a.key, 60)
    with pytest.raises(EntryNotFoundError):
        cache.rm(a.key)
    cache.gc()
    entry = cache.get_or_convert(src)  # the layout is recreated and the conversion runs
    assert entry.outcome == "converted" and files(entry.path) == expected
    assert [r.ok for r in cache.verify()] == [True]

    # deleted while a conversion runs: a clear error, nothing published, and the next request converts
    cache.rm(entry.key)
    removed = []

    def remove_root(status) -> None:
        if not removed and status.state == "converting" and status.detail:
            removed.append(True)
            while cache.root.exists():  # (the conversion's writer may add a file while rm walks the tree: again)
                shutil.rmtree(cache.root, ignore_errors=True)

    with pytest.raises(CacheError, match="was removed while") as info:
        cache.get_or_convert(src, progress=remove_root)
    assert removed and str(cache.root) in str(info.value)
    assert cache.get(entry.key) is None
    again = cache.get_or_convert(src)
    assert again.outcome == "converted" and files(again.path) == expected
    assert_nothing_in_flight(cache)
    fault_log.record(
        CATEGORY,
        "cache directory deleted (rm -rf) under a live Cache: idle, and during a conversion",
        2,
        "lookups miss, lease/rm say EntryNotFound, gc works, a mapped file keeps its bytes; a conversion in "
        "progress fails with CacheError 'removed while ... converted'; the next request recreates the layout and "
        "converts byte-identical",
    )


@pytest.mark.timeout(120)
def test_cache_directory_made_read_only(sample, tmp_path: Path, capsys, fault_log) -> None:
    src, small, expected = sample
    fs = tmp_path / "fs"
    with tmpfs(fs, "32m") as real:
        if not real:
            pytest.skip("a read-only file system needs mount rights (chmod does not stop root)")
        cache = Cache(fs / "cache", budget_bytes="1G", device="cpu")
        a = cache.get_or_convert(small)
        a_files = files(a.path)
        remount(fs, "ro")

        hit = cache.get_or_convert(small)  # existing entries keep being served
        assert hit.outcome == "hit" and files(hit.path) == a_files
        assert Cache(fs / "cache", device="cpu").lookup(small).key == a.key, "a new Cache opens it"
        assert [r.ok for r in cache.verify()] == [True] and cache.usage().entries == 1
        for what, call in (
            ("a new conversion", lambda: cache.get_or_convert(src)),
            ("a lease", lambda: cache.acquire_lease(a.key, 60)),
            ("rm", lambda: cache.rm(a.key)),
            ("gc", lambda: cache.gc()),
        ):
            with pytest.raises(CacheError, match="read-only") as info:
                call()
            assert str(cache.root) in str(info.value), what
        code = cli.main(["convert", str(src), "--cache-dir", str(cache.root), "--device", "cpu", "--target", "fnuz"])
        err = capsys.readouterr().err.splitlines()
        assert code == 1 and len(err) == 1 and "read-only" in err[0], err

        remount(fs, "rw")
        assert_nothing_in_flight(cache)
        entry = cache.get_or_convert(src)
        assert entry.outcome == "converted" and files(entry.path) == expected
    fault_log.record(
        CATEGORY,
        "cache file system remounted read-only under a live Cache (root: chmod would not stop it)",
        1,
        "hits still served and verify works; new conversion/lease/rm/gc raise CacheError 'read-only' naming the "
        "cache (CLI exit 1, one line); after remounting rw the conversion succeeds",
    )


# ---------------------------------------------------------------------------------------------------------------------
# Corruption, leases, mappings


def _flip(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)  # root writes through the 0444 mode, as a faulty disk or a stray tool could
    try:
        (b,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b ^ 0x01]), offset)
    finally:
        os.close(fd)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["tensor data", "safetensors header", "config.json"])
def test_corrupted_entry_detected_quarantined_never_served(sample, tmp_path: Path, where: str, fault_log) -> None:
    src, _, expected = sample
    cache = Cache(tmp_path / "cache", budget_bytes="1G", device="cpu")
    entry = cache.get_or_convert(src)
    shard = "model-00002-of-00002.safetensors"
    name, offset = {
        "tensor data": (shard, (entry.path / shard).stat().st_size // 2),
        "safetensors header": (shard, 20),
        "config.json": ("config.json", 10),
    }[where]
    _flip(entry.path / name, offset)

    # lookups do not re-hash: until verify runs, the corrupt entry is still returned (the daemon must verify)
    assert cache.lookup(src).key == entry.key
    [result] = cache.verify()
    assert not result.ok and result.quarantined_to is not None
    assert any(p.startswith(f"{name}: content digest") for p in result.problems), result.problems
    assert "QUARANTINED.txt" in os.listdir(result.quarantined_to)
    assert not entry.path.exists(), "the path handed out before is gone, not silently repaired"
    assert cache.lookup(src) is None and cache.get(entry.key) is None
    with pytest.raises(EntryNotFoundError):
        cache.acquire_lease(entry.key, 60)

    again = cache.get_or_convert(src)
    assert again.outcome == "converted" and files(again.path) == expected
    assert [r.ok for r in cache.verify()] == [True]
    fault_log.record(
        CATEGORY,
        f"one flipped bit in a published entry ({where})",
        1,
        "verify found it (digest mismatch, file named) and quarantined the entry; never served after (lookup "
        "misses, lease refused); the next request reconverted byte-identical. Before verify, lookups still return it",
    )


@pytest.mark.timeout(120)
def test_eviction_of_a_leased_entry_is_refused(sample, tmp_path: Path, fault_log) -> None:
    _, small, _ = sample
    cache = Cache(tmp_path / "cache", budget_bytes="1G", device="cpu")
    a = cache.get_or_convert(small)
    small2 = tmp_path / "small2"
    shutil.copytree(small, small2)
    (small2 / "generation_config.json").write_text('{"do_sample": false}')  # another key
    b = cache.get_or_convert(small2)
    assert a.key != b.key

    holder = subprocess.Popen(["sleep", "60"])  # an engine process holding a lease on A
    try:
        cache.acquire_lease(a.key, 3600, holder="engine", pid=holder.pid)
        with cache.lease(b.key, 3600, holder="this test"):
            with pytest.raises(EntryLeasedError, match="engine"):
                cache.rm(a.key)
            with pytest.raises(EntryLeasedError):
                cache.rm(b.key)
            report = cache.gc(budget_bytes=0)  # must evict everything it may
            assert report.evicted == [] and {e.key for e in cache.entries()} == {a.key, b.key}
        report = cache.gc(budget_bytes=0)  # B's lease released: B goes, A stays
        assert [k for k, _ in report.evicted] == [b.key] and [e.key for e in cache.entries()] == [a.key]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    report = cache.gc(budget_bytes=0)  # the holder died: its lease no longer protects A
    assert [k for k, _ in report.evicted] == [a.key] and cache.entries() == []
    fault_log.record(
        CATEGORY,
        "eviction (gc to budget 0) and rm of entries leased by a live process (another process, this one)",
        3,
        "refused (EntryLeasedError naming the holder; gc evicts nothing leased); evicted once the lease was "
        "released or its holder process died",
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["rm --force while leased", "evicted by gc", "quarantined by verify"])
def test_mapped_files_keep_their_bytes_after_removal(sample, tmp_path: Path, how: str, fault_log) -> None:
    src, _, expected = sample
    cache = Cache(tmp_path / "cache", budget_bytes="1G", device="cpu")
    entry = cache.get_or_convert(src)
    digests = {f.name: f.digest for f in entry.manifest.files}
    maps = {}
    for p in sorted(entry.path.glob("*.safetensors")):
        with open(p, "rb") as f:  # the descriptor may close; the mapping holds the file
            maps[p.name] = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    lease = cache.acquire_lease(entry.key, 3600, holder="engine")

    if how == "rm --force while leased":
        with pytest.raises(EntryLeasedError):
            cache.rm(entry.key)
        cache.rm(entry.key, force=True)
    elif how == "evicted by gc":
        cache.release_lease(lease)
        assert [k for k, _ in cache.gc(budget_bytes=0).evicted] == [entry.key]
    else:
        _flip(entry.path / "config.json", 3)
        assert cache.verify()[0].quarantined_to is not None
        shutil.rmtree(cache.quarantine_dir / os.listdir(cache.quarantine_dir)[0])  # and then purged
    assert not entry.root.exists() and cache.get(entry.key) is None

    for name, m in maps.items():
        assert "blake3:" + blake3.blake3(m[:]).hexdigest() == digests[name], f"{name} changed under its mapping"
        assert m[:] == expected[name]
        m.close()
    fault_log.record(
        CATEGORY,
        f"entry removed while an engine maps its shards ({how})",
        len(maps),
        "every mapped byte still matches the manifest digest after the removal",
    )
