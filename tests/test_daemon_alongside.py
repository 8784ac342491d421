"""The daemon's first resolve of a source it never hashed converts it while hashing it (read once).

``POST /v1/checkpoints`` starts the conversion under the source's provisional name, answers once the hashing
beside it has the content key (202, or 200 when that content was cached already), and the job goes on under the
key. The cache's ``hash_alongside_min_bytes`` is set to 0 so that the small checkpoints of the tests take that
path (real ones do from 256 MiB on); files are aged past the stat cache's racy window, as a downloaded checkpoint's
are.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from transformd.cache import Recipe, cache_key, keys, source_identity
from transformd.checkpoint import convert_checkpoint
from transformd.sample import write_sample_checkpoint

from .support.checkpoints import O, default_shards, overflow, write_checkpoint
from .support.daemon import DaemonThread, Daemons, metric_value, wait_ready
from .test_trust_oracles import mode  # noqa: F401 - the fixture: with the caller's credentials and without

pytestmark = pytest.mark.timeout(120)


def _old(src: Path) -> Path:
    """Age every file past the stat cache's racy window."""
    for f in src.rglob("*"):
        if f.is_file():
            os.utime(f, (f.stat().st_atime - 60, f.stat().st_mtime - 60))
    return src


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def models(tmp_path: Path) -> Path:
    return tmp_path / "models"


@pytest.fixture
def start(daemons: Daemons, tmp_path: Path, models: Path) -> Callable[..., DaemonThread]:
    def go(converter=None, **settings) -> DaemonThread:
        daemon = daemons.start(converter, cache_dir=tmp_path / "cache", allow_roots=[models], **settings)
        daemon.daemon.cache.hash_alongside_min_bytes = 0
        return daemon
    return go


