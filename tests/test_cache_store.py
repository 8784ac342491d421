"""The store in one process: layout, manifest, read-only files, status, failures, single flight between threads."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from transformd.cache import (
    CHECKPOINT_DIR,
    MANIFEST_NAME,
    Cache,
    CacheTimeoutError,
    ConversionFailedError,
    ConversionStatus,
    Recipe,
    SourceError,
    default_root,
)
from transformd.formats import FORMAT_VERSION, MxFormatError

from .support.fakes import CopyConverter, FailingConverter, write_source


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_root_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TRANSFORMD_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_root() == tmp_path / "home" / ".cache" / "transformd"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "xdg" / "transformd"
    monkeypatch.setenv("TRANSFORMD_CACHE_DIR", str(tmp_path / "env"))
    assert default_root() == tmp_path / "env"
    assert default_root(tmp_path / "arg") == tmp_path / "arg"
    assert Cache(budget_bytes="1G").root == tmp_path / "env"


def test_budget_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("TRANSFORMD_CACHE_BUDGET", raising=False)
    cache = Cache(tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["budget_bytes"] > 0 and cache.budget_bytes == cfg["budget_bytes"]
    monkeypatch.setenv("TRANSFORMD_CACHE_BUDGET", "2GiB")
    assert cache.budget_bytes == 2 * 2**30
    assert Cache(tmp_path / "c", budget_bytes="500M").budget_bytes == 500_000_000
    assert Cache(tmp_path / "c", budget_bytes=12345).budget_bytes == 12345
    monkeypatch.setenv("TRANSFORMD_CACHE_BUDGET", "50%")
    assert 0 < cache.budget_bytes < os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize
    with pytest.raises(ValueError):
        Cache(tmp_path / "c", budget_bytes="lots")


def test_entry_layout_manifest_and_read_only_files(tmp_path):
    src = write_source(tmp_path / "m")
    write_source(src, {"nested/dir/file.json": b"[1]"})
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    entry = cache.get_or_convert(src, Recipe(target="ocp", scale_mode="amax"))
    root = tmp_path / "cache"
    assert entry.root == root / "entries" / cache.entry_name(entry.key)
    assert entry.path == entry.root / CHECKPOINT_DIR
    assert sorted(os.listdir(entry.root)) == [CHECKPOINT_DIR, MANIFEST_NAME]
    # the converted checkpoint is what the converter wrote
    expected = _tree(src)
    expected["recipe.json"] = json.dumps(Recipe("ocp", "amax").as_dict(), sort_keys=True).encode()
    assert _tree(entry.path) == expected
    # manifest: recipe, source identity, every output file's size and digest, timings, result
    m = json.loads((entry.root / MANIFEST_NAME).read_text())
    assert m["key"] == entry.key
    assert m["recipe"] == {"target": "ocp", "scale_mode": "amax", "select": None, "format_version": FORMAT_VERSION}
    assert {f["name"] for f in m["source"]["files"]} == set(_tree(src))
    assert m["source"]["path_hint"] == str(src)
    assert {f["name"]: f["size"] for f in m["output"]["files"]} == {k: len(v) for k, v in expected.items()}
    assert all(f["digest"].startswith("blake3:") for f in m["output"]["files"])
    assert set(m["timings"]) >= {"identify", "convert", "publish", "total"}
    assert m["result"] == {"files": 5, "error_report": {"relative_l2": 0.0}}
    assert entry.manifest.total_bytes == sum(len(v) for v in expected.values())
    # read-only: every file 0444, every directory of the checkpoint 0555
    for p in [entry.root / MANIFEST_NAME, *entry.path.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode == (0o555 if p.is_dir() else 0o444), (p, oct(mode))
    assert stat.S_IMODE(entry.path.stat().st_mode) == 0o555
    # nothing left behind
    assert os.listdir(root / "staging") == []
    assert os.listdir(root / "locks") == ["gc.lock"]
    assert (root / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")


def test_lookup_and_last_use(tmp_path):
    src = write_source(tmp_path / "m")
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    assert cache.lookup(src) is None
    entry = cache.get_or_convert(src)
    old = time.time() - 1000
    os.utime(entry.root, (old, old))
    assert cache.get(entry.key, touch=False).last_used == pytest.approx(old)
    hit = cache.lookup(src)
    assert hit.key == entry.key and hit.outcome == "hit"
    assert time.time() - entry.root.stat().st_mtime < 5
    assert cache.lookup(src, Recipe(target="ocp")) is None
    assert cache.status(entry.key) == ConversionStatus(key=entry.key, state="ready")
    assert cache.status("0" * 32) is None


def test_lease_ttl_returns_a_leased_entry(tmp_path):
    src = write_source(tmp_path / "m")
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    entry = cache.get_or_convert(src, lease_ttl=60)
    assert entry.lease is not None and entry.lease.is_live()
    assert [lease.id for lease in cache.leases(entry.key)] == [entry.lease.id]
    again = cache.get_or_convert(src, lease_ttl=60)
    assert again.outcome == "hit" and again.lease.id != entry.lease.id
    renewed = cache.renew_lease(entry.lease, 3600)
    assert renewed.id == entry.lease.id and renewed.expires_at > entry.lease.expires_at
    assert cache.release_lease(entry.lease) and cache.release_lease(again.lease)
    assert not cache.release_lease(again.lease)
    assert cache.leases(entry.key) == []


def test_invalid_input_leaves_nothing_and_is_reported(tmp_path):
    src = write_source(tmp_path / "m")
    cache = Cache(tmp_path / "cache", budget_bytes="1G")
    bad = MxFormatError("E8M0 scale byte 0xFF (NaN)", tensor="model.layers.0.w", file="model.safetensors")
    with pytest.raises(MxFormatError, match="0xFF"):
        cache.get_or_convert(src, converter=FailingConverter(bad))
    key = cache.key_for(src)
    assert cache.get(key) is None
    assert os.listdir(tmp_path / "cache" / "entries") == []
    assert os.listdir(tmp_path / "cache" / "staging") == []
    st = cache.status(key)
    assert st.state == "failed" and st.error_type == "MxFormatError" and "0xFF" in st.error
    # a later request tries again (the failure is not cached)
    entry = cache.get_or_convert(src, converter=CopyConverter())
    assert entry.outcome == "converted" and cache.status(key).state == "ready"


def test_source_changed_during_conversion_is_discarded(tmp_path):
    src = write_source(tmp_path / "m")

    def mutating(s, out, recipe, progress):
        with open(src / "tokenizer.json", "ab") as f:
            f.write(b" ")
        return CopyConverter()(s, out, recipe, progress)

    cache = Cache(tmp_path / "cache", budget_bytes="1G")
    with pytest.raises(SourceError, match="changed while it was converted.*tokenizer.json"):
        cache.get_or_convert(src, converter=mutating)
    assert os.listdir(tmp_path / "cache" / "entries") == []
    assert os.listdir(tmp_path / "cache" / "staging") == []


def test_second_finisher_does_not_clobber(tmp_path):
    """If two processes converted at once (no working locks), the first published entry stays."""
    src = write_source(tmp_path / "m")
    cache = Cache(tmp_path / "cache", budget_bytes="1G")
    key = cache.key_for(src)

    def racing(s, out, recipe, progress):
        # another process publishes the same key meanwhile
        other = tmp_path / "other"
        other.mkdir()
        CopyConverter()(s, other / CHECKPOINT_DIR, recipe, progress)
        (other / CHECKPOINT_DIR / "winner").write_text("first")
        (other / MANIFEST_NAME).write_text(json.dumps({"schema": 1}))
        os.rename(other, cache.entry_dir(key))
        CopyConverter()(s, out, recipe, progress)
        (out / "winner").write_text("second")

    entry = cache.get_or_convert(src, converter=racing)
    assert entry.key == key
    assert (entry.path / "winner").read_text() == "first"
    assert os.listdir(tmp_path / "cache" / "staging") == []


def test_converter_must_write_a_directory_of_regular_files(tmp_path):
    src = write_source(tmp_path / "m")
    cache = Cache(tmp_path / "cache", budget_bytes="1G")

    def nothing(s, out, recipe, progress):
        pass

    def symlinking(s, out, recipe, progress):
        out.mkdir()
        (out / "model.safetensors").symlink_to("/etc/passwd")

    for conv, msg in [(nothing, "did not create"), (symlinking, "not a regular file")]:
        with pytest.raises(Exception, match=msg):
            cache.get_or_convert(src, converter=conv)
        assert os.listdir(tmp_path / "cache" / "entries") == []
        assert os.listdir(tmp_path / "cache" / "staging") == []


def test_threads_single_flight_with_progress(tmp_path):
    src = write_source(tmp_path / "m")
    log = tmp_path / "log"
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter(log, delay=0.25, steps=5))
    results: list = []
    updates: dict[int, list[ConversionStatus]] = {i: [] for i in range(4)}

    def run(i):
        results.append(cache.get_or_convert(src, progress=updates[i].append, poll_interval=0.02))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    # another Cache object (as another process would) sees the conversion in flight
    seen = None
    deadline = time.time() + 10
    while time.time() < deadline and seen is None:
        st = Cache(tmp_path / "cache", budget_bytes="1G", cleanup=False).in_flight()
        if st and st[0].detail:
            seen = st[0]
        time.sleep(0.02)
    for t in threads:
        t.join(30)
    assert log.read_text().count("\n") == 1
    assert len({e.key for e in results}) == 1 and len({e.path for e in results}) == 1
    assert sorted(e.outcome for e in results) == ["converted", "waited", "waited", "waited"]
    assert seen is not None and seen.state == "converting" and seen.pid == os.getpid()
    assert seen.staging_dir.startswith(str(tmp_path / "cache" / "staging" / results[0].key))
    assert seen.detail["files_total"] == 4
    assert seen.estimate_bytes > 0
    converter_updates = [u for v in updates.values() for u in v if not u.waiting]
    waiter_updates = [u for v in updates.values() for u in v if u.waiting]
    assert converter_updates and waiter_updates
    assert all(u.key == results[0].key for u in converter_updates + waiter_updates)
    assert {u.state for u in converter_updates} >= {"converting", "publishing"}


def test_waiters_get_the_converters_failure(tmp_path):
    src = write_source(tmp_path / "m")
    started = threading.Event()

    def slow_fail(s, out, recipe, progress):
        started.set()
        time.sleep(0.5)
        raise MxFormatError("e4m3fn code 0x7F (NaN)", tensor="w")

    cache = Cache(tmp_path / "cache", budget_bytes="1G")
    errors: list[BaseException] = []

    def convert():
        try:
            cache.get_or_convert(src, converter=slow_fail)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=convert)
    t.start()
    assert started.wait(10)
    with pytest.raises(ConversionFailedError) as info:
        cache.get_or_convert(src, converter=CopyConverter(), poll_interval=0.02)
    t.join(10)
    assert info.value.error_type == "MxFormatError" and "0x7F" in str(info.value)
    assert isinstance(errors[0], MxFormatError)
    assert os.listdir(tmp_path / "cache" / "entries") == []


def test_wait_timeout(tmp_path):
    src = write_source(tmp_path / "m")
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter(delay=0.3))
    t = threading.Thread(target=cache.get_or_convert, args=(src,))
    t.start()
    deadline = time.time() + 10
    while not cache.in_flight() and time.time() < deadline:
        time.sleep(0.01)
    with pytest.raises(CacheTimeoutError, match="timed out"):
        cache.get_or_convert(src, timeout=0.2, poll_interval=0.02)
    t.join(10)
    assert cache.lookup(src) is not None


def test_staging_of_another_host_or_container_is_judged_by_its_lock(tmp_path):
    """A pid from another host/PID namespace means nothing here: its key's flock decides."""
    from transformd._durable import write_json_atomic
    from transformd.cache.lock import FileLock, process_identity

    src = write_source(tmp_path / "m")
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    key = cache.key_for(src)
    other = dict(process_identity(), host="another-node", pid=1)
    base = f"{key}.1.abcd"

    def plant():
        (cache.staging_dir / base / "checkpoint").mkdir(parents=True)
        status = {"key": key, "state": "converting", "estimate_bytes": 1, "owner": other}
        write_json_atomic(cache.staging_dir / f"{base}.json", status)

    plant()
    lock = FileLock(cache.locks_dir / f"{key}.lock")
    assert lock.try_acquire()  # its owner still converts (holds the lock)
    try:
        assert cache.cleanup().staging_removed == []
        assert [s.key for s in cache.in_flight()] == [key]
        assert cache.status(key).state == "converting" and cache.status(key).staging_dir.endswith(base)
    finally:
        lock.release()
    assert cache.in_flight() == []  # the lock is free: that process is gone
    assert cache.cleanup().staging_removed == [base]
    # the same, found by the process that takes the key over
    plant()
    entry = cache.get_or_convert(src)
    assert entry.outcome == "converted" and os.listdir(cache.staging_dir) == []


