"""The digests of an entry's files taken while its conversion goes on (transformd.cache.seal): a shard is hashed
once it is complete, and the manifest records the digest of every file as published, even when a converter changes
a shard after it was hashed."""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from transformd.cache import MANIFEST_NAME, Cache, Recipe
from transformd.cache import seal as seal_mod
from transformd.cache import store as store_mod
from transformd.cache.keys import hash_own_file
from transformd.cache.seal import DigestsAlongside, declared_size

from .support.fakes import write_source
from .support.waiting import wait_for


def _shard(fill: int, n: int = 4096) -> bytes:
    """A safetensors file of one U8 tensor of ``n`` bytes of ``fill``."""
    header = json.dumps({"t": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bytes([fill]) * n


@pytest.fixture
def hashed(monkeypatch):
    """The files hashed alongside (by DigestsAlongside) and at the seal (by the store), in order."""
    calls: dict[str, list[str]] = {"alongside": [], "seal": []}

    def recording(kind):
        def hash_(path, **_):
            calls[kind].append(os.path.basename(path))
            return hash_own_file(path)

        return hash_

    monkeypatch.setattr(seal_mod, "hash_file", recording("alongside"))
    monkeypatch.setattr(store_mod, "hash_own_file", recording("seal"))
    monkeypatch.setattr(seal_mod, "POLL_S", 0.01)
    return calls


def test_declared_size_is_known_once_the_header_is_written(tmp_path):
    data = _shard(7)
    p = tmp_path / "a.safetensors"
    for cut, expected in ((0, None), (5, None), (8, None), (20, None), (len(data) - 4096, len(data)),
                          (len(data), len(data))):
        p.write_bytes(data[:cut])
        assert declared_size(str(p)) == expected, cut


def test_a_shard_is_hashed_once_complete_and_its_digest_stands_only_for_it_unchanged(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    data = _shard(1)
    p = out / "model-00001.safetensors"
    with DigestsAlongside(out, poll_s=0.01) as early:
        with open(p, "wb") as f:
            f.write(data[:-100])  # incomplete: not hashed, whatever the wait
            f.flush()
            time.sleep(0.2)
            assert early.digest(str(p), os.stat(p)) is None
            f.write(data[-100:])
        wait_for(lambda: early.digest(str(p), os.stat(p)) is not None, what="the complete shard's digest")
    assert early.digest(str(p), os.stat(p)) == hash_own_file(p)
    # the same size, other bytes, a later modification time: not the digest of that file any more
    p.write_bytes(_shard(2))
    later = os.stat(p).st_mtime_ns + 10**9
    os.utime(p, ns=(later, later))
    assert early.digest(str(p), os.stat(p)) is None
    # a new file under the name (another inode), even with the same bytes and times
    st = os.stat(p)
    os.unlink(p)
    p.write_bytes(_shard(2))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert early.digest(str(p), os.stat(p)) is None


def test_the_thread_reads_the_shards_on_a_few_threads_it_never_maps_them(tmp_path, monkeypatch):
    """A converter still runs while the thread hashes: a mapped file that it shortened would kill the process with
    SIGBUS (the seal, after the converter returned, maps them); and BLAKE3 takes ``BACKGROUND_HASH_THREADS``, not
    every core, from the conversion beside it (keys.hash_file)."""
    mapped: list[object] = []
    real = mmap.mmap
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: mapped.append(a) or real(*a, **k))
    asked: list[dict] = []
    real_hash = seal_mod.hash_file
    monkeypatch.setattr(seal_mod, "hash_file", lambda path, **kw: asked.append(kw) or real_hash(path, **kw))
    out = tmp_path / "out"
    out.mkdir()
    p = out / "model.safetensors"
    p.write_bytes(_shard(3))
    with DigestsAlongside(out, poll_s=0.01) as early:
        wait_for(lambda: early.digest(str(p), os.stat(p)) is not None, what="the shard's digest")
    assert mapped == [] and asked == [{"background": True}]
    assert early.digest(str(p), os.stat(p)) == hash_own_file(p)


def _seal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "transformd-seal"]


class _ShardsConverter:
    """Writes shards one after the other, waiting after the first until it was hashed alongside; ``then`` runs
    after that (to change the first shard behind the early digest's back)."""

    def __init__(self, hashed, then=None):
        self.hashed, self.then = hashed, then

    def __call__(self, src: Path, out: Path, recipe: Recipe, progress) -> dict:
        out.mkdir()
        (out / "model-00001-of-00002.safetensors").write_bytes(_shard(1))
        wait_for(lambda: "model-00001-of-00002.safetensors" in self.hashed["alongside"],
                 what="the first shard's hashing")
        if self.then is not None:
            self.then(out / "model-00001-of-00002.safetensors")
        (out / "model-00002-of-00002.safetensors").write_bytes(_shard(2))
        (out / "config.json").write_text("{}")
        progress({"files_done": 3, "files_total": 3})
        return {}


def _manifest_digests(entry) -> dict[str, str]:
    m = json.loads((entry.root / MANIFEST_NAME).read_text())
    return {f["name"]: f["digest"] for f in m["output"]["files"]}


def _actual_digests(entry) -> dict[str, str]:
    return {p.name: hash_own_file(p) for p in entry.path.iterdir()}


def test_the_publish_hashes_only_what_was_not_hashed_alongside(tmp_path, hashed):
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=_ShardsConverter(hashed))
    entry = cache.get_or_convert(write_source(tmp_path / "m"), Recipe(target="ocp", scale_mode="exact"))
    assert _seal_threads() == []  # (stopped with the conversion: a daemon converts many)
    assert _manifest_digests(entry) == _actual_digests(entry)
    assert "model-00001-of-00002.safetensors" not in hashed["seal"]
    assert {"config.json"} <= set(hashed["seal"])  # (the last shard: by whichever came first)
    assert set(hashed["seal"]) | set(hashed["alongside"]) == set(_actual_digests(entry))
    assert [r.ok for r in cache.verify(entry.key)] == [True]


@pytest.mark.parametrize("change", ["rewritten in place", "replaced"])
def test_a_shard_changed_after_it_was_hashed_alongside_is_hashed_again(tmp_path, hashed, change):
    def then(p: Path) -> None:
        time.sleep(0.05)  # (past a coarse clock's tick: the change time is what tells the files apart)
        st = os.stat(p)
        if change == "replaced":  # another inode, the same size and times
            os.unlink(p)
            p.write_bytes(_shard(9))
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        else:
            with open(p, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                f.write(b"\x09")
            later = st.st_mtime_ns + 10**9  # (a coarse clock may not move the time by itself)
            os.utime(p, ns=(later, later))

    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=_ShardsConverter(hashed, then))
    entry = cache.get_or_convert(write_source(tmp_path / "m"), Recipe(target="ocp", scale_mode="exact"))
    assert "model-00001-of-00002.safetensors" in hashed["seal"]
    assert _manifest_digests(entry) == _actual_digests(entry)
    assert [r.ok for r in cache.verify(entry.key)] == [True]


def test_the_thread_stops_with_a_failed_conversion(tmp_path, hashed):
    def then(p: Path) -> None:
        raise RuntimeError("the converter broke")

    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=_ShardsConverter(hashed, then))
    with pytest.raises(Exception, match="the converter broke"):
        cache.get_or_convert(write_source(tmp_path / "m"), Recipe(target="ocp", scale_mode="exact"))
    assert _seal_threads() == []
    assert os.listdir(cache.staging_dir) == []
