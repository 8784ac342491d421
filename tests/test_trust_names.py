"""Trust class 2 (second round): the path to a cache entry is a capability, not a key anyone can compute.

The key of a gated repo follows from what the Hub shows everyone (file names, sizes, LFS digests) and the default
recipe; entries were ``entries/<key>/`` (0711, files world-readable), so a user outside the repo's group read its
converted shard on the first guess. An entry is now ``entries/<key>-<tag>``, the tag a keyed blake3 of the key under
the cache's secret (0400, the daemon's): the daemon hands the path to callers who passed its read check, and no one
else can name it. Nor does the head start's command line (world-readable in ``/proc``) name the staging directory.

Real daemon (root, in a thread); the other user is a child process that ``setuid``s to 65534.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from transformd.cache import Cache
from transformd.cache.names import SECRET_NAME
from transformd.sample import write_sample_checkpoint

from .support.callers import NOBODY, as_uid
from .support.daemon import Daemons, short_tempdir, wait_ready

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid"),
]

CATEGORY = "trust 2: converted weights without the right to read the source"
SHARD = "model-00002-of-00002.safetensors"

#: Runs as ``uid``: tries to open each path, prints what happened (only modules imported before the setuid work).
_OPENER = textwrap.dedent(
    """
    import json, os, sys
    uid = int(sys.argv[1])
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
    out = {}
    for p in json.loads(sys.argv[2]):
        try:
            if p.endswith("/"):
                out[p] = "listed %d" % len(os.listdir(p))
            else:
                fd = os.open(p, os.O_RDONLY)
                out[p] = "read %d bytes" % len(os.read(fd, 1 << 20))
                os.close(fd)
        except OSError as e:
            out[p] = "errno %d" % e.errno
    print(json.dumps(out))
    """
)


def _open_as(uid: int, paths: list[str]) -> dict[str, str]:
    r = subprocess.run([sys.executable, "-c", _OPENER, str(uid), json.dumps(paths)], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def world() -> Iterator[dict[str, Any]]:
    base = short_tempdir("tdn-")
    os.chmod(base, 0o755)
    allowed = base / "models"
    gated = write_sample_checkpoint(allowed / "gated", layers=1, experts=2)  # root's, 0700: 65534 may not read it
    public = write_sample_checkpoint(allowed / "public", layers=1, experts=2, seed=1)
    os.chmod(allowed, 0o755)
    os.chmod(gated, 0o700)
    for p in [public, *public.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    try:
        with Daemons() as daemons:
            daemon = daemons.start(cache_dir=base / "cache", allow_roots=[allowed], prefix="tdn-", log_level="critical")
            os.chmod(daemon.socket_path.parent, 0o755)
            os.chmod(daemon.socket_path, 0o666)
            yield {"daemon": daemon, "cache": base / "cache", "gated": gated, "public": public}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_user_who_computes_the_key_cannot_open_the_entry(world: dict[str, Any], fault_log) -> None:
    """Before: 65534 read the gated checkpoint's converted shard and manifest at ``entries/<key>/`` (key known)."""
    cache = world["cache"]
    with world["daemon"].client(timeout=60) as http:
        ready = wait_ready(http, http.post("/v1/checkpoints", json={"source": str(world["gated"])}).json()["key"],
                           timeout=120)
    key, served = ready["key"], Path(ready["path"])
    guesses = [f"{cache}/entries/{key}/checkpoint/{SHARD}", f"{cache}/entries/{key}/manifest.json",
               f"{cache}/entries/{key}/", f"{cache}/entries/", f"{cache}/staging/", f"{cache}/{SECRET_NAME}"]
    seen = _open_as(NOBODY, guesses)
    assert not [p for p, what in seen.items() if not what.startswith("errno")], seen
    assert (served / SHARD).is_file() and served.parent.name.startswith(f"{key}-")
    # a caller who passed the read check is given the path and opens it (an engine in another container)
    (status, body), = as_uid(world["daemon"].socket_path, NOBODY, [("POST", "/v1/checkpoints",
                                                                    {"source": str(world["public"])})])
    assert status in (200, 202), body
    with world["daemon"].client(timeout=60) as http:
        path = wait_ready(http, body["key"], timeout=120)["path"]
    (status, denied), = as_uid(world["daemon"].socket_path, NOBODY, [("GET", f"/v1/checkpoints/{key}", None)])
    assert status == 403 and str(served.parent.name) not in json.dumps(denied), denied
    seen = _open_as(NOBODY, [f"{path}/{SHARD}"])
    assert seen[f"{path}/{SHARD}"].startswith("read "), seen
    fault_log.record(CATEGORY, "uid 65534 computes the key of a checkpoint it may not read and opens entries/<key>/, "
                     "the cache's secret, lists entries/ and staging/", len(guesses),
                     "every open fails (no such entry name; the secret 0400); its own source's path opens")


