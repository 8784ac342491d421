"""A full disk: a real 2 MiB tmpfs (mounted when this runs as root with mount rights), else a simulated ENOSPC."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from transformd.cache import Cache, CacheError, CacheFullError, DiskFullError
from transformd.cache import budget as budget_mod
from transformd.cache import store as store_mod
from transformd.cache.store import ENTRY_OVERHEAD_BYTES

from .support.fakes import CopyConverter, FillingConverter, write_source


class _SimulatedFull:
    """Stands in for a full file system where mounting a tmpfs is not allowed."""

    def __init__(self, nbytes: int, limit: int = 1 << 20):
        self.inner = FillingConverter(min(nbytes, limit))
        self.nbytes, self.limit = nbytes, limit

    def __call__(self, src, out, recipe, progress):
        self.inner(src, out, recipe, progress)
        if self.nbytes > self.limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "model.safetensors"))


@pytest.fixture
def small_fs(tmp_path, mount_tmpfs):
    """(directory on a 2 MiB file system, whether it is a real tmpfs)."""
    mnt = tmp_path / "mnt"
    return mnt, mount_tmpfs(mnt, "2m")


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_disk_full_mid_conversion(tmp_path, small_fs):
    mnt, real = small_fs
    cache = Cache(mnt / "cache", budget_bytes="100M", converter=CopyConverter())
    a = cache.get_or_convert(write_source(tmp_path / "A", shard_bytes=100_000))
    a_files = _tree(a.root)
    free_before = os.statvfs(mnt).f_bavail
    src = write_source(tmp_path / "B", seed=1, shard_bytes=20_000)
    filler = FillingConverter(8 << 20) if real else _SimulatedFull(8 << 20)
    with pytest.raises(DiskFullError) as info:
        cache.get_or_convert(src, converter=filler)
    err = info.value
    msg = str(err)
    assert str(cache.root) in msg and "ran out of disk space" in msg
    assert f"{err.needed_bytes} bytes" in msg
    assert err.needed_bytes == cache.identity(src).total_bytes + ENTRY_OVERHEAD_BYTES
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOSPC
    assert isinstance(err, CacheFullError)  # the daemon maps both to 507
    # staging removed, space given back, the existing entry intact
    assert os.listdir(cache.staging_dir) == []
    if real:  # the space is given back (but for the failure record and the source's stat-cache file)
        assert os.statvfs(mnt).f_bavail >= free_before - 3
    assert [e.key for e in cache.entries()] == [a.key]
    assert _tree(a.root) == a_files
    assert [r.ok for r in cache.verify()] == [True]
    assert cache.status(cache.key_for(src)).error_type == "OSError"
    # and the cache still works
    assert cache.get_or_convert(src).outcome == "converted"
    assert {e.key for e in cache.entries()} == {a.key, cache.key_for(src)}


def test_disk_full_during_publish(tmp_path):
    """ENOSPC while digesting/fsyncing/writing the manifest (injected at the 'sealed' step)."""
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    a = cache.get_or_convert(write_source(tmp_path / "A"))
    src = write_source(tmp_path / "B", seed=1)

    def hook(phase):
        if phase == "sealed":
            raise OSError(errno.ENOSPC, "No space left on device")

    cache._fault_hook = hook
    with pytest.raises(DiskFullError, match="ran out of disk space"):
        cache.get_or_convert(src)
    cache._fault_hook = None
    assert os.listdir(cache.staging_dir) == [] and os.listdir(cache.locks_dir) == ["gc.lock"]
    assert [e.key for e in cache.entries()] == [a.key]
    assert [r.ok for r in cache.verify()] == [True]
    assert cache.get_or_convert(src).outcome == "converted"


def test_source_larger_than_the_free_space_is_refused_up_front(tmp_path, small_fs):
    mnt, real = small_fs
    if not real:
        # without a small file system, make the budget the limit instead (same code path and outcome)
        cache = Cache(mnt / "cache", budget_bytes=1_000_000, converter=CopyConverter())
    else:
        cache = Cache(mnt / "cache", budget_bytes="100M", converter=CopyConverter())
    a = cache.get_or_convert(write_source(tmp_path / "A", shard_bytes=100_000))
    big = write_source(tmp_path / "big", seed=2, shard_bytes=1_500_000)
    log = tmp_path / "log"
    with pytest.raises(CacheFullError, match="Nothing was evicted") as info:
        cache.get_or_convert(big, converter=CopyConverter(log))
    assert not isinstance(info.value, DiskFullError)
    assert not log.exists(), "refused before converting"
    assert [e.key for e in cache.entries()] == [a.key]
    assert os.listdir(cache.staging_dir) == []


def test_eviction_makes_room_on_the_disk(tmp_path, small_fs, monkeypatch):
    mnt, real = small_fs
    cache = Cache(mnt / "cache", budget_bytes="100M", converter=CopyConverter())
    a = cache.get_or_convert(write_source(tmp_path / "A", shard_bytes=100_000))
    if not real:  # pretend the file system has 1.5 MB free besides the cache's entries
        used0 = cache._used_bytes()
        for mod in (store_mod, budget_mod):  # the budget's room check and the store's both ask
            monkeypatch.setattr(mod, "free_bytes", lambda p: 1_500_000 - (cache._used_bytes() - used0))
    free = store_mod.free_bytes(mnt)
    # a source whose estimate exceeds the free space by less than A's size
    shard = (free - ENTRY_OVERHEAD_BYTES + a.size_bytes // 2) // 2
    src = write_source(tmp_path / "B", seed=3, shard_bytes=shard)
    assert cache.identity(src).total_bytes + ENTRY_OVERHEAD_BYTES > free
    b = cache.get_or_convert(src)
    assert [e.key for e in cache.entries()] == [b.key]
    assert [r.ok for r in cache.verify()] == [True]


def test_a_cache_file_it_may_not_write_is_the_caches_fault_not_the_sources(tmp_path):
    """A permission error on a file of the cache (a staging directory made immutable, an operator's chmod) is a
    CacheError naming the cache (the daemon's 503 cache_unavailable); before, it went out as a PermissionError,
    which the daemon answers as 403 "may not read" the file, blaming the caller. One on a source file stays what it
    is."""
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    src = write_source(tmp_path / "A")
    for where, raised in ((cache.staging_dir / ".tmp.status.json", CacheError), (src / "config.json", PermissionError)):

        def hook(phase, where=where):
            if phase == "reserved":
                raise PermissionError(errno.EACCES, "Permission denied", str(where))

        cache._fault_hook = hook
        with pytest.raises(raised) as caught:
            cache.get_or_convert(src)
        assert type(caught.value) is raised, caught.value
        if raised is CacheError:
            assert f"cannot use the cache directory {cache.root}" in str(caught.value), caught.value
    cache._fault_hook = None
    assert os.listdir(cache.staging_dir) == [] and cache.get_or_convert(src).outcome == "converted"
