"""The strict header reader against files written by the safetensors library and against hostile files,
and the streaming writer against the safetensors library's reader."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from transformd.safetensors_io import (
    MAX_HEADER_BYTES,
    CheckpointError,
    SafetensorsWriter,
    read_header,
    read_tensor,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(7, generator=g),
        "c.codes": torch.randint(0, 256, (4, 64), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn),
        "d.e8m0": torch.randint(0, 255, (4, 2), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu),
        "e.scalar": torch.tensor(1.5),
        "f.empty": torch.zeros(0, 3),
        "g.i64": torch.arange(5),
        "h.bool": torch.tensor([True, False, True]),
    }


def _raw_file(path: Path, header: object, data: bytes = b"", *, header_len: int | None = None) -> Path:
    """A safetensors file with an arbitrary header (an object, or raw bytes) and data section."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# ---------------------------------------------------------------------------------------------------------------------
# Reading what the safetensors library writes


def test_read_header_of_library_file(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    assert set(header.tensors) == set(tensors)
    assert header.file_size == path.stat().st_size
    begins = [t.begin for t in header.tensors.values()]
    assert begins == sorted(begins), "tensors are listed in file order"
    with open(path, "rb") as f:
        for name, t in tensors.items():
            info = header.tensors[name]
            assert info.shape == tuple(t.shape)
            got = read_tensor(f, info)
            assert got.dtype == t.dtype
            assert _bytes(got) == _bytes(t)


# ---------------------------------------------------------------------------------------------------------------------
# Writing


def test_writer_output_is_read_by_safetensors(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "w.safetensors"
    specs = [(n, _st_dtype(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    with SafetensorsWriter(path, specs, {"format": "pt", "who": "test"}) as w:
        for name, t in tensors.items():
            w.write(name, t)
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert n % 8 == 0, "header padded to a multiple of 8, as the safetensors library does"
    loaded = load_file(str(path))
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert _bytes(loaded[name]) == _bytes(t)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt", "who": "test"}
    assert w.bytes_written == path.stat().st_size
    read_header(path)  # and our own strict reader accepts it


def test_writer_pieces_and_byte_range_copy(tmp_path: Path) -> None:
    src = tmp_path / "src.safetensors"
    big = torch.arange(1000, dtype=torch.float32)
    save_file({"big": big, "small": torch.ones(3)}, str(src))
    info = read_header(src).tensors["big"]
    out = tmp_path / "out.safetensors"
    pieces = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    with open(src, "rb") as f, SafetensorsWriter(out, [("copied", "F32", [1000]), ("pieces", "I32", [3, 4])]) as w:
        w.copy_from("copied", f, info.begin)
        for row in pieces:  # one tensor in several pieces
            w.write("pieces", row)
    loaded = load_file(str(out))
    assert torch.equal(loaded["copied"], big)
    assert torch.equal(loaded["pieces"], pieces)
    src_bytes, out_bytes = src.read_bytes(), out.read_bytes()
    out_info = read_header(out).tensors["copied"]
    assert src_bytes[info.begin : info.end] == out_bytes[out_info.begin : out_info.end]


def test_writer_takes_every_kind_of_buffer(tmp_path: Path) -> None:
    """Tensors of any dtype and layout, memoryviews of a slot and 0-d tensors are written as their bytes."""
    fp8 = torch.arange(64, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(8, 8)
    strided = torch.arange(32, dtype=torch.float32).reshape(4, 8)[:, ::2]  # not contiguous: copied once
    slot = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    specs = [("fp8", "F8_E4M3", [8, 8]), ("strided", "F32", [4, 4]), ("view", "U8", [16]), ("scalar", "F32", [])]
    out = tmp_path / "out.safetensors"
    with SafetensorsWriter(out, specs) as w:
        w.write("fp8", fp8)
        w.write("strided", strided)
        w.write("view", memoryview(slot.numpy())[100:116])
        w.write("scalar", torch.tensor(2.5))
    loaded = load_file(str(out))
    assert torch.equal(loaded["fp8"].view(torch.uint8), fp8.view(torch.uint8))
    assert torch.equal(loaded["strided"], strided)
    assert torch.equal(loaded["view"], slot[100:116])
    assert float(loaded["scalar"]) == 2.5


def test_writer_refuses_misuse(tmp_path: Path) -> None:
    specs = [("a", "F32", [2]), ("b", "U8", [3])]
    w = SafetensorsWriter(tmp_path / "m.safetensors", specs)
    with pytest.raises(ValueError, match="arrived while a is incomplete"):
        w.write("b", b"abc")
    with pytest.raises(ValueError, match="would get 12 bytes; it holds 8"):
        w.write("a", torch.zeros(3))
    w.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="left incomplete: b"):
        w.close()
    with pytest.raises(ValueError, match="repeated"):
        SafetensorsWriter(tmp_path / "n.safetensors", [("a", "F32", [1]), ("a", "F32", [1])])
    with pytest.raises(FileExistsError):  # never writes over an existing file
        SafetensorsWriter(tmp_path / "m.safetensors", specs)


def _st_dtype(dtype: torch.dtype) -> str:
    from transformd.safetensors_io import TORCH_DTYPES

    return next(k for k, v in TORCH_DTYPES.items() if v == dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Hostile and broken files: each refused with the file, the tensor where there is one, and the problem


GOOD = {"t": _entry("F32", [2], 0, 8)}

HOSTILE = {
    "shorter than 8 bytes": (b"\x01\x02", None, "shorter than the 8-byte header length"),
    "header length past end": (("hdr", GOOD, b"\0" * 8, 10_000), None, "runs past the end"),
    "header length above cap": (("hdr", GOOD, b"\0" * 8, MAX_HEADER_BYTES + 1), None, "above the limit"),
    "not JSON": (("hdr", b"{not json" + b" " * 7, b""), None, "not valid UTF-8 JSON"),
    "not UTF-8": (("hdr", b"\xff\xfe{}", b""), None, "not valid UTF-8 JSON"),
    "JSON list": (("hdr", [1, 2], b""), None, "not an object"),
    "entry not object": (("hdr", {"t": [1]}, b""), "t", "not an object"),
    "missing offsets": (("hdr", {"t": {"dtype": "F32", "shape": [2]}}, b"\0" * 8), "t", "lacks data_offsets"),
    "unknown dtype": (("hdr", {"t": _entry("F128", [2], 0, 8)}, b"\0" * 8), "t", "unknown dtype 'F128'"),
    "negative dim": (("hdr", {"t": _entry("F32", [-2], 0, 8)}, b"\0" * 8), "t", "not a list of non-negative integers"),
    "float dim": (("hdr", {"t": _entry("F32", [2.0], 0, 8)}, b"\0" * 8), "t", "not a list of non-negative integers"),
    "bool dim": (("hdr", {"t": _entry("F32", [True], 0, 4)}, b"\0" * 4), "t", "not a list of non-negative integers"),
    "shape not list": (("hdr", {"t": _entry("F32", 2, 0, 8)}, b"\0" * 8), "t", "not a list of non-negative integers"),
    "bad offsets": (("hdr", {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, b"\0" * 8), "t", "not a pair"),
    "reversed offsets": (("hdr", {"t": _entry("F32", [0], 8, 0)}, b"\0" * 8), "t", "end before they begin"),
    "byte count": (("hdr", {"t": _entry("F32", [3], 0, 8)}, b"\0" * 8), "t", "holds 8 bytes, but F32 [3] needs 12"),
    "overlap": (
        ("hdr", {"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 4, 12)}, b"\0" * 12),
        "b",
        "overlap the previous tensor",
    ),
    "gap": (
        ("hdr", {"a": _entry("F32", [1], 0, 4), "b": _entry("F32", [1], 8, 12)}, b"\0" * 12), "b", "belong to none"
    ),
    "truncated data": (("hdr", {"t": _entry("F32", [4], 0, 16)}, b"\0" * 8), "t", "run past the end of the file"),
    "trailing bytes": (("hdr", GOOD, b"\0" * 12), None, "4 bytes after the last tensor's data belong to none"),
    "duplicate name": (
        ("hdr", b'{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                b'"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0"),
        "t",
        "names this key twice",
    ),
    "metadata not strings": (("hdr", {"__metadata__": {"a": 1}, **GOOD}, b"\0" * 8), None, "__metadata__"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_headers_refused(tmp_path: Path, case: str) -> None:
    spec, tensor, problem = HOSTILE[case]
    path = tmp_path / "bad.safetensors"
    if isinstance(spec, bytes):
        path.write_bytes(spec)
    else:
        _, header, data, *length = spec
        _raw_file(path, header, data, header_len=length[0] if length else None)
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    err = info.value
    assert problem in str(err)
    assert str(path) in str(err) and err.file == str(path)
    assert err.tensor == tensor
    if tensor:
        assert f"tensor {tensor}" in str(err)


def test_zero_size_tensors_share_offsets(tmp_path: Path) -> None:
    header = {"a": _entry("F32", [0], 0, 0), "b": _entry("U8", [0, 5], 0, 0), "c": _entry("U8", [2], 0, 2)}
    path = _raw_file(tmp_path / "z.safetensors", header, b"\1\2")
    h = read_header(path)
    assert [t.nbytes for t in h.tensors.values()] == [0, 0, 2]
