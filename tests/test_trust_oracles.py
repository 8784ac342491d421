"""Trust, second round (issue 42, items 3 and 4): no answer tells a caller what lies where it may not look, and no
race between a check and a use tells it either.

The test runs as root (the daemon too, in a thread). uid 1000 ("alice") keeps a checkpoint, a 1 TiB sparse file and
a link out of the roots in a 0700 directory inside the allowed root; uid 65534 (a real process that ``setuid``s,
see tests/support/callers.py) owns a readable copy of a checkpoint and attacks from it:

* links in its own source into alice's directory, to a file, a directory and a name that exist and to names that do
  not: before, 403 when the target existed and 422 "broken symlink" when not, and a 507 that stated the size of
  alice's file; now one 403, the same words for every target;
* a repo id whose hub records (``refs/main``, ``trees/<commit>.json``) or snapshot were planted as links into alice's
  directory: before, read with the daemon's rights (422, 404 or 403 by what lay there); now the same answer whether
  or not something lies there;
* a thread exchanging its source directory with a link to alice's directory (``renameat2(RENAME_EXCHANGE)``) while
  it posts: before, a 507 with the size of alice's file, a 403 naming the link in her directory, a 500 from
  ``realpath``; now none of those.

Each runs twice: with the caller's own file-system credentials (the daemon is root: ``kernel``) and with the
daemon's rights and the mode-bit checks (``checks``: a daemon without CAP_SETUID), forced by patching
:func:`transformd.daemon.fscreds.kernel_available`.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from transformd.daemon import fscreds
from transformd.sample import write_sample_checkpoint

from .support.callers import NOBODY, as_uid
from .support.daemon import Daemons, short_tempdir

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other uids"),
]

CATEGORY = "trust 2: confused deputy (caller credentials)"
ALICE = 1000
HUGE = 1 << 40  # alice's sparse file: a size no budget here holds
SIZE_WORDS = (str(HUGE), "1.0 TiB", "1 TiB", "1099511")


@pytest.fixture(params=["kernel", "checks"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "kernel" and not fscreds.kernel_available():
        pytest.skip("this process cannot take another uid's file-system credentials")
    if request.param == "checks":
        monkeypatch.setattr(fscreds, "kernel_available", lambda: False)
    return str(request.param)


def _world(base: Path) -> dict[str, Any]:
    """An allowed root (0755) with alice's 0700 home (a checkpoint, a huge sparse file, a link out of the roots, an
    empty directory) and uid 65534's readable checkpoint."""
    os.chmod(base, 0o755)
    allowed = base / "models"
    allowed.mkdir(mode=0o755)
    home = allowed / "alice"
    home.mkdir()
    private = write_sample_checkpoint(home / "m", layers=1, experts=1, shards=1)
    with open(home / "huge.safetensors", "wb") as f:
        f.truncate(HUGE)
    (home / "leak-name.safetensors").symlink_to("/etc/passwd")
    (home / "empty").mkdir()
    for p in [home, *home.rglob("*")]:
        os.chown(p, ALICE, ALICE, follow_symlinks=False)
    os.chmod(home, 0o700)
    mine = allowed / "nobody"
    mine.mkdir(mode=0o755)
    own = write_sample_checkpoint(mine / "m", layers=1, experts=1, shards=1, seed=3)
    for p in [mine, *mine.rglob("*")]:
        os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
    return {"allowed": allowed, "home": home, "private": private, "mine": mine, "own": own}


def _start(daemons: Daemons, base: Path, allowed: Path, **settings: Any) -> Any:
    daemon = daemons.start(cache_dir=base / "cache", allow_roots=[allowed], prefix="tdo-", log_level="critical",
                           cache_budget="64M", **settings)
    os.chmod(daemon.socket_path.parent, 0o755)
    os.chmod(daemon.socket_path, 0o666)
    return daemon


