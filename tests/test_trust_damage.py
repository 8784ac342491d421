"""Trust class 7: a damaged entry is detected without an explicit ``verify``, quarantined, and converted again.

Real daemon, real conversion; the entry's files are then damaged on disk (as root: they are 0444) and a new daemon
is started on the same cache (as after a restart):

* a truncated shard (size differs from the manifest): caught by the cheap size check on first serve; quarantined;
  the next POST converts again (before: ``/files`` answered 500 ``entry_corrupt`` on every call, forever);
* one flipped byte in a shard's data (same size, valid header): caught by the digest check that runs in the
  background on the first serve after the start; quarantined; the next POST converts again (before: served as
  ready forever).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from transformd.daemon.settings import Settings
from transformd.sample import write_sample_checkpoint

from .support.daemon import DaemonThread, short_tempdir, wait_ready

pytestmark = pytest.mark.timeout(240)

CATEGORY = "trust 7: damaged entries"
SHARD = "model-00002-of-00002.safetensors"


def _settings(run: Path, tmp: Path) -> Settings:
    return Settings(socket=run / "td.sock", cache_dir=tmp / "cache", allow_roots=[tmp / "models"], device="cpu",
                    log_level="critical")


def _convert(http: httpx.Client, src: Path) -> dict[str, Any]:
    r = http.post("/v1/checkpoints", json={"source": str(src)})
    assert r.status_code in (200, 202), r.text
    return wait_ready(http, r.json()["key"], timeout=120)


def _damage(path: Path, how: str) -> None:
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[: len(data) - 100]
    else:
        data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    os.chmod(path, 0o444)


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damage_is_quarantined_and_converted_again(tmp_path: Path, how: str, fault_log) -> None:
    src = write_sample_checkpoint(tmp_path / "models" / "m", layers=1, experts=2)
    run = short_tempdir("tdd-")
    try:
        with DaemonThread(_settings(run, tmp_path)) as daemon, daemon.client(timeout=60) as http:
            ready = _convert(http, src)
        key, entry = ready["key"], Path(ready["path"])
        good = (entry / SHARD).read_bytes()
        os.chmod(entry, 0o755)
        _damage(entry / SHARD, how)
        with DaemonThread(_settings(run, tmp_path)) as daemon, daemon.client(timeout=60) as http:
            deadline = time.monotonic() + 60
            codes = []
            while time.monotonic() < deadline:  # bounded: until the damage is noticed
                r = http.get(f"/v1/checkpoints/{key}/files")
                codes.append(r.status_code)
                if r.status_code == 404:
                    break
                time.sleep(0.2)
            assert codes[-1] == 404, codes[-10:]
            assert any(n.startswith(key) for n in os.listdir(tmp_path / "cache" / "quarantine"))
            again = _convert(http, src)  # converts anew
            assert again["key"] == key and again["state"] == "ready"
            assert (Path(again["path"]) / SHARD).read_bytes() == good
            assert http.get(f"/v1/checkpoints/{key}/files").status_code == 200
    finally:
        shutil.rmtree(run, ignore_errors=True)
    fault_log.record(CATEGORY, f"entry shard damaged on disk ({how}), daemon restarted", len(codes) + 1,
                     "noticed on first serve, quarantined; the next POST converts again")


@pytest.mark.parametrize("how", ["delete", "truncate"])
def test_damage_after_the_first_serve_is_noticed_on_the_next(tmp_path: Path, how: str, fault_log) -> None:
    """Once the daemon had answered for an entry it answered from memory: a shard deleted or truncated afterwards
    was never noticed (POST said ready, ``/files`` returned the remembered table with a path to nothing). Each hit
    now compares the files' size, inode and change time with those of the first serve: quarantined, converted again."""
    src = write_sample_checkpoint(tmp_path / "models" / "m", layers=1, experts=2)
    run = short_tempdir("tdd-")
    try:
        with DaemonThread(_settings(run, tmp_path)) as daemon, daemon.client(timeout=60) as http:
            ready = _convert(http, src)
            key, entry = ready["key"], Path(ready["path"])
            good = (entry / SHARD).read_bytes()
            assert http.get(f"/v1/checkpoints/{key}/files").status_code == 200  # served: remembered
            r = http.post("/v1/checkpoints", json={"source": str(src)})
            assert r.status_code == 200 and r.json()["state"] == "ready", r.text
            os.chmod(entry, 0o755)
            if how == "delete":
                os.unlink(entry / SHARD)
            else:
                os.truncate(entry / SHARD, 100)
            r = http.get(f"/v1/checkpoints/{key}/files")
            assert r.status_code == 404, r.text
            assert any(n.startswith(key) for n in os.listdir(tmp_path / "cache" / "quarantine"))
            r = http.post("/v1/checkpoints", json={"source": str(src)})
            assert r.status_code == 202, r.text  # converts anew, not "ready" from memory
            again = wait_ready(http, key, timeout=120)
            assert again["state"] == "ready"
            assert (Path(again["path"]) / SHARD).read_bytes() == good
    finally:
        shutil.rmtree(run, ignore_errors=True)
    fault_log.record(CATEGORY, f"a served entry's shard {how}d on disk while the daemon runs", 3,
                     "noticed on the next hit (size, inode, change time), quarantined; the next POST converts again")
