"""Storage faults under the running daemon: disk full, the cache directory deleted or read-only, a corrupted entry,
eviction of a leased entry, and a reader that keeps its mapping of a removed entry.

The daemon is the real app under uvicorn on a unix socket with the real converter (in a thread of the test process,
so that a test can fill the disk at an exact moment of a conversion). Where the test may mount (root), the cache
lives on its own small tmpfs, so "disk full" and "read-only" are the kernel's ENOSPC and EROFS, reached by a noisy
neighbour filling the file system at a chosen moment and by ``mount -o remount,ro``; without mount permission the
disk-full cases inject ENOSPC instead (the read-only case is skipped).

Documented answers: a conversion that runs out of disk fails with 507 ``disk_full`` (the message names the cache
and the bytes needed; the staging directory is removed, every entry intact, the daemon serving; the next request
converts again once there is room); a request that cannot fit at all is 507 ``cache_full`` with nothing evicted; a
cache directory that is gone or read-only makes ``/healthz`` 503 ``degraded`` naming the problem and new
conversions fail with 503 ``cache_unavailable``, while ready entries are still served; once the directory is back
(recreated by the next conversion, or remounted read-write) everything works again. An entry that ``transformd
cache verify`` quarantined is never served again (404, absent from ``/v1/cache``; a POST converts afresh). A leased
entry is neither deleted (409) nor evicted by ``transformd cache gc``/``rm``; a reader that mapped its files keeps
valid bytes after it is removed.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors import safe_open

from transformd.client import TransformdClient, TransformdError
from transformd.daemon.shards import TransformdShardConverter
from transformd.cache import Cache
from transformd._durable import rmtree_force
from transformd.loader import load_from_daemon
from transformd.sample import write_sample_checkpoint

from .support.daemon import DaemonThread, Daemons, wait_ready
from .support.tmpfs import remount
from .support.entries import entry_dir

pytestmark = pytest.mark.timeout(90)

CATEGORY = "storage faults under the daemon"
TMPFS_BYTES = 16 << 20


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("storage-models")
    for i in range(3):
        write_sample_checkpoint(root / f"m{i}", layers=2, experts=4, seed=i)
    return root


@pytest.fixture
def disk(tmp_path: Path, mount_tmpfs: Callable[..., bool]) -> dict[str, Any]:
    """A small tmpfs (``mounted``) or a plain directory; ``cache`` is inside it."""
    mnt = tmp_path / "disk"
    mounted = mount_tmpfs(mnt, TMPFS_BYTES, "mode=0755")
    return {"mnt": mnt, "cache": mnt / "cache", "mounted": mounted}


@pytest.fixture
def start(daemons: Daemons) -> Callable[..., DaemonThread]:
    """``start(cache, models, converter=None, **settings)``: a daemon on ``cache`` that allows ``models``."""
    return lambda cache, models, converter=None, **kw: daemons.start(
        converter, cache_dir=cache, allow_roots=[models], prefix="tds-", log_level="critical", **kw
    )


def fill(mnt: Path, name: str = "filler") -> int:
    """Write into ``mnt`` until the file system is full (a noisy neighbour); returns the bytes written."""
    written = 0
    chunk = b"\xa5" * (1 << 20)
    with open(mnt / name, "ab", buffering=0) as f:
        while chunk:
            try:
                written += f.write(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                chunk = chunk[: len(chunk) // 2]
    return written


class FillingDuringConversion(TransformdShardConverter):
    """The real converter; ``trigger()`` runs at its first progress update (e.g. fills the disk)."""

    def __init__(self, trigger: Callable[[], None]):
        super().__init__("cpu")
        self.trigger = trigger
        self.fired = False

    def __call__(self, src, out, recipe, progress, *, shard_order=None):  # type: ignore[override]
        def first(update: Any) -> None:
            if not self.fired:
                self.fired = True
                self.trigger()
            progress(update)

        return super().__call__(src, out, recipe, first, shard_order=shard_order)


def _post(http: httpx.Client, src: Path) -> httpx.Response:
    return http.post("/v1/checkpoints", json={"source": str(src)})


def _resolve(http: httpx.Client, src: Path) -> dict[str, Any]:
    r = _post(http, src)
    assert r.status_code in (200, 202), r.text
    body = wait_ready(http, r.json()["key"]) if r.status_code == 202 else r.json()
    return body


def _entries_intact(cache: Path, keys: list[str]) -> None:
    results = Cache(cache, cleanup=False).verify(quarantine=False)
    assert sorted(r.key for r in results) == sorted(keys)
    assert all(r.ok for r in results), [r.problems for r in results]
    assert os.listdir(cache / "staging") == []


def test_disk_full_during_a_conversion_and_during_publish(start, disk: dict[str, Any], models: Path,
                                                          fault_log) -> None:
    mnt, cache = disk["mnt"], disk["cache"]

    def neighbour_fills() -> None:
        if disk["mounted"]:
            fill(mnt)
        else:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    converter = FillingDuringConversion(neighbour_fills)
    daemon = start(cache, models, converter=converter, cache_budget="12M")
    with daemon.client() as http:
        converter.fired = True  # the first conversion runs normally
        a = _resolve(http, models / "m0")
        assert a["state"] == "ready"

        # 1. the disk fills up while m1 converts
        converter.fired = False
        r = _post(http, models / "m1")
        assert r.status_code == 202, r.text
        failed = wait_ready(http, r.json()["key"])
        assert failed["state"] == "failed", failed
        err = failed["error"]
        assert err["status"] == 507 and err["code"] == "disk_full", err
        assert str(cache) in err["message"] and "ran out of disk space" in err["message"], err
        assert "every existing entry is intact" in err["message"]
        _entries_intact(cache, [a["key"]])
        assert http.get("/healthz").status_code == 200
        assert _post(http, models / "m0").status_code == 200  # still served
        # the disk is still full and the only entry is leased (cannot be evicted to make room): refused up front
        with (
            TransformdClient(socket=daemon.socket_path) as td,
            td.lease(a["key"], ttl_s=60, holder="engine"),
            pytest.raises(TransformdError) as info,  # ConversionFailedError carrying the daemon's 507
        ):
            td.resolve(models / "m1", poll_interval=0.05, timeout=30)
        assert info.value.status == 507 and info.value.code == "cache_full", repr(info.value)
        assert "leased" in info.value.message and "Nothing was evicted" in info.value.message, info.value.message
        _entries_intact(cache, [a["key"]])
        (mnt / "filler").unlink(missing_ok=True)
        b = _resolve(http, models / "m1")  # room again: the same request converts
        assert b["state"] == "ready"

        # 2. the disk fills up while m2 is being published (after its files are sealed, before the manifest)
        def publish_fill(phase: str) -> None:
            if phase == "sealed":
                neighbour_fills()

        daemon.daemon.cache._fault_hook = publish_fill
        r = _post(http, models / "m2")
        assert r.status_code == 202, r.text
        failed = wait_ready(http, r.json()["key"])
        daemon.daemon.cache._fault_hook = None
        assert failed["state"] == "failed" and failed["error"]["status"] == 507, failed
        assert failed["error"]["code"] == "disk_full" and str(cache) in failed["error"]["message"]
        _entries_intact(cache, [a["key"], b["key"]])
        assert http.get("/healthz").status_code == 200
        (mnt / "filler").unlink(missing_ok=True)
        c = _resolve(http, models / "m2")
        assert c["state"] == "ready"
        _entries_intact(cache, [a["key"], b["key"], c["key"]])
    how = "tmpfs filled by another writer" if disk["mounted"] else "injected ENOSPC"
    fault_log.record(CATEGORY, f"disk full during a conversion ({how})", 1,
                     "507 disk_full naming the cache; staging removed, entries intact, daemon serving; converts "
                     "once there is room")
    fault_log.record(CATEGORY, "request while the disk is still full and the other entry is leased", 1,
                     "507 cache_full at the reservation saying the other entry is leased, nothing evicted; resolve() raises "
                     "it (status 507, code cache_full)")
    fault_log.record(CATEGORY, f"disk full during publish (after sealing, before the manifest; {how})", 1,
                     "507 disk_full; nothing published, entries intact; converts once there is room")


def test_cache_directory_deleted_under_the_running_daemon(start, tmp_path: Path, models: Path, fault_log) -> None:
    cache = tmp_path / "cache"
    slow = threading.Event()

    class Slow(TransformdShardConverter):
        def __call__(self, src, out, recipe, progress, *, shard_order=None):  # type: ignore[override]
            def p(update: Any) -> None:
                if slow.is_set():
                    time.sleep(0.02)
                progress(update)

            return super().__call__(src, out, recipe, p, shard_order=shard_order)

    daemon = start(cache, models, converter=Slow("cpu"))
    with daemon.client() as http:
        a = _resolve(http, models / "m0")
        rmtree_force(cache)
        health = http.get("/healthz")
        assert health.status_code == 503 and health.json()["status"] == "degraded", health.text
        assert any("missing" in p for p in health.json()["problems"]), health.json()
        assert http.get(f"/v1/checkpoints/{a['key']}").status_code == 404
        assert http.get(f"/v1/checkpoints/{a['key']}/files").status_code == 404
        listing = http.get("/v1/cache")
        assert listing.status_code == 200 and listing.json()["entries"] == [], listing.text
        assert http.get("/metrics").status_code == 200
        again = _resolve(http, models / "m0")  # the next conversion recreates the directory
        assert again.get("state") == "ready" and again["key"] == a["key"], again
        assert http.get("/healthz").status_code == 200
        assert [e["key"] for e in http.get("/v1/cache").json()["entries"]] == [a["key"]]

        # deleted in the middle of a conversion
        slow.set()
        r = _post(http, models / "m1")
        assert r.status_code == 202
        key = r.json()["key"]
        for _ in range(500):
            if list((cache / "staging").glob("*.json")):
                break
            time.sleep(0.01)
        rmtree_force(cache)
        failed = wait_ready(http, key)
        slow.clear()
        assert failed["state"] == "failed", failed
        assert failed["error"]["status"] == 503 and failed["error"]["code"] == "cache_unavailable", failed
        assert "was removed while" in failed["error"]["message"], failed
        done = _resolve(http, models / "m1")
        assert done["state"] == "ready"
        _entries_intact(cache, [key])
        assert http.get("/healthz").status_code == 200
    fault_log.record(CATEGORY, "cache directory deleted under the running daemon (idle)", 1,
                     "healthz 503 degraded 'missing'; old key 404; next POST recreates it and converts; healthz 200")
    fault_log.record(CATEGORY, "cache directory deleted during a conversion", 1,
                     f"conversion failed ({failed['error']['status']} {failed['error']['code']}: "
                     "the cache directory was removed); next POST converts")


def test_cache_directory_made_read_only_under_the_running_daemon(start, disk: dict[str, Any], models: Path,
                                                                  fault_log) -> None:
    if not disk["mounted"]:
        pytest.skip("needs mount permission (a read-only remount of the cache's tmpfs)")
    mnt, cache = disk["mnt"], disk["cache"]
    daemon = start(cache, models)
    with daemon.client() as http:
        a = _resolve(http, models / "m0")
        remount(mnt, "ro")
        try:
            health = http.get("/healthz")
            assert health.status_code == 503 and health.json()["status"] == "degraded", health.text
            assert any("not writable" in p for p in health.json()["problems"]), health.json()
            # ready entries are still served
            assert _post(http, models / "m0").status_code == 200
            files = http.get(f"/v1/checkpoints/{a['key']}/files")
            assert files.status_code == 200 and files.json()["files"]
            assert http.get("/v1/cache").status_code == 200
            # a new conversion is refused with a clear error
            r = _post(http, models / "m1")
            if r.status_code == 202:
                body = wait_ready(http, r.json()["key"])
                assert body["state"] == "failed", body
                err = body["error"]
            else:
                err = r.json()["error"]
            assert err["status"] == 503 and err["code"] == "cache_unavailable", err
            assert "read-only" in err["message"] and str(cache) in err["message"], err
        finally:
            remount(mnt, "rw")
        assert http.get("/healthz").status_code == 200
        b = _resolve(http, models / "m1")
        assert b["state"] == "ready"
        _entries_intact(cache, [a["key"], b["key"]])
    fault_log.record(CATEGORY, "cache file system remounted read-only under the running daemon", 1,
                     f"healthz 503 degraded 'not writable'; ready entries still served; new conversion "
                     f"{err['status']} {err['code']} 'read-only'; works again after remount rw")


def _verify_cli(cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "transformd", "cache", "verify", "--cache-dir", str(cache), "--json"],
                          capture_output=True, text=True, timeout=60, check=False)


def test_a_corrupted_entry_is_never_served_after_verify(start, tmp_path: Path, models: Path, fault_log) -> None:
    cache = tmp_path / "cache"
    daemon = start(cache, models)
    with daemon.client() as http:
        a = _resolve(http, models / "m0")
        key = a["key"]
        listed = http.get(f"/v1/checkpoints/{key}/files").json()  # the daemon has read and remembered the entry
        shard = Path(listed["files"][-1]["path"])
        good = shard.read_bytes()
        with open(shard, "r+b") as f:  # one flipped byte in the data (root may write the 0444 file)
            f.seek(len(good) - 100)
            f.write(bytes([good[-100] ^ 0x01]))
        r = _verify_cli(cache)
        assert r.returncode == 1, r.stdout + r.stderr
        report = json.loads(r.stdout)
        assert [x["key"] for x in report if not x["ok"]] == [key]
        assert any(shard.name in p for p in report[0]["problems"]) and report[0]["quarantined_to"]
        bodies = [
            http.get(f"/v1/checkpoints/{key}"),
            http.get(f"/v1/checkpoints/{key}/files"),
            http.get(f"/v1/checkpoints/{key}/files/{shard.name}"),
        ]
        for b in bodies:
            assert b.status_code == 404, b.text
            assert "quarantine" not in b.text
        assert http.post(f"/v1/checkpoints/{key}/leases", json={}).status_code == 404
        assert [e["key"] for e in http.get("/v1/cache").json()["entries"]] == []
        again = _resolve(http, models / "m0")  # converts afresh
        assert again["key"] == key and "quarantine" not in again["path"]
        assert (Path(again["path"]) / shard.name).read_bytes() == good
        assert http.get(f"/v1/checkpoints/{key}/files").json()["files"][-1]["path"] == str(shard)
    assert _verify_cli(cache).returncode == 0
    fault_log.record(CATEGORY, "flipped byte in a served entry's shard, then `transformd cache verify`", 1,
                     "verify exits 1 and quarantines it; the daemon answers 404 (status, files, shard, lease), "
                     "/v1/cache omits it; the next POST converts afresh with the right bytes")


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _cli(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "transformd", "cache", *args, "--cache-dir", str(cache)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_leased_entries_are_not_removed_and_mapped_readers_keep_their_bytes(
    start, tmp_path: Path, models: Path, fault_log
) -> None:
    cache = tmp_path / "cache"
    daemon = start(cache, models)
    with daemon.client() as http, TransformdClient(socket=daemon.socket_path) as td:
        a = _resolve(http, models / "m0")
        key = a["key"]
        reference = {}
        for p in sorted(Path(a["path"]).glob("*.safetensors")):
            with safe_open(str(p), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    reference[name] = f.get_tensor(name).clone()
        with td.lease(key, ttl_s=120, holder="engine rank 0"):
            r = http.delete(f"/v1/checkpoints/{key}")
            assert r.status_code == 409 and r.json()["error"]["code"] == "entry_leased", r.text
            gc = _cli(cache, "gc", "--budget", "0")
            assert gc.returncode == 0 and "evicted 0 entries" in gc.stdout, gc.stdout + gc.stderr
            rm = _cli(cache, "rm", key)
            assert rm.returncode == 1 and "leased" in rm.stderr and "engine rank 0" in rm.stderr, rm.stderr
            assert http.get(f"/v1/checkpoints/{key}").json()["state"] == "ready"
            tensors = load_from_daemon(td, key)
        assert set(tensors) == set(reference)
        # the lease is gone: the entry can be removed while the engine still maps it
        assert http.delete(f"/v1/checkpoints/{key}").status_code == 204
        assert not entry_dir(cache, key).exists()
        for name, t in reference.items():
            assert tensors[name].dtype == t.dtype and _same_bytes(tensors[name], t), name
        # and once more through gc eviction
        b = _resolve(http, models / "m1")
        mapped = load_from_daemon(td, b["key"])
        copies = {n: t.clone() for n, t in mapped.items()}
        gc = _cli(cache, "gc", "--budget", "0")
        assert gc.returncode == 0 and f"evicted  {b['key']}" in gc.stdout, gc.stdout
        assert http.get(f"/v1/checkpoints/{b['key']}").status_code == 404
        for name, t in copies.items():
            assert _same_bytes(mapped[name], t), name
    fault_log.record(CATEGORY, "DELETE, `cache gc --budget 0` and `cache rm` of a leased entry", 3,
                     "409 entry_leased naming the holder / not evicted / rm exits 1 'leased'; entry still ready")
    fault_log.record(CATEGORY, "entry removed (DELETE, then gc eviction) while an engine maps its files (loader)", 2,
                     "the mapped tensors keep their exact bytes")
