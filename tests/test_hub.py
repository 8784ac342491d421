"""Hugging Face repo ids as sources (transformd.hub): resolved offline through the local hub cache.

The hub cache is built on disk in huggingface_hub's own layout (``models--org--name/{refs, snapshots, blobs}``,
snapshot files as relative links to blobs named by their sha256), and huggingface_hub's own cache scanner must
read it back as the repo, revisions and refs it is meant to be. Repo ids are then resolved by ref (``main``, a
second branch) and by commit hash through the library, ``transformd convert``, the daemon's API and
``transformd resolve``. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from transformd import hub
from transformd.client import NotFoundError, TransformdClient
from transformd.daemon.settings import Settings
from transformd.cli import main as cli_main
from transformd.sample import write_sample_checkpoint

from .support.daemon import DaemonThread, Daemons, short_tempdir, wait_ready

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
REPO_ID = "org/Model"
MAIN = "a" * 40  # the commit of refs/main
V2 = "b" * 40  # the commit of refs/v2: other weights


def add_snapshot(cache: Path, repo_id: str, commit: str, checkpoint: Path, refs: tuple[str, ...] = ()) -> Path:
    """Put ``checkpoint``'s files into the hub cache ``cache`` as huggingface_hub lays out a download of
    ``repo_id`` at ``commit``: each file moved to ``blobs/<sha256>``, the snapshot a tree of relative links to
    them, ``refs/<ref>`` holding the commit. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())

    def sha256(f: Path) -> str:  # (read in pieces: a benchmark's checkpoint has shards of gigabytes)
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while piece := fh.read(16 << 20):
                h.update(piece)
        return h.hexdigest()

    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:  # (hashlib lets go of the GIL)
        digests = list(pool.map(sha256, files))
    for f, digest in zip(files, digests):
        blob = repo / "blobs" / digest
        if blob.exists():
            f.unlink()
        else:
            os.replace(f, blob)
        link = snapshot / f.relative_to(checkpoint)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hub cache under an allowed root ``<tmp>/models``: org/Model at main and v2, two contents."""
    root = tmp_path_factory.mktemp("models")
    work = tmp_path_factory.mktemp("work")
    cache = root / "hub"
    add_snapshot(cache, REPO_ID, MAIN, write_sample_checkpoint(work / "m", layers=1, experts=2, shards=1), ("main",))
    v2 = write_sample_checkpoint(work / "v2", layers=1, experts=2, shards=1, seed=1)
    add_snapshot(cache, REPO_ID, V2, v2, ("v2",))
    return cache


def test_the_layout_is_huggingface_hubs_own(hub_cache: Path) -> None:
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub_cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO_ID and repo.repo_type == "model"
    revisions = {r.commit_hash: set(r.refs) for r in repo.revisions}
    assert revisions == {MAIN: {"main"}, V2: {"v2"}}
    files = {f.file_name: f for r in repo.revisions for f in r.files}
    assert "model.safetensors" in files and files["model.safetensors"].blob_path.parent.name == "blobs"


# ---------------------------------------------------------------------------------------------------------------------
# the library


@pytest.mark.parametrize(("revision", "commit"), [(None, MAIN), ("main", MAIN), ("v2", V2), (MAIN, MAIN), (V2, V2)])
def test_resolve_by_ref_and_by_commit(hub_cache: Path, revision: str | None, commit: str) -> None:
    found = hub.resolve_repo(REPO_ID, revision, cache_dir=hub_cache)
    assert found.snapshot == hub_cache / "models--org--Model" / "snapshots" / commit
    assert (found.repo_id, found.revision, found.commit) == (REPO_ID, revision or "main", commit)
    assert (found.snapshot / "config.json").is_file() and os.path.islink(found.snapshot / "config.json")
    assert hub.source_path(REPO_ID, revision, cache_dir=hub_cache) == found.snapshot


def test_the_hub_cache_comes_from_hf_hub_cache_else_hf_home(hub_cache: Path, monkeypatch, tmp_path: Path) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub.default_hub_cache() == tmp_path / ".cache" / "huggingface" / "hub"
    with pytest.raises(hub.RepoNotCachedError):
        hub.resolve_repo(REPO_ID)

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    assert hub.resolve_repo(REPO_ID).commit == MAIN

    monkeypatch.delenv("HF_HUB_CACHE")
    home = tmp_path / "hf-home"
    home.mkdir()
    (home / "hub").symlink_to(hub_cache)
    monkeypatch.setenv("HF_HOME", str(home))
    assert hub.default_hub_cache() == home / "hub"
    found = hub.resolve_repo(REPO_ID, "v2").snapshot  # huggingface_hub returns it with the links resolved
    assert found.samefile(home / "hub" / "models--org--Model" / "snapshots" / V2)


def test_the_environment_order_is_huggingface_hubs(hub_cache: Path, tmp_path: Path) -> None:
    """default_hub_cache reads the environment when asked; huggingface_hub.constants at import: they agree."""
    code = ("import huggingface_hub.constants as c, transformd.hub as h; "
            "print(c.HF_HUB_CACHE); print(h.default_hub_cache())")
    for env in ({"HF_HUB_CACHE": str(hub_cache)}, {"HF_HOME": str(tmp_path / "h")}, {"XDG_CACHE_HOME": str(tmp_path)}):
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "XDG_CACHE"))}
        out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                             check=True, cwd=REPO).stdout.split()
        assert out[0] == out[1], env


def test_a_missing_repo_says_how_to_fetch_it(hub_cache: Path) -> None:
    with pytest.raises(hub.RepoNotCachedError) as info:
        hub.resolve_repo("org/Missing", "main", cache_dir=hub_cache)
    assert (info.value.http_status, info.value.code) == (404, "repo_not_cached")
    assert f"hf download org/Missing --revision main --cache-dir {hub_cache}" in str(info.value)


@pytest.mark.parametrize("revision", ["v9", "c" * 40, "a" * 7])
def test_a_missing_revision_says_so(hub_cache: Path, revision: str) -> None:
    with pytest.raises(hub.RevisionNotCachedError) as info:
        hub.resolve_repo(REPO_ID, revision, cache_dir=hub_cache)
    assert (info.value.http_status, info.value.code) == (404, "revision_not_cached")
    assert f"not at revision {revision}" in str(info.value) and f"--revision {revision}" in str(info.value)


@pytest.mark.parametrize(
    "source",
    ["/models/x", "./org/Model", "../org/Model", "~/org/Model", "org", "a/b/c", "", "org/Model\0"],
)
def test_what_is_a_path_and_what_a_repo_id(source: str) -> None:
    assert not hub.is_repo_id(source) and not hub.is_repo_id(Path("org/Model"))


def test_a_name_that_exists_here_is_a_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert hub.is_repo_id("org/Model")
    (tmp_path / "org" / "Model").mkdir(parents=True)
    assert not hub.is_repo_id("org/Model") and hub.is_repo_id("org/Model", paths_exist=False)


@pytest.mark.parametrize(
    "repo_id",
    ["org/..", "../etc", "org/../../etc", "org--x/y", "org/x--y", "org/na me", "org/mod\u00e8le", "org/.hidden",
     "org/x.", "-org/x", "a" * 97 + "/b", "org/" + "b" * 97, "org/Model\n", "org/Model/../x", "org/x.git"],
)
def test_hostile_repo_ids_are_refused(repo_id: str) -> None:
    with pytest.raises(hub.InvalidRepoIdError) as info:
        hub.check_repo_id(repo_id)
    assert info.value.http_status == 400


@pytest.mark.parametrize("repo_id", ["org/Model", "a" * 96 + "/" + "b" * 96, "_x/y_", "a__b/c_.-d", "Qwen/Qwen2.5-7B"])
def test_huggingface_hubs_repo_ids_are_accepted(repo_id: str) -> None:
    assert hub.check_repo_id(repo_id) == repo_id and hub.is_repo_id(repo_id, paths_exist=False)


@pytest.mark.parametrize("revision", ["../../../etc/passwd", "/etc/passwd", ".hidden", "a//b", "main/", "a/../b",
                                      "x" * 300, "main\0", "refs/pr/../../x"])
def test_hostile_revisions_are_refused_before_any_lookup(hub_cache: Path, revision: str) -> None:
    with pytest.raises(hub.HubError) as info:
        hub.resolve_repo(REPO_ID, revision, cache_dir=hub_cache)
    assert (info.value.http_status, info.value.code) == (400, "bad_revision")


def test_a_ref_that_leads_out_of_the_snapshots_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO_ID, MAIN, write_sample_checkpoint(tmp_path / "m", layers=1, experts=1, shards=1))
    (tmp_path / "etc").mkdir()
    (cache / "models--org--Model" / "refs").mkdir()
    (cache / "models--org--Model" / "refs" / "evil").write_text("../../../etc")
    with pytest.raises(hub.RevisionNotCachedError):
        hub.resolve_repo(REPO_ID, "evil", cache_dir=cache)


@pytest.mark.parametrize("kind", ["fifo", "device", "outside"])
def test_a_ref_record_that_could_block_or_leave_the_roots_is_not_read(tmp_path: Path, kind: str) -> None:
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO_ID, MAIN, write_sample_checkpoint(tmp_path / "m", layers=1, experts=1, shards=1))
    refs = cache / "models--org--Model" / "refs"
    refs.mkdir()
    if kind == "fifo":
        os.mkfifo(refs / "main")
    elif kind == "device":
        (refs / "main").symlink_to("/dev/zero")
    else:
        (tmp_path / "secret").write_text(MAIN)
        (refs / "main").symlink_to(tmp_path / "secret")
    err = _refused_within_10_s(cache)
    assert str(tmp_path / "secret") not in str(err) and "/dev/zero" not in str(err)


@pytest.mark.parametrize("record", ["refs/main", f"trees/{MAIN}.json"])
def test_a_record_swapped_for_a_fifo_after_the_checks_does_not_block_the_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record: str
) -> None:
    """Another user who may write the hub cache swaps a record that huggingface_hub opens by name (the ref, the
    cached file list) for a FIFO between the checks of the repo's folder and the lookup (a helper's attack, a
    loop of renames: 153 of 200 requests never answered, the daemon's source threads all blocked). The lookup
    reads each record once, without blocking, and refuses a FIFO there."""
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO_ID, MAIN, write_sample_checkpoint(tmp_path / "m", layers=1, experts=1, shards=1),
                 refs=("main",))
    repo = cache / "models--org--Model"
    (repo / "trees").mkdir()
    (repo / "trees" / f"{MAIN}.json").write_text('{"format_version": 1, "files": {}}')
    checks = hub._check_repo_folder

    def racing(storage: str, roots, hidden=None) -> None:
        checks(storage, roots, hidden)
        os.unlink(repo / record)  # the swap, right after the checks
        os.mkfifo(repo / record)

    monkeypatch.setattr(hub, "_check_repo_folder", racing)
    assert record in str(_refused_within_10_s(cache, unblock=repo / record))


@pytest.mark.parametrize(
    ("ref", "revision", "tree", "found"),
    [
        (MAIN, "main", None, True),
        (MAIN, MAIN, None, True),  # a commit hash: no ref read
        (MAIN, "main/x", None, False),  # refs/main is a file: no refs/main/x (was a 422 "not a plain file")
        ("./" + MAIN, "main", None, False),  # not a commit hash: huggingface_hub never writes such a ref
        (MAIN + "/", "main", None, False),
        ("\udcff\udcfe", "main", None, False),  # not UTF-8 (was a UnicodeDecodeError, a 500 in the daemon)
        (MAIN, "main", {"config.json": {}}, True),  # the cached file list names only files the snapshot has
        (MAIN, "main", {"config.json": {}, "gone.safetensors": {}}, "incomplete"),
        (MAIN, "main", {"../../outside": {}}, True),  # a name that would leave the snapshot is not looked up
    ],
    ids=["ref", "commit", "through-a-file", "dot-ref", "slash-ref", "bad-utf8", "listed", "incomplete", "escape"],
)
def test_the_lookup_follows_huggingface_hubs_offline_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ref: str,
                                                           revision: str, tree: dict | None, found: bool | str) -> None:
    """``refs/<revision>`` holds the commit, ``snapshots/<commit>`` is the snapshot, and it is incomplete when the
    file list huggingface_hub caches for the commit (``trees/<commit>.json``) names a file it lacks. Read by
    transformd (a FIFO swapped in must not block it); the hub cache named relative to the working directory, as
    HF_HUB_CACHE may."""
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO_ID, MAIN, write_sample_checkpoint(tmp_path / "m", layers=1, experts=1, shards=1))
    repo = cache / "models--org--Model"
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_bytes(ref.encode("utf-8", "surrogateescape"))
    if tree is not None:
        (repo / "trees").mkdir()
        (repo / "trees" / f"{MAIN}.json").write_text(json.dumps({"format_version": 1, "files": tree}))
    monkeypatch.chdir(tmp_path)
    if found is True:
        got = hub.resolve_repo(REPO_ID, revision, cache_dir="hub", roots=(os.path.realpath(cache),))
        assert (got.commit, got.snapshot) == (MAIN, repo.resolve() / "snapshots" / MAIN)
        return
    with pytest.raises(hub.RevisionNotCachedError) as err:
        hub.resolve_repo(REPO_ID, revision, cache_dir="hub", roots=(os.path.realpath(cache),))
    assert ("is incomplete" in str(err.value)) == (found == "incomplete"), err.value
    assert "hf download org/Model" in str(err.value)


def test_a_record_too_large_for_what_it_holds_is_not_read(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO_ID, MAIN, write_sample_checkpoint(tmp_path / "m", layers=1, experts=1, shards=1))
    (cache / "models--org--Model" / "refs").mkdir()
    (cache / "models--org--Model" / "refs" / "main").write_text(MAIN + " " * 2000)
    with pytest.raises(hub.HubError) as err:
        hub.resolve_repo(REPO_ID, cache_dir=cache, roots=(os.path.realpath(cache),))
    assert (err.value.http_status, err.value.code) == (422, "invalid_source")
    assert "more than 1024 bytes" in str(err.value)


def _refused_within_10_s(cache: Path, unblock: Path | None = None) -> hub.HubError:
    """The error of looking ``REPO_ID`` up in ``cache`` (the daemon's roots: the cache), which must come within
    10 s: a 422 invalid_source. ``unblock``: a FIFO to write to if the lookup blocked on it (so the thread ends)."""
    roots = (os.path.realpath(cache),)
    result: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(result, lambda: hub.resolve_repo(REPO_ID, cache_dir=cache, roots=roots)),
                         daemon=True)
    t.start()
    t.join(10)
    if t.is_alive() and unblock is not None:
        with open(os.open(unblock, os.O_WRONLY), "wb") as fifo:
            fifo.write(MAIN.encode())
    assert not t.is_alive(), "the lookup blocked"
    (err,) = result
    assert isinstance(err, hub.HubError) and (err.http_status, err.code) == (422, "invalid_source"), err
    return err


def _catch(out: list[BaseException], fn) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - handed to the test
        out.append(e)


def test_the_hub_module_imports_neither_torch_nor_huggingface_hub() -> None:
    """The client's side (transformd.hub) stays light; huggingface_hub only when looking up."""
    code = ("import sys, transformd.hub as m, transformd.client, transformd.cli.resolve, transformd.cli\n"
            "assert m.is_repo_id('org/Model')\n"
            "print(sorted(n for n in ('torch', 'huggingface_hub') if n in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out


# ---------------------------------------------------------------------------------------------------------------------
# transformd convert


def test_convert_a_repo_id_and_its_path_into_one_cache_entry(hub_cache: Path, tmp_path: Path, monkeypatch,
                                                            capsys) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    cache = ["--cache-dir", str(tmp_path / "cache"), "--device", "cpu"]
    assert cli_main(["convert", REPO_ID, *cache]) == 0
    out, err = capsys.readouterr()
    entry = out.splitlines()[-1]
    assert f"{REPO_ID} at main (commit {MAIN})" in err and "converted" in err

    snapshot = hub_cache / "models--org--Model" / "snapshots" / MAIN
    assert cli_main(["convert", str(snapshot), *cache]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == entry and "found in the cache" in err

    assert cli_main(["convert", REPO_ID, "--revision", MAIN, *cache]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == entry
    assert cli_main(["convert", REPO_ID, "--revision", "v2", *cache]) == 0
    assert capsys.readouterr().out.splitlines()[-1] != entry


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["org/Missing"], "hf download org/Missing --revision main"),
        ([REPO_ID, "--revision", "v9"], "not at revision v9"),
        (["./org/Model", "--revision", "main"], "applies to a Hugging Face repo id"),
        (["org/.."], "is not a Hugging Face repo id"),
        (["org/x--y"], "is not a Hugging Face repo id"),
        ([REPO_ID, "--revision", "../../etc"], "neither a branch or tag name"),
    ],
)
def test_convert_refuses_with_exit_2(hub_cache: Path, tmp_path: Path, monkeypatch, capsys, args, said) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    assert cli_main(["convert", *args, "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("transformd: error: ") and said in err, err


# ---------------------------------------------------------------------------------------------------------------------
# the daemon and transformd resolve


@pytest.fixture(scope="module")
def daemon(hub_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonThread]:
    """A daemon whose allowed root holds the hub cache; it finds it through HF_HUB_CACHE."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_CACHE", str(hub_cache))
    with Daemons() as daemons:
        yield daemons.start(cache_dir=tmp_path_factory.mktemp("cache"), allow_roots=[hub_cache.parent])
    mp.undo()


def _post(http, expect: int | None = None, **body: object) -> dict:
    r = http.post("/v1/checkpoints", json=body)
    if expect is not None:
        assert r.status_code == expect, r.text
        return r.json()
    assert r.status_code in (200, 202), r.text
    out = r.json()
    if r.status_code == 202:
        assert out["hub"]["repo_id"] == body["source"]
        out = {**wait_ready(http, out["key"]), "hub": out["hub"]}
    return out


def test_the_api_resolves_repo_ids_by_ref_and_commit_into_the_content_key(daemon: DaemonThread,
                                                                          hub_cache: Path) -> None:
    snapshot = hub_cache / "models--org--Model" / "snapshots"
    with daemon.client() as http:
        body = _post(http, source=REPO_ID)
        assert body["state"] == "ready" and Path(body["path"], "config.json").is_file()
        assert body["hub"] == {"repo_id": REPO_ID, "revision": "main", "commit": MAIN,
                               "snapshot": str(snapshot / MAIN)}
        key = body["key"]

        files = http.get(f"/v1/checkpoints/{key}/files").json()
        assert files["hub"]["repo_id"] == REPO_ID and files["hub"]["snapshot"] == str(snapshot / MAIN)
        assert files["files"] and all(f["ready"] for f in files["files"])

        by_path = _post(http, 200, source=str(snapshot / MAIN))
        assert by_path["key"] == key and by_path["path"] == body["path"] and "hub" not in by_path
        by_commit = _post(http, 200, source=REPO_ID, revision=MAIN)
        assert by_commit["key"] == key and by_commit["hub"]["revision"] == MAIN
        other = _post(http, source=REPO_ID, revision="v2")
        assert other["key"] != key and other["hub"]["commit"] == V2

        entries = http.get("/v1/cache").json()["entries"]
        assert len({e["key"] for e in entries}) == len(entries) == 2


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"source": "org/Missing"}, 404, "repo_not_cached"),
        ({"source": REPO_ID, "revision": "v9"}, 404, "revision_not_cached"),
        ({"source": REPO_ID, "revision": "c" * 40}, 404, "revision_not_cached"),
        ({"source": "org/.."}, 400, "bad_source"),
        ({"source": "../etc/passwd"}, 400, "bad_source"),
        ({"source": "org/x--y"}, 400, "bad_source"),
        ({"source": "org/Model/../../x"}, 400, "bad_source"),
        ({"source": REPO_ID, "revision": "../../../../etc"}, 400, "bad_revision"),
        ({"source": "/etc", "revision": "main"}, 422, "revision_needs_repo_id"),
        ({"source": "/etc", "revision": "../x"}, 400, "bad_revision"),
    ],
)
def test_the_api_refuses_missing_and_hostile_repo_ids(daemon: DaemonThread, body: dict, status: int,
                                                      code: str) -> None:
    with daemon.client() as http:
        r = http.post("/v1/checkpoints", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and len(err["message"]) > 20
    if code == "repo_not_cached":
        assert "hf download org/Missing --revision main" in err["message"] and "--allow-download" in err["message"]


def test_resolve_cli_passes_the_repo_id_and_revision_through(daemon: DaemonThread, hub_cache: Path,
                                                             capsys) -> None:
    sock = ["--socket", str(daemon.socket_path)]
    assert cli_main(["resolve", REPO_ID, *sock]) == 0
    main = capsys.readouterr().out.strip()
    assert cli_main(["resolve", REPO_ID, "--revision", "v2", *sock]) == 0
    v2 = capsys.readouterr().out.strip()
    assert Path(main, "config.json").is_file() and Path(v2).is_dir() and main != v2
    assert cli_main(["resolve", REPO_ID, "--revision", MAIN, *sock]) == 0
    assert capsys.readouterr().out.strip() == main

    assert cli_main(["resolve", "org/Missing", *sock]) == 2
    assert "hf download org/Missing --revision main" in capsys.readouterr().err
    with TransformdClient(socket=daemon.socket_path) as td, pytest.raises(NotFoundError) as info:
        td.resolve(REPO_ID, revision="nope")
    assert info.value.code == "revision_not_cached"


def test_the_hub_cache_is_read_only_when_it_is_an_allowed_root(hub_cache: Path, tmp_path: Path) -> None:
    """Not under an --allow-root: the usual 403, before anything in it is looked at; --allow-hub-cache adds it."""
    run = short_tempdir()
    elsewhere = tmp_path / "models"
    elsewhere.mkdir()
    base = {"cache_dir": tmp_path / "cache", "allow_roots": [elsewhere], "device": "cpu", "log_level": "warning",
            "hub_cache": hub_cache}
    try:
        with DaemonThread(Settings(socket=run / "a.sock", **base)) as d, d.client() as http:
            for source in (REPO_ID, "org/Missing"):
                r = http.post("/v1/checkpoints", json={"source": source})
                assert r.status_code == 403 and r.json()["error"]["code"] == "source_not_allowed", r.text
                assert str(hub_cache) not in r.text and "--allow-hub-cache" in r.text
            snapshot = hub_cache / "models--org--Model" / "snapshots" / MAIN
            r = http.post("/v1/checkpoints", json={"source": str(snapshot)})
            assert r.status_code == 403 and r.json()["error"]["code"] == "source_not_allowed"
        with DaemonThread(Settings(socket=run / "b.sock", allow_hub_cache=True, **base)) as d, d.client() as http:
            body = _post(http, source=REPO_ID, revision="v2")
            assert body["hub"]["commit"] == V2 and body["state"] == "ready"
    finally:
        shutil.rmtree(run, ignore_errors=True)


def test_allow_download_fetches_with_huggingface_hub(hub_cache: Path, tmp_path: Path, monkeypatch) -> None:
    """The one download path, without a network: huggingface_hub's snapshot_download is asked (not offline) and
    its snapshot checked like a cached one. Without --allow-download nothing is fetched (the tests above)."""
    import huggingface_hub

    fresh = tmp_path / "hub"
    calls: list[dict] = []

    def fake_download(repo_id: str, **kwargs: object) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        if kwargs.get("local_files_only"):
            raise AssertionError("the offline lookup is done before, by its own call")
        snap = add_snapshot(fresh, repo_id, MAIN, write_sample_checkpoint(tmp_path / "dl", layers=1, experts=1,
                                                                         shards=1), ("main",))
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    found = hub.HubResolver(fresh, [os.path.realpath(tmp_path)], allow_download=True).resolve("org/Fetched", None)
    assert found.commit == MAIN and calls == [{"repo_id": "org/Fetched", "revision": "main", "cache_dir": fresh}]
    with pytest.raises(hub.RepoNotCachedError):
        hub.HubResolver(fresh, [os.path.realpath(tmp_path)]).resolve("org/Other", None)


def test_deploy_examples_mount_the_hub_cache_read_only_in_both() -> None:
    import yaml

    compose = yaml.safe_load((REPO / "transformd" / "deploy" / "docker-compose.yaml").read_text())["services"]
    daemon, engine = compose["transformd"], compose["engine"]
    path = daemon["environment"]["HF_HUB_CACHE"]
    assert "--allow-hub-cache" in daemon["command"]
    for service in (daemon, engine):
        assert any(v.split(":")[1] == path and v.endswith(":ro") for v in service["volumes"]), service["volumes"]

    pod = next(d for d in yaml.safe_load_all((REPO / "transformd" / "deploy" / "kubernetes.yaml").read_text()) if d)
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == "transformd")
    env = {e["name"]: e.get("value") for e in sidecar["env"]}  # (the bucket's credentials come from a Secret)
    assert "--allow-hub-cache" in sidecar["args"]
    for c in (sidecar, *pod["spec"]["containers"]):
        assert any(m["mountPath"] == env["HF_HUB_CACHE"] and m.get("readOnly") for m in c["volumeMounts"]), c["name"]
