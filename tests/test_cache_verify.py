"""Integrity: verify finds flipped bytes, truncation, missing/extra files, a bad manifest; quarantines them."""

from __future__ import annotations

import os

import pytest

from transformd.cache import Cache, EntryNotFoundError

from .support.fakes import CopyConverter, write_source


@pytest.fixture
def two(tmp_path):
    log = tmp_path / "log"
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter(log))
    srcs = [write_source(tmp_path / f"m{i}", seed=i) for i in range(2)]
    entries = [cache.get_or_convert(s) for s in srcs]
    return cache, srcs, entries, log


def _writable(path):
    os.chmod(path.parent, 0o755)
    os.chmod(path, 0o644)


def test_clean_cache_verifies(two):
    cache, _, entries, _ = two
    results = cache.verify()
    assert sorted(r.key for r in results) == sorted(e.key for e in entries)
    assert all(r.ok and not r.problems and r.quarantined_to is None for r in results)
    assert all(r.files_checked == 5 and r.bytes_checked > 2 * 64 * 1024 for r in results)


def test_flipped_byte_is_found_and_quarantined(two):
    cache, srcs, entries, log = two
    bad, good = entries
    shard = bad.path / "model-00001-of-00002.safetensors"
    _writable(shard)
    data = bytearray(shard.read_bytes())
    data[12345] ^= 0x10
    shard.write_bytes(bytes(data))

    results = {r.key: r for r in cache.verify()}
    assert results[good.key].ok
    r = results[bad.key]
    assert not r.ok
    assert len(r.problems) == 1 and "model-00001-of-00002.safetensors" in r.problems[0] and "digest" in r.problems[0]
    # moved to quarantine with the reasons; never served again
    assert r.quarantined_to is not None and r.quarantined_to.parent == cache.quarantine_dir
    assert "model-00001-of-00002.safetensors" in (r.quarantined_to / "QUARANTINED.txt").read_text()
    assert not cache.entry_dir(bad.key).exists()
    assert cache.get(bad.key) is None and cache.lookup(srcs[0]) is None
    assert cache.usage().quarantined == 1
    # the next request converts afresh
    again = cache.get_or_convert(srcs[0])
    assert again.key == bad.key and again.outcome == "converted"
    assert log.read_text().count("\n") == 3
    assert [x.ok for x in cache.verify(bad.key)] == [True]


@pytest.mark.parametrize("damage", ["truncate", "remove", "extra", "manifest", "symlink"])
def test_other_damage_is_found(two, damage):
    cache, _, entries, _ = two
    e = entries[0]
    target = e.path / "tokenizer.json"
    if damage == "truncate":
        _writable(target)
        with open(target, "r+b") as f:
            f.truncate(3)
        expect = "size 3 bytes"
    elif damage == "remove":
        os.chmod(e.path, 0o755)
        target.unlink()
        expect = "missing"
    elif damage == "extra":
        os.chmod(e.path, 0o755)
        (e.path / "stray.bin").write_bytes(b"x")
        expect = "not in the manifest"
    elif damage == "symlink":
        os.chmod(e.path, 0o755)
        target.unlink()
        target.symlink_to("/etc/hostname")
        expect = "symlink"
    else:
        m = e.root / "manifest.json"
        _writable(m)
        m.write_text("{ not json")
        expect = "manifest.json unreadable"
    [r] = cache.verify(e.key)
    assert not r.ok and any(expect in p for p in r.problems), r.problems
    assert cache.get(e.key) is None
    assert [x.ok for x in cache.verify()] == [True]  # the other entry


def test_verify_without_quarantine_and_unknown_key(two):
    cache, _, entries, _ = two
    shard = entries[1].path / "config.json"
    _writable(shard)
    shard.write_bytes(shard.read_bytes().replace(b"fake", b"fakf"))
    [r] = cache.verify(entries[1].key, quarantine=False)
    assert not r.ok and r.quarantined_to is None
    assert cache.get(entries[1].key) is not None
    with pytest.raises(EntryNotFoundError):
        cache.verify("0" * 32)


def test_gc_purges_quarantine_on_request(two):
    cache, _, entries, _ = two
    m = entries[0].root / "manifest.json"
    _writable(m)
    m.write_text("{}")
    cache.verify()
    assert cache.gc().quarantine_removed == 0 and len(os.listdir(cache.quarantine_dir)) == 1
    assert cache.gc(purge_quarantine=True).quarantine_removed == 1
    assert os.listdir(cache.quarantine_dir) == []
