"""The corpus of hostile and broken checkpoints: each case is a small checkpoint
(:func:`tests.support.checkpoints.write_checkpoint`) with one defect planted, and how it must be refused
(:class:`Expect`: error, file, tensor, problem). Raw safetensors surgery helpers beside it.

tests/test_faults_hostile.py feeds the corpus to the library, the cache and the command line;
tests/test_daemon_hostile.py to the daemon.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformd.cache import SourceError
from transformd.formats import MxFormatError
from transformd.safetensors_io import MAX_HEADER_BYTES, CheckpointError, read_header

from .checkpoints import SHARD_A, SHARD_B, O, Q, default_shards, poke, replace_pair, set_tensor, write_checkpoint

INDEX = "model.safetensors.index.json"
ANY_TENSOR = "*"  # the message must name some tensor, which one depends on the file's order


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
    "NaN code 0x7F": Case("values", _values(set_tensor(f"{O}.weight", poke((3, 70), 0x7F)), f"{O}.weight",
                                            "NaN weight code (0x7F/0xFF) at index (3, 70)")),
    "NaN code 0xFF": Case("values", _values(set_tensor(f"{O}.weight", poke((95, 0), 0xFF)), f"{O}.weight",
                                            "NaN weight code (0x7F/0xFF) at index (95, 0)")),
    "E8M0 scale 0xFF": Case("values", _values(set_tensor(f"{O}.weight_scale", poke((7, 4), 0xFF)), f"{O}.weight",
                                              "E8M0 scale byte 0xFF (NaN) at scale index (7, 4)")),
    "scale shape mismatch": Case("values", _values(replace_pair(O, (32, 96), (32, 2)), f"{O}.weight",
                                                   "scale shape [32, 2] does not match")),
    "K not a multiple of 32": Case("values", _values(replace_pair(O, (32, 80), (32, 2)), f"{O}.weight", "K = 80")),
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
