"""The remote tier's library (transformd.remote) against a real S3 server: ``rclone serve s3`` on loopback
(tests/support/s3server.py), and against a shared directory (``file://``). No mock of S3.

Entries are real local cache entries (a :class:`Cache` with the copying fake converter), published by one cache
and fetched into the staging directory of another (a second node).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.fakes import CopyConverter, write_source
from tests.support.s3server import S3Server, s3_fixture, s3_server_fixture  # noqa: F401 (fixtures)
from transformd.cache import Cache
from transformd.cache.keys import Recipe
from transformd.cache.manifest import CHECKPOINT_DIR, MANIFEST_NAME
from transformd.remote import (
    Remote,
    RemoteConfigError,
    RemoteCorruptError,
    RemoteDeniedError,
    RemoteError,
    RemoteUnavailableError,
)
from transformd.remote import fetch as fetch_mod

REPO, COMMIT = "acme/tiny-mx", "0123456789abcdef0123456789abcdef01234567"


def _entry(tmp: Path, name: str = "node1", *, seed: int = 0, shard_bytes: int = 300_000):
    """A real local entry: a source converted by a cache of its own (one node)."""
    src = write_source(tmp / f"{name}-src", seed=seed, shard_bytes=shard_bytes)
    cache = Cache(tmp / f"{name}-cache", converter=CopyConverter())
    return cache.get_or_convert(src)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _objects(s3: S3Server) -> dict[str, bytes]:
    return _files(s3.root / s3.bucket)


@pytest.fixture(params=["s3", "file"])
def remote_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The tier as a bucket of the real S3 server, or as a shared directory."""
    if request.param == "file":
        (tmp_path / "shared").mkdir()
        return f"file://{tmp_path / 'shared'}"
    s3 = request.getfixturevalue("s3")
    return s3.url(f"t/{tmp_path.name}")


def test_publish_then_fetch_is_bit_identical(remote_url: str, tmp_path: Path) -> None:
    entry = _entry(tmp_path)
    remote = Remote.from_url(remote_url)
    assert remote.fetch(entry.key, tmp_path / "stage0") is False  # a miss before anything is published
    assert not (tmp_path / "stage0" / CHECKPOINT_DIR).exists()
    assert remote.publish(entry.key, entry.root) is True
    assert remote.has(entry.key)
    assert remote.publish(entry.key, entry.root) is False  # already there: not uploaded again
    seen = []
    second = Remote.from_url(remote_url)  # another node
    stage = tmp_path / "stage"
    assert second.fetch(entry.key, stage, seen.append) is True
    assert _files(stage / CHECKPOINT_DIR) == _files(entry.path)
    assert json.loads((stage / MANIFEST_NAME).read_text()) == entry.manifest.to_dict()
    assert seen and seen[-1].bytes_done == seen[-1].bytes_total == entry.manifest.total_bytes
    assert seen[-1].files_done == len(entry.manifest.files)
    assert all(not os.stat(p).st_mode & 0o222 for p in (stage / CHECKPOINT_DIR).rglob("*"))  # sealed, read-only
    # the caller's one-rename publish makes it an entry a cache serves and verifies
    cache2 = Cache(tmp_path / "node2-cache", converter=CopyConverter())
    os.rename(stage, cache2.entry_dir(entry.key))  # (entries/<key>-<tag>: cache.names)
    got = cache2.get(entry.key)
    assert got is not None and _files(got.path) == _files(entry.path)
    assert [r.ok for r in cache2.verify(entry.key)] == [True]


def test_before_sees_the_manifest_before_any_byte(remote_url: str, tmp_path: Path) -> None:
    """The caller makes room (or refuses) from the manifest's size before anything is downloaded."""
    entry = _entry(tmp_path)
    remote = Remote.from_url(remote_url)
    remote.publish(entry.key, entry.root)
    assert remote.manifest(entry.key).to_dict() == entry.manifest.to_dict()
    assert remote.manifest("0" * 32) is None

    def refuse(manifest) -> None:
        assert manifest.total_bytes == entry.manifest.total_bytes
        raise OSError(28, "no room for the entry")

    with pytest.raises(OSError, match="no room"):
        remote.fetch(entry.key, tmp_path / "stage", before=refuse)
    assert list((tmp_path / "stage").glob("*")) == []


