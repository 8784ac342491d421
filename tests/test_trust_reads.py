"""Trust class 1: the daemon reads only files that resolve inside an allowed root, checked on the open descriptor.

Adversarial cases against the real daemon (real app under uvicorn on a unix socket, real converter, real files);
``outside/`` is beside the allowed root and holds a valid safetensors file and a secret text file:

* an index entry with a dot-name (skipped by the old root check and by the key, yet read) linking outside:
  refused, nothing published, no cache entry;
* a symlink to an outside file, to an outside path that does not exist, ``/proc/self/root/...`` and an outside
  directory that exists or not: the same 403 message (only the name asked for differs), never the outside path;
* a shard inside the root whose first 8 bytes are text: the 422 does not quote them as a header length;
* the conversion reads the checked descriptors: a symlink swapped after the check does not redirect the read.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from transformd.sample import write_sample_checkpoint

from .support.daemon import Daemons

pytestmark = pytest.mark.timeout(120)

CATEGORY = "trust 1: reads outside the allowed roots"
SECRET = b"SECRET-root:x:0:0:do-not-leak\n" * 4
SHARD_B = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("trust-reads")
    allowed = base / "allowed"
    outside = base / "outside"
    allowed.mkdir()
    outside.mkdir()
    good = write_sample_checkpoint(allowed / "good", layers=1, experts=2)
    shutil.copy(good / SHARD_B, outside / "real.safetensors")
    (outside / "secret.txt").write_bytes(SECRET)
    with Daemons() as daemons:
        daemon = daemons.start(cache_dir=base / "cache", allow_roots=[allowed], prefix="tdr-", log_level="critical")
        with daemon.client(timeout=60) as http:
            yield {"http": http, "allowed": allowed, "outside": outside, "good": good, "cache": base / "cache"}


def _copy(world: dict[str, Any], name: str) -> Path:
    dst = world["allowed"] / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(world["good"], dst)
    return dst


def _entries(world: dict[str, Any]) -> list[str]:
    return sorted(os.listdir(world["cache"] / "entries"))


def _no_leak(text: str, world: dict[str, Any]) -> None:
    assert str(world["outside"]) not in text, text
    assert "SECRET" not in text and "do-not-leak" not in text, text


def _wait(http: httpx.Client, key: str) -> dict[str, Any]:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        body = http.get(f"/v1/checkpoints/{key}").json()
        if body["state"] in ("ready", "failed"):
            return body
        time.sleep(0.05)
    raise AssertionError("conversion did not finish")


def test_dot_named_index_entry_linking_outside_is_never_read(world: dict[str, Any], fault_log) -> None:
    """The issue's escape: ``.x.safetensors`` -> a file outside, named by the index. Before: converted, published."""
    src = _copy(world, "dotname")
    (src / SHARD_B).unlink()
    os.symlink(world["outside"] / "real.safetensors", src / ".b.safetensors")
    index = json.loads((src / INDEX).read_text())
    index["weight_map"] = {k: (".b.safetensors" if v == SHARD_B else v) for k, v in index["weight_map"].items()}
    (src / INDEX).write_text(json.dumps(index))
    before = _entries(world)
    http = world["http"]
    r = http.post("/v1/checkpoints", json={"source": str(src)})
    body = r.json()
    if r.status_code == 202:  # the old daemon: it converted the outside file
        body = _wait(http, body["key"])
    assert r.status_code in (403, 422), (r.status_code, body)
    _no_leak(r.text, world)
    assert _entries(world) == before, "an entry was published from a file outside the roots"
    fault_log.record(CATEGORY, "index entry with a dot-name linking to a safetensors file outside", 1,
                     f"{r.status_code} {body['error']['code']}, nothing read or published")


def _refusal(http: httpx.Client, source: str) -> dict[str, Any]:
    r = http.post("/v1/checkpoints", json={"source": source})
    assert r.status_code == 403, (source, r.status_code, r.text)
    return r.json()["error"]