def test_status_temporaries_of_dead_processes_are_cleaned_up(tmp_path):
    """A process killed while it replaced its staging status leaves ".tmp.BASE.json.PID.HEX" (test_faults_crash
    found one after start-up cleanup): cleanup removes it with the rest of BASE, or alone, and keeps a live
    process' temporary."""
    import subprocess
    import sys

    from transformd.cache.lock import FileLock

    src = write_source(tmp_path / "m")
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    key = cache.key_for(src)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone, orphan, live = f"{key}.{dead.pid}.abcd", f"{key}.{dead.pid}.ef01", f"{key}.{os.getpid()}.9999"
    (cache.staging_dir / gone / "checkpoint").mkdir(parents=True)  # killed before its first status was in place
    temporaries = [f".tmp.{gone}.json.{dead.pid}.0123abcd", f".tmp.{orphan}.json.{dead.pid}.4567abcd",
                   f".tmp.{live}.json.{os.getpid()}.89abcdef"]
    for name in temporaries:
        (cache.staging_dir / name).write_text("{")
    lock = FileLock(cache.locks_dir / f"{key}.lock")
    assert lock.try_acquire()  # the live process converts that key
    try:
        assert sorted(cache.cleanup().staging_removed) == sorted([gone, orphan])
    finally:
        lock.release()
    assert os.listdir(cache.staging_dir) == temporaries[2:]


