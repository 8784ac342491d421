"""Hostile and broken checkpoints, refused through every door, and property-based fuzzing of the parsers.

Every case of the corpus is a small checkpoint (tests/test_checkpoint.py's builder) with one defect planted, fed to

* ``convert_checkpoint(src, out)``,
* ``Cache.get_or_convert(src)`` (the real converter),
* the command line in-process, ``transformd convert SRC --out DIR`` and ``transformd convert SRC --cache-dir C``
  (``transformd.cli.main``, the console script's own function: exit code, one line on standard error),
* and, for a representative subset, the installed ``transformd`` console script in a subprocess (both modes).

Each must refuse it with a message that names the file (and the tensor where there is one) and the problem;
the source must be left as it was, nothing may be left beside ``--out``, and the cache must hold nothing but
its layout and the documented ``failures/<key>.json`` record (plus its ``stat-cache/`` file).

Symlink policy (tested below): the library and the CLI follow symlinks wherever they point, as Hugging Face hub
snapshots need (their files link to ``../../blobs/``); they read with the invoking user's own permissions. The
index may only name plain file names in the checkpoint directory (no ``/``, no ``..``, no absolute path), so a
checkpoint cannot redirect reads by name. Confining what a client can make the *daemon* read is the daemon's job:
``transformd/api/paths.py`` (``SourcePolicy``) resolves every symlink of a source against the allowed roots.

The fuzzing half drives :func:`read_header` and the index/config parsing of :func:`plan_conversion` with
hypothesis (derandomized, no example database): arbitrary bytes, random JSON structures, mutated valid files
and random index/config documents. Only the documented errors may come out (:class:`CheckpointError`,
:class:`MxFormatError`, both ``ValueError``), within the deadline, without allocating by a declared size; what
is accepted is self-consistent, and valid files round-trip.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import stat
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from transformd import cli
from transformd.cache import Cache, SourceError
from transformd.checkpoint import convert_checkpoint, plan_conversion
from transformd.formats import MxFormatError
from transformd.safetensors_io import (
    DTYPE_BITS,
    MAX_HEADER_BYTES,
    TORCH_DTYPES,
    CheckpointError,
    SafetensorsWriter,
    read_header,
    read_tensor,
)

from .test_checkpoint import SHARD_A, SHARD_B, O, Q, _poke, _replace_pair, _set, default_shards, write_checkpoint

CATEGORY = "hostile input"
INDEX = "model.safetensors.index.json"
ANY_TENSOR = "*"  # the message must name some tensor, which one depends on the file's order
TRANSFORMD = Path(sys.executable).with_name("transformd")


# ---------------------------------------------------------------------------------------------------------------------
# Raw file surgery


def raw_parts(path: Path) -> tuple[int, bytes, bytes]:
    """(declared header length, header bytes, data bytes) of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, raw[8 : 8 + n], raw[8 + n :]


def write_raw(path: Path, header: bytes | dict, data: bytes, *, header_len: int | None = None) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text) if header_len is None else header_len) + text + data)


def edit_header(path: Path, fn: Callable[[dict], None]) -> None:
    """Apply ``fn`` to the parsed header of ``path`` (data offsets relative) and write it back, data unchanged."""
    _, text, data = raw_parts(path)
    header = json.loads(text)
    fn(header)
    write_raw(path, header, data)


def edit_json(path: Path, fn: Callable[[dict], object]) -> None:
    """Apply ``fn`` to the parsed JSON document of ``path`` (in place; its return value is ignored) and write it."""
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def tensors_by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: tuple(header[k]["data_offsets"]))


def tree(d: Path) -> dict[str, object]:
    """Every entry under ``d``: bytes of regular files, the link target of symlinks, the type of anything else.

    Never opens a FIFO (that would block) and never follows a link.
    """
    out: dict[str, object] = {}
    for p in sorted(d.rglob("*")):
        st_ = os.lstat(p)
        rel = str(p.relative_to(d))
        if stat.S_ISLNK(st_.st_mode):
            out[rel] = ("link", os.readlink(p))
        elif stat.S_ISREG(st_.st_mode):
            out[rel] = p.read_bytes()
        elif not stat.S_ISDIR(st_.st_mode):
            out[rel] = ("special", stat.S_IFMT(st_.st_mode))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The corpus


@dataclass(frozen=True)
class Expect:
    """How a case must be refused: the error, the file (relative to src; "" = src itself), tensor, problem."""

    error: type[BaseException]
    file: str
    problem: str
    tensor: str | None = None
    #: when the cache refuses earlier than the converter (while identifying the source): that error and problem
    cache_error: type[BaseException] | None = None
    cache_problem: str | None = None


@dataclass(frozen=True)
class Case:
    group: str
    build: Callable[[Path, Path], Expect]  # (src, outside) -> expectation; src is a valid checkpoint to damage


def _mx_shards(mutate: Callable[[dict], None]) -> Callable[[Path], None]:
    """A value-level defect: rebuild the checkpoint's tensors with ``mutate`` applied to them."""

    def rebuild(src: Path) -> None:
        shards = default_shards()
        mutate(shards)
        tmp = src.with_name(src.name + ".tmp")
        write_checkpoint(tmp, shards)
        for name in shards:
            os.replace(tmp / name, src / name)
        os.replace(tmp / INDEX, src / INDEX)
        shutil.rmtree(tmp)

    return rebuild