@pytest.fixture
def base() -> Iterator[Path]:
    path = short_tempdir("tdo-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _no_leak(answers: list[tuple[int, Any]], home: Path) -> None:
    text = json.dumps(answers)
    assert "leak-name" not in text and "huge" not in text and str(home) + "/" not in text, answers
    assert not any(word in text for word in SIZE_WORDS), answers


def _one_answer(answers: list[tuple[int, Any]], asked: list[str]) -> tuple[Any, str]:
    """The one answer all ``answers`` gave: an error's status and message (the asked-for name replaced), or a
    served key (queued, converting or ready alike)."""
    said = {(status, re.sub(r"\(pid \d+\)", "", json.dumps(body).replace(name, "NAME"))) if status not in (200, 202)
            else ("served", body["key"]) for name, (status, body) in zip(asked, answers, strict=True)}
    assert len(said) == 1, answers
    return next(iter(said))


def test_links_into_a_private_directory_tell_nothing_of_what_is_there(base: Path, daemons: Daemons, mode: str,
                                                                       fault_log) -> None:
    """uid 65534's own readable source with one more entry, a link into alice's 0700 directory: to her checkpoint's
    shard, her huge file, her link out of the roots, her empty directory, her checkpoint directory, and to names that
    do not exist (a file, a directory below a missing one). Before: 403 for what existed, 422 "broken symlink" for
    what did not, a 403 source_not_allowed naming the link to a link out of the roots, and a 507 stating the huge
    file's size. Every one is now the same 403."""
    w = _world(base)
    home = w["home"]
    shard = next(w["private"].glob("*.safetensors")).name
    targets = [w["private"] / shard, home / "huge.safetensors", home / "leak-name.safetensors", home / "empty",
               w["private"], home / "missing.safetensors", home / "missing" / "deeper.safetensors"]
    daemon = _start(daemons, base, w["allowed"])
    sources = []
    for i, target in enumerate(targets):
        src = w["mine"] / f"s{i}"
        shutil.copytree(w["own"], src, symlinks=True)
        (src / "extra.safetensors").symlink_to(target)
        for p in [src, *src.rglob("*")]:
            os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
        sources.append(str(src))
    answers = as_uid(daemon.socket_path, NOBODY, [("POST", "/v1/checkpoints", {"source": s}) for s in sources])
    _no_leak(answers, home)
    status, said = _one_answer(answers, sources)
    assert status == 403 and "permission_denied" in said, answers
    assert not list((base / "cache" / "entries").glob("*")), "nothing converted"
    fault_log.record(CATEGORY, f"uid 65534's source holds a link into uid 1000's 0700 directory ({mode}): to a "
                     "shard, a 1 TiB file, a link out of the roots, a directory, a checkpoint, missing names",
                     len(answers), "one 403 for all; no size, no name, nothing converted")


def _hub_world(base: Path) -> tuple[dict[str, Any], Path]:
    """:func:`_world` plus a hub cache inside the allowed root, writable by uid 65534 (a shared hub cache), holding
    ``org/Model`` at ``main``; alice's home gets a file holding a commit hash and a file list."""
    from .test_hub import MAIN, REPO_ID, add_snapshot

    w = _world(base)
    hub = w["allowed"] / "hub"
    snapshot = add_snapshot(hub, REPO_ID, MAIN, write_sample_checkpoint(base / "work" / "m", layers=1, experts=1,
                                                                        shards=1), ("main",))
    for p in [hub, *hub.rglob("*")]:
        os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
    home = w["home"]
    os.chmod(home, 0o755)
    (home / "ref").write_text(MAIN)
    (home / "tree.json").write_text(json.dumps({"format_version": 1, "files": {"absent.bin": {}}}))
    shutil.copytree(snapshot, home / "snap", symlinks=False)
    for p in [home / "ref", home / "tree.json", home / "snap", *(home / "snap").rglob("*")]:
        os.chown(p, ALICE, ALICE, follow_symlinks=False)
    os.chmod(home, 0o700)
    return w, snapshot.parent.parent


@pytest.mark.parametrize("record", ["refs/main", f"trees/{'a' * 40}.json", f"snapshots/{'a' * 40}"])
def test_hub_records_planted_as_links_into_a_private_directory_tell_nothing(base: Path, daemons: Daemons, mode: str,
                                                                           record: str, fault_log) -> None:
    """A repo folder of a shared hub cache that uid 65534 may write: it replaces a record (``refs/main``, the file
    list ``trees/<commit>.json``) or the snapshot with a link into alice's 0700 directory, to something there (a
    commit hash, a file list naming a missing file, a copy of the snapshot) and to a name that is not. Before, the
    daemon read them with its own rights: 404 or 422 or 403 by what lay there. The two answers are now the same."""
    from .test_hub import REPO_ID

    w, repo = _hub_world(base)
    home = w["home"]
    there = {"refs/main": home / "ref", f"trees/{'a' * 40}.json": home / "tree.json"}.get(record, home / "snap")
    daemon = _start(daemons, base, w["allowed"], hub_cache=w["allowed"] / "hub")
    answers = []
    for target in [there, home / "missing"]:
        planted = repo / record
        if planted.is_dir() and not planted.is_symlink():
            shutil.rmtree(planted)
        elif planted.exists() or planted.is_symlink():
            planted.unlink()
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.symlink_to(target)
        os.chown(planted, NOBODY, NOBODY, follow_symlinks=False)
        answers += as_uid(daemon.socket_path, NOBODY, [("POST", "/v1/checkpoints", {"source": REPO_ID})])
    _no_leak(answers, home)
    _one_answer(answers, [REPO_ID, REPO_ID])
    assert answers[0][0] != 500, answers
    fault_log.record(CATEGORY, f"uid 65534 plants {record} of a shared hub cache as a link into uid 1000's 0700 "
                     f"directory, to something there and to a missing name ({mode})", len(answers),
                     "the same answer for both")


_libc = ctypes.CDLL(None, use_errno=True)
RENAME_EXCHANGE = 2
AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@pytest.mark.parametrize("behind", ["huge.safetensors", "leak-name.safetensors"])
def test_a_directory_exchanged_for_a_link_while_posting_leaks_nothing(base: Path, daemons: Daemons, mode: str,
                                                                      behind: str, fault_log) -> None:
    """uid 65534 posts its own source while a thread exchanges it, again and again, with a link into alice's 0700
    directory (``renameat2(RENAME_EXCHANGE)``: the name is always there, a directory or the link). Alice's directory
    holds a 1 TiB file or a link out of the roots (``behind``). Before: the path walk checked one and the daemon read the other
    (a 507 stating the file's size, a 403 naming the link, a 500 from a ``realpath`` race). Now no answer is a 500 or
    a 507, and none names or sizes anything of hers."""
    w = _world(base)
    home = w["home"]
    os.chmod(home, 0o755)  # (her checkpoint dir made a source that holds her secrets, then closed again)
    os.rename(home / behind, w["private"] / behind)
    os.chmod(home, 0o700)
    src = w["mine"] / "racing"
    shutil.copytree(w["own"], src, symlinks=True)
    for p in [src, *src.rglob("*")]:
        os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
    link = w["mine"] / "other"
    link.symlink_to(w["private"])
    daemon = _start(daemons, base, w["allowed"], max_queued_per_caller=1000)
    stop = threading.Event()
    swaps = [0]

    def swapping() -> None:
        while not stop.is_set():
            _exchange(src, link)
            swaps[0] += 1
            time.sleep(0.0005)

    t = threading.Thread(target=swapping, daemon=True)
    t.start()
    try:
        answers = as_uid(daemon.socket_path, NOBODY, [("POST", "/v1/checkpoints", {"source": str(src)})] * 60)
    finally:
        stop.set()
        t.join()
    assert swaps[0] > 100, swaps
    _no_leak(answers, home)
    statuses = sorted({status for status, _ in answers})
    assert 500 not in statuses and 507 not in statuses, answers
    assert set(statuses) <= {200, 202, 403, 404, 409, 422, 429}, answers
    fault_log.record(CATEGORY, f"uid 65534 posts its source while a thread exchanges it with a link into uid 1000's "
                     f"0700 directory holding {behind} ({mode})", len(answers),
                     f"answers {statuses}: no 500, no 507, nothing of hers named or sized")
