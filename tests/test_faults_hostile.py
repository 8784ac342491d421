"""Hostile and broken checkpoints, refused through every door, and property-based fuzzing of the parsers.

Every case of the corpus (tests/support/hostile.py) is a small checkpoint with one defect planted, fed to

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
``transformd/cache/securefs.py`` (every source file opened and checked against the allowed roots, symlinks resolved).

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
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from transformd import cli
from transformd.cache import Cache
from transformd.checkpoint import convert_checkpoint, plan_conversion
from transformd.formats import MxFormatError
from transformd.safetensors_io import (
    DTYPE_BITS,
    TORCH_DTYPES,
    CheckpointError,
    SafetensorsWriter,
    read_header,
    read_tensor,
)

from .support.checkpoints import SHARD_B, write_checkpoint
from .support.hostile import BIG_INT, CORPUS, DEEP, INDEX, Expect, build_case, check_message, tree

CATEGORY = "hostile input"
TRANSFORMD = Path(sys.executable).with_name("transformd")

#: Cases also run through the installed console script in subprocesses (both modes): one of each kind.
SUBPROCESS_CASES = [
    "truncated shard",
    "huge header (200 MiB declared)",
    "NaN code 0x7F",
    "index names ../x.safetensors (which exists)",
    "FIFO among the carried files",
    "config.json a JSON list",
]



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
    assert top <= {"CACHEDIR.TAG", "config.json", "entry-names.key"}, top


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
