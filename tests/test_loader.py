"""The mmap loader: tensors equal to safetensors.safe_open's, zero-copy, copy-on-write, from a table or a directory."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.support.fake_daemon import FakeDaemon, ServerThread
from transformd.client import ShardFile, TransformdClient
from transformd.checkpoint import convert_checkpoint
from transformd.loader import LoadedTensors, load_from_daemon, load_tensors
from transformd.safetensors_io import CheckpointError, SafetensorsWriter, read_header
from transformd.sample import write_sample_checkpoint

REPO = Path(__file__).resolve().parents[1]


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _assert_same_as_safe_open(files: list[Path], loaded: dict[str, torch.Tensor]) -> set[str]:
    """Every tensor of ``files`` equals safe_open's: dtype, shape and bytes (NaN-safe). Returns the dtypes seen."""
    dtypes, names = set(), set()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                expected, got = st.get_tensor(name), loaded[name]
                assert got.dtype == expected.dtype, name
                assert got.shape == expected.shape, name
                assert _bytes(got) == _bytes(expected), name
                dtypes.add(str(got.dtype).removeprefix("torch."))
                names.add(name)
    assert names == set(loaded)
    return dtypes


def _table(files: list[Path]) -> dict:
    """The daemon's /files answer for these files (absolute offsets), as the real daemon builds it."""
    out = []
    for f in files:
        h = read_header(f)
        out.append({"name": f.name, "path": str(f.resolve()), "size": h.file_size,
                    "digest": "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest(), "ready": True,
                    "tensors": {t.name: {"dtype": t.dtype, "shape": list(t.shape), "offsets": [t.begin, t.end]}
                                for t in h.tensors.values()}})
    return {"files": out}


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g) * 50
    codes = torch.randint(0, 256, (6, 10), generator=g, dtype=torch.int32).to(torch.uint8)
    return {
        "f8_fnuz": codes.clone().view(torch.float8_e4m3fnuz),  # includes 0x80 (NaN in FNUZ): bytes must survive
        "f8_e4m3": codes.clone().view(torch.float8_e4m3fn),
        "f8_e5m2": codes.clone().view(torch.float8_e5m2),
        "f32": base,
        "f64": base.double(),
        "bf16": base.bfloat16(),
        "f16": base.half(),
        "u8": codes,
        "i8": codes.clone().view(torch.int8),
        "i16": base.to(torch.int16),
        "i32": base.to(torch.int32),
        "i64": base.to(torch.int64) * (1 << 40),
        "bool": base > 0,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The sample MXFP8 checkpoint converted to both targets (3-D fused experts for one of them)."""
    root = tmp_path_factory.mktemp("loader")
    out = {}
    for target, fused in (("fnuz", False), ("ocp", True)):
        src = write_sample_checkpoint(root / f"src-{target}", fused_experts=fused, shards=3)
        out[target] = convert_checkpoint(src, root / f"out-{target}", target=target, device="cpu").out
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Equality


def test_every_dtype_equals_safe_open(tmp_path):
    path = tmp_path / "all.safetensors"
    save_file(_every_dtype(), str(path))
    loaded = load_tensors(path)
    dtypes = _assert_same_as_safe_open([path], loaded)
    assert {"float8_e4m3fnuz", "float8_e4m3fn", "float32", "bfloat16", "float16", "uint8", "int8", "int32",
            "int64", "bool"} <= dtypes
    assert loaded.copied == []


@pytest.mark.parametrize("target", ["fnuz", "ocp"])
def test_converted_checkpoint_from_directory(converted, target):
    out = converted[target]
    files = sorted(out.glob("*.safetensors"))
    loaded = load_tensors(out)
    dtypes = _assert_same_as_safe_open(files, loaded)
    assert ("float8_e4m3fnuz" if target == "fnuz" else "float8_e4m3fn") in dtypes
    assert {"float32", "bfloat16"} <= dtypes
    assert len(loaded.mappings) == len(files) and loaded.copied == []


@pytest.mark.parametrize("target", ["fnuz", "ocp"])
def test_converted_checkpoint_from_files_table(converted, target):
    files = sorted(converted[target].glob("*.safetensors"))
    table = _table(files)
    for given in (table, table["files"], [ShardFile.from_json(f) for f in table["files"]]):
        _assert_same_as_safe_open(files, load_tensors(given))


def test_list_of_paths_and_single_file(converted):
    files = sorted(converted["fnuz"].glob("*.safetensors"))
    _assert_same_as_safe_open(files, load_tensors(files))
    _assert_same_as_safe_open(files[:1], load_tensors(files[0]))


# ---------------------------------------------------------------------------------------------------------------------
# Zero copy, copy-on-write, lifetime


def test_tensors_are_views_of_the_mapping(converted):
    loaded = load_tensors(converted["fnuz"])
    for name, t in loaded.items():
        if t.numel():
            owners = [m for m in loaded.mappings if m.contains(t)]
            assert len(owners) == 1, name
            # The view starts exactly at the tensor's offset in its file.
            header = read_header(owners[0].path)
            assert t.data_ptr() - owners[0].address == header.tensors[name].begin, name


def _no_core_dump() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def test_writing_into_a_loaded_tensor_touches_only_the_writer(converted, tmp_path):
    """The default map is private copy-on-write: a write succeeds in the writer (no SIGSEGV), the cache file's
    bytes stay as they were, another map of the file sees the file, and reading shares the page cache (no
    private copy of what was only read). In a subprocess, so a crash would show as its exit status."""
    shard = sorted(converted["fnuz"].glob("*.safetensors"))[-1]
    before = shard.read_bytes()
    code = (
        "import torch; from transformd.loader import load_tensors\n"
        "def vma(address):  # (Rss, Anonymous) bytes of the mapping that starts at address, from smaps\n"
        "    found, out = False, {}\n"
        "    for line in open('/proc/self/smaps'):\n"
        "        head = line.split()[0]\n"
        "        if '-' in head and ':' not in head:\n"
        "            if found: break\n"
        "            found = int(head.split('-')[0], 16) == address\n"
        "        elif found and head in ('Rss:', 'Anonymous:'):\n"
        "            out[head] = int(line.split()[1]) * 1024\n"
        "    return out['Rss:'], out['Anonymous:']\n"
        f"t = load_tensors({str(shard)!r})\n"
        "m = t.mappings[0]\n"
        "total = sum(float(x.view(-1).view(torch.uint8).sum()) for x in t.values() if x.numel())\n"
        "rss, anon = vma(m.address)\n"
        "assert rss > m.size // 2 and anon == 0, ('read pages stay the page cache`s', rss, anon)\n"
        "name = max((n for n, x in t.items() if x.dtype == torch.float32), key=lambda n: t[n].numel())\n"
        "t[name].fill_(7.0)\n"
        "assert bool((t[name] == 7.0).all())\n"
        "rss, anon = vma(m.address)\n"
        "nbytes = t[name].numel() * 4\n"
        "assert 0 < anon <= nbytes + 2 * 4096, ('only the written pages are copied', anon, nbytes)\n"
        f"other = load_tensors({str(shard)!r}, names=[name])[name]\n"
        "assert not bool((other == 7.0).all()), 'another map sees the write'\n"
        "print('wrote', name, flush=True)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         preexec_fn=_no_core_dump)
    assert run.returncode == 0 and "wrote" in run.stdout, (run.returncode, run.stderr[-1500:])
    assert shard.read_bytes() == before, "the cache file never changes"


def test_read_only_mapping_on_request_faults_on_write(converted, tmp_path):
    """``writable=False`` keeps the old PROT_READ map: a write faults, and the file is untouched."""
    shard = sorted(converted["fnuz"].glob("*.safetensors"))[-1]
    before = shard.read_bytes()
    code = (
        "import sys; from transformd.loader import load_tensors\n"
        f"t = load_tensors({str(shard)!r}, writable=False)\n"
        "name = next(n for n, x in t.items() if x.numel())\n"
        "print('mapped', flush=True)\n"
        "t[name].view(-1).view(__import__('torch').uint8)[0] = 7\n"
        "print('wrote', flush=True)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         preexec_fn=_no_core_dump)
    assert "mapped" in run.stdout and "wrote" not in run.stdout
    assert run.returncode == -signal.SIGSEGV, (run.returncode, run.stderr[-500:])
    assert shard.read_bytes() == before


def test_writable_mapping_is_private_copy_on_write(converted):
    shard = sorted(converted["fnuz"].glob("*.safetensors"))[-1]
    before = shard.read_bytes()
    mine = load_tensors(shard, writable=True)
    name = next(n for n, t in mine.items() if t.numel() and t.dtype == torch.float32)
    original = mine[name].clone()
    mine[name].fill_(1.0)
    assert torch.equal(load_tensors(shard, names=[name])[name], original)  # other maps see the file
    assert shard.read_bytes() == before


def test_tensors_keep_their_mapping_alive(converted):
    loaded = load_tensors(converted["ocp"])
    name = next(n for n, t in loaded.items() if t.dtype == torch.float32 and t.numel() > 1)
    keep = loaded[name][1:]  # a view of a view
    expected = keep.clone()
    del loaded
    gc.collect()
    assert torch.equal(keep, expected)


def test_a_copied_file_does_not_change_mapped_tensors(tmp_path):
    """Replacing the file (as a cache rename does) leaves existing maps on the old inode."""
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.arange(1000, dtype=torch.float32)}, str(path))
    loaded = load_tensors(path)
    replacement = tmp_path / "y.safetensors"
    save_file({"a": torch.zeros(1000, dtype=torch.float32)}, str(replacement))
    replacement.replace(path)
    assert torch.equal(loaded["a"], torch.arange(1000, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------------------------------
# Selection, devices, odd layouts, bad tables


def test_names_selects_and_maps_only_needed_files(converted):
    files = sorted(converted["fnuz"].glob("*.safetensors"))
    first = read_header(files[0])
    name = next(iter(first.tensors))
    loaded = load_tensors(converted["fnuz"], names=[name])
    assert list(loaded) == [name] and [m.path for m in loaded.mappings] == [files[0]]
    with pytest.raises(KeyError, match="no tensor named nope"):
        load_tensors(converted["fnuz"], names=[name, "nope"])


def test_other_device_copies(converted):
    loaded = load_tensors(converted["fnuz"], device="meta")
    assert all(t.device.type == "meta" for t in loaded.values())
    assert sorted(loaded.copied) == sorted(loaded)


def test_misaligned_tensor_is_copied_and_equal(tmp_path):
    """A safetensors file may put an F32 tensor at an odd offset; it is copied into an aligned buffer."""
    path = tmp_path / "odd.safetensors"
    odd = torch.tensor([1, 2, 3], dtype=torch.uint8)
    f32 = torch.linspace(-1, 1, 17)
    with SafetensorsWriter(path, [("odd", "U8", [3]), ("f", "F32", [17])]) as w:
        w.write("odd", odd)
        w.write("f", f32)
    loaded = load_tensors(path)
    assert loaded.copied == ["f"]
    assert torch.equal(loaded["f"], f32) and torch.equal(loaded["odd"], odd)
    _assert_same_as_safe_open([path], loaded)


def test_bad_tables_are_refused(converted):
    files = sorted(converted["fnuz"].glob("*.safetensors"))
    table = _table(files[:1])
    entry = table["files"][0]
    name = next(iter(entry["tensors"]))

    bad = {"files": [{**entry, "size": entry["size"] + 1}]}
    with pytest.raises(CheckpointError, match="changed"):
        load_tensors(bad)
    beyond = {**entry, "tensors": {name: {**entry["tensors"][name], "offsets": [entry["size"], entry["size"] + 8]}}}
    with pytest.raises(CheckpointError, match="outside"):
        load_tensors([beyond])
    wrong = {**entry, "tensors": {name: {**entry["tensors"][name], "dtype": "F64"}}}
    with pytest.raises(CheckpointError, match="needs"):
        load_tensors([wrong])
    with pytest.raises(ValueError, match="not converted yet"):
        load_tensors([{**entry, "ready": False}])
    with pytest.raises(ValueError, match="not converted yet"):
        load_tensors([{**entry, "path": None}])
    with pytest.raises(CheckpointError, match="also in"):
        load_tensors([files[0], files[0]])
    # ranges the file's own header would refuse: two tensors as one memory, a tensor of header bytes (a review)
    (a, ta), (b, tb) = list(entry["tensors"].items())[:2]
    same = {**entry, "tensors": {a: ta, b: {**tb, "offsets": ta["offsets"], "shape": ta["shape"], "dtype": ta["dtype"]}}}
    with pytest.raises(CheckpointError, match="overlap another tensor's bytes"):
        load_tensors([same])
    head = {**entry, "tensors": {a: {"dtype": "U8", "shape": [8], "offsets": [8, 16]}}}
    with pytest.raises(CheckpointError, match="overlap the header"):
        load_tensors([head])


def test_empty_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no .safetensors"):
        load_tensors(tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# From the daemon (fake, speaking the contract)


@pytest.fixture
def daemon_client(converted):
    tmp = Path(tempfile.mkdtemp(prefix="tdl"))
    models = tmp / "models"
    (models / "m").mkdir(parents=True)
    daemon = FakeDaemon(models)
    daemon.register(models / "m", converted["fnuz"])
    server = ServerThread(daemon.app(), uds=str(tmp / "td.sock")).start()
    with TransformdClient(socket=tmp / "td.sock") as client:
        yield daemon, client, models / "m"
    server.stop()
    shutil.rmtree(tmp, ignore_errors=True)


def test_load_from_daemon_when_ready(daemon_client, converted):
    daemon, client, src = daemon_client
    assert client.resolve(src, poll_interval=0.01) == converted["fnuz"].resolve()
    loaded = load_from_daemon(client, client.last_key)
    assert isinstance(loaded, LoadedTensors)
    _assert_same_as_safe_open(sorted(converted["fnuz"].glob("*.safetensors")), loaded)


def test_load_from_daemon_waits_shard_by_shard(daemon_client, converted):
    """Before the entry is ready, each shard is asked for by name and mapped once it is converted."""
    daemon, client, src = daemon_client
    status = client.submit(src, target="fnuz")
    assert status.state == "queued"
    before = client.files(status.key)
    assert before and all(not f.ready and f.path is None and f.final_path for f in before)
    loaded = load_from_daemon(client, status.key, timeout=30)
    _assert_same_as_safe_open(sorted(converted["fnuz"].glob("*.safetensors")), loaded)
    assert daemon.jobs[status.key].shards_ready == {p.name for p in converted["fnuz"].glob("*.safetensors")}

    status2 = client.submit(src, target="ocp")
    with pytest.raises(ValueError, match="not converted yet"):
        load_from_daemon(client, status2.key, wait=False)


def test_a_fifo_named_like_a_shard_is_refused_not_waited_on(tmp_path: Path) -> None:
    """load_tensors(dir) opened every *.safetensors blocking: a FIFO that a user who may write the directory put
    there hung the engine's load for good (an attack review). Now refused at once, named."""
    src = write_sample_checkpoint(tmp_path / "m", layers=1, experts=2)
    shard = sorted(src.glob("*.safetensors"))[-1]
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(CheckpointError, match="not a regular file") as info:
        load_tensors(src)
    assert str(shard) in str(info.value)


def test_a_shard_published_while_it_was_waited_for_is_mapped_from_its_final_path(converted, tmp_path):
    """load_from_daemon waits for every shard, then maps them: a shard the daemon served from staging had been
    renamed into the entry by then, and every load of a converting entry failed, "cannot map: No such file" (a
    review). Its final path is mapped instead."""
    from transformd.client import ShardFile

    files = sorted(converted["fnuz"].glob("*.safetensors"))
    table = {f["name"]: f for f in _table(files)["files"]}

    class Converting:  # the daemon's answers for an entry in conversion: the shards in staging, since published
        def files(self, key, **kw):
            return [ShardFile(n, None, None, None, False, {}, Path(t["path"])) for n, t in table.items()]

        def file(self, key, name, **kw):
            shard = ShardFile.from_json(table[name])
            return dataclasses.replace(shard, path=tmp_path / "staging" / name, final_path=shard.path)

    loaded = load_from_daemon(Converting(), "0" * 32, timeout=5)
    _assert_same_as_safe_open(files, loaded)