def test_get_lease(tmp_path):
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    entry = cache.get_or_convert(write_source(tmp_path / "m"))
    lease = cache.acquire_lease(entry.key, 30, pid=None, holder="client 10.0.0.7")
    assert cache.get_lease(entry.key, lease.id) == lease and lease.owner is None
    assert cache.get_lease(entry.key, "0" * 16) is None
    cache.release_lease(lease.id, entry.key)
    assert cache.get_lease(entry.key, lease.id) is None


def test_converter_leftovers_beside_the_checkpoint_are_not_published(tmp_path):
    src = write_source(tmp_path / "m")

    def messy(s, out, recipe, progress):
        (out.parent / ".checkpoint.tmp-123").mkdir()
        (out.parent / ".checkpoint.tmp-123" / "half.safetensors").write_bytes(b"x")
        return CopyConverter()(s, out, recipe, progress)

    cache = Cache(tmp_path / "cache", budget_bytes="1G")
    entry = cache.get_or_convert(src, converter=messy)
    assert sorted(os.listdir(entry.root)) == [CHECKPOINT_DIR, MANIFEST_NAME]


def test_other_users_pass_through_the_cache_but_list_nothing(tmp_path) -> None:
    """Every directory of the cache was 0755: any user of the node listed every entry (and so read every converted
    checkpoint, served by the daemon only to callers who could read its source) and read the stat cache, which
    names every source. entries/ and staging/ are 0711 now (an engine maps the paths the daemon gave it), the rest
    0700; a cache made before is mended when it is opened."""
    import shutil
    import subprocess
    import sys

    from .support.daemon import short_tempdir

    base = short_tempdir("tdmode-")
    try:
        os.chmod(base, 0o755)
        old = base / "cache"
        Cache(old)
        for d in old.iterdir():
            if d.is_dir():
                os.chmod(d, 0o755)  # the layout of before
        cache = Cache(old, converter=CopyConverter())
        entry = cache.get_or_convert(write_source(base / "src", seed=1))
        modes = {d.name: stat.S_IMODE(d.stat().st_mode) for d in cache.root.iterdir() if d.is_dir()}
        assert modes == {**{name: 0o700 for name in modes}, "entries": 0o711, "staging": 0o711}, modes
        assert set(modes) >= {"entries", "staging", "stat-cache", "locks", "leases", "failures"}
        if os.geteuid() != 0:
            return
        probe = (
            "import os, sys, json\nos.setgid(65534); os.setuid(65534)\nout = {}\n"
            "for p in sys.argv[1:]:\n"
            "    try:\n        out[p] = len(os.listdir(p)) if os.path.isdir(p) else len(open(p, 'rb').read())\n"
            "    except PermissionError:\n        out[p] = 'denied'\n"
            "print(json.dumps(out))"
        )
        paths = [cache.entries_dir, cache.root / "stat-cache", cache.locks_dir, entry.path,
                 next(p for p in entry.path.rglob("*") if p.is_file())]
        r = subprocess.run([sys.executable, "-c", probe, *map(str, paths)], capture_output=True, text=True, check=True)
        seen = json.loads(r.stdout)
        assert [seen[str(p)] for p in paths[:3]] == ["denied"] * 3, seen
        assert all(isinstance(seen[str(p)], int) and seen[str(p)] > 0 for p in paths[3:]), seen
    finally:
        shutil.rmtree(base, ignore_errors=True)
