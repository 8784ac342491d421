"""Trust class 3: digests that names claim are hints; the bytes decide the key.

Against the real daemon (unix socket, real converter, real files):

* a forged hub snapshot: blobs named with the SHA-256 of a genuine model's shard but holding other bytes. Before,
  it got the genuine model's key without a byte being read, and its conversion was served to the next caller of
  the genuine model. Now its key is the key of its bytes;
* an ``hf download --local-dir`` record with a timestamp in the future: a weight changed in place kept its old
  key. Now the bytes are hashed and the key changes;
* a genuine snapshot still gets the hub id (verified once, remembered by stat signature), so a snapshot and a
  verified local-dir download of one revision share a key.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from transformd.sample import write_sample_checkpoint

from .support.daemon import Daemons

pytestmark = pytest.mark.timeout(180)

CATEGORY = "trust 3: trusted claims (hub blob names, local-dir etags)"
SHARD_B = "model-00002-of-00002.safetensors"


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hub_snapshot(repo: Path, files: dict[str, bytes], rev: str, names: dict[str, str] | None = None) -> Path:
    """A hub cache repo snapshot; ``names`` overrides the blob name of a file (a forged claim)."""
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for rel, data in files.items():
        blob = (names or {}).get(rel) or (
            hashlib.sha256(data).hexdigest() if rel.endswith(".safetensors") else _git_sha1(data)
        )
        (repo / "blobs" / blob).write_bytes(data)
        (snap / rel).symlink_to(Path("..", "..", "blobs", blob))
    return snap


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("trust-claims")
    allowed = base / "hub"
    allowed.mkdir()
    good = write_sample_checkpoint(base / "sample", layers=1, experts=2)
    files = {p.name: p.read_bytes() for p in good.iterdir() if p.is_file()}
    with Daemons() as daemons:
        daemon = daemons.start(cache_dir=base / "cache", allow_roots=[allowed], prefix="tdq-", log_level="critical")
        with daemon.client(timeout=60) as http:
            yield {"http": http, "allowed": allowed, "files": files}


def _key(world: dict[str, Any], src: Path) -> str:
    r = world["http"].post("/v1/checkpoints", json={"source": str(src)})
    assert r.status_code in (200, 202), r.text
    return r.json()["key"]


def _tamper(data: bytes) -> bytes:
    out = bytearray(data)
    out[-1] ^= 0x01  # the last byte of the data section: still a valid shard, other content
    return bytes(out)


def test_forged_blob_names_do_not_lend_a_genuine_key(world: dict[str, Any], fault_log) -> None:
    files = world["files"]
    genuine = hub_snapshot(world["allowed"] / "models--org--genuine", files, "a" * 40)
    forged_files = dict(files, **{SHARD_B: _tamper(files[SHARD_B])})
    claim = {SHARD_B: hashlib.sha256(files[SHARD_B]).hexdigest()}  # the genuine shard's digest as the blob name
    forged = hub_snapshot(world["allowed"] / "models--evil--forged", forged_files, "b" * 40, names=claim)
    forged_key = _key(world, forged)  # the attacker asks first
    genuine_key = _key(world, genuine)
    assert forged_key != genuine_key, "a forged blob name gave other bytes the genuine model's key"
    # a second revision of the genuine blobs is still the same content (the verified claim is the id)
    again = hub_snapshot(world["allowed"] / "models--org--genuine", files, "c" * 40)
    assert _key(world, again) == genuine_key
    fault_log.record(CATEGORY, "hub snapshot whose blob name claims a genuine shard's sha256, other bytes", 3,
                     "keyed by its bytes, not the claim; genuine revisions still share a key")


def test_a_future_download_timestamp_does_not_keep_an_old_key(world: dict[str, Any], fault_log) -> None:
    files = world["files"]
    local = world["allowed"] / "local"
    local.mkdir()
    for name, data in files.items():
        (local / name).write_bytes(data)
    meta = local / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    future = time.time() + 10 * 365 * 86400
    for name, data in files.items():
        etag = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else _git_sha1(data)
        (meta / f"{name}.metadata").write_text(f"{'c' * 40}\n{etag}\n{future}\n")
    before = _key(world, local)
    shard = local / SHARD_B
    shard.write_bytes(_tamper(files[SHARD_B]))  # changed in place; the record still claims the old digest
    os.utime(shard, (future - 5, future - 5))  # and an mtime below the record's timestamp
    after = _key(world, local)
    assert after != before, "a changed weight kept its old key because of a timestamp"
    fault_log.record(CATEGORY, "local-dir etag record with a future timestamp, weight changed in place", 2,
                     "the bytes are hashed: a new key")


def test_bytes_changed_under_a_memory_map_never_reach_another_users_copy(world: dict[str, Any], fault_log) -> None:
    """A write through a shared memory map whose pages are already dirty moves no timestamp: the stat cache keeps
    the content id of the bytes hashed before, and the next conversion of that source converts other bytes under
    that id. Before, its entry had the key of the genuine content, so the next caller of a genuine copy (another
    user's, who could not write the attacker's files) was served the attacker's weights. The key now names who
    could rewrite the source (keys.source_writers): the genuine copy gets a key, and a conversion, of its own."""
    import mmap
    import struct

    from transformd.checkpoint import convert_checkpoint

    from .support.daemon import wait_ready

    files, http = world["files"], world["http"]
    genuine, evil = world["allowed"] / "genuine-copy", world["allowed"] / "writable-copy"
    for src, mode in ((genuine, 0o644), (evil, 0o666)):  # the attacker's copy: others may write it
        src.mkdir()
        for name, data in files.items():
            (src / name).write_bytes(data)
            os.chmod(src / name, mode)
    shard = evil / SHARD_B
    data = files[SHARD_B]
    (n,) = struct.unpack("<Q", data[:8])
    start = 8 + n
    fd = os.open(shard, os.O_RDWR)
    try:
        with mmap.mmap(fd, len(data)) as mm:
            for off in range(start - start % mmap.PAGESIZE, len(data), mmap.PAGESIZE):
                mm[off] = mm[off]  # every page of the data dirty and writable, the same bytes
            time.sleep(2.2)  # past the stat cache's racy window: the id of these bytes is remembered
            first = _key(world, evil)
            assert wait_ready(http, first)["state"] == "ready"
            before = os.stat(shard)
            mm[start:] = b"\x7e" * (len(data) - start)  # no page fault: no timestamp moves
            after = os.stat(shard)
            if (before.st_mtime_ns, before.st_ctime_ns) != (after.st_mtime_ns, after.st_ctime_ns):
                pytest.skip("this kernel moved the timestamps (the pages were written back meanwhile)")
            r = http.post("/v1/checkpoints", json={"source": str(evil), "target": "fnuz"})
            poisoned = r.json()["key"]
            assert wait_ready(http, poisoned)["state"] == "ready"
    finally:
        os.close(fd)
    r = http.post("/v1/checkpoints", json={"source": str(genuine), "target": "fnuz"})
    assert r.status_code in (200, 202) and r.json()["key"] != poisoned, "the genuine copy got the attacker's entry"
    served = Path(wait_ready(http, r.json()["key"])["path"])
    clean = convert_checkpoint(world["allowed"] / "genuine-copy", world["allowed"].parent / "clean", target="fnuz",
                               device="cpu").out
    assert (served / SHARD_B).read_bytes() == (clean / SHARD_B).read_bytes()
    fault_log.record(CATEGORY, "bytes changed through a dirty shared memory map (no timestamp moves) after keying",
                     3, "the key names the source's writers: another's genuine copy is converted from its own bytes")
