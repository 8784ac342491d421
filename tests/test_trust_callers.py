"""Trust class 2: the confused deputy. A source (and its cached conversion) is served only to a caller who could
read every file of it; callers are told apart by the unix socket's peer credentials.

The test runs as root (the daemon too, in a thread: it can read everything). Another caller is a real process
that ``setuid``s to an unprivileged uid (65534) and speaks HTTP over the daemon's unix socket. A checkpoint in a
0700 directory owned by uid 1000 is readable by the daemon, not by uid 65534:

* uid 65534 POSTing it: 403 ``permission_denied`` (before: converted and served, 0444);
* the entry converted for root: uid 65534 gets 403 for its state, its files, one shard and a lease;
* uid 65534 with its own readable copy of the same content: served (same key: content, not paths);
* a source the unprivileged caller can read (world-readable) is served to it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from transformd.cache import keys
from transformd.sample import write_sample_checkpoint

from .support.daemon import Daemons, short_tempdir, wait_ready
from .support.callers import NOBODY, as_uid, refused_for
from .test_trust_oracles import mode  # noqa: F401 - the fixture: with the caller's credentials and without

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid"),
]

CATEGORY = "trust 2: confused deputy (caller credentials)"
OWNER = 1000


def _alices_checkpoint(base: Path) -> tuple[Path, Path]:
    """An allowed root in ``base`` (made 0755) with uid 1000's checkpoint in a 0700 home: (the root, the
    checkpoint)."""
    os.chmod(base, 0o755)
    allowed = base / "models"
    allowed.mkdir(mode=0o755)
    home = allowed / "alice"
    home.mkdir()
    private = write_sample_checkpoint(home / "m", layers=1, experts=2)
    for p in [home, *home.rglob("*")]:
        os.chown(p, OWNER, OWNER)
    os.chmod(home, 0o700)
    return allowed, private


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, Any]]:
    base = short_tempdir("tdcb-")  # not under pytest's 0700 root: the unprivileged caller must reach its copy
    allowed, private = _alices_checkpoint(base)
    public = allowed / "public" / "m"
    shutil.copytree(private, public)
    for p in [public.parent, public, *public.rglob("*")]:  # the same owner, so the same writers: the same key
        os.chown(p, OWNER, OWNER)
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    try:
        with Daemons() as daemons:
            daemon = daemons.start(cache_dir=base / "cache", allow_roots=[allowed], prefix="tdc-", log_level="critical")
            sock = daemon.socket_path
            os.chmod(sock.parent, 0o755)
            os.chmod(sock, 0o666)  # let the unprivileged process connect (the test's choice, not the default)
            with daemon.client(timeout=60) as http:
                yield {"http": http, "sock": sock, "private": private, "public": public}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_caller_who_cannot_read_the_source_is_refused(world: dict[str, Any], fault_log) -> None:
    (status, body), = as_uid(world["sock"], NOBODY, [("POST", "/v1/checkpoints", {"source": str(world["private"])})])
    assert status == 403, (status, body)
    assert body["error"]["code"] == "permission_denied", body
    assert "may not read" in body["error"]["message"]
    fault_log.record(CATEGORY, "uid 65534 POSTs a checkpoint in uid 1000's 0700 directory", 1,
                     "403 permission_denied, nothing converted for it")


@pytest.mark.usefixtures("mode")
def test_what_lies_in_a_directory_the_caller_cannot_search_is_not_told(world: dict[str, Any], fault_log) -> None:
    """A caller who cannot search uid 1000's 0700 directory learnt what is in it from the answers to paths in it:
    404 for a missing name, 400 "is not a directory" for a file, 422 "contains no files" for an empty directory, and
    a private checkpoint's size in a 507 (an attack review). Every such path is one 403 now, before anything of it
    is looked at; a missing path the caller could see for itself is still a 404."""
    private = world["private"]
    home = private.parent
    empty = home / "empty"
    empty.mkdir(exist_ok=True)
    os.chown(empty, OWNER, OWNER)
    link = home.parent / "public" / "link-to-missing"
    if not link.is_symlink():
        link.symlink_to(home / "missing")
    inside = [private, home / "missing", home / "missing" / "deeper", private / "config.json", empty, link, link / "x"]
    answers = as_uid(world["sock"], NOBODY, [("POST", "/v1/checkpoints", {"source": str(s)}) for s in [home, *inside]])
    for status, body in answers:
        assert status == 403 and body["error"]["code"] == "permission_denied", answers
    said = {body["error"]["message"].replace(str(s), "SRC") for s, (_, body) in zip(inside, answers[1:], strict=True)}
    one = refused_for("search permission on a directory above the source")
    assert len(said) == 1 and one in said.pop(), answers
    (status, body), = as_uid(world["sock"], NOBODY, [("POST", "/v1/checkpoints",
                                                      {"source": str(home.parent / "public" / "missing")})])
    assert status == 404, (status, body)
    # a source the caller may read, holding uid 1000's 0700 directory: what is in it is not told either (a link out
    # of the roots in it was named by a 403 source_not_allowed; a large file in it was sized by a 507)
    mixed = home.parent / "public" / "mixed"
    if not mixed.exists():
        shutil.copytree(private, mixed)
        (mixed / "extra").mkdir()
        (mixed / "extra" / "leak.safetensors").symlink_to("/etc/passwd")
        for p in [mixed, *mixed.rglob("*")]:
            os.chown(p, OWNER, OWNER, follow_symlinks=False)
            if not p.is_symlink():
                os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.chmod(mixed / "extra", 0o700)
    (status, body), = as_uid(world["sock"], NOBODY, [("POST", "/v1/checkpoints", {"source": str(mixed)})])
    assert status == 403 and body["error"]["code"] == "permission_denied", (status, body)
    one = refused_for("read permission on a directory of the source")
    assert "leak" not in json.dumps(body) and one in json.dumps(body)
    fault_log.record(CATEGORY, "uid 65534 POSTs paths in uid 1000's 0700 directory (a checkpoint, the directory, "
                     "missing names, a file, an empty directory, a link to a missing name), and a readable source "
                     "holding a 0700 directory with a link out of the roots", len(answers) + 1,
                     "one 403 for all: nothing of them looked at, nothing in them named")


@pytest.mark.usefixtures("mode")
def test_what_a_hub_cache_the_caller_cannot_search_holds_is_not_told(fault_log) -> None:
    """A repo id skipped the caller's check: with the hub cache in a 0700 directory, uid 65534 learnt which repos
    and revisions it held (404 repo_not_cached, 404 revision_not_cached, or a 403 naming the snapshot and its
    commit: a review). One 403 for all, naming nothing in it."""
    from transformd.daemon.settings import Settings

    from .support.daemon import DaemonThread
    from .test_hub import MAIN, REPO_ID, add_snapshot

    base = short_tempdir("tdhb-")
    try:
        allowed, private = _alices_checkpoint(base)
        hub = allowed / "alice" / "hub"
        add_snapshot(hub, REPO_ID, MAIN, write_sample_checkpoint(base / "work" / "m", layers=1, experts=1,
                                                                  shards=1), ("main",))
        settings = Settings(socket=base / "run" / "td.sock", cache_dir=base / "cache", allow_roots=[allowed],
                            hub_cache=hub, allow_hub_cache=True, device="cpu", log_level="critical")
        with DaemonThread(settings) as daemon:
            os.chmod(daemon.socket_path.parent, 0o755)
            os.chmod(daemon.socket_path, 0o666)
            asked = [{"source": REPO_ID}, {"source": REPO_ID, "revision": "dev"}, {"source": "org/Absent"}]
            answers = as_uid(daemon.socket_path, NOBODY, [("POST", "/v1/checkpoints", body) for body in asked])
            for status, body in answers:
                assert status == 403 and body["error"]["code"] == "permission_denied", answers
                assert str(hub) not in json.dumps(body) and MAIN not in json.dumps(body), answers
            assert len({body["error"]["message"].replace(a["source"], "ID") for a, (_, body) in
                        zip(asked, answers, strict=True)}) == 1, answers
            with daemon.client(timeout=60) as http:  # root may
                assert http.post("/v1/checkpoints", json={"source": REPO_ID}).status_code in (200, 202)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    fault_log.record(CATEGORY, "uid 65534 asks for repo ids in a hub cache inside uid 1000's 0700 directory (a "
                     "cached repo, a missing revision, a missing repo)", len(answers), "one 403 for all, naming "
                     "nothing in it")


def test_a_cached_entry_is_served_only_to_callers_who_can_read_its_source(world: dict[str, Any], fault_log) -> None:
    http = world["http"]
    r = http.post("/v1/checkpoints", json={"source": str(world["private"])})  # root: may read it
    assert r.status_code in (200, 202), r.text
    key = r.json()["key"]
    ready = wait_ready(http, key, timeout=120)
    assert ready["state"] == "ready"
    shard = "model-00001-of-00002.safetensors"
    answers = as_uid(world["sock"], NOBODY, [
        ("GET", f"/v1/checkpoints/{key}", None),
        ("GET", f"/v1/checkpoints/{key}/files", None),
        ("GET", f"/v1/checkpoints/{key}/files/{shard}", None),
        ("POST", f"/v1/checkpoints/{key}/leases", {"ttl_s": 60}),
        ("DELETE", f"/v1/checkpoints/{key}", None),
        ("POST", "/v1/checkpoints", {"source": str(world["private"])}),
    ])
    for status, body in answers:
        assert status == 403, answers
        assert str(world["private"]) + "/" not in json.dumps(body)
    assert http.get(f"/v1/checkpoints/{key}").json()["state"] == "ready"  # still there for root
    # the same content in a copy the caller can read: served (the key is the content's)
    (status, body), = as_uid(world["sock"], NOBODY, [("POST", "/v1/checkpoints", {"source": str(world["public"])})])
    assert status == 200 and body["key"] == key and body["state"] == "ready", (status, body)
    answers = as_uid(world["sock"], NOBODY, [("GET", f"/v1/checkpoints/{key}/files", None)])
    assert answers[0][0] == 200, answers
    fault_log.record(CATEGORY, "uid 65534 asks for the entry of a 0700 checkpoint by key (state, files, shard, "
                     "lease, delete, POST)", len(answers) + 6, "403 each; served after POSTing its own readable copy")


@pytest.mark.parametrize("when", ["plan", "conversion", "engine check", "keyed conversion"])
def test_a_source_swapped_after_its_check_is_not_converted_for_the_caller(daemons: Daemons, fault_log, monkeypatch,
                                                                          when: str) -> None:
    """A checkpoint converted as it is hashed (read once) is checked for the caller on its first open, and the job
    opens it again by path: to check it (the plan, the engine's readiness), then to convert it. uid 65534 POSTs
    its own copy, and once the daemon has checked it, swaps in a symbolic link to uid 1000's private checkpoint
    (a review's race, timed there with inotify; here at each reopen). Before: the daemon converted the private
    checkpoint and answered uid 65534 with its key and path (its files then readable through the cache), or a 422
    naming its files. Now the reopened tree must be the one that was checked (its path and files' stat
    signatures), and the readiness check reads only what the caller could read. A source keyed when it was asked
    for (small, or known to the stat cache) waits in the queue as a job of that key: its worker reopened the path
    and hashed the private files, and the 409 named their key, so a caller could confirm a guess of another's
    content (a review of the first fix); now the worker converts only the files the request identified. Where the
    daemon reads with the caller's own credentials (issue 42), every reopen is the caller's: the link into the 0700
    directory is the kernel's one 403 before anything behind it is opened."""
    from transformd.daemon import app as app_module, service as service_module

    base = short_tempdir("tdsw-")
    try:
        allowed, private = _alices_checkpoint(base)
        home = private.parent
        decoy = write_sample_checkpoint(allowed / "bob" / "m", layers=1, experts=2, seed=7)
        for p in [decoy.parent, *decoy.parent.rglob("*")]:
            os.chown(p, NOBODY, NOBODY)
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        for f in [*private.rglob("*"), *decoy.rglob("*")]:  # past the stat cache's racy window, as downloads are
            os.utime(f, (f.stat().st_atime - 60, f.stat().st_mtime - 60))
        swapped = []

        def swap() -> None:
            if not swapped:
                os.rename(decoy, decoy.with_name("was"))
                os.symlink(private, decoy)
                swapped.append(True)

        def swapping_first(cls, name):
            real = getattr(cls, name)

            def hooked(*args, **kwargs):
                swap()
                return real(*args, **kwargs)

            monkeypatch.setattr(cls, name, hooked)

        if when == "plan":
            swapping_first(service_module.ConversionService, "_plan_blocking")
        elif when in ("conversion", "keyed conversion"):
            swapping_first(service_module.ConversionService, "_run")
        else:
            swapping_first(app_module, "plan_readiness")
        daemon = daemons.start(cache_dir=base / "cache", allow_roots=[allowed], prefix="tdsw-", log_level="critical")
        if when != "keyed conversion":  # converted as it is hashed (real checkpoints: from 256 MiB on)
            daemon.daemon.cache.hash_alongside_min_bytes = 0
        read = []
        hash_file = keys.hash_file
        monkeypatch.setattr(keys, "hash_file", lambda path, *a, **kw: read.append(os.readlink(path))
                            or hash_file(path, *a, **kw))
        os.chmod(daemon.socket_path.parent, 0o755)
        os.chmod(daemon.socket_path, 0o666)
        request = {"source": str(decoy), **({"engine": "vllm"} if when == "engine check" else {})}
        (status, body), = as_uid(daemon.socket_path, NOBODY, [("POST", "/v1/checkpoints", request)])
        if status == 202 and when == "keyed conversion":  # queued under its key: the job fails
            key, deadline = body["key"], time.monotonic() + 60
            while body.get("state") not in ("failed", "ready") and time.monotonic() < deadline:
                time.sleep(0.1)
                (status, body), = as_uid(daemon.socket_path, NOBODY, [("GET", f"/v1/checkpoints/{key}", None)])
            assert body["state"] == "failed", body
            status, body = body["error"]["status"], {"error": body["error"]}
            assert set(re.findall("[0-9a-f]{32}", body["error"]["message"])) <= {key}, body
        assert swapped, "the swap happened"
        assert not [p for p in read if p.startswith(str(home))], "no file of the private checkpoint read"
        code = {"engine check": "permission_denied"}.get(when, "source_changed")
        if refused_for("") != "":  # the job reopens it with the caller's own credentials: refused
            code = "permission_denied"
        assert status in (403, 409) and body["error"]["code"] == code, (status, body)
        assert str(private) not in json.dumps(body)
        deadline = time.monotonic() + 30
        while daemon.daemon.service.active_jobs() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not list((base / "cache" / "entries").glob("*")), "nothing converted from the private checkpoint"
    finally:
        shutil.rmtree(base, ignore_errors=True)
    fault_log.record(CATEGORY, f"uid 65534 swaps a symbolic link to uid 1000's 0700 checkpoint in for its own copy "
                     f"once checked, before the {when} reopens it", 1,
                     "409 source_changed (403 for the engine check); nothing of it converted or named")


def test_a_request_refused_for_its_queue_leaves_no_grant(daemons: Daemons, fault_log) -> None:
    """Each POST granted its caller the key before the caller's queue limit refused it (429): one uid's 20,000
    requests left 20,000 grants in the daemon's memory (an attack review: RSS 324 -> 353 MiB, without end). A
    refused request now grants nothing; an admitted one still does."""
    base = short_tempdir("tdq-")
    try:
        allowed, private = _alices_checkpoint(base)
        public = allowed / "public"
        shutil.copytree(private, public)
        for p in [public, *public.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        daemon = daemons.start(cache_dir=base / "cache", allow_roots=[allowed], prefix="tdq-", log_level="critical")
        os.chmod(daemon.socket_path.parent, 0o755)
        os.chmod(daemon.socket_path, 0o666)
        real = daemon.daemon.service.queued_by
        daemon.daemon.service.queued_by = lambda uid: 99  # every caller's queue is full
        answers = as_uid(daemon.socket_path, NOBODY, [("POST", "/v1/checkpoints", {"source": str(public)})] * 3)
        assert [status for status, _ in answers] == [429] * 3, answers
        assert not [k for k, uids in daemon.daemon.readers.items() if NOBODY in uids]
        daemon.daemon.service.queued_by = real
        (status, body), = as_uid(daemon.socket_path, NOBODY, [("POST", "/v1/checkpoints", {"source": str(public)})])
        assert status in (200, 202) and NOBODY in daemon.daemon.readers[body["key"]], (status, body)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    fault_log.record(CATEGORY, "uid 65534 POSTs while its queue is full", 3,
                     "429 caller_queue_full, no grant left behind; admitted later: granted")
