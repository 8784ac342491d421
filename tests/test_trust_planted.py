"""Tests that kill the two bugs a review planted and the whole suite let pass (issue 42, item 10).

* The permission rule applying the group's bits to a caller who is neither the owner nor in the group: no test had
  a source that its group may read and others may not (0750 directories, 0640 files). Here uid 1000 owns one, its
  group 1000 may read it; a caller outside the group (uid 65534) is refused, a member of it (uid 65533 with gid
  1000) is served. Against the real daemon, the callers are child processes of those uids.
* ``O_NOFOLLOW`` dropped where ``--local-dir`` download records (``.cache/huggingface/download/<name>.metadata``)
  are read: no test linked such a record out of the source. A record that is a symbolic link (or lies under one)
  is never read, wherever it points; a regular one is (the control).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from transformd.cache import source_identity
from transformd.sample import write_sample_checkpoint

from .support.callers import NOBODY, as_uid
from .support.daemon import Daemons, short_tempdir
from .support.fakes import write_source

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid"),
]

CATEGORY = "trust, round 2: planted bugs"
OWNER = GROUP = 1000
MEMBER = NOBODY - 1  # in GROUP, not its owner


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, Any]]:
    base = short_tempdir("tdgb-")
    os.chmod(base, 0o755)
    allowed = base / "models"
    allowed.mkdir(mode=0o755)
    src = write_sample_checkpoint(allowed / "team" / "m", layers=1, experts=2)
    for p in [allowed / "team", *(allowed / "team").rglob("*")]:
        os.chown(p, OWNER, GROUP)
        os.chmod(p, 0o750 if p.is_dir() else 0o640)  # the group may read it; others may not
    try:
        with Daemons() as daemons:
            daemon = daemons.start(cache_dir=base / "cache", allow_roots=[allowed], prefix="tdgb-",
                                   log_level="critical")
            os.chmod(daemon.socket_path.parent, 0o755)
            os.chmod(daemon.socket_path, 0o666)  # let the unprivileged processes connect (the test's choice)
            yield {"sock": daemon.socket_path, "src": src}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_group_readable_source_is_refused_to_a_caller_outside_the_group(world: dict[str, Any], fault_log) -> None:
    request = [("POST", "/v1/checkpoints", {"source": str(world["src"])})]
    (status, body), = as_uid(world["sock"], NOBODY, request)
    assert status == 403 and body["error"]["code"] == "permission_denied", (status, body)
    (status, body), = as_uid(world["sock"], MEMBER, request, gid=GROUP)
    assert status in (200, 202), (status, body)
    fault_log.record(CATEGORY, "a 0750/0640 source of a group, asked for by an outsider and by a member", 2,
                     "outsider 403 permission_denied; member served")


def _local_dir(base: Path) -> tuple[Path, dict[str, str]]:
    files = {"model.safetensors": os.urandom(20_000), "config.json": b'{"model_type": "fake"}'}
    local = write_source(base / "local", files)
    etags = {
        "model.safetensors": hashlib.sha256(files["model.safetensors"]).hexdigest(),
        "config.json": hashlib.sha1(b"blob %d\0" % len(files["config.json"]) + files["config.json"]).hexdigest(),
    }
    return local, etags


def _record(etag: str) -> str:
    return f"{'c' * 40}\n{etag}\n{time.time()}\n"


def test_a_download_record_linked_out_of_the_source_is_not_read(tmp_path: Path, fault_log) -> None:
    outside = tmp_path / "outside"  # another place altogether (outside the source and any root)
    (outside / "huggingface" / "download").mkdir(parents=True)
    local, etags = _local_dir(tmp_path)
    meta = local / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    (outside / "record").write_text(_record(etags["model.safetensors"]))
    (meta / "model.safetensors.metadata").symlink_to(outside / "record")  # the record itself a link
    (meta / "config.json.metadata").write_text(_record(etags["config.json"]))  # (a regular one: the control)
    digests = {f.name: f.digest for f in source_identity(local).files}
    assert digests["config.json"] == "hf-git-sha1:" + etags["config.json"]
    assert digests["model.safetensors"].startswith("blake3:"), digests
    # a directory on the way a link: .cache -> outside
    shutil.rmtree(local / ".cache")
    (outside / "huggingface" / "download" / "config.json.metadata").write_text(_record(etags["config.json"]))
    (local / ".cache").symlink_to(outside)
    digests = {f.name: f.digest for f in source_identity(local).files}
    assert digests["config.json"].startswith("blake3:"), digests
    fault_log.record(CATEGORY, "--local-dir download records that are links out of the source (or lie under one)",
                     2, "never read: the files are hashed")