def test_outside_paths_get_one_answer_whether_they_exist_or_not(world: dict[str, Any], fault_log) -> None:
    """No oracle: existing and missing outside paths, /proc/self/root and links all read the same 403."""
    http, outside, allowed = world["http"], world["outside"], world["allowed"]
    (outside / "model").mkdir(exist_ok=True)
    links = allowed / "links"
    links.mkdir(exist_ok=True)
    for name, target in [("to-existing", outside / "model"), ("to-missing", outside / "nothing-here")]:
        if not (links / name).is_symlink():
            os.symlink(target, links / name)
    sources = [
        str(outside / "model"),
        str(outside / "nothing-here"),
        f"/proc/self/root{outside}/model",
        f"/proc/self/root{outside}/nothing-here",
        str(links / "to-existing"),
        str(links / "to-missing"),
    ]
    shapes = set()
    for source in sources:
        err = _refusal(http, source)
        assert err["code"] == "source_not_allowed", err
        _no_leak(err["message"].replace(source, "SRC"), world)
        shapes.add(err["message"].replace(source, "SRC"))
    assert len(shapes) == 1, shapes
    fault_log.record(CATEGORY, "outside source: existing, missing, /proc/self/root, symlinked (existence oracle)",
                     len(sources), "one identical 403 source_not_allowed, no outside path")


def test_links_inside_a_source_to_outside_get_one_answer(world: dict[str, Any], fault_log) -> None:
    """A shard linking to an outside secret and one linking to a missing outside file: the same 403."""
    http = world["http"]
    shapes = set()
    for i, target in enumerate([world["outside"] / "secret.txt", world["outside"] / "missing.safetensors",
                                Path("/proc/self/environ")]):
        src = _copy(world, f"link{i}")
        (src / SHARD_B).unlink()
        os.symlink(target, src / SHARD_B)
        err = _refusal(http, str(src))
        assert err["code"] == "source_not_allowed", err
        _no_leak(err["message"], world)
        assert "/proc/self/environ" not in err["message"]
        shapes.add(err["message"].replace(str(src), "SRC"))
    assert len(shapes) == 1, shapes
    fault_log.record(CATEGORY, "shard symlinked to an outside secret, a missing outside file, /proc/self/environ",
                     3, "one identical 403 naming only the link")


def test_header_length_error_does_not_quote_file_bytes(world: dict[str, Any], fault_log) -> None:
    """A text file where a shard should be: the old 422 printed its first 8 bytes as a header length."""
    src = _copy(world, "textshard")
    (src / SHARD_B).unlink()
    (src / SHARD_B).write_bytes(SECRET)
    r = world["http"].post("/v1/checkpoints", json={"source": str(src)})
    assert r.status_code == 422, r.text
    quoted = str(struct.unpack("<Q", SECRET[:8])[0])
    assert quoted not in r.text, r.text
    assert "is above the limit" in r.json()["error"]["message"]
    fault_log.record(CATEGORY, "text file as a shard (header length = its first 8 bytes)", 1,
                     "422 without the bytes")


def test_conversion_reads_the_checked_descriptor_not_the_name(tmp_path: Path, fault_log) -> None:
    """A symlink swapped after the check (to a file outside) does not change what is read."""
    from transformd.cache.securefs import OutsideRootsError, open_source
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "m").mkdir(parents=True)
    outside.mkdir()
    (allowed / "real.json").write_text('{"inside": true}')
    (outside / "secret.json").write_bytes(SECRET)
    os.symlink(allowed / "real.json", allowed / "m" / "config.json")
    roots = [os.path.realpath(allowed)]
    with open_source(allowed / "m", roots) as tree:
        view = tree.view()
        os.unlink(allowed / "m" / "config.json")
        os.symlink(outside / "secret.json", allowed / "m" / "config.json")  # the swap
        assert (view / "config.json").read_text() == '{"inside": true}'
        assert sorted(os.listdir(view)) == ["config.json"]
    with pytest.raises(OutsideRootsError) as err:
        open_source(allowed / "m", roots)
    assert str(outside) not in str(err.value)
    fault_log.record(CATEGORY, "symlink swapped to an outside file after the check", 1,
                     "the checked descriptor is read; a new check refuses")


def test_hidden_files_are_neither_read_nor_keyed(tmp_path: Path, fault_log) -> None:
    """Dot-names are not in the view the converter reads, so the key covers exactly the files read."""
    from transformd.cache.securefs import open_source
    src = write_sample_checkpoint(tmp_path / "allowed" / "m", layers=1, experts=2)
    (src / ".hidden.json").write_text("{}")
    with open_source(src, [os.path.realpath(tmp_path / "allowed")]) as tree:
        names = [f.rel for f in tree.files]
        view = tree.view()
        assert ".hidden.json" not in names and not (view / ".hidden.json").exists()
        assert sorted(os.listdir(view)) == sorted(n for n in os.listdir(src) if not n.startswith("."))
    fault_log.record(CATEGORY, "hidden file in a source", 1,
                     "not opened, not in the key, not readable by the converter")
