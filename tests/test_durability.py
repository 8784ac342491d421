"""Durability of the publish paths: everything is fsynced before the rename that publishes it, in order.

A SIGKILL cannot show a missing fsync (the page cache survives a killed process), so these tests record every
``os.fsync``, ``os.rename`` and ``os.replace`` the code makes while it converts and publishes, and check the order
a power cut needs, for ``convert_checkpoint(src, out)`` (staging directory renamed to ``out``) and for the cache
(``staging/<key>...`` renamed to ``entries/<key>``):

1. every file of the published tree was fsynced before the rename, after its last write (its size at the fsync is
   its final size);
2. every directory of the tree was fsynced before the rename and after the fsync of each entry directly inside it
   (a directory fsynced before an entry was created does not make that entry durable);
3. the directory holding the published name was fsynced after the rename.

Files and directories are matched by (device, inode), which a rename keeps, so an fsync under a staging name
counts for the published file. With every ``os.fsync`` of the code made a no-op, each of these tests fails.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from transformd.cache import Cache
from transformd.checkpoint import convert_checkpoint
from transformd.sample import write_sample_checkpoint

from .support.fakes import CopyConverter, write_source


@dataclass
class Event:
    kind: str  # "fsync" or "rename"
    inode: tuple[int, int] | None = None  # fsync: (st_dev, st_ino) of the descriptor
    size: int | None = None  # fsync of a regular file: its size at that moment
    src: str | None = None  # rename: the two paths as given
    dst: str | None = None


@dataclass
class DurabilityLog:
    """Every fsync and rename of the process, in order (the conversion fsyncs from several threads)."""

    events: list[Event] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, event: Event) -> None:
        with self.lock:
            self.events.append(event)

    def publish_index(self, published: Path) -> int:
        """Index of the last rename whose destination is ``published``."""
        want = os.path.realpath(published)
        found = [i for i, e in enumerate(self.events) if e.kind == "rename" and os.path.realpath(e.dst) == want]
        assert found, f"nothing was renamed to {published}"
        return found[-1]

    def fsyncs_of(self, st: os.stat_result) -> list[int]:
        return [i for i, e in enumerate(self.events) if e.kind == "fsync" and e.inode == (st.st_dev, st.st_ino)]


@pytest.fixture
def durability(monkeypatch: pytest.MonkeyPatch) -> DurabilityLog:
    log = DurabilityLog()
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        size = None if stat.S_ISDIR(st.st_mode) else st.st_size
        real_fsync(fd)
        log.add(Event("fsync", inode=(st.st_dev, st.st_ino), size=size))

    def rename(src, dst, *args, **kwargs):
        real_rename(src, dst, *args, **kwargs)
        log.add(Event("rename", src=os.fspath(src), dst=os.fspath(dst)))

    def replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        log.add(Event("rename", src=os.fspath(src), dst=os.fspath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    return log


def assert_published_durably(log: DurabilityLog, published: Path) -> int:
    """Check rules 1-3 of the module docstring for the tree at ``published``; returns how many paths were checked."""
    at = log.publish_index(published)
    problems: list[str] = []
    checked = 0
    for dirpath, dirnames, filenames in os.walk(published):
        d = Path(dirpath)
        dir_syncs = [i for i in log.fsyncs_of(os.stat(d)) if i < at]
        if not dir_syncs:
            problems.append(f"directory {d} was not fsynced before the rename")
        for name in filenames + dirnames:
            p = d / name
            st = os.stat(p)
            syncs = [i for i in log.fsyncs_of(st) if i < at]
            checked += 1
            if not syncs:
                problems.append(f"{p} was not fsynced before the rename")
                continue
            if name in filenames and log.events[syncs[-1]].size != st.st_size:
                problems.append(f"{p} was fsynced at {log.events[syncs[-1]].size} bytes, it has {st.st_size}")
            if dir_syncs and dir_syncs[-1] < syncs[0]:
                problems.append(f"directory {d} was fsynced before its entry {name} was complete")
    parent_syncs = [i for i in log.fsyncs_of(os.stat(published.parent)) if i > at]
    if not parent_syncs:
        problems.append(f"{published.parent} was not fsynced after {published.name} was renamed into it")
    assert not problems, "\n".join(problems)
    return checked


def test_convert_checkpoint_fsyncs_every_file_and_directory_before_publishing(tmp_path, durability) -> None:
    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2)
    (src / "extra").mkdir()
    (src / "extra" / "notes.txt").write_text("carried over")  # a copied file in a sub-directory
    out = tmp_path / "out"
    convert_checkpoint(src, out, device="cpu")
    assert assert_published_durably(durability, out) >= 5
    assert (out / "extra" / "notes.txt").read_text() == "carried over"


def test_convert_checkpoint_overwrite_publishes_durably(tmp_path, durability) -> None:
    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2)
    out = tmp_path / "out"
    convert_checkpoint(src, out, device="cpu")
    convert_checkpoint(src, out, device="cpu", target="ocp", overwrite=True)
    assert assert_published_durably(durability, out) >= 4


def test_cache_publish_fsyncs_the_entry_and_its_manifest_before_the_rename(tmp_path, durability) -> None:
    """The converter fsyncs its files (CopyConverter does, as the Converter contract asks); the cache fsyncs the
    manifest and every directory, and renames once."""
    src = write_source(tmp_path / "src", {"config.json": b"{}", "model.safetensors": b"\1" * 5000,
                                          "sub/tokenizer.json": b'{"v": 1}'})
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    entry = cache.get_or_convert(src)
    published = cache.entry_dir(entry.key)
    names = {str(p.relative_to(published)) for p in published.rglob("*")}
    assert {"manifest.json", "checkpoint/model.safetensors", "checkpoint/sub/tokenizer.json"} <= names
    assert assert_published_durably(durability, published) == len(names)


def _tree_inodes(root: Path) -> dict[tuple[int, int], str]:
    return {(st.st_dev, st.st_ino): str(p.relative_to(root))
            for p in root.rglob("*") if p.is_file() for st in [os.stat(p)]}


def assert_one_fsync_per_file_and_one_rename(log: DurabilityLog, published: Path) -> None:
    """Every file of the tree fsynced exactly once; the tree renamed exactly once, into ``published``."""
    files = _tree_inodes(published)
    counts = {name: 0 for name in files.values()}
    for e in log.events:
        if e.kind == "fsync" and e.inode in files:
            counts[files[e.inode]] += 1
    assert counts and all(n == 1 for n in counts.values()), f"fsyncs per file (want one each): {counts}"
    # renames other than the atomic replacement of small JSON records (lease, status: ".tmp.<name>...")
    moves = [(e.src, e.dst) for e in log.events if e.kind == "rename" and not Path(e.src).name.startswith(".tmp.")]
    assert len(moves) == 1 and os.path.realpath(moves[0][1]) == os.path.realpath(published), moves


@pytest.mark.parametrize("how", ["convert --out", "cache"])
def test_one_staging_directory_one_fsync_per_file_one_rename(tmp_path, durability, how) -> None:
    """The real converter: its pipeline's syncer fsyncs each shard, the copies and JSON files fsync themselves,
    and neither the cache nor ``convert_checkpoint`` fsyncs a file again or stages twice."""
    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2)
    (src / "tokenizer.json").write_text("{}")
    durability.events.clear()  # (the sample's own rename into place is not the conversion's)
    if how == "cache":
        from transformd.cache import TransformdConverter

        cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=TransformdConverter(device="cpu"))
        published = cache.entry_dir(cache.get_or_convert(src).key)
    else:
        published = tmp_path / "out"
        convert_checkpoint(src, published, device="cpu")
    assert_one_fsync_per_file_and_one_rename(durability, published)
    assert_published_durably(durability, published)
