"""The remote tier in the request's route (transformd.request, ``serve --remote``, ``convert --remote``), against a
real S3 server on loopback (``rclone serve s3``, tests/support/s3server.py): no mock of S3.

Two daemons with caches of their own are two nodes. The first converts and uploads in the background; the second,
with an empty cache, downloads the entry instead of converting it (bit-identical), also by a repo id and commit it
has no snapshot of (the alias record the first wrote). A tier that is down or does not answer costs a bounded wait,
and the request converts locally; the failure is counted.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from transformd import cli
from transformd.sample import write_sample_checkpoint

from .support.daemon import Daemons, wait_ready
from .support.entries import entry_dir
from .support.s3server import S3Server, s3_fixture, s3_server_fixture  # noqa: F401 - fixtures
from .test_hub import add_snapshot

pytestmark = pytest.mark.timeout(240)

REPO_ID = "org/Model"
COMMIT = "c" * 40


def _files(checkpoint: Path) -> dict[str, bytes]:
    return {p.relative_to(checkpoint).as_posix(): p.read_bytes() for p in sorted(checkpoint.rglob("*")) if p.is_file()}


def _resolve(daemon, body: dict) -> dict:
    with daemon.client() as http:
        r = http.post("/v1/checkpoints", json=body)
        assert r.status_code in (200, 202), r.text
        answer = r.json()
        return wait_ready(http, answer["key"], timeout=120) if r.status_code == 202 else answer


def _remote(daemon) -> dict:
    with daemon.client() as http:
        return http.get("/v1/cache").json()["remote"]


def _metric(daemon, line_start: str) -> float:
    with daemon.client() as http:
        text = http.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def _uploaded(daemon, n: int = 1, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while (remote := _remote(daemon))["uploads"] < n:
        assert remote["upload_failures"] == 0 and time.monotonic() < deadline, remote
        time.sleep(0.1)
    return remote


def test_a_second_node_downloads_what_the_first_converted(s3: S3Server, daemons: Daemons, tmp_path: Path) -> None:
    """Node A converts (its answer comes before the upload ends) and uploads the entry; node B, with a cache of its
    own, resolves the same content (a copy at another path) and gets A's files from the tier, converting nothing."""
    models = tmp_path / "models"
    src = write_sample_checkpoint(models / "a" / "m", layers=1, experts=2, shards=2)
    copy = write_sample_checkpoint(models / "b" / "m", layers=1, experts=2, shards=2)  # the same bytes elsewhere
    url = s3.url("second-node")
    a = daemons.start(cache_dir=tmp_path / "cache-a", allow_roots=[models], remote=url)
    first = _resolve(a, {"source": str(src), "target": "ocp"})
    assert first["state"] == "ready"
    _uploaded(a)
    b = daemons.start(cache_dir=tmp_path / "cache-b", allow_roots=[models], remote=url)
    second = _resolve(b, {"source": str(copy), "target": "ocp"})
    assert second["key"] == first["key"] and second["path"] != first["path"]
    assert _files(Path(second["path"])) == _files(Path(first["path"])), "bit-identical to the conversion"
    remote = _remote(b)
    assert remote["hits"] == 1 and remote["bytes"] > 0 and remote["failures"] == 0, remote
    assert _metric(b, 'transformd_conversions_total{outcome="converted"}') == 0
    assert _metric(b, 'transformd_conversions_total{outcome="fetched"}') == 1
    assert _metric(b, 'transformd_remote_total{event="hits"}') == 1
    # a third node that may only read the tier downloads too, and uploads nothing it converts
    c = daemons.start(cache_dir=tmp_path / "cache-c", allow_roots=[models], remote=url, remote_read_only=True)
    other = write_sample_checkpoint(models / "c" / "m", layers=1, experts=2, shards=1, seed=3)
    assert _resolve(c, {"source": str(copy), "target": "ocp"})["key"] == first["key"]
    _resolve(c, {"source": str(other), "target": "ocp"})
    time.sleep(0.5)
    remote = _remote(c)
    assert remote["read_only"] and remote["hits"] == 1 and remote["misses"] == 1 and remote["uploads"] == 0, remote