class _Gate:
    """Holds every BLAKE3 hash of a source file until opened; counts the files hashed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, closed: bool = False):
        self.opened, self.hashed = threading.Event(), []
        if not closed:
            self.opened.set()
        real = keys.hash_file

        def hash_file(path, *args, **kwargs):
            assert self.opened.wait(60)
            self.hashed.append(os.path.basename(os.readlink(path)))
            return real(path, *args, **kwargs)

        monkeypatch.setattr(keys, "hash_file", hash_file)


def _manifest_timings(ready: dict) -> dict:
    import json

    return json.loads((Path(ready["path"]).parent / "manifest.json").read_text())["timings"]


def test_first_resolve_converts_while_hashing_under_the_key_of_the_content(start, models, tmp_path, monkeypatch):
    src = _old(write_sample_checkpoint(models / "sample", layers=1, experts=2))
    gate = _Gate(monkeypatch)
    daemon = start()
    with daemon.client() as http:
        r = http.post("/v1/checkpoints", json={"source": str(src), "target": "ocp"})
        assert r.status_code in (200, 202), r.text
        key = r.json()["key"]
        ready = wait_ready(http, key)
        assert ready["state"] == "ready" and ready["key"] == key, ready
        assert "hash_alongside" in _manifest_timings(ready), "took the read-once path"
        files = sorted(p.name for p in src.iterdir() if p.is_file())
        assert sorted(gate.hashed) == files, "each source file read for the key exactly once"

        again = http.post("/v1/checkpoints", json={"source": str(src), "target": "ocp"})
        assert again.status_code == 200 and again.json()["key"] == key and again.json()["path"] == ready["path"]
        assert sorted(gate.hashed) == files, "the second request is keyed from the stat cache"
        metrics = http.get("/metrics").text
    assert key == cache_key(source_identity(src), Recipe(**ready["recipe"])), "the key hashing first gives"
    convert_checkpoint(src, tmp_path / "direct", target="ocp")
    assert _tree(Path(ready["path"])) == _tree(tmp_path / "direct")
    assert metric_value(metrics, "transformd_cache_misses_total") == 1
    assert metric_value(metrics, "transformd_cache_hits_total") == 1
    assert metric_value(metrics, "transformd_conversions_total", {"outcome": "converted"}) == 1


def test_requests_during_the_hashing_join_the_one_conversion(start, models, monkeypatch):
    src = _old(write_sample_checkpoint(models / "sample", layers=1, experts=2))
    gate = _Gate(monkeypatch, closed=True)
    daemon = start()
    answers: list = []

    def post() -> None:
        with daemon.client() as http:
            answers.append(http.post("/v1/checkpoints", json={"source": str(src), "target": "ocp"}))

    posts = [threading.Thread(target=post) for _ in range(3)]
    for t in posts:
        t.start()
    service = daemon.daemon.service
    deadline = time.monotonic() + 30
    while not (len(service.active_jobs()) == 1 and service.active_jobs()[0].slot is not None):
        assert time.monotonic() < deadline, "no conversion started"
        time.sleep(0.01)
    time.sleep(0.3)  # the other requests arrive while the source is still being hashed
    assert len(service.active_jobs()) == 1 and not answers, "nobody is answered before the key is known"
    gate.opened.set()
    for t in posts:
        t.join(60)
    keys_ = {r.json()["key"] for r in answers}
    assert len(answers) == 3 and all(r.status_code in (200, 202) for r in answers) and len(keys_) == 1
    with daemon.client() as http:
        ready = wait_ready(http, keys_.pop())
        metrics = http.get("/metrics").text
    assert ready["state"] == "ready"
    assert metric_value(metrics, "transformd_conversions_total", {"outcome": "converted"}) == 1
    assert len(gate.hashed) == len([p for p in src.iterdir() if p.is_file()])


def test_a_copy_of_cached_content_is_a_hit_and_its_conversion_stops(start, models, tmp_path, monkeypatch):
    src = _old(write_sample_checkpoint(models / "sample", layers=1, experts=2))
    daemon = start()
    with daemon.client() as http:
        first = http.post("/v1/checkpoints", json={"source": str(src), "target": "ocp"})
        ready = wait_ready(http, first.json()["key"])
        copy = _old(Path(shutil.copytree(src, models / "copy")))
        r = http.post("/v1/checkpoints", json={"source": str(copy), "target": "ocp"})
        assert r.status_code == 200, r.text
        hit = r.json()
        assert hit["state"] == "ready" and hit["key"] == ready["key"] and hit["path"] == ready["path"]
        metrics = http.get("/metrics").text
    assert metric_value(metrics, "transformd_cache_hits_total") == 1
    assert metric_value(metrics, "transformd_conversions_total", {"outcome": "converted"}) == 1
    assert not list((tmp_path / "cache" / "staging").iterdir()), "the stopped conversion left nothing behind"


@pytest.mark.parametrize("when", ["checked", "converting"])
def test_an_invalid_checkpoint_is_a_422_naming_the_tensor_with_nothing_left(start, models, tmp_path, when):
    if when == "checked":  # found from the headers, before the conversion starts
        shards = default_shards()
        shards["model-00002-of-00002.safetensors"].pop(f"{O}.weight_scale")
    else:  # found in the values, as the conversion reads them
        shards = default_shards()
        overflow(shards)
    src = _old(write_checkpoint(models / "bad", shards))
    daemon = start()
    with daemon.client() as http:
        r = http.post("/v1/checkpoints", json={"source": str(src), "target": "ocp"})
        if r.status_code == 202:  # the values were read after the hashing had the key (as when hashed first)
            failed = wait_ready(http, r.json()["key"])
            assert failed["state"] == "failed" and failed["error"]["code"] == "invalid_checkpoint", failed
            text = str(failed["error"])
        else:
            assert r.status_code == 422, r.text
            text = r.text
    assert when == "converting" or r.status_code == 422, "a problem of the headers is found before the answer"
    assert f"{O}.weight" in text and "model-00002-of-00002.safetensors" in text, text
    cache = tmp_path / "cache"
    assert not list((cache / "staging").iterdir()) and not list((cache / "entries").iterdir())


def test_with_no_worker_free_the_source_is_hashed_first_and_answered_at_once(start, models, monkeypatch):
    """A provisional job would wait in the queue before its hashing starts, and so would the answer: the
    request hashes first instead, and is answered while the other conversion still runs."""
    first = _old(write_sample_checkpoint(models / "first", layers=1, experts=2))
    second = _old(write_sample_checkpoint(models / "second", layers=1, experts=2, seed=1))
    release = threading.Event()

    from transformd.cache import TransformdConverter

    class Held(TransformdConverter):
        calls = 0

        def __call__(self, *args, **kwargs):  # the first call (of the first source) waits for ``release``
            Held.calls += 1
            if Held.calls == 1:
                assert release.wait(60)
            return super().__call__(*args, **kwargs)

    daemon = start(Held("cpu"), max_concurrent_conversions=1)
    service, answers = daemon.daemon.service, []

    def post_first() -> None:
        with daemon.client() as http:
            answers.append(http.post("/v1/checkpoints", json={"source": str(first), "target": "ocp"}))

    thread = threading.Thread(target=post_first)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not any(j.state == "converting" for j in service.active_jobs()):
            assert time.monotonic() < deadline, "the first conversion did not start"
            time.sleep(0.01)
        with daemon.client() as http:
            b = http.post("/v1/checkpoints", json={"source": str(second), "target": "ocp"})
            assert b.status_code == 202 and b.json()["state"] == "queued", b.text
            assert not answers, "the first conversion is still held"
            assert b.json()["key"] == cache_key(source_identity(second), Recipe(target="ocp"))
            release.set()
            thread.join(60)
            ready_b = wait_ready(http, b.json()["key"])
            assert ready_b["state"] == "ready"
            timings = _manifest_timings(ready_b)
            assert "identify" in timings and "hash_alongside" not in timings, timings
            # (answered once hashed alongside its conversion: with so small a source that may be after it is ready)
            assert answers[0].status_code in (200, 202), answers[0].text
            ready_a = wait_ready(http, answers[0].json()["key"])
            assert ready_a["state"] == "ready" and "hash_alongside" in _manifest_timings(ready_a)
    finally:
        release.set()
        thread.join(60)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
@pytest.mark.usefixtures("mode")
def test_a_caller_who_cannot_read_the_source_is_refused_before_anything_is_read(daemons: Daemons, monkeypatch):
    """The permission check of the read-once path: from the opened tree, before a job or a hash exists. The
    directories are open to the caller (the walk of the way to the source, before, lets it through): its files
    are not."""
    from .support.callers import NOBODY, as_uid, refused_for
    from .support.daemon import short_tempdir

    base = short_tempdir("tdal-")
    try:
        os.chmod(base, 0o755)
        home = base / "models" / "alice"
        home.mkdir(parents=True)
        os.chmod(base / "models", 0o755)
        src = _old(write_sample_checkpoint(home / "m", layers=1, experts=2))
        for p in [home, *home.rglob("*")]:
            os.chown(p, 1000, 1000)
            os.chmod(p, 0o755 if p.is_dir() else 0o600)
        gate = _Gate(monkeypatch)
        daemon = daemons.start(cache_dir=base / "cache", allow_roots=[base / "models"], prefix="tdal-",
                               log_level="critical")
        daemon.daemon.cache.hash_alongside_min_bytes = 0
        os.chmod(daemon.socket_path.parent, 0o755)
        os.chmod(daemon.socket_path, 0o666)
        (status, body), = as_uid(daemon.socket_path, NOBODY, [("POST", "/v1/checkpoints", {"source": str(src)})])
        assert status == 403 and body["error"]["code"] == "permission_denied", (status, body)
        assert refused_for("read permission on a file of the source") in body["error"]["message"], body
        assert not gate.hashed and not daemon.daemon.service.active_jobs(), "nothing read or started for it"
        assert not list((base / "cache" / "staging").iterdir())
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_resolve_says_what_it_waits_for_while_the_daemon_keys_a_new_checkpoint(start, models, monkeypatch, capsys):
    """No progress can be shown before the answer, which comes once the key is known: ``resolve`` says why."""
    from transformd.cli import main
    from transformd.cli import resolve as resolve_cli

    monkeypatch.setattr(resolve_cli, "IDENTIFY_NOTICE_S", 0.1)
    src = _old(write_sample_checkpoint(models / "sample", layers=1, experts=2))
    gate = _Gate(monkeypatch, closed=True)
    daemon = start()
    threading.Timer(1.5, gate.opened.set).start()
    code = main(["resolve", str(src), "--socket", str(daemon.socket_path), "--target", "ocp"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"the daemon is reading {src} to key it" in err, err
    assert Path(out.strip().splitlines()[-1]).is_dir()


@pytest.mark.parametrize("keyed", [False, True], ids=["before-the-key", "after-the-key"])
def test_shutdown_cancels_a_conversion_started_before_its_key_and_leaves_nothing(start, models, monkeypatch, keyed):
    """Stopping the daemon while a first resolve converts: the request ends (it is not left hanging), the
    conversion stops at its next progress update, and neither staging nor an entry is left."""
    from .support.fakes import CopyConverter, write_source

    src = write_source(models / "m", seed=3)  # (backdated: settled)
    gate = _Gate(monkeypatch, closed=not keyed)
    daemon = start(CopyConverter(delay=3.0, steps=60), shutdown_grace_s=1)
    service, cache, answers = daemon.daemon.service, daemon.daemon.cache, []

    def post() -> None:
        try:
            with daemon.client() as http:
                answers.append(http.post("/v1/checkpoints", json={"source": str(src), "target": "ocp"}).status_code)
        except Exception as e:  # noqa: BLE001 - the connection may be closed by the stopping server
            answers.append(type(e).__name__)

    thread = threading.Thread(target=post)
    thread.start()
    deadline = time.monotonic() + 30
    while not any(j.slot is not None and j.state == "converting" for j in service.active_jobs()) or (
        keyed and not answers
    ):
        assert time.monotonic() < deadline, "the conversion did not start"
        time.sleep(0.02)
    job = next(j for j in service._jobs.values() if j.slot is not None)
    try:
        daemon.stop()
    finally:
        gate.opened.set()  # the hashing thread finishes its file; the conversion was cancelled meanwhile
    thread.join(30)
    assert answers == [202 if keyed else 503], "answered before the stop, or told the daemon stops (not cut off)"
    deadline = time.monotonic() + 30
    while job.state != "failed" or any(cache.staging_dir.iterdir()):
        assert time.monotonic() < deadline, (job.state, list(cache.staging_dir.iterdir()))
        time.sleep(0.02)
    assert job.error.code == "cancelled", job.error
    assert list(cache.entries_dir.iterdir()) == []
