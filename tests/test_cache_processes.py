"""Real processes: single flight across processes, SIGKILL at random points and during publish, takeover."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from transformd.cache import Cache, Recipe

from .support.fakes import CopyConverter, worker_command, write_source
from .support.waiting import wait_for

PUBLISH_PHASES = ["reserved", "converted", "sealed", "manifest-written", "before-rename", "published"]


def _worker(root: Path, src: Path, *args: str) -> subprocess.Popen:
    argv, env = worker_command("--root", str(root), "--src", str(src), *args)
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(10)


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _settled(src: Path, alongside: bool) -> Path:
    """Alongside: the files aged past the stat cache's racy window (a source written moments ago is hashed
    first)."""
    for f in src.iterdir() if alongside else ():
        os.utime(f, (f.stat().st_atime - 60, f.stat().st_mtime - 60))
    return src


def _assert_clean(root: Path) -> None:
    assert os.listdir(root / "staging") == []
    assert os.listdir(root / "locks") == ["gc.lock"]
    assert os.listdir(root / "trash") == []


@pytest.mark.parametrize("alongside", [False, True], ids=["hash-first", "hash-alongside"])
def test_concurrent_processes_convert_once(tmp_path, alongside):
    """Hash first: the six agree on the key, one converts under its lock. Alongside (converting while hashing,
    as sources from 256 MiB are): one converts under the source's provisional lock, the others wait for it."""
    src = _settled(write_source(tmp_path / "m", shard_bytes=256 * 1024), alongside)
    root = tmp_path / "cache"
    log = tmp_path / "conversions.log"
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(6)]
    procs = [
        _worker(
            root,
            src,
            "--log",
            str(log),
            "--delay",
            "0.3",
            "--steps",
            "3",
            "--start-file",
            str(go),
            "--ready-file",
            str(r),
            *(["--alongside"] if alongside else []),
        )
        for r in ready
    ]
    wait_for(lambda: all(r.exists() for r in ready), timeout=60, what="all workers to be ready")
    go.touch()  # all six ask for the key within a few milliseconds of each other
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert log.read_text().count("\n") == 1, "exactly one conversion"
    assert len({o["key"] for o in outs}) == 1 and len({o["path"] for o in outs}) == 1
    outcomes = sorted(o["outcome"] for o in outs)
    assert outcomes == ["converted"] + ["waited"] * 5
    entry_path = Path(outs[0]["path"])
    got = _tree(entry_path)
    got.pop("recipe.json")
    assert got == _tree(src)
    cache = Cache(root, budget_bytes="1G")
    assert [r.ok for r in cache.verify()] == [True]
    assert len(cache.entries()) == 1
    _assert_clean(root)


@pytest.mark.parametrize("alongside", [False, True], ids=["hash-first", "hash-alongside"])
def test_sigkill_at_random_points_of_a_conversion(tmp_path, alongside):
    src = _settled(write_source(tmp_path / "m", shard_bytes=128 * 1024), alongside)
    root = tmp_path / "cache"
    rng = random.Random(1234)
    for attempt in range(4):
        p = _worker(root, src, "--delay", "0.4", "--steps", "8", *(["--alongside"] if alongside else []))
        wait_for(
            lambda: (
                any(n.endswith(".json") for n in os.listdir(root / "staging")) if (root / "staging").exists() else False
            ),
            what="the conversion to start",
        )
        time.sleep(rng.uniform(0.0, 1.2))  # somewhere inside the ~1.6 s conversion
        _kill(p)
        # nothing visible; the dead process' staging and lock file are still there until cleanup
        assert os.listdir(root / "entries") == [], attempt
        assert Cache(root, budget_bytes="1G", cleanup=False).lookup(src) is None
        assert os.listdir(root / "staging")
        assert any(n.endswith(".lock") and n != "gc.lock" for n in os.listdir(root / "locks"))
        report = Cache(root, budget_bytes="1G").cleanup()  # a Cache() at start-up already cleaned; nothing left
        assert report.staging_removed == []
        _assert_clean(root)
    # the next call succeeds
    log = tmp_path / "log"
    entry = Cache(root, budget_bytes="1G", converter=CopyConverter(log)).get_or_convert(src)
    assert entry.outcome == "converted" and log.read_text().count("\n") == 1
    assert [r.ok for r in Cache(root, budget_bytes="1G").verify()] == [True]


@pytest.mark.parametrize("phase", PUBLISH_PHASES)
def test_sigkill_during_publish(tmp_path, phase):
    src = write_source(tmp_path / "m")
    root = tmp_path / "cache"
    marker = tmp_path / "marker"
    p = _worker(root, src, "--pause-at", phase, "--marker", str(marker))
    wait_for(marker.exists, what=f"phase {phase}")
    _kill(p)
    cache = Cache(root, budget_bytes="1G", cleanup=False)
    key = cache.key_for(src)
    visible = os.listdir(root / "entries")
    if phase == "published":
        # the rename happened: the entry is complete and valid
        assert visible == [cache.entry_name(key)]
        assert [r.ok for r in cache.verify()] == [True]
    else:
        assert visible == []
        assert cache.lookup(src) is None
    # start-up cleans what the dead process left; the next call succeeds
    log = tmp_path / "log"
    cache = Cache(root, budget_bytes="1G", converter=CopyConverter(log))
    _assert_clean(root)
    entry = cache.get_or_convert(src)
    assert entry.key == key
    assert entry.outcome == ("hit" if phase == "published" else "converted")
    assert [r.ok for r in cache.verify()] == [True]
    _assert_clean(root)


def test_waiter_takes_over_from_a_dead_converter(tmp_path):
    src = write_source(tmp_path / "m")
    root = tmp_path / "cache"
    marker = tmp_path / "marker"
    log = tmp_path / "log"
    holder = _worker(root, src, "--log", str(log), "--pause-at", "converted", "--marker", str(marker))
    wait_for(marker.exists, what="the first converter")
    waiter = _worker(root, src, "--log", str(log))
    cache = Cache(root, budget_bytes="1G", cleanup=False)
    key = cache.key_for(src)
    st = cache.status(key)
    assert st is not None and st.state == "converting" and st.pid == holder.pid
    time.sleep(2.0)  # the waiter has imported and is polling by now
    assert waiter.poll() is None, "the waiter must wait while the holder lives"
    _kill(holder)
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["key"] == key and res["outcome"] == "converted"
    assert log.read_text().count("\n") == 2  # the dead one's attempt and the takeover
    assert [r.ok for r in cache.verify()] == [True]
    _assert_clean(root)


def test_dead_process_staging_is_never_served(tmp_path):
    """A complete-looking staging directory of a dead process is removed, not promoted."""
    src = write_source(tmp_path / "m")
    root = tmp_path / "cache"
    marker = tmp_path / "marker"
    p = _worker(root, src, "--pause-at", "before-rename", "--marker", str(marker))
    wait_for(marker.exists, what="before-rename")
    _kill(p)
    staged = [n for n in os.listdir(root / "staging") if not n.endswith(".json")]
    assert len(staged) == 1 and (root / "staging" / staged[0] / "manifest.json").exists()
    cache = Cache(root, budget_bytes="1G", converter=CopyConverter())
    assert cache.lookup(src) is None
    assert cache.get(staged[0][:32]) is None
    _assert_clean(root)
    assert cache.get_or_convert(src, Recipe()).outcome == "converted"