def test_parallel_ranges_and_a_server_without_them(remote_url: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Files larger than a range are fetched in parallel ranges where the store answers them (a directory), and
    as one stream each where it does not (rclone answers a ranged GET with 200): bit-identical either way."""
    monkeypatch.setattr(fetch_mod, "RANGE_BYTES", 64 * 1024)
    entry = _entry(tmp_path, shard_bytes=1_000_000)
    remote = Remote.from_url(remote_url)
    remote.publish(entry.key, entry.root)
    reads: list[tuple[str, int, int]] = []
    read_range = remote.store.read_range

    def counted(name: str, start: int, end: int):
        reads.append((name, start, end))
        return read_range(name, start, end)

    monkeypatch.setattr(remote.store, "read_range", counted)
    assert remote.fetch(entry.key, tmp_path / "stage") is True
    assert _files(tmp_path / "stage" / CHECKPOINT_DIR) == _files(entry.path)
    if remote_url.startswith("file:"):
        assert len(reads) > 2 * 1_000_000 // (64 * 1024) and remote._ranges
    else:  # rclone answered the one-byte probe with the whole object (200): ranges off for this remote, one stream
        assert len(reads) == 1 and reads[0][1:] == (0, 1) and not remote._ranges
    assert remote.fetch(entry.key, tmp_path / "stage2") is True
    assert _files(tmp_path / "stage2" / CHECKPOINT_DIR) == _files(entry.path)


@pytest.mark.parametrize("order", ["in order", "reversed", "shuffled", "threads"])
def test_parts_hashed_in_file_order_whatever_order_they_arrive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               order: str) -> None:
    """The ranged download's hash (fetch._InOrderHash) is the BLAKE3 of the whole file whatever order its parts
    arrive in (one thread, or eight at once), and exactly one arrival (the one that completes it) gets it."""
    import random

    import blake3

    monkeypatch.setattr(fetch_mod, "RANGE_BYTES", 4096)
    data = os.urandom(37 * 4096 + 123)  # a short last part
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        starts = list(range(0, len(data), 4096))
        if order == "reversed":
            starts.reverse()
        elif order != "in order":
            random.Random(7).shuffle(starts)
        hashing = fetch_mod._InOrderHash(fd, len(data))
        part = lambda s: hashing.arrived(s, memoryview(data[s:s + 4096]))  # noqa: E731
        if order == "threads":
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(part, starts))
        else:
            got = [part(s) for s in starts]
    finally:
        os.close(fd)
    digests = [g for g in got if g is not None]
    assert digests == ["blake3:" + blake3.blake3(data).hexdigest()]
    assert hashing.hashed == len(data) and not hashing.waiting


def test_a_damaged_part_of_a_ranged_download_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One byte changed in the middle of a shard that is fetched in ranges (a shared directory answers them): the
    digest taken while the parts arrive differs from the manifest's; nothing is kept."""
    monkeypatch.setattr(fetch_mod, "RANGE_BYTES", 64 * 1024)
    entry = _entry(tmp_path, shard_bytes=1_000_000)
    (tmp_path / "shared").mkdir()
    remote = Remote.from_url(f"file://{tmp_path / 'shared'}")
    remote.publish(entry.key, entry.root)
    shard = max(entry.manifest.files, key=lambda r: r.size)
    obj = tmp_path / "shared" / "entries" / entry.key / CHECKPOINT_DIR / shard.name
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 1
    os.chmod(obj, 0o644)
    obj.write_bytes(bytes(data))
    stage = tmp_path / "stage"
    with pytest.raises(RemoteCorruptError, match="differs from the manifest") as info:
        Remote.from_url(f"file://{tmp_path / 'shared'}").fetch(entry.key, stage)
    assert shard.name in str(info.value)
    assert list(stage.iterdir()) == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove", "extend"])
def test_a_damaged_remote_file_is_an_error_and_nothing_is_kept(s3: S3Server, tmp_path: Path, damage: str) -> None:
    """An object of the entry replaced (through the S3 API) by other bytes, fewer, more, or removed."""
    import obstore

    entry = _entry(tmp_path)
    remote = Remote.from_url(s3.url(f"t/{tmp_path.name}"))
    remote.publish(entry.key, entry.root)
    shard = next(r.name for r in entry.manifest.files if r.name.endswith(".safetensors"))
    obj = f"entries/{entry.key}/{CHECKPOINT_DIR}/{shard}"
    data = (entry.path / shard).read_bytes()
    if damage == "remove":
        obstore.delete(remote.store._store, obj)
    else:
        damaged = {"flip": data[:1000] + bytes([data[1000] ^ 1]) + data[1001:], "truncate": data[: len(data) // 2],
                   "extend": data + b"\0"}[damage]
        remote.store.write_bytes(obj, damaged, create=False)
    stage = tmp_path / "stage"
    with pytest.raises(RemoteCorruptError) as info:
        Remote.from_url(s3.url(f"t/{tmp_path.name}")).fetch(entry.key, stage)
    assert shard in str(info.value) and "\n" not in str(info.value)
    if damage == "truncate":  # told as such, not as a digest that differs
        assert f"is {len(data) // 2} bytes, its manifest says {len(data)}" in str(info.value)
    assert list(stage.iterdir()) == []  # nothing unverified stays


def test_an_upload_killed_before_its_manifest_is_a_miss(s3: S3Server, tmp_path: Path) -> None:
    """A node killed (SIGKILL) after uploading every file and before the manifest: the files are in the bucket,
    the entry is not (a miss, never half an entry); a later publish completes it."""
    entry = _entry(tmp_path)
    url = s3.url(f"t/{tmp_path.name}")
    child = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from transformd.remote import Remote\n"
        "r = Remote.from_url(sys.argv[1])\n"
        "real = r.store.write_bytes\n"
        "def die(name, data, *, create):\n"
        "    if name.endswith('manifest.json'):\n"
        "        os.kill(os.getpid(), 9)\n"
        "    return real(name, data, create=create)\n"
        "r.store.write_bytes = die\n"
        "r.publish(sys.argv[2], Path(sys.argv[3]))\n"
    )
    p = subprocess.run([sys.executable, "-c", child, url, entry.key, str(entry.root)], capture_output=True, timeout=120)
    assert p.returncode == -9, p.stderr.decode()
    objects = _files(s3.object_path(f"t/{tmp_path.name}"))
    assert any(f"entries/{entry.key}/{CHECKPOINT_DIR}/" in n for n in objects)
    assert not any(n.endswith(f"{entry.key}/{MANIFEST_NAME}") for n in objects)
    remote = Remote.from_url(url)
    assert remote.has(entry.key) is False
    assert remote.fetch(entry.key, tmp_path / "stage") is False
    assert not (tmp_path / "stage" / CHECKPOINT_DIR).exists()
    assert remote.publish(entry.key, entry.root) is True
    assert remote.fetch(entry.key, tmp_path / "stage") is True


def test_server_down_is_a_bounded_wait_then_remote_error(s3: S3Server, tmp_path: Path) -> None:
    entry = _entry(tmp_path)
    remote = Remote.from_url(s3.url("t"), connect_timeout_s=1, read_timeout_s=1)
    s3.stop()
    t = time.monotonic()
    with pytest.raises(RemoteUnavailableError) as info:
        remote.fetch(entry.key, tmp_path / "stage")
    assert time.monotonic() - t < 60
    assert "\n" not in str(info.value) and s3.url("t") in str(info.value)
    with pytest.raises(RemoteUnavailableError):
        remote.publish(entry.key, entry.root)
    s3.start()


def test_a_server_that_never_answers_is_a_bounded_wait(s3: S3Server, tmp_path: Path) -> None:
    """Connections accepted, nothing answered (the server process stopped): the read timeout ends the wait."""
    entry = _entry(tmp_path)
    remote = Remote.from_url(s3.url("t"), connect_timeout_s=1, read_timeout_s=1)
    s3.pause()
    try:
        t = time.monotonic()
        with pytest.raises(RemoteUnavailableError):
            remote.fetch(entry.key, tmp_path / "stage")
        with pytest.raises(RemoteUnavailableError):
            remote.publish(entry.key, entry.root)
        with pytest.raises(RemoteUnavailableError):
            remote.lookup_alias(REPO, COMMIT)
        assert time.monotonic() - t < 90
    finally:
        s3.resume()
    assert list((tmp_path / "stage").glob("*")) == []


def test_a_write_over_a_slow_link_is_bounded_per_request_not_by_the_read_timeout(s3: S3Server, tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    """An upload whose bytes keep flowing over a slow link (here 1 MB/s, each shard's PUT about 1.5 s) completes
    under a read timeout shorter than it (1 s), and is bit-identical when read back; a write request is bounded by
    ``write_timeout_s`` (one part, or one small object), and one that outlasts it fails in one line. Before, the
    read timeout (and obstore's default 30 s request timeout) ended every write request that lasted longer,
    however fast its bytes went: a 32 MiB part had to be sent within 30 s."""
    from tests.support.s3server import SlowLink

    entry = _entry(tmp_path, shard_bytes=3 << 19)
    link = SlowLink(s3.port, 1e6)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", link.endpoint)
        url = s3.url(f"t/{tmp_path.name}")
        remote = Remote.from_url(url, read_timeout_s=1, write_timeout_s=60)
        t0 = time.monotonic()
        assert remote.publish(entry.key, entry.root) is True
        assert time.monotonic() - t0 > 1.0, "each shard's write outlasted the read timeout"
        assert remote.fetch(entry.key, tmp_path / "stage") is True
        assert _files(tmp_path / "stage" / CHECKPOINT_DIR) == _files(entry.path)
        other = _entry(tmp_path, "node2", seed=1, shard_bytes=3 << 19)
        with pytest.raises(RemoteUnavailableError) as info:
            Remote.from_url(url, read_timeout_s=1, write_timeout_s=0.5).publish(other.key, other.root)
        assert "\n" not in str(info.value) and url in str(info.value) and s3.secret_key not in str(info.value)
        assert not Remote.from_url(url).has(other.key)
    finally:
        link.close()


def test_a_read_is_bounded_by_progress_not_by_its_length(s3: S3Server, tmp_path: Path) -> None:
    """A file read as one stream (a server without ranges) lasts as long as the file takes: bytes that keep coming
    for longer than 30 s are read to the end (before: obstore's default request timeout, 30 s, cut the stream
    mid-file, and the node converted instead of downloading any shard that took longer)."""
    data = os.urandom(64 << 20)
    (tmp_path / "big").write_bytes(data)
    remote = Remote.from_url(s3.url(f"t/{tmp_path.name}"))
    remote.store.write_file("big", tmp_path / "big")
    t0, got = time.monotonic(), bytearray()
    for chunk in remote.store.read_stream("big"):
        got += chunk
        time.sleep(5.0)  # (a slow reader of 8 MiB chunks: the stream lasts about 40 s)
    took = time.monotonic() - t0
    assert len(got) == len(data) and took > 35, (len(got), took)
    assert bytes(got) == data, "the bytes of the object"


@pytest.mark.parametrize("which", ["secret", "key"])
def test_wrong_credentials_are_a_one_line_error(s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               which: str) -> None:
    entry = _entry(tmp_path)
    wrong = "0" * 40
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY" if which == "secret" else "AWS_ACCESS_KEY_ID", wrong)
    remote = Remote.from_url(s3.url(f"t/{tmp_path.name}"))
    for call in (lambda: remote.fetch(entry.key, tmp_path / "stage"), lambda: remote.publish(entry.key, entry.root)):
        with pytest.raises(RemoteDeniedError) as info:
            call()
        msg = str(info.value)
        assert "\n" not in msg and "access denied" in msg and s3.url(f"t/{tmp_path.name}") in msg
        assert wrong not in msg and s3.secret_key not in msg
    assert not (s3.object_path(f"t/{tmp_path.name}")).exists()  # nothing was written


def test_absent_credentials_are_a_one_line_error(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(RemoteDeniedError) as info:
        Remote.from_url(s3.url("t"))
    assert "\n" not in str(info.value) and "no credentials" in str(info.value)


def test_concurrent_publishes_of_one_key(remote_url: str, tmp_path: Path) -> None:
    """Two nodes that converted the same source publish at once, twice each: the entry in the tier is whole
    and fetches bit-identical; where the store honours If-None-Match (a directory: link) exactly one commits."""
    a, b = _entry(tmp_path, "a"), _entry(tmp_path, "b")
    assert a.key == b.key and a.manifest.to_dict() != b.manifest.to_dict()  # (own host/time fields)
    results: list[bool | BaseException] = []

    def go(entry) -> None:
        try:
            results.append(Remote.from_url(remote_url).publish(entry.key, entry.root))
        except BaseException as e:  # noqa: BLE001
            results.append(e)

    threads = [threading.Thread(target=go, args=(e,)) for e in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(r, bool) for r in results), results
    assert results.count(True) >= 1
    if remote_url.startswith("file:"):
        assert results.count(True) == 1
    stage = tmp_path / "stage"
    assert Remote.from_url(remote_url).fetch(a.key, stage) is True
    assert _files(stage / CHECKPOINT_DIR) == _files(a.path)
    assert json.loads((stage / MANIFEST_NAME).read_text()) in (a.manifest.to_dict(), b.manifest.to_dict())


def test_read_only_never_writes(s3: S3Server, tmp_path: Path) -> None:
    entry = _entry(tmp_path)
    url = s3.url(f"t/{tmp_path.name}")
    before = _objects(s3)  # (every test's objects)
    ro = Remote.from_url(url, read_only=True)
    assert ro.publish(entry.key, entry.root, alias=(REPO, COMMIT, Recipe())) is False
    assert ro.publish_alias(REPO, COMMIT, Recipe(), entry.key) is False
    assert _objects(s3) == before
    Remote.from_url(url).publish(entry.key, entry.root)
    assert ro.fetch(entry.key, tmp_path / "stage") is True


@pytest.mark.parametrize("name", ["../../evil.txt", "/etc/evil", "a/../../evil", "a//b", "./a", "a\\..\\b", "x\0y",
                                  "", "dup"])
def test_hostile_manifest_names_are_rejected(s3: S3Server, tmp_path: Path, name: str) -> None:
    entry = _entry(tmp_path)
    url = s3.url(f"t/{tmp_path.name}")
    remote = Remote.from_url(url)
    remote.publish(entry.key, entry.root)
    manifest = entry.manifest.to_dict()
    files = manifest["output"]["files"]
    if name == "dup":  # the same name twice, or a file that is also a directory
        files.append(dict(files[0]))
    else:
        files.append({"name": name, "size": 5, "digest": "blake3:" + "0" * 64})
    remote.store.write_bytes(f"entries/{entry.key}/{MANIFEST_NAME}", json.dumps(manifest).encode(), create=False)
    stage = tmp_path / "deep" / "er" / "stage"
    with pytest.raises(RemoteCorruptError, match="file name"):
        remote.fetch(entry.key, stage)
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "deep" / "evil.txt").exists()
    assert not stage.exists() or list(stage.iterdir()) == []


def test_file_that_is_also_a_directory_is_rejected(s3: S3Server, tmp_path: Path) -> None:
    entry = _entry(tmp_path)
    remote = Remote.from_url(s3.url(f"t/{tmp_path.name}"))
    manifest = entry.manifest.to_dict()
    first = manifest["output"]["files"][0]["name"]
    manifest["output"]["files"].append({"name": f"{first}/x", "size": 1, "digest": "blake3:" + "0" * 64})
    remote.store.write_bytes(f"entries/{entry.key}/{MANIFEST_NAME}", json.dumps(manifest).encode(), create=False)
    with pytest.raises(RemoteCorruptError, match="both a file and a directory"):
        remote.fetch(entry.key, tmp_path / "stage")


def test_a_manifest_of_another_key_is_rejected(s3: S3Server, tmp_path: Path) -> None:
    entry = _entry(tmp_path)
    remote = Remote.from_url(s3.url(f"t/{tmp_path.name}"))
    other = "f" * 32
    remote.store.write_bytes(f"entries/{other}/{MANIFEST_NAME}", (entry.root / MANIFEST_NAME).read_bytes(),
                             create=False)
    with pytest.raises(RemoteCorruptError, match="for key"):
        remote.fetch(other, tmp_path / "stage")
    for bad in ("../" + entry.key, entry.key.upper(), "x"):
        with pytest.raises(ValueError):
            remote.fetch(bad, tmp_path / "stage")


def test_alias_by_repo_id_and_commit(remote_url: str, tmp_path: Path) -> None:
    entry = _entry(tmp_path)
    remote = Remote.from_url(remote_url)
    assert remote.lookup_alias(REPO, COMMIT) is None
    remote.publish(entry.key, entry.root, alias=(REPO, COMMIT, Recipe()))
    other = Remote.from_url(remote_url)  # a node with no source: repo id and commit only
    assert other.lookup_alias(REPO, COMMIT, Recipe()) == entry.key
    assert other.lookup_alias(REPO, "f" * 40) is None
    assert other.lookup_alias(REPO, COMMIT, Recipe(target="ocp")) is None
    assert other.fetch(entry.key, tmp_path / "stage") is True
    with pytest.raises(RemoteConfigError):
        other.lookup_alias("../etc", COMMIT)
    with pytest.raises(RemoteConfigError):
        other.lookup_alias(REPO, "main")


def test_an_alias_record_that_says_something_else_is_rejected(s3: S3Server, tmp_path: Path) -> None:
    from transformd.remote import names

    remote = Remote.from_url(s3.url(f"t/{tmp_path.name}"))
    name = names.alias_name(REPO, COMMIT, Recipe())
    forged = {**names.alias_record("evil/other", COMMIT, Recipe()), "key": "a" * 32}
    remote.store.write_bytes(name, json.dumps(forged).encode(), create=False)
    with pytest.raises(RemoteCorruptError):
        remote.lookup_alias(REPO, COMMIT)
    remote.store.write_bytes(name, json.dumps({**forged, "repo_id": REPO, "key": "../x"}).encode(), create=False)
    with pytest.raises(RemoteCorruptError):
        remote.lookup_alias(REPO, COMMIT)


@pytest.mark.parametrize("url", ["http://x/y", "s3://", "s3://b/../c", "s3://b?x=1", "file://host/x", "file:rel",
                                 "", "s3://user@b/p"])
def test_bad_urls(url: str) -> None:
    with pytest.raises(RemoteConfigError):
        Remote.from_url(url)


def test_remote_errors_are_cache_errors() -> None:
    from transformd.errors import CacheError

    assert issubclass(RemoteError, CacheError)
    assert issubclass(RemoteConfigError, ValueError)