def _truncate(n_bytes: int) -> Callable[[Path, Path], Expect]:
    def build(src: Path, outside: Path) -> Expect:
        shard = src / SHARD_B
        last = max(read_header(shard).tensors.values(), key=lambda t: t.end).name
        os.truncate(shard, shard.stat().st_size - n_bytes)
        return Expect(CheckpointError, SHARD_B, "run past the end of the file", last)

    return build


def _cut_in_header(src: Path, outside: Path) -> Expect:
    n, _, _ = raw_parts(src / SHARD_B)
    os.truncate(src / SHARD_B, 8 + n // 2)
    return Expect(CheckpointError, SHARD_B, f"header length {n} runs past the end")


def _tiny_file(src: Path, outside: Path) -> Expect:
    (src / SHARD_B).write_bytes(b"\x05\x00\x00")
    return Expect(CheckpointError, SHARD_B, "file is 3 bytes, shorter than the 8-byte header length")


def _declared_length(n: int, problem: str) -> Callable[[Path, Path], Expect]:
    def build(src: Path, outside: Path) -> Expect:
        _, text, data = raw_parts(src / SHARD_B)
        write_raw(src / SHARD_B, text, data, header_len=n)
        return Expect(CheckpointError, SHARD_B, problem)

    return build


def _header_text(text: bytes, problem: str) -> Callable[[Path, Path], Expect]:
    def build(src: Path, outside: Path) -> Expect:
        _, _, data = raw_parts(src / SHARD_B)
        write_raw(src / SHARD_B, text, data)
        return Expect(CheckpointError, SHARD_B, problem)

    return build


def _overlap(src: Path, outside: Path) -> Expect:
    def fn(h: dict) -> None:
        first, second = tensors_by_offset(h)[:2]
        begin = h[first]["data_offsets"][0]
        size = h[second]["data_offsets"][1] - h[second]["data_offsets"][0]
        h[second]["data_offsets"] = [begin, begin + size]

    edit_header(src / SHARD_B, fn)
    return Expect(CheckpointError, SHARD_B, "overlap the previous tensor", ANY_TENSOR)


def _past_the_end(src: Path, outside: Path) -> Expect:
    """A tensor declared with 1 TiB of data that the file does not have (and that must never be allocated)."""

    def fn(h: dict) -> None:
        end = max(v["data_offsets"][1] for k, v in h.items() if k != "__metadata__")
        h["evil.weight"] = {"dtype": "U8", "shape": [1 << 40], "data_offsets": [end, end + (1 << 40)]}

    edit_header(src / SHARD_B, fn)
    edit_json(src / INDEX, lambda ix: ix["weight_map"].__setitem__("evil.weight", SHARD_B))
    return Expect(CheckpointError, SHARD_B, "run past the end of the file", "evil.weight")


def _gap_far_away(src: Path, outside: Path) -> Expect:
    def fn(h: dict) -> None:
        last = tensors_by_offset(h)[-1]
        b, e = h[last]["data_offsets"]
        h[last]["data_offsets"] = [b + (1 << 50), e + (1 << 50)]

    edit_header(src / SHARD_B, fn)
    return Expect(CheckpointError, SHARD_B, "belong to none", ANY_TENSOR)


def _entry_edit(tensor: str, key: str, value: object, problem: str, shard: str = SHARD_A):
    def build(src: Path, outside: Path) -> Expect:
        edit_header(src / shard, lambda h: h[tensor].__setitem__(key, value))
        return Expect(CheckpointError, shard, problem, tensor)

    return build


def _duplicate_name(src: Path, outside: Path) -> Expect:
    _, text, data = raw_parts(src / SHARD_A)
    header = json.loads(text)
    name = tensors_by_offset(header)[0]
    dup = json.dumps({name: header[name]})[1:-1].encode()
    write_raw(src / SHARD_A, b"{" + dup + b"," + json.dumps(header).encode()[1:], data)
    return Expect(CheckpointError, SHARD_A, "header names this key twice", name)


def _values(mutate: Callable[[dict], None], tensor: str, problem: str) -> Callable[[Path, Path], Expect]:
    def build(src: Path, outside: Path) -> Expect:
        _mx_shards(mutate)(src)
        return Expect(MxFormatError, SHARD_B, problem, tensor)

    return build


def _empty_experts(src: Path, outside: Path) -> Expect:
    """A 3-D MXFP8 pair of 2**62 empty experts: zero bytes of data, an astronomically long loop if iterated."""

    def fn(h: dict) -> None:
        end = max(v["data_offsets"][1] for k, v in h.items() if k != "__metadata__")
        h["z.weight"] = {"dtype": "F8_E4M3", "shape": [2**62, 0, 32], "data_offsets": [end, end]}
        h["z.weight_scale"] = {"dtype": "U8", "shape": [2**62, 0, 1], "data_offsets": [end, end]}

    edit_header(src / SHARD_B, fn)
    edit_json(src / INDEX, lambda ix: ix["weight_map"].update({"z.weight": SHARD_B, "z.weight_scale": SHARD_B}))
    return Expect(MxFormatError, SHARD_B, "weight [4611686018427387904, 0, 32] has no elements", "z.weight")


def _index_maps(tensor: str, shard: object, problem: str, *, make_file: str | None = None):
    def build(src: Path, outside: Path) -> Expect:
        if make_file is not None:  # the file exists, so a refusal is about the name, not about its absence
            target = Path(make_file.format(src=src, outside=outside))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes((src / SHARD_B).read_bytes())
        value = shard.format(src=src, outside=outside) if isinstance(shard, str) else shard
        edit_json(src / INDEX, lambda ix: ix["weight_map"].__setitem__(tensor, value))
        return Expect(CheckpointError, INDEX, problem, tensor)

    return build


def _index_doc(doc: object, problem: str) -> Callable[[Path, Path], Expect]:
    def build(src: Path, outside: Path) -> Expect:
        if isinstance(doc, bytes):
            (src / INDEX).write_bytes(doc)
        elif callable(doc):
            edit_json(src / INDEX, doc)
        else:
            (src / INDEX).write_text(json.dumps(doc))
        return Expect(CheckpointError, INDEX, problem)

    return build


def _misplaced(src: Path, outside: Path) -> Expect:
    edit_json(src / INDEX, lambda ix: ix["weight_map"].__setitem__("model.norm.weight", SHARD_B))
    return Expect(CheckpointError, SHARD_B, "the shard does not hold it", "model.norm.weight")


def _omitted(src: Path, outside: Path) -> Expect:
    edit_json(src / INDEX, lambda ix: ix["weight_map"].pop("model.norm.weight"))
    return Expect(CheckpointError, SHARD_A, "does not list it", "model.norm.weight")


def _config(name: str, content: bytes | None, problem: str) -> Callable[[Path, Path], Expect]:
    def build(src: Path, outside: Path) -> Expect:
        if content is None:
            (src / name).unlink()
        else:
            (src / name).write_bytes(content)
        return Expect(CheckpointError, name, problem)

    return build


def _fifo_at(rel: str) -> Callable[[Path, Path], Expect]:
    def build(src: Path, outside: Path) -> Expect:
        p = src / rel
        if p.exists():
            p.unlink()
        os.mkfifo(p)
        return Expect(CheckpointError, rel, "is not a regular file")

    return build


def _symlinked_shard_to(kind: str) -> Callable[[Path, Path], Expect]:
    def build(src: Path, outside: Path) -> Expect:
        (src / SHARD_B).unlink()
        if kind == "text file":  # a file outside the checkpoint that is no safetensors file (think /etc/passwd)
            (outside / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n" * 8)
            os.symlink(outside / "passwd", src / SHARD_B)
            return Expect(CheckpointError, SHARD_B, "is above the limit")
        if kind == "nothing":
            os.symlink(outside / "gone.safetensors", src / SHARD_B)
            return Expect(CheckpointError, INDEX, "which does not exist", ANY_TENSOR,
                          cache_error=SourceError, cache_problem="is a broken symlink")
        if kind == "itself":  # a loop
            os.symlink(src / (SHARD_B + ".loop"), src / SHARD_B)
            os.symlink(src / SHARD_B, src / (SHARD_B + ".loop"))
            return Expect(CheckpointError, INDEX, "which does not exist", ANY_TENSOR,
                          cache_error=SourceError, cache_problem="Too many levels of symbolic links")
        if kind == "directory":
            os.symlink(outside, src / SHARD_B)
            return Expect(CheckpointError, INDEX, "which does not exist", ANY_TENSOR)
        raise AssertionError(kind)

    return build


def _broken_link_among_files(src: Path, outside: Path) -> Expect:
    os.symlink(outside / "missing.txt", src / "notes.txt")
    return Expect(CheckpointError, "notes.txt", "a broken symlink?",
                  cache_error=SourceError, cache_problem="is a broken symlink")


DEEP = b"[" * 100_000 + b"]" * 100_000
BIG_INT = b'{"t": {"dtype": "U8", "shape": [' + b"7" * 5000 + b'], "data_offsets": [0, 1]}}'
EMBED = "model.embed_tokens.weight"

CORPUS: dict[str, Case] = {
    # safetensors header and data layout
    "truncated shard": Case("safetensors file", _truncate(10)),
    "shard cut inside its header": Case("safetensors file", _cut_in_header),
    "shard shorter than the length prefix": Case("safetensors file", _tiny_file),
    "header length past the end of the file": Case(
        "safetensors file", _declared_length(50_000_000, "runs past the end of the")
    ),
    "huge header (200 MiB declared)": Case(
        "safetensors file", _declared_length(200 << 20, f"is above the limit of {MAX_HEADER_BYTES} bytes")
    ),
    "header length 2**64-1": Case("safetensors file", _declared_length(2**64 - 1, "is above the limit")),
    "header not JSON": Case("safetensors file", _header_text(b"{this is not json", "not valid UTF-8 JSON")),
    "header not UTF-8": Case("safetensors file", _header_text(b'{"\xff\xfe": 1}', "not valid UTF-8 JSON")),
    "header a JSON list": Case("safetensors file", _header_text(b"[1, 2, 3]", "header is a JSON list, not an object")),
    "header nested 100000 deep": Case("safetensors file", _header_text(DEEP, "not valid UTF-8 JSON")),
    "header integer of 5000 digits": Case("safetensors file", _header_text(BIG_INT, "not valid UTF-8 JSON")),
    "overlapping offsets": Case("safetensors file", _overlap),
    "offsets out of range (1 TiB tensor in a small file)": Case("safetensors file", _past_the_end),
    "offsets out of range (2**50 gap)": Case("safetensors file", _gap_far_away),
    "unknown dtype": Case("safetensors file", _entry_edit(EMBED, "dtype", "F128", "unknown dtype 'F128'")),
    "shape/byte-count mismatch": Case(
        "safetensors file", _entry_edit(EMBED, "shape", [41, 96], "holds 7680 bytes, but BF16 [41, 96] needs 7872")
    ),
    "dimension above int64": Case(
        "safetensors file", _entry_edit(EMBED, "shape", [2**64, 0], "one above 9223372036854775807")
    ),
    "65 dimensions": Case("safetensors file", _entry_edit(EMBED, "shape", [1] * 65, "more than 64 dimensions")),
    "negative offsets": Case(
        "safetensors file", _entry_edit(EMBED, "data_offsets", [-1, 7679], "is not a pair of non-negative integers")
    ),
    "duplicate tensor name": Case("safetensors file", _duplicate_name),
    # values and pairing
    "NaN code 0x7F": Case("values", _values(_set(f"{O}.weight", _poke((3, 70), 0x7F)), f"{O}.weight",
                                            "NaN weight code (0x7F/0xFF) at index (3, 70)")),
    "NaN code 0xFF": Case("values", _values(_set(f"{O}.weight", _poke((95, 0), 0xFF)), f"{O}.weight",
                                            "NaN weight code (0x7F/0xFF) at index (95, 0)")),
    "E8M0 scale 0xFF": Case("values", _values(_set(f"{O}.weight_scale", _poke((7, 4), 0xFF)), f"{O}.weight",
                                              "E8M0 scale byte 0xFF (NaN) at scale index (7, 4)")),
    "scale shape mismatch": Case("values", _values(_replace_pair(O, (32, 96), (32, 2)), f"{O}.weight",
                                                   "scale shape [32, 2] does not match")),
    "K not a multiple of 32": Case("values", _values(_replace_pair(O, (32, 80), (32, 2)), f"{O}.weight", "K = 80")),
    "2**62 empty experts": Case("values", _empty_experts),
    # the index
    "index names a missing file": Case(
        "index", _index_maps(f"{Q}.weight", "model-00009-of-00009.safetensors", "which does not exist")
    ),
    "index names ../x.safetensors (which exists)": Case(
        "index", _index_maps(f"{Q}.weight", "../outside/x.safetensors", "not a file name in the directory",
                             make_file="{outside}/x.safetensors")
    ),
    "index names an absolute path (which exists)": Case(
        "index", _index_maps(f"{Q}.weight", "{outside}/x.safetensors", "not a file name in the directory",
                             make_file="{outside}/x.safetensors")
    ),
    "index names sub/x.safetensors (which exists)": Case(
        "index", _index_maps(f"{Q}.weight", "sub/x.safetensors", "not a file name in the directory",
                             make_file="{src}/sub/x.safetensors")
    ),
    "index names '..'": Case("index", _index_maps(f"{Q}.weight", "..", "not a file name in the directory")),
    "index maps to a number": Case("index", _index_maps(f"{Q}.weight", 7, "not a file name in the directory")),
    "index maps to null": Case("index", _index_maps(f"{Q}.weight", None, "not a file name in the directory")),
    "index not JSON": Case("index", _index_doc(b"{'weight_map': ", "cannot be read as JSON")),
    "index a JSON list": Case("index", _index_doc([{"weight_map": {}}], "holds a JSON list, not an object")),
    "index without weight_map": Case("index", _index_doc({"metadata": {}}, "has no weight_map object")),
    "index weight_map a list": Case("index", _index_doc({"weight_map": [SHARD_A]}, "has no weight_map object")),
    "index metadata not an object": Case(
        "index", _index_doc(lambda ix: ix.__setitem__("metadata", [1, 2]), "metadata entry that is not an object")
    ),
    "index places a tensor in the wrong shard": Case("index", _misplaced),
    "shard holds a tensor the index omits": Case("index", _omitted),
    # configs
    "config.json missing": Case("configs", _config("config.json", None, "is missing")),
    "config.json not JSON": Case("configs", _config("config.json", b"{model_type: x", "cannot be read as JSON")),
    "config.json a JSON list": Case("configs", _config("config.json", b"[]", "holds a JSON list, not an object")),
    "config.json a JSON string": Case("configs", _config("config.json", b'"x"', "holds a JSON str, not an object")),
    "config.json nested 100000 deep": Case("configs", _config("config.json", DEEP, "cannot be read as JSON")),
    "config.json not UTF-8": Case("configs", _config("config.json", b'{"a": "\xff"}', "cannot be read as JSON")),
    "hf_quant_config.json not JSON": Case("configs", _config("hf_quant_config.json", b"{", "cannot be read as JSON")),
    # paths and file types
    "symlinked shard escaping to a non-safetensors file": Case("paths and file types", _symlinked_shard_to("text file")),
    "dangling symlinked shard": Case("paths and file types", _symlinked_shard_to("nothing")),
    "symlink loop as a shard": Case("paths and file types", _symlinked_shard_to("itself")),
    "shard symlinked to a directory": Case("paths and file types", _symlinked_shard_to("directory")),
    "FIFO as config.json": Case("paths and file types", _fifo_at("config.json")),
    "FIFO as the index": Case("paths and file types", _fifo_at(INDEX)),
    "FIFO among the carried files": Case("paths and file types", _fifo_at("notes.txt")),
    "broken symlink among the carried files": Case("paths and file types", _broken_link_among_files),
}

#: Cases also run through the installed console script in subprocesses (both modes): one of each kind.
SUBPROCESS_CASES = [
    "truncated shard",
    "huge header (200 MiB declared)",
    "NaN code 0x7F",
    "index names ../x.safetensors (which exists)",
    "FIFO among the carried files",
    "config.json a JSON list",
]


def build_case(root: Path, name: str) -> tuple[Path, Path, Expect]:
    """``root/work/{src,outside}``: a damaged checkpoint and a directory beside it; returns (src, work, expect)."""
    work = root / "work"
    src = write_checkpoint(work / "src")
    outside = work / "outside"
    outside.mkdir()
    expect = CORPUS[name].build(src, outside)
    return src, work, expect


def check_message(message: str, src: Path, expect: Expect, *, cache: bool = False) -> None:
    problem = expect.cache_problem if cache and expect.cache_problem else expect.problem
    assert problem in message, f"problem {problem!r} not in: {message}"
    if not (cache and expect.cache_error):
        where = str(src / expect.file) if expect.file else str(src)
        assert where in message, f"file {where} not named in: {message}"
        if expect.tensor == ANY_TENSOR:
            assert "tensor " in message, f"no tensor named in: {message}"
        elif expect.tensor:
            assert f"tensor {expect.tensor}" in message, f"tensor {expect.tensor} not named in: {message}"
    else:
        assert str(src) in message, f"source {src} not named in: {message}"
    assert len(message) < 2000, "an error message must stay short, whatever the input"


def assert_cache_holds_only_the_failure(root: Path, expect: Expect, key: str | None) -> None:
    """Nothing but the layout, ``failures/<key>.json`` (when the converter refused) and a stat-cache file."""
    for d in ("entries", "staging", "trash", "quarantine", "leases"):
        assert os.listdir(root / d) == [], f"{d}/ is not empty: {os.listdir(root / d)}"
    assert set(os.listdir(root / "locks")) <= {"gc.lock"}, os.listdir(root / "locks")
    failures = os.listdir(root / "failures")
    if key is None:
        assert failures == []
    else:
        assert failures == [f"{key}.json"], failures
        record = json.loads((root / "failures" / f"{key}.json").read_text())
        assert record["error_type"] == expect.error.__name__ and expect.problem in record["message"]
    assert all(n.endswith(".json") and not n.startswith(".") for n in os.listdir(root / "stat-cache"))
    top = {n for n in os.listdir(root) if not (root / n).is_dir()}
    assert top <= {"CACHEDIR.TAG", "config.json"}, top


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, list[str], list[str]]:
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_refused_through_every_door(tmp_path: Path, name: str, capsys, fault_log) -> None:
    src, work, expect = build_case(tmp_path, name)
    before = tree(src)
    listing = sorted(os.listdir(work))

    # 1. the library
    with pytest.raises(expect.error) as info:
        convert_checkpoint(src, work / "out", device="cpu")
    check_message(str(info.value), src, expect)
    assert sorted(os.listdir(work)) == listing, "nothing may be left beside the output"

    # 2. the cache, with the real converter
    root = tmp_path / "cache"
    cache = Cache(root, budget_bytes="1G", device="cpu")
    with pytest.raises(expect.cache_error or expect.error) as info:
        cache.get_or_convert(src)
    check_message(str(info.value), src, expect, cache=True)
    key = None if expect.cache_error else cache.key_for(src)
    assert_cache_holds_only_the_failure(root, expect, key)
    if key is not None:
        st_ = cache.status(key)
        assert st_.state == "failed" and st_.error_type == expect.error.__name__
        assert cache.lookup(src) is None

    # 3. the command line (the console script's function), --out and cache mode
    code, stdout, stderr = run_cli(capsys, "convert", src, "--out", work / "out", "--device", "cpu")
    assert code == 2 and stdout == [] and len(stderr) == 1 and stderr[0].startswith("transformd: error: "), stderr
    check_message(stderr[0], src, expect)
    assert sorted(os.listdir(work)) == listing
    root2 = tmp_path / "cache-cli"
    code, stdout, stderr = run_cli(capsys, "convert", src, "--cache-dir", root2, "--device", "cpu", "--target", "fnuz")
    assert code == 2 and stdout == [] and len(stderr) == 1 and stderr[0].startswith("transformd: error: "), stderr
    check_message(stderr[0], src, expect, cache=True)
    assert_cache_holds_only_the_failure(root2, expect, key)

    assert tree(src) == before, "the source must not be changed by a refusal"
    errors = expect.error.__name__ + (f", cache: {expect.cache_error.__name__}" if expect.cache_error else "")
    names = "file and tensor" if expect.tensor else "file"
    fault_log.record(
        f"{CATEGORY}: {CORPUS[name].group}",
        name,
        4,
        f"refused ({errors}; names {names} and problem); nothing beside --out; cache keeps only its failures/ record",
    )


@pytest.mark.timeout(120)
def test_corpus_refused_by_the_console_script(tmp_path: Path, fault_log) -> None:
    """A representative subset through the installed ``transformd`` script: exit 2, one line, nothing left."""
    assert TRANSFORMD.exists(), TRANSFORMD
    runs = []
    for i, name in enumerate(SUBPROCESS_CASES):
        src, work, expect = build_case(tmp_path / f"c{i}", name)
        for mode in ("out", "cache"):
            dest = ["--out", str(work / "out")] if mode == "out" else ["--cache-dir", str(tmp_path / f"c{i}" / "cache")]
            runs.append((name, mode, src, work, expect, [str(TRANSFORMD), "convert", str(src), *dest, "--device", "cpu", "--target", "fnuz"]))
    env = {**os.environ, "TRANSFORMD_CACHE_DIR": str(tmp_path / "unused-default-cache")}
    results = []
    for batch in range(0, len(runs), 4):  # four at a time on a 2-core machine: bounded memory and time
        procs = [(r, subprocess.Popen(r[5], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
                 for r in runs[batch : batch + 4]]
        try:
            for r, p in procs:
                out, err = p.communicate(timeout=90)
                results.append((r, p.returncode, out, err))
        finally:  # a hang (or the test's timeout) must not leave processes behind
            for _, p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate(timeout=30)
    for (name, mode, src, work, expect, _), code, out, err in results:
        lines = err.splitlines()
        assert code == 2, (name, mode, code, err)
        assert out == "" and len(lines) == 1 and lines[0].startswith("transformd: error: "), (name, mode, err)
        check_message(lines[0], src, expect, cache=mode == "cache")
        assert sorted(os.listdir(work)) == ["outside", "src"], (name, mode)
        if mode == "cache":
            root = work.parent / "cache"
            assert_cache_holds_only_the_failure(root, expect, Cache(root, cleanup=False).key_for(src))
    assert not (tmp_path / "unused-default-cache").exists()
    fault_log.record(
        f"{CATEGORY}: console script",
        f"{len(SUBPROCESS_CASES)} corpus cases through `transformd convert` subprocesses, --out and cache mode",
        len(runs),
        "exit 2, one-line error naming file/tensor/problem, nothing left",
    )


# ---------------------------------------------------------------------------------------------------------------------
# Symlinks: the library follows them (HF snapshots); the index cannot name a path; the daemon confines


def test_symlink_policy_of_the_library(tmp_path: Path, capsys, fault_log) -> None:
    plain = write_checkpoint(tmp_path / "plain")
    expected = tree(convert_checkpoint(plain, tmp_path / "expected", device="cpu").out)

    # a shard and a carried file linked to files outside the checkpoint directory, as in an HF hub snapshot
    src = write_checkpoint(tmp_path / "linked")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name in (SHARD_B, "tokenizer.json"):
        os.replace(src / name, blobs / name)
        os.symlink(os.path.relpath(blobs / name, src), src / name)

    out = convert_checkpoint(src, tmp_path / "out", device="cpu").out
    got = tree(out)
    assert got == expected, "links are followed: the output is that of the plain checkpoint"
    assert not any(isinstance(v, tuple) for v in got.values()), "the output holds regular files only, no links"

    code, stdout, _ = run_cli(capsys, "convert", src, "--out", tmp_path / "out-cli", "--device", "cpu", "--target", "fnuz")
    assert code == 0 and tree(Path(stdout[-1])) == expected

    cache = Cache(tmp_path / "cache", budget_bytes="1G", device="cpu")
    entry = cache.get_or_convert(src)
    assert tree(entry.path) == expected
    assert cache.key_for(src) == cache.key_for(plain), "the key is the linked content's, not the link's"
    fault_log.record(
        f"{CATEGORY}: paths and file types",
        "shard and carried file symlinked outside the checkpoint (HF snapshot style)",
        3,
        "followed by policy (library/CLI read with the caller's permissions; the daemon confines sources to "
        "allowed roots); output holds regular files only, identical to the plain checkpoint's",
    )


# ---------------------------------------------------------------------------------------------------------------------
# Property-based fuzzing


FUZZ_CATEGORY = "fuzzing (hypothesis, derandomized)"
FUZZ = settings(
    max_examples=200,
    deadline=1000,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def check_header_result(path: Path) -> str:
    """Parse ``path``: either a CheckpointError naming it, or a header whose tensors tile the data exactly."""
    try:
        h = read_header(path)
    except CheckpointError as err:
        assert err.file == str(path) and str(path) in str(err)
        assert len(str(err)) < 2000 + len(str(path)) + len(err.tensor or "")
        return "refused"
    size = path.stat().st_size
    assert h.file_size == size and 8 <= h.data_start <= size
    pos = h.data_start
    for t in h.tensors.values():  # in offset order
        assert t.dtype in DTYPE_BITS
        assert t.begin == pos and t.end >= t.begin
        assert t.nbytes * 8 == DTYPE_BITS[t.dtype] * math.prod(t.shape)
        assert len(t.shape) <= 64 and all(0 <= d < 2**63 for d in t.shape)
        pos = t.end
    assert pos == size
    return "accepted"


def _json_values() -> st.SearchStrategy:
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12)
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
        max_leaves=16,
    )


def _entry() -> st.SearchStrategy:
    dims = st.integers(0, 9) | st.sampled_from([-1, 2**63, 2**64, 2**70, True, 1.0, "3"])
    shapes = st.lists(dims, max_size=4) | _json_values()
    offsets = st.lists(st.integers(-2, 80) | st.sampled_from([2**63, 2**64, 1.5, None]), min_size=0, max_size=3)
    dtypes = st.sampled_from(sorted(DTYPE_BITS)) | st.text(max_size=6) | st.integers()
    return st.fixed_dictionaries({}, optional={"dtype": dtypes, "shape": shapes, "data_offsets": offsets | _json_values()})


@FUZZ
@given(data=st.binary(max_size=4096))
@example(data=b"")
@example(data=struct.pack("<Q", 2**64 - 1))
@example(data=struct.pack("<Q", 200 << 20) + b"{}")
@example(data=struct.pack("<Q", 2) + b"{}")
@example(data=struct.pack("<Q", len(DEEP)) + DEEP)
@example(data=struct.pack("<Q", len(BIG_INT)) + BIG_INT + b"\0")
def test_fuzz_arbitrary_bytes(fuzz_dir: Path, data: bytes, fault_log) -> None:
    path = fuzz_dir / "arbitrary.safetensors"
    path.write_bytes(data)
    fault_log.record(FUZZ_CATEGORY, "arbitrary bytes as a safetensors file", 1, check_header_result(path))


@FUZZ
@given(header=_json_values() | st.dictionaries(st.text(max_size=6), _entry(), max_size=4),
       data=st.binary(max_size=96), pad=st.integers(0, 9))
def test_fuzz_json_structures(fuzz_dir: Path, header, data: bytes, pad: int, fault_log) -> None:
    path = fuzz_dir / "structured.safetensors"
    text = json.dumps(header, allow_nan=True).encode() + b" " * pad
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    fault_log.record(FUZZ_CATEGORY, "random JSON values and tensor entries as a header", 1, check_header_result(path))


_TORCH_ST = sorted(TORCH_DTYPES)


@st.composite
def _specs(draw, *, torch_only: bool = False) -> list[tuple[str, str, list[int]]]:
    names = draw(st.lists(st.text(min_size=1, max_size=10).filter(lambda s: s != "__metadata__"),
                          min_size=0, max_size=5, unique=True))
    specs = []
    for name in names:
        dtype = draw(st.sampled_from(_TORCH_ST if torch_only else sorted(DTYPE_BITS)))
        shape = draw(st.lists(st.integers(0, 6), max_size=3))
        if DTYPE_BITS[dtype] * math.prod(shape) % 8:
            shape = [*shape, 8]  # sub-byte dtypes must fill whole bytes
        specs.append((name, dtype, shape))
    return specs


def _write_valid(path: Path, specs, metadata, rng: random.Random) -> dict[str, bytes]:
    """Write a valid file with random bytes for each tensor; returns the bytes per name."""
    from transformd.safetensors_io import tensor_nbytes

    if path.exists():
        path.unlink()
    blobs = {name: rng.randbytes(tensor_nbytes(dtype, shape)) for name, dtype, shape in specs}
    with SafetensorsWriter(path, specs, metadata) as w:
        for name, _, _ in specs:
            w.write(name, blobs[name])
    return blobs


@FUZZ
@given(specs=_specs(), metadata=st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
       seed=st.integers(0, 2**32 - 1))
def test_valid_files_round_trip(fuzz_dir: Path, specs, metadata, seed: int, fault_log) -> None:
    path = fuzz_dir / "valid.safetensors"
    blobs = _write_valid(path, specs, metadata, random.Random(seed))
    h = read_header(path)
    assert {n: (t.dtype, list(t.shape)) for n, t in h.tensors.items()} == {n: (d, s) for n, d, s in specs}
    assert h.metadata == metadata
    with open(path, "rb") as f:
        for name, dtype, _ in specs:
            t = h.tensors[name]
            assert path.read_bytes()[t.begin : t.end] == blobs[name]
            if dtype in TORCH_DTYPES:
                assert read_tensor(f, t).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == blobs[name]
    # the safetensors library reads what we write, byte for byte
    torch_specs = [s for s in specs if s[1] in TORCH_DTYPES]
    if len(torch_specs) == len(specs):
        with safe_open(str(path), "pt") as f:
            assert set(f.keys()) == {n for n, _, _ in specs}
            for name, _, _ in specs:
                assert f.get_tensor(name).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == blobs[name]
    fault_log.record(FUZZ_CATEGORY, "valid files written by SafetensorsWriter round-trip", 1, "read back identical")


@FUZZ
@given(specs=_specs(torch_only=True), seed=st.integers(0, 2**32 - 1))
def test_library_files_are_read_as_written(fuzz_dir: Path, specs, seed: int, fault_log) -> None:
    """Files written by the safetensors library itself parse to the same names, dtypes, shapes and bytes."""
    rng = random.Random(seed)
    tensors = {}
    for name, dtype, shape in specs:
        nbytes = DTYPE_BITS[dtype] * math.prod(shape) // 8
        tensors[name] = torch.frombuffer(bytearray(rng.randbytes(nbytes)) or bytearray(1), dtype=torch.uint8)[
            :nbytes].view(TORCH_DTYPES[dtype]).reshape(shape)
    path = fuzz_dir / "library.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    h = read_header(path)
    assert {n: (t.dtype, list(t.shape)) for n, t in h.tensors.items()} == {n: (d, s) for n, d, s in specs}
    raw = path.read_bytes()
    for name, t in h.tensors.items():
        assert raw[t.begin : t.end] == tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    fault_log.record(FUZZ_CATEGORY, "files written by the safetensors library parse as written", 1, "read identical")


_MUTATION = st.tuples(st.sampled_from(["set", "insert", "delete", "truncate", "json-digit"]),
                      st.integers(0, 2**16), st.integers(0, 255))


@FUZZ
@given(specs=_specs(), seed=st.integers(0, 2**32 - 1), mutations=st.lists(_MUTATION, min_size=1, max_size=4))
def test_fuzz_mutated_valid_files(fuzz_dir: Path, specs, seed: int, mutations, fault_log) -> None:
    path = fuzz_dir / "mutated.safetensors"
    _write_valid(path, specs, {"format": "pt"}, random.Random(seed))
    raw = bytearray(path.read_bytes())
    for op, pos, byte in mutations:
        if not raw:
            break
        i = pos % len(raw)
        if op == "set":
            raw[i] = byte
        elif op == "insert":
            raw[i:i] = bytes([byte])
        elif op == "delete":
            del raw[i]
        elif op == "truncate":
            del raw[i:]
        else:  # change a digit inside the header's JSON: offsets and shapes
            (n,) = struct.unpack("<Q", bytes(raw[:8]).ljust(8, b"\0"))
            digits = [j for j in range(8, min(len(raw), 8 + n)) if 48 <= raw[j] <= 57]
            if digits:
                raw[digits[pos % len(digits)]] = 48 + byte % 10
    path.write_bytes(bytes(raw))
    result = check_header_result(path)
    if result == "accepted" and all(t.dtype in TORCH_DTYPES for t in read_header(path).tensors.values()):
        with safe_open(str(path), "pt") as f:  # what we accept, the reference library accepts too
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                f.get_tensor(name)
    fault_log.record(FUZZ_CATEGORY, "valid files with 1-4 byte mutations (set/insert/delete/truncate/digits)", 1,
                     result)


@settings(FUZZ, max_examples=60)
@given(declared=st.integers(0, 2**64 - 1), dims=st.lists(st.integers(0, 2**66), min_size=1, max_size=3),
       begin=st.integers(0, 2**66), span=st.integers(0, 2**66))
def test_declared_sizes_are_never_allocated(
    fuzz_dir: Path, declared: int, dims, begin: int, span: int, fault_log
) -> None:
    """Header lengths, shapes and offsets are numbers to check, never sizes to allocate or read."""
    path = fuzz_dir / "declared.safetensors"
    entry = {"t": {"dtype": "U8", "shape": dims, "data_offsets": [begin, begin + span]}}
    text = json.dumps(entry).encode()
    for prefix in (struct.pack("<Q", declared), struct.pack("<Q", len(text))):
        path.write_bytes(prefix + text + b"\0" * 64)
        tracemalloc.start()
        try:
            result = check_header_result(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"read_header allocated {peak} bytes for a {path.stat().st_size}-byte file"
        fault_log.record(FUZZ_CATEGORY, "declared header length, shape and offsets up to 2**66", 1,
                         f"{result}, peak allocation < 1 MiB (tracemalloc)")


# -- the index and the configs, through plan_conversion (and a conversion when the plan is accepted)


@pytest.fixture(scope="module")
def fuzz_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("fuzz-ckpt") / "src")


def _weight_maps(real: dict[str, str]) -> st.SearchStrategy:
    names = sorted(real)
    values = st.sampled_from(sorted(set(real.values()))) | st.sampled_from(
        ["", ".", "..", "../x.safetensors", "/etc/passwd", "sub/x", "missing.safetensors", "a\0b", "config.json"]
    ) | _json_values()
    keys = st.sampled_from(names) | st.text(max_size=8)

    @st.composite
    def mutate(draw) -> dict:
        wm = dict(real)
        for _ in range(draw(st.integers(0, 3))):
            op = draw(st.sampled_from(["set", "drop", "add"]))
            if op == "set":
                wm[draw(st.sampled_from(names))] = draw(values)
            elif op == "drop" and wm:
                wm.pop(draw(st.sampled_from(sorted(wm))))
            else:
                wm[draw(keys)] = draw(values)
        return wm

    return mutate() | _json_values()


@settings(FUZZ, max_examples=120, deadline=5000)  # each accepted plan is also converted
@given(data=st.data())
def test_fuzz_index_and_configs(fuzz_checkpoint: Path, tmp_path_factory, data, fault_log) -> None:
    src = fuzz_checkpoint
    originals = {n: (src / n).read_bytes() for n in (INDEX, "config.json", "hf_quant_config.json")}
    real_map = json.loads(originals[INDEX])["weight_map"]
    try:
        which = data.draw(st.sampled_from(["index", "index", "config", "hf_quant"]))
        name = INDEX
        if which == "index":
            doc = data.draw(
                st.fixed_dictionaries({"weight_map": st.just(real_map)}, optional={"metadata": _json_values()})
                | st.fixed_dictionaries({"weight_map": _weight_maps(real_map)},
                                        optional={"metadata": _json_values(), "extra": _json_values()})
                | _json_values()
            )
            (src / INDEX).write_text(json.dumps(doc))
        else:
            name = "config.json" if which == "config" else "hf_quant_config.json"
            base = json.loads(originals[name])
            doc = data.draw(_json_values() | st.builds(
                lambda k, v: {**base, k: v},
                st.sampled_from(["quantization_config", "quantization", "producer", "ignore"]), _json_values(),
            ))
            (src / name).write_text(json.dumps(doc))
        fault = f"random {INDEX if which == 'index' else name} document"
        try:
            plan_conversion(src)
        except (CheckpointError, MxFormatError) as err:
            assert str(src) in str(err)
            fault_log.record(FUZZ_CATEGORY, fault, 1, "refused by the plan")
            return
        out = tmp_path_factory.mktemp("fuzz-out") / "out"
        try:  # an accepted plan must convert (a wrong structure must not surface after the work is done)
            convert_checkpoint(src, out, device="cpu")
        except (CheckpointError, MxFormatError) as err:
            assert str(src) in str(err) and not out.exists()
            assert os.listdir(out.parent) == []
            fault_log.record(FUZZ_CATEGORY, fault, 1, "refused during the conversion")
        else:
            json.loads((out / "config.json").read_text())
            fault_log.record(FUZZ_CATEGORY, fault, 1, "accepted and converted")
    finally:
        for n, b in originals.items():
            (src / n).write_bytes(b)