def test_entries_of_an_earlier_layout_are_moved_under_their_names(tmp_path: Path) -> None:
    """A cache made before names (``entries/<key>``), or whose secret was made again, is not left with unreachable
    entries: opening it moves each under its name (a name already taken: the old copy goes to the trash)."""
    from .support.fakes import CopyConverter, write_source

    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    first = cache.get_or_convert(write_source(tmp_path / "a"))
    second = cache.get_or_convert(write_source(tmp_path / "b", seed=1))
    os.rename(first.root, cache.entries_dir / first.key)  # the layout before names
    os.rename(second.root, cache.entries_dir / f"{second.key}-{'0' * 32}")  # another secret's name
    assert cache.get(first.key) is None and cache.get(second.key) is None
    shutil.copytree(cache.entries_dir / first.key, tmp_path / "dup", symlinks=True)
    reopened = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    assert sorted(os.listdir(reopened.entries_dir)) == sorted(reopened.entry_name(k) for k in (first.key, second.key))
    assert reopened.get(first.key) is not None and reopened.get(second.key) is not None
    assert reopened.usage().entries == 2 and all(r.ok for r in reopened.verify())
    os.rename(tmp_path / "dup", reopened.entries_dir / first.key)  # an old copy beside the entry: to the trash
    again = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    assert sorted(os.listdir(again.entries_dir)) == sorted(again.entry_name(k) for k in (first.key, second.key))
    assert os.listdir(again.trash_dir) == []  # (emptied by the cleanup that follows)


def test_another_users_cache_names_its_entries_only_through_its_daemon(tmp_path: Path) -> None:
    """Another user (not root) cannot make the names: a clear error, not a guess."""
    cache = Cache(tmp_path / "cache", budget_bytes="1G")
    secret = cache.root / SECRET_NAME
    assert secret.stat().st_mode & 0o777 == 0o400
    code = textwrap.dedent(f"""
        import os, sys
        from transformd.cache import Cache, CacheError
        cache = Cache({str(cache.root)!r}, budget_bytes="1G")
        os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
        try:
            cache.get("0" * 32)
        except CacheError as e:
            print(e)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 0, r.stderr
    assert "through its daemon" in r.stdout and str(secret) in r.stdout, r.stdout


def test_the_head_starts_command_line_names_no_output_directory(tmp_path: Path) -> None:
    """Its command line (world-readable in /proc) named the staging directory (``staging/<key>.<pid>.<rand>``)."""
    from transformd.checkpoint import plan_conversion, write_checkpoint
    from transformd.checkpoint.headstart import HeadStart
    from transformd.formats import ScaleMode, Target

    src = write_sample_checkpoint(tmp_path / "src", layers=2, experts=2, shards=3)
    out = tmp_path / "staging" / "a-secret-name"
    out.mkdir(parents=True)
    plan = plan_conversion(src)
    head = HeadStart(plan, out, Target.OCP, ScaleMode.EXACT, threads=1)
    cmdline = Path(f"/proc/{head._proc.pid}/cmdline").read_bytes()
    deadline = time.monotonic() + 120
    while not head.finished and time.monotonic() < deadline:
        time.sleep(0.02)
    write_checkpoint(plan, out, target="ocp", devices=None, head_start=head)
    assert b"a-secret-name" not in cmdline and b"staging" not in cmdline, cmdline
    assert head.finished and all((out / f.shard.name).is_file() for f in head.finished)
