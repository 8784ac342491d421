"""Budget and LRU eviction; leases (live, expired, dead holder) protect entries; rm and gc."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from transformd.cache import Cache, CacheFullError, EntryLeasedError, EntryNotFoundError
from transformd._durable import write_json_atomic
from transformd.cache.lock import process_identity
from transformd.cache.store import ENTRY_OVERHEAD_BYTES

from .support.fakes import CopyConverter, write_source

SHARD = 50_000


def _make(tmp_path, names, budget="1G"):
    srcs = {n: write_source(tmp_path / n, seed=i, shard_bytes=SHARD) for i, n in enumerate(names)}
    cache = Cache(tmp_path / "cache", budget_bytes=budget, converter=CopyConverter())
    return cache, srcs


def _age(cache: Cache, key: str, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(cache.entry_dir(key), (t, t))


def _estimate(cache: Cache, src) -> int:
    return cache.identity(src).total_bytes + ENTRY_OVERHEAD_BYTES


def _filled(tmp_path):
    """Entries A, B, C (C oldest use, then A, then B most recent) and a budget one byte short for D."""
    cache, srcs = _make(tmp_path, ["A", "B", "C", "D"])
    keys = {n: cache.get_or_convert(srcs[n]).key for n in "ABC"}
    _age(cache, keys["C"], 300)
    _age(cache, keys["A"], 200)
    _age(cache, keys["B"], 100)
    used = sum(e.size_bytes for e in cache.entries())
    tight = Cache(cache.root, budget_bytes=used + _estimate(cache, srcs["D"]) - 1, converter=CopyConverter())
    return tight, srcs, keys


def test_lru_entry_is_evicted_first(tmp_path):
    cache, srcs, keys = _filled(tmp_path)
    assert [e.key for e in cache.entries()] == [keys["B"], keys["A"], keys["C"]]  # most recent first
    d = cache.get_or_convert(srcs["D"])
    remaining = {e.key for e in cache.entries()}
    assert keys["C"] not in remaining, "the least recently used entry goes"
    assert remaining == {keys["A"], keys["B"], d.key}
    assert cache.lookup(srcs["C"]) is None
    assert os.listdir(cache.trash_dir) == []


def test_lookup_refreshes_last_use(tmp_path):
    cache, srcs, keys = _filled(tmp_path)
    assert cache.lookup(srcs["C"]) is not None  # C becomes the most recently used; A is now the oldest
    cache.get_or_convert(srcs["D"])
    remaining = {e.key for e in cache.entries()}
    assert keys["A"] not in remaining and keys["C"] in remaining and keys["B"] in remaining


def test_live_lease_protects_from_eviction(tmp_path):
    cache, srcs, keys = _filled(tmp_path)
    with cache.lease(keys["C"], 60, holder="engine rank 0"):
        _age(cache, keys["C"], 300)  # taking the lease counts as a use; keep C the oldest
        cache.get_or_convert(srcs["D"])
        remaining = {e.key for e in cache.entries()}
        assert keys["C"] in remaining and keys["A"] not in remaining
    assert cache.leases(keys["C"]) == []


def test_expired_lease_does_not_protect(tmp_path):
    cache, srcs, keys = _filled(tmp_path)
    lease = cache.acquire_lease(keys["C"], 0.05, pid=None)
    _age(cache, keys["C"], 300)
    time.sleep(0.1)
    assert not lease.is_live()
    cache.get_or_convert(srcs["D"])
    assert keys["C"] not in {e.key for e in cache.entries()}
    assert cache.leases(keys["C"]) == []  # the entry's leases went with it


def test_dead_holder_lease_does_not_protect(tmp_path):
    cache, srcs, keys = _filled(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lease = cache.acquire_lease(keys["C"], 3600, pid=holder.pid, holder="short-lived engine")
        assert lease.owner["pid"] == holder.pid and lease.is_live()
    finally:
        holder.kill()
        holder.wait()
    assert not lease.is_live() and lease.holder_alive() is False
    _age(cache, keys["C"], 300)
    cache.get_or_convert(srcs["D"])
    assert keys["C"] not in {e.key for e in cache.entries()}


def test_recycled_pid_is_not_the_holder(tmp_path):
    cache, _, keys = _filled(tmp_path)
    owner = dict(process_identity(), start=process_identity()["start"] - 1)  # same pid, other start time
    from transformd.cache.lease import Lease, write_lease

    write_lease(cache.leases_dir, Lease(keys["C"], "ab" * 8, time.time(), time.time() + 3600, "", owner))
    assert not cache.leases(keys["C"])[0].is_live()


def test_cannot_fit_leaves_the_cache_intact(tmp_path):
    cache, srcs, keys = _filled(tmp_path)
    leases = [cache.acquire_lease(k, 60) for k in keys.values()]
    before = {e.key: e.size_bytes for e in cache.entries()}
    with pytest.raises(CacheFullError) as info:
        cache.get_or_convert(srcs["D"])
    err = info.value
    assert err.needed_bytes == _estimate(cache, srcs["D"])
    assert err.budget_bytes == cache.budget_bytes
    assert err.used_bytes == sum(before.values()) and err.leased_bytes == sum(before.values())
    msg = str(err)
    assert str(cache.root) in msg and "leased" in msg and "Nothing was evicted" in msg
    assert {e.key: e.size_bytes for e in cache.entries()} == before
    assert [r.ok for r in cache.verify()] == [True, True, True]
    assert os.listdir(cache.staging_dir) == [] and cache.lookup(srcs["D"]) is None
    for lease in leases:
        cache.release_lease(lease)
    assert cache.get_or_convert(srcs["D"]).outcome == "converted"


def test_entry_larger_than_the_budget(tmp_path):
    cache, srcs = _make(tmp_path, ["A"], budget=1000)
    with pytest.raises(CacheFullError, match="the budget is only"):
        cache.get_or_convert(srcs["A"])
    assert os.listdir(cache.entries_dir) == [] and os.listdir(cache.staging_dir) == []


def test_conversions_in_flight_reserve_room(tmp_path):
    cache, srcs = _make(tmp_path, ["A"])
    est = _estimate(cache, srcs["A"])
    # another live process (here: this one) is converting another key and reserved room for it
    other = f"{'f' * 32}.{os.getpid()}.0000"
    write_json_atomic(
        cache.staging_dir / f"{other}.json",
        {"key": "f" * 32, "state": "converting", "estimate_bytes": 10_000, "owner": process_identity()},
    )
    tight = Cache(cache.root, budget_bytes=est + 5_000, converter=CopyConverter(), cleanup=False)
    with pytest.raises(CacheFullError, match="reserved by conversions in progress"):
        tight.get_or_convert(srcs["A"])
    assert (cache.staging_dir / f"{other}.json").exists(), "a live process' reservation is not cleaned"
    # once that process is gone, its reservation no longer counts
    write_json_atomic(
        cache.staging_dir / f"{other}.json",
        {"key": "f" * 32, "state": "converting", "estimate_bytes": 10_000, "owner": dict(process_identity(), start=1)},
    )
    assert tight.get_or_convert(srcs["A"]).outcome == "converted"
    assert os.listdir(cache.staging_dir) == []


def test_rm_refuses_a_leased_entry_unless_forced(tmp_path):
    cache, srcs = _make(tmp_path, ["A", "B"])
    a = cache.get_or_convert(srcs["A"])
    b = cache.get_or_convert(srcs["B"])
    a_size = a.size_bytes
    with cache.lease(a.key, 60):
        with pytest.raises(EntryLeasedError, match=a.key):
            cache.rm(a.key)
        assert cache.get(a.key) is not None
        assert cache.rm(a.key, force=True) == a_size
    assert cache.get(a.key) is None and not (cache.leases_dir / a.key).exists()
    assert cache.rm(b.key) > 2 * SHARD
    with pytest.raises(EntryNotFoundError, match=b.key):
        cache.rm(b.key)
    with pytest.raises(EntryNotFoundError):
        cache.acquire_lease(b.key, 60)
    assert os.listdir(cache.entries_dir) == [] and os.listdir(cache.trash_dir) == []


def test_gc_applies_the_budget_in_lru_order_and_removes_dead_leases(tmp_path):
    cache, srcs = _make(tmp_path, ["A", "B", "C"])
    keys = {n: cache.get_or_convert(srcs[n]).key for n in "ABC"}
    for n, age in zip("ABC", (100, 300, 200), strict=True):
        _age(cache, keys[n], age)
    size = {e.key: e.size_bytes for e in cache.entries()}
    expired = cache.acquire_lease(keys["A"], 0.01, pid=None)
    live = cache.acquire_lease(keys["C"], 60)
    _age(cache, keys["A"], 100)
    _age(cache, keys["C"], 200)
    time.sleep(0.05)
    # room for one entry: B (oldest) and A (next, its lease expired) go; C is leased
    report = cache.gc(budget_bytes=size[keys["C"]])
    assert [k for k, _ in report.evicted] == [keys["B"], keys["A"]]
    assert report.freed_bytes == size[keys["A"]] + size[keys["B"]]
    assert report.used_bytes == size[keys["C"]]
    assert {e.key for e in cache.entries()} == {keys["C"]}
    # a budget of zero still keeps the leased entry
    assert cache.gc(budget_bytes=0).evicted == []
    cache.release_lease(live)
    assert [k for k, _ in cache.gc(budget_bytes=0).evicted] == [keys["C"]]
    assert not expired.is_live() and cache.leases() == []


def test_usage(tmp_path):
    cache, srcs = _make(tmp_path, ["A", "B"], budget="10M")
    a = cache.get_or_convert(srcs["A"])
    cache.get_or_convert(srcs["B"])
    with cache.lease(a.key):
        u = cache.usage()
    assert u.entries == 2 and u.budget_bytes == 10_000_000
    assert u.used_bytes == sum(e.size_bytes for e in cache.entries())
    assert u.leased_bytes == a.size_bytes and u.in_flight == 0 and u.quarantined == 0 and u.free_bytes > 0