def test_a_node_without_the_snapshot_finds_the_entry_by_repo_id_and_commit(s3: S3Server, daemons: Daemons,
                                                                             tmp_path: Path, monkeypatch,
                                                                             capsys) -> None:
    """Node A converts org/Model at a commit from its hub cache and records the alias with the entry; node B has no
    snapshot of it (an empty hub cache) and ``convert org/Model --revision COMMIT --remote`` downloads A's entry."""
    models = tmp_path / "models"
    add_snapshot(models / "hub", REPO_ID, COMMIT,
                 write_sample_checkpoint(tmp_path / "work" / "m", layers=1, experts=2, shards=1), ("main",))
    url = s3.url("alias")
    a = daemons.start(cache_dir=tmp_path / "cache-a", allow_roots=[models], hub_cache=models / "hub", remote=url)
    first = _resolve(a, {"source": REPO_ID, "revision": COMMIT, "target": "ocp"})
    _uploaded(a)
    (tmp_path / "empty-hub").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    code = cli.main(["convert", REPO_ID, "--revision", COMMIT, "--target", "ocp", "--cache-dir",
                     str(tmp_path / "cache-b"), "--remote", url, "--no-daemon", "--device", "cpu"])
    assert code == 0
    entry = entry_dir(tmp_path / "cache-b", first["key"]) / "checkpoint"
    assert _files(entry) == _files(Path(first["path"]))
    assert "downloaded from the remote tier" in capsys.readouterr().err
    # a daemon with an empty hub cache (its callers may search it) answers the same request from the tier
    (tmp_path / "models-b" / "hub").mkdir(parents=True)
    b = daemons.start(cache_dir=tmp_path / "cache-c", allow_roots=[tmp_path / "models-b"],
                      hub_cache=tmp_path / "models-b" / "hub", remote=url)
    served = _resolve(b, {"source": REPO_ID, "revision": COMMIT, "target": "ocp"})
    assert served["key"] == first["key"] and _files(Path(served["path"])) == _files(Path(first["path"]))
    assert _remote(b)["hits"] == 1 and _metric(b, 'transformd_conversions_total{outcome="fetched"}') == 1
    with b.client() as http:  # its files are served to the caller who asked; an unknown commit is the hub's 404
        assert http.get(f"/v1/checkpoints/{first['key']}/files").status_code == 200
        r = http.post("/v1/checkpoints", json={"source": REPO_ID, "revision": "e" * 40, "target": "ocp"})
    assert r.status_code == 404 and r.json()["error"]["code"] in ("repo_not_cached", "revision_not_cached"), r.text
    # without the tier's record (another commit), the hub's own error is said
    code = cli.main(["convert", REPO_ID, "--revision", "d" * 40, "--target", "ocp", "--cache-dir",
                     str(tmp_path / "cache-b"), "--remote", url, "--no-daemon", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code != 0 and "is not in the Hugging Face hub cache" in err, err


def test_a_repo_id_new_to_the_tier_is_converted_while_it_is_hashed(s3: S3Server, daemons: Daemons,
                                                                  tmp_path: Path) -> None:
    """The first node, a repo id at a commit whose snapshot is large and new to it: the tier holds no alias record of
    it, so the node converts it while hashing it (each file read once, as without a tier: before, a tier made it hash
    the source first, 1.63x the answer without a tier for 16 GiB on the H100 server) and uploads the entry with the
    record. A second node with the same snapshot, which the tier now has a record of, hashes it first and
    downloads the entry (nothing converted); a third without the snapshot finds it by the record."""
    import json

    from transformd.cache.keys import Recipe
    from transformd.remote import Remote

    models, work = tmp_path / "models", tmp_path / "work"
    src = write_sample_checkpoint(work / "m", layers=1, experts=2, shards=2)
    for f in src.iterdir():  # (settled: older than the stat cache's racy window)
        os.utime(f, (f.stat().st_atime - 60, f.stat().st_mtime - 60))
    add_snapshot(models / "hub", REPO_ID, COMMIT, src, ("main",))
    url = s3.url("alias-first")
    body = {"source": REPO_ID, "revision": COMMIT, "target": "ocp"}
    a = daemons.start(cache_dir=tmp_path / "cache-a", allow_roots=[models], hub_cache=models / "hub", remote=url)
    a.daemon.cache.hash_alongside_min_bytes = 0  # (the sample is small: the path a large source takes)
    first = _resolve(a, body)
    timings = json.loads((Path(first["path"]).parent / "manifest.json").read_text())["timings"]
    assert "hash_alongside" in timings, "converted while hashed, not hashed first"
    _uploaded(a)
    assert _remote(a)["misses"] == 1, _remote(a)
    recipe = Recipe.from_dict(first["recipe"])
    assert Remote.from_url(url).lookup_alias(REPO_ID, COMMIT, recipe) == first["key"], "uploaded with its record"
    b = daemons.start(cache_dir=tmp_path / "cache-b", allow_roots=[models], hub_cache=models / "hub", remote=url)
    b.daemon.cache.hash_alongside_min_bytes = 0
    second = _resolve(b, body)
    assert second["key"] == first["key"] and _files(Path(second["path"])) == _files(Path(first["path"]))
    assert _remote(b)["hits"] == 1 and _metric(b, 'transformd_conversions_total{outcome="converted"}') == 0
    (tmp_path / "models-c" / "hub").mkdir(parents=True)
    c = daemons.start(cache_dir=tmp_path / "cache-c", allow_roots=[tmp_path / "models-c"],
                      hub_cache=tmp_path / "models-c" / "hub", remote=url)
    assert _resolve(c, body)["key"] == first["key"]


def test_convert_of_a_repo_id_records_its_alias_and_hashes_it_as_it_converts(s3: S3Server, tmp_path: Path,
                                                                             monkeypatch, capsys) -> None:
    """``convert org/Model --revision COMMIT --remote`` on the first node: converted while hashed (as the daemon
    does), and uploaded with the alias record, so a node without the snapshot finds it (the CLI recorded none)."""
    import json

    from transformd import cache as cache_module
    from transformd.cache.keys import Recipe
    from transformd.remote import Remote

    models = tmp_path / "models"
    src = write_sample_checkpoint(tmp_path / "work" / "m", layers=1, experts=2, shards=2)
    for f in src.iterdir():
        os.utime(f, (f.stat().st_atime - 60, f.stat().st_mtime - 60))
    add_snapshot(models / "hub", REPO_ID, COMMIT, src, ("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(models / "hub"))
    monkeypatch.setattr(cache_module, "Cache", type("Cache", (cache_module.Cache,), {"hash_alongside_min_bytes": 0}))
    url = s3.url("cli-alias")
    code = cli.main(["convert", REPO_ID, "--revision", COMMIT, "--target", "ocp", "--cache-dir",
                     str(tmp_path / "cache-a"), "--remote", url, "--no-daemon", "--device", "cpu"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0, out
    entry = Path(out[-1]).parent
    manifest = json.loads((entry / "manifest.json").read_text())
    assert "hash_alongside" in manifest["timings"], manifest["timings"]
    recipe = Recipe.from_dict(manifest["recipe"])
    assert Remote.from_url(url).lookup_alias(REPO_ID, COMMIT, recipe) == manifest["key"]


@pytest.mark.parametrize("how", ["down", "silent", "denied"])
def test_a_tier_down_silent_or_denied_falls_back_to_a_local_conversion(s3: S3Server, daemons: Daemons,
                                                                       tmp_path: Path, monkeypatch, caplog,
                                                                       how: str) -> None:
    """The server stopped (connections refused), stopped answering (SIGSTOP: connections accepted, never answered),
    or refusing this node's credentials: the request converts locally after a bounded wait, the failure is counted,
    and its cause is one log line, said once for the two requests (without the secret). After a tier that did not
    answer, the next request is not made to wait for it again (the tier is held off for a while)."""
    models = tmp_path / "models"
    sources = [write_sample_checkpoint(models / f"m{i}", layers=1, experts=2, shards=1, seed=i) for i in range(2)]
    if how == "denied":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + s3.secret_key)
    d = daemons.start(cache_dir=tmp_path / "cache", allow_roots=[models], remote=s3.url(f"fallback-{how}"))
    if how != "denied":
        (s3.stop if how == "down" else s3.pause)()
    caplog.set_level("DEBUG", logger="transformd.remote")
    took, bodies = [], []
    try:
        for src in sources:
            t0 = time.monotonic()
            bodies.append(_resolve(d, {"source": str(src), "target": "ocp"}))
            took.append(time.monotonic() - t0)
    finally:
        s3.resume()
        if s3.proc is None:
            s3.start()
    assert [b["state"] for b in bodies] == ["ready"] * 2 and took[0] < 100, took
    if how != "denied":  # (a denial is an answer: asked again, said once)
        assert took[1] < 20, took
    assert _metric(d, 'transformd_conversions_total{outcome="converted"}') == 2
    remote = _remote(d)
    assert remote["failures"] == 2 and remote["hits"] == 0, remote
    said = [r for r in caplog.records if r.name == "transformd.remote" and "download failed" in r.getMessage()]
    levels = ["WARNING", "DEBUG"] if how == "denied" else ["WARNING"]
    assert [r.levelname for r in said] == levels, [(r.levelname, r.getMessage()) for r in said]
    assert "\n" not in said[0].getMessage() and s3.secret_key not in caplog.text


def test_a_silent_tier_holds_up_one_repo_id_alias_lookup_not_each(s3: S3Server, daemons: Daemons,
                                                                   tmp_path: Path) -> None:
    """Repo ids new to the node are looked up by their alias record before they are converted: a tier that does not
    answer (SIGSTOP) costs the first request a short bounded wait (hub_sources.ALIAS_WAIT_S, well inside a client's
    30 s request timeout: the POST was answered after the tier's 30 s read timeout, a client's timeout), and the next
    request is not made to wait again (the tier is held off); both convert while hashed."""
    import json

    models, work = tmp_path / "models", tmp_path / "work"
    commits = ["a" * 40, "b" * 40]
    for i, commit in enumerate(commits):
        src = write_sample_checkpoint(work / f"m{i}", layers=1, experts=2, shards=1, seed=i)
        for f in src.iterdir():
            os.utime(f, (f.stat().st_atime - 60, f.stat().st_mtime - 60))
        add_snapshot(models / "hub", REPO_ID, commit, src)
    d = daemons.start(cache_dir=tmp_path / "cache", allow_roots=[models], hub_cache=models / "hub",
                      remote=s3.url("silent-alias"))
    d.daemon.cache.hash_alongside_min_bytes = 0
    s3.pause()
    took, bodies = [], []
    try:
        for commit in commits:
            t0 = time.monotonic()
            bodies.append(_resolve(d, {"source": REPO_ID, "revision": commit, "target": "ocp"}))
            took.append(time.monotonic() - t0)
    finally:
        s3.resume()
    assert [b["state"] for b in bodies] == ["ready"] * 2 and took[0] < 20 and took[1] < took[0], took
    assert _remote(d)["failures"] >= 1
    for b in bodies:
        assert "hash_alongside" in json.loads((Path(b["path"]).parent / "manifest.json").read_text())["timings"]
    assert _metric(d, 'transformd_conversions_total{outcome="converted"}') == 2


def test_a_silent_tier_answers_a_repo_id_not_here_with_the_hubs_error_in_time(s3: S3Server, daemons: Daemons,
                                                                             tmp_path: Path) -> None:
    """A node without the snapshot asks the tier's alias record; a tier that does not answer (SIGSTOP) gives the
    hub's own 404 (as without a tier) after a short bounded wait, within a client's 30 s request timeout (the POST
    waited for the tier's 30 s read timeout), and the next request is answered at once (the tier is held off)."""
    (tmp_path / "models" / "hub").mkdir(parents=True)
    d = daemons.start(cache_dir=tmp_path / "cache", allow_roots=[tmp_path / "models"],
                      hub_cache=tmp_path / "models" / "hub", remote=s3.url("silent-no-snapshot"))
    s3.pause()
    took, answers = [], []
    try:
        with d.client(timeout=60) as http:
            for _ in range(2):
                t0 = time.monotonic()
                answers.append(http.post("/v1/checkpoints", json={"source": REPO_ID, "revision": COMMIT,
                                                                  "target": "ocp"}))
                took.append(time.monotonic() - t0)
    finally:
        s3.resume()
    assert [r.status_code for r in answers] == [404, 404], [r.text for r in answers]
    assert answers[0].json()["error"]["code"] in ("repo_not_cached", "revision_not_cached"), answers[0].text
    assert took[0] < 20 and took[1] < 2, took


def test_a_corrupt_file_in_the_tier_is_never_published_and_the_node_converts(s3: S3Server, daemons: Daemons,
                                                                             tmp_path: Path) -> None:
    """A shard of the tier's entry changed in the bucket (same size, other bytes): the second node's download fails
    its digest check, nothing of it is published, the node converts locally (the same bytes as the first node's)
    and counts a verification failure."""
    models = tmp_path / "models"
    src = write_sample_checkpoint(models / "m", layers=1, experts=2, shards=1)
    url = s3.url("corrupt")
    a = daemons.start(cache_dir=tmp_path / "cache-a", allow_roots=[models], remote=url)
    first = _resolve(a, {"source": str(src), "target": "ocp"})
    _uploaded(a)
    (shard,) = Path(first["path"]).glob("*.safetensors")
    damaged = s3.object_path(f"corrupt/entries/{first['key']}/checkpoint/{shard.name}")
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    b = daemons.start(cache_dir=tmp_path / "cache-b", allow_roots=[models], remote=url)
    second = _resolve(b, {"source": str(src), "target": "ocp"})
    assert _files(Path(second["path"])) == _files(Path(first["path"])), "converted here, not the damaged download"
    remote = _remote(b)
    assert remote["verification_failures"] == 1 and remote["failures"] == 1 and remote["hits"] == 0, remote
    assert _metric(b, 'transformd_conversions_total{outcome="converted"}') == 1
    assert not list((tmp_path / "cache-b" / "staging").iterdir()), "nothing of the download left in staging"


def test_a_download_shows_as_a_conversion_does(tmp_path: Path) -> None:
    """While a download fills its staging directory, the job's progress (bytes, rate, ETA) and another process's
    view of the cache's status files say ``downloading``; a miss leaves nothing in staging."""
    from transformd.cache import Cache, Recipe
    from transformd.cache.fetched import get_or_fetch
    from transformd.daemon.service import Job
    from transformd.daemon.views import foreign_view

    cache = Cache(tmp_path / "cache")
    key = "0123456789abcdef0123456789abcdef"
    job = Job(key, tmp_path, Recipe(target="ocp"))
    job.start()
    seen: list[dict] = []

    def fill(stage: Path, report, reserve) -> bool:
        reserve(16 << 20)
        for done in (0, 4 << 20, 8 << 20):
            report({"bytes_done": done, "bytes_total": 16 << 20})
            time.sleep(0.15)  # (a rate needs 0.2 s of samples)
        seen.append(foreign_view(cache.status(key)))
        return False  # a miss

    assert get_or_fetch(cache, key, fill, source="s3://bucket/x (models/m)", progress=job.on_status) is None
    progress = job.progress.as_dict()
    assert progress["phase"] == "downloading" and progress["bytes_done"] == 8 << 20, progress
    assert progress["bytes_total"] == 16 << 20 and progress["eta_s"] is not None, progress
    assert seen[0]["state"] == "converting" and seen[0]["progress"]["phase"] == "downloading", seen
    assert not list(cache.staging_dir.iterdir()) and cache.get(key) is None


def test_convert_into_the_cache_downloads_or_uploads_through_the_tier(s3: S3Server, tmp_path: Path, capsys) -> None:
    """``convert --cache-dir --remote``: a first node's conversion is in the tier when the command has ended (it
    printed DIR first); a second node (another cache) downloads it, bit-identical, converting nothing."""
    from transformd.remote import Remote

    src = write_sample_checkpoint(tmp_path / "models" / "m", layers=1, experts=2, shards=2)
    url = s3.url("cli")
    argv = ["convert", str(src), "--target", "ocp", "--remote", url, "--no-daemon", "--device", "cpu"]
    assert cli.main([*argv, "--cache-dir", str(tmp_path / "cache-a")]) == 0
    first = Path(capsys.readouterr().out.splitlines()[-1])
    assert Remote.from_url(url).has(first.parent.name.partition("-")[0]), "uploaded before the command ended"
    assert cli.main([*argv, "--cache-dir", str(tmp_path / "cache-b")]) == 0
    out, err = capsys.readouterr()
    second = Path(out.splitlines()[-1])
    assert "downloaded from the remote tier" in err.splitlines()[-1], err
    assert second != first and _files(second) == _files(first)


def test_an_entry_the_cache_cannot_hold_is_refused_before_its_download(s3: S3Server, daemons: Daemons,
                                                                       tmp_path: Path) -> None:
    """Room is made from the tier's manifest before the first byte comes: a cache whose budget cannot hold the
    entry raises CacheFullError (the request's 507, as for a conversion) with nothing downloaded or left."""
    from transformd.cache import Cache, CacheFullError
    from transformd.request import Tier

    models = tmp_path / "models"
    src = write_sample_checkpoint(models / "m", layers=1, experts=2, shards=1)
    url = s3.url("full")
    a = daemons.start(cache_dir=tmp_path / "cache-a", allow_roots=[models], remote=url)
    key = _resolve(a, {"source": str(src), "target": "ocp"})["key"]
    _uploaded(a)
    small = Cache(tmp_path / "small", budget_bytes="256K")
    tier = Tier.from_url(url)
    with pytest.raises(CacheFullError, match="cannot hold"):
        tier.fetch(small, key, source=str(src))
    assert not list(small.staging_dir.iterdir()) and small.get(key) is None
    assert tier.counts["failures"] == 0 and tier.counts["hits"] == 0, tier.counts


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_serve_read_only_without_a_remote_is_refused_at_start(tmp_path: Path, monkeypatch, how: str) -> None:
    """``serve --remote-read-only`` (or ``TRANSFORMD_REMOTE_READ_ONLY=1``) with no remote named anywhere: one line
    naming the setting and what it needs, exit 2, nothing listening (before: the daemon started without a tier, the
    setting silently ignored)."""
    import os
    import subprocess
    import sys

    (tmp_path / "models").mkdir()
    sock = tmp_path / "td.sock"
    argv = [sys.executable, "-m", "transformd", "serve", "--socket", str(sock), "--cache-dir", str(tmp_path / "cache"),
            "--allow-root", str(tmp_path / "models"), "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMD_")}
    if how == "flag":
        argv.append("--remote-read-only")
    else:
        env["TRANSFORMD_REMOTE_READ_ONLY"] = "1"
    if how == "environment":
        env["TRANSFORMD_REMOTE"] = ""  # (set and empty: no remote either)
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = child.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        child.kill()
        _, err = child.communicate()
        pytest.fail(f"the daemon started without a remote tier: {err}")
    assert child.returncode == 2, err
    assert err.splitlines() == ["transformd: error: --remote-read-only (TRANSFORMD_REMOTE_READ_ONLY) needs a remote "
                                "tier: pass --remote s3://BUCKET[/PREFIX] (or TRANSFORMD_REMOTE), or drop it"], err
    assert not sock.exists()


def _published_alias(s3: S3Server, tmp_path: Path, prefix: str):
    """A real entry (the copying fake converter) published to the tier with an alias record of org/Model@COMMIT;
    returns the tier's URL, the entry and the alias's recipe."""
    from tests.support.fakes import CopyConverter, write_source
    from transformd.cache import Cache, Recipe
    from transformd.remote import Remote

    entry = Cache(tmp_path / "node-a", converter=CopyConverter()).get_or_convert(write_source(tmp_path / "src"))
    url = s3.url(prefix)
    recipe = Recipe()
    assert Remote.from_url(url).publish(entry.key, entry.root, (REPO_ID, COMMIT, recipe)) is True
    return url, entry, recipe


def test_a_download_only_request_waits_for_another_process_that_holds_the_key(s3: S3Server, tmp_path: Path) -> None:
    """A node with no snapshot (a repo id and commit, the tier's alias record gives the key) while another process of
    its cache holds that key's lock (here a download under the real lock, held back until the test lets it go): the
    request waits for it, as a conversion waits for one, and answers the entry it published, downloading nothing
    itself (before: None at once, the hub's error or the daemon's job failed). Then, with a holder that gives up
    (the lock released, no entry), the request downloads the entry itself."""
    from transformd.cache import Cache
    from transformd.cache.fetched import get_or_fetch
    from transformd.cache.lock import FileLock
    from transformd.remote import Remote
    from transformd.request import Tier

    url, entry, recipe = _published_alias(s3, tmp_path, "wait-published")
    cache = Cache(tmp_path / "node-b")
    entered, go, got = threading.Event(), threading.Event(), {}

    def held_back(stage: Path, report, reserve) -> bool:
        entered.set()
        assert go.wait(60)
        return Remote.from_url(url).fetch(entry.key, stage, before=lambda m: reserve(m.total_bytes))

    holder = threading.Thread(target=lambda: got.setdefault("holder", get_or_fetch(cache, entry.key, held_back,
                                                                                   source="the other process")))
    holder.start()
    assert entered.wait(30)
    tier = Tier.from_url(url)
    asking = threading.Thread(target=lambda: got.setdefault("request", tier.fetch_alias(cache, REPO_ID, COMMIT,
                                                                                        recipe)))
    asking.start()
    time.sleep(1.0)
    assert asking.is_alive() and "request" not in got, "it waits while the other holds the key"
    go.set()
    holder.join(60)
    asking.join(60)
    assert got["holder"].outcome == "fetched"
    assert got["request"] is not None and got["request"].outcome == "waited", got
    assert got["request"].path == got["holder"].path and _files(got["request"].path) == _files(entry.path)
    assert tier.counts["hits"] == 0 and tier.counts["failures"] == 0, tier.counts  # (it downloaded nothing)
    # a holder that gives up: the lock released with no entry published; the request then downloads it itself
    cache = Cache(tmp_path / "node-c")
    lock = FileLock(cache.locks_dir / f"{entry.key}.lock")
    assert lock.try_acquire()
    asking = threading.Thread(target=lambda: got.__setitem__("request", tier.fetch_alias(cache, REPO_ID, COMMIT,
                                                                                         recipe)))
    got.pop("request")
    asking.start()
    time.sleep(1.0)
    assert asking.is_alive() and "request" not in got
    lock.release()
    asking.join(60)
    assert got["request"] is not None and got["request"].outcome == "fetched", got
    assert _files(got["request"].path) == _files(entry.path) and tier.counts["hits"] == 1, tier.counts


def test_a_download_only_request_whose_key_stays_locked_ends_in_a_clear_timeout(s3: S3Server,
                                                                              tmp_path: Path) -> None:
    """Another process holds the key's lock and never lets it go: the wait ends after its bound (the ``timeout`` a
    conversion's wait takes) with CacheTimeoutError naming the key and the cache, nothing downloaded or left."""
    from transformd.cache import Cache, CacheTimeoutError
    from transformd.cache.lock import FileLock
    from transformd.request import Tier

    url, entry, recipe = _published_alias(s3, tmp_path, "wait-forever")
    cache = Cache(tmp_path / "node-b")
    lock = FileLock(cache.locks_dir / f"{entry.key}.lock")
    assert lock.try_acquire()
    tier = Tier.from_url(url)
    try:
        t0 = time.monotonic()
        with pytest.raises(CacheTimeoutError) as info:
            tier.fetch_alias(cache, REPO_ID, COMMIT, recipe, timeout=1.0)
        assert time.monotonic() - t0 < 30
    finally:
        lock.release()
    message = str(info.value)
    assert "timed out after 1.0 s" in message and entry.key in message and str(cache.root) in message, message
    assert "\n" not in message and cache.get(entry.key) is None and not list(cache.staging_dir.iterdir())
    assert tier.counts["hits"] == 0, tier.counts


def test_the_daemons_download_only_job_waits_for_a_key_another_process_holds(s3: S3Server, daemons: Daemons,
                                                                           tmp_path: Path) -> None:
    """The daemon's job for a repo id and commit it has no snapshot of, while another process of its cache holds
    the key's lock: the job waits (``waiting`` for another process, not failed), and once the lock is let go with
    no entry published, downloads the entry itself (before: the job failed at once, "the remote tier no longer
    gives entry ...")."""
    from tests.support.fakes import CopyConverter, write_source
    from transformd.cache import Cache, Recipe
    from transformd.cache.lock import FileLock
    from transformd.remote import Remote

    entry = Cache(tmp_path / "node-a", converter=CopyConverter()).get_or_convert(write_source(tmp_path / "src"),
                                                                                  Recipe(target="ocp"))
    url = s3.url("daemon-wait")
    assert Remote.from_url(url).publish(entry.key, entry.root, (REPO_ID, COMMIT, Recipe(target="ocp")))
    (tmp_path / "models" / "hub").mkdir(parents=True)
    b = daemons.start(cache_dir=tmp_path / "cache-b", allow_roots=[tmp_path / "models"],
                      hub_cache=tmp_path / "models" / "hub", remote=url)
    locks = tmp_path / "cache-b" / "locks"
    lock = FileLock(locks / f"{entry.key}.lock")
    assert lock.try_acquire()
    try:
        with b.client() as http:
            r = http.post("/v1/checkpoints", json={"source": REPO_ID, "revision": COMMIT, "target": "ocp"})
            assert r.status_code == 202 and r.json()["key"] == entry.key, r.text
            time.sleep(1.5)
            body = http.get(f"/v1/checkpoints/{entry.key}").json()
            assert body["state"] not in ("failed", "ready"), body
    finally:
        lock.release()
    with b.client() as http:
        body = wait_ready(http, entry.key, timeout=60)
    assert body["state"] == "ready", body
    assert _files(Path(body["path"])) == _files(entry.path)
    assert _remote(b)["hits"] == 1


def test_an_upload_to_a_server_that_stops_reading_fails_after_its_bound(s3: S3Server, tmp_path: Path,
                                                                        caplog) -> None:
    """The server stops (SIGSTOP: connections accepted, nothing read) as the background upload after a conversion
    begins to send the entry's files: the upload fails after the write bound (per request), is counted as an upload
    failure, said once at warning without a credential; the local entry is untouched and no manifest lands in the
    bucket, not even once the server goes on."""
    from tests.support.fakes import CopyConverter, write_source
    from transformd.cache import Cache, Recipe
    from transformd.remote import Remote
    from transformd.request import Tier, produce

    url = s3.url("stalled")
    tier = Tier(Remote.from_url(url, write_timeout_s=2))
    real = tier.remote.store.write_file

    def stop_then_write(name: str, path: Path) -> None:
        s3.pause()
        real(name, path)

    tier.remote.store.write_file = stop_then_write
    cache = Cache(tmp_path / "cache", converter=CopyConverter())
    caplog.set_level("DEBUG", logger="transformd.remote")
    try:
        entry = produce(cache, write_source(tmp_path / "src", shard_bytes=4 << 20), Recipe(), tier=tier)
        assert entry.outcome == "converted"
        t0 = time.monotonic()
        assert tier.wait_uploads(120), "the upload ended"
        took = time.monotonic() - t0
    finally:
        s3.resume()
    assert took < 60, took
    assert tier.counts["upload_failures"] == 1 and tier.counts["uploads"] == 0, tier.counts
    said = [r for r in caplog.records if r.name == "transformd.remote" and "upload failed" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"], [(r.levelname, r.getMessage()) for r in said]
    assert "\n" not in said[0].getMessage() and s3.secret_key not in caplog.text and s3.access_key not in caplog.text
    assert [r.ok for r in cache.verify()] == [True] and cache.get(entry.key) is not None
    time.sleep(1.0)  # (what the stopped server had in its buffers, it has now handled)
    assert not Remote.from_url(url).has(entry.key)
    assert not s3.object_path(f"stalled/entries/{entry.key}/manifest.json").exists()
