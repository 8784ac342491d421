"""Reading a source ahead of its conversion while a cold process starts (transformd/readahead.py)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from transformd import readahead
from transformd.readahead import ReadAhead, read_ahead_bytes, shard_files
from transformd.sample import write_sample_checkpoint

from .support.checkpoints import assert_converted, write_checkpoint


def _name(fd: int) -> str:
    return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, int, int]]:
    """The read-ahead thread's reads: (file name, offset, bytes), and how (``reads.how``: the system calls)."""
    seen = _Reads()
    sendfile, preadv = os.sendfile, os.preadv

    def sending(out, fd, offset, count):
        assert _name(out) == "null"  # nothing is copied into the process
        n = sendfile(out, fd, offset, count)
        seen.append((_name(fd), offset, n))
        seen.how.append("sendfile")
        return n

    def reading(fd, buffers, offset, *args):
        n = preadv(fd, buffers, offset, *args)
        seen.append((_name(fd), offset, n))
        seen.how.append("preadv")
        return n

    monkeypatch.setattr(os, "sendfile", sending)
    monkeypatch.setattr(os, "preadv", reading)
    monkeypatch.setattr(readahead, "_SLICE_BYTES", 1000)
    return seen


class _Reads(list):
    def __init__(self):
        super().__init__()
        self.how: list[str] = []


def _files(d: Path, sizes: dict[str, int]) -> list[Path]:
    d.mkdir()
    for name, size in sizes.items():
        (d / name).write_bytes(os.urandom(size))
    return [d / name for name in sizes]


def test_it_reads_the_files_in_order_up_to_its_budget(tmp_path, reads):
    files = _files(tmp_path / "src", {"b.safetensors": 2500, "a.safetensors": 1500, "c.safetensors": 3000})
    fds = os.listdir("/proc/self/fd")
    ahead = ReadAhead([tmp_path / "missing", *files], budget=5000)  # one it cannot open is skipped
    ahead.join(30)
    assert os.listdir("/proc/self/fd") == fds  # every file and /dev/null closed
    assert ahead.bytes_read == 5000
    assert reads == [("b.safetensors", 0, 1000), ("b.safetensors", 1000, 1000), ("b.safetensors", 2000, 500),
                     ("b.safetensors", 2500, 0), ("a.safetensors", 0, 1000), ("a.safetensors", 1000, 500),
                     ("a.safetensors", 1500, 0), ("c.safetensors", 0, 1000)]
    assert set(reads.how) == {"sendfile"}  # one system call a slice, no copy: the thread seldom needs the GIL


def test_where_sendfile_is_refused_it_reads(tmp_path, reads, monkeypatch):
    files = _files(tmp_path / "src", {"b.safetensors": 2500, "a.safetensors": 1500})
    refused = []

    def refuse(out, fd, offset, count):
        refused.append(offset)
        raise OSError(errno.EINVAL, "sendfile is not supported here")

    monkeypatch.setattr(os, "sendfile", refuse)
    fds = os.listdir("/proc/self/fd")
    ahead = ReadAhead(files, budget=3000)
    ahead.join(30)
    assert ahead.bytes_read == 3000 and refused == [0]  # asked once, then read
    assert os.listdir("/proc/self/fd") == fds
    assert reads == [("b.safetensors", 0, 1000), ("b.safetensors", 1000, 1000), ("b.safetensors", 2000, 500),
                     ("b.safetensors", 2500, 0), ("a.safetensors", 0, 500)]


def test_a_null_device_that_is_a_file_is_not_written(tmp_path, reads, monkeypatch):
    """A sandbox whose /dev/null is a regular file: sendfile would fill it with the checkpoint."""
    files = _files(tmp_path / "src", {"a.safetensors": 2500})
    (tmp_path / "null").write_bytes(b"")
    monkeypatch.setattr(os, "devnull", str(tmp_path / "null"))
    fds = os.listdir("/proc/self/fd")
    ahead = ReadAhead(files, budget=3000)
    ahead.join(30)
    assert ahead.bytes_read == 2500 and set(reads.how) == {"preadv"}
    assert (tmp_path / "null").stat().st_size == 0 and os.listdir("/proc/self/fd") == fds


def _resident(path: Path) -> int:
    """How many of ``path``'s pages are in the page cache (mmap and mincore, through libc)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                               ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(address, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and posix_fadvise as on Linux")
def test_what_it_reads_is_in_the_page_cache_afterwards(tmp_path):
    """sendfile into /dev/null reads the file into the page cache (the kernel does not skip it)."""
    files = _files(tmp_path / "src", {"a.safetensors": 4 << 20, "b.safetensors": 4 << 20})
    os.sync()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    before = [_resident(f) for f in files]
    if any(before):
        pytest.skip(f"this file system keeps the pages ({before} resident after POSIX_FADV_DONTNEED)")
    ReadAhead(files, budget=(4 << 20) + (1 << 20)).join(30)
    pages = (1 << 20) // mmap.PAGESIZE
    assert _resident(files[0]) == 4 * pages
    assert pages <= _resident(files[1]) < 4 * pages  # (the kernel's own read-ahead may take a little more)


def test_it_stops_when_asked(tmp_path, reads, monkeypatch):
    files = _files(tmp_path / "src", {"a.safetensors": 100_000})
    real = os.sendfile
    ahead: list[ReadAhead] = []

    def stopping(out, fd, offset, count):  # the conversion starts after the third slice
        if offset == 2000:
            ahead[0].stop()
        return real(out, fd, offset, count)

    monkeypatch.setattr(os, "sendfile", stopping)
    ahead.append(ReadAhead.__new__(ReadAhead))
    ReadAhead.__init__(ahead[0], files, budget=1 << 30)
    ahead[0].join(30)
    assert ahead[0].bytes_read == 3000


def test_the_shards_of_the_index_else_in_name_order_and_a_budget_the_memory_allows(tmp_path):
    d = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2)
    (d / ".hidden.safetensors").write_bytes(b"")
    (d / "consolidated.safetensors").write_bytes(b"")  # not in the index: the conversion never reads it
    assert [p.name for p in shard_files(d)] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (d / "model.safetensors.index.json").write_text('{"weight_map": {"a": "../escape.safetensors"}}')
    assert shard_files(d) == []
    (d / "model.safetensors.index.json").unlink()
    assert [p.name for p in shard_files(d)] == ["consolidated.safetensors", "model-00001-of-00002.safetensors",
                                                "model-00002-of-00002.safetensors"]
    assert shard_files(tmp_path / "missing") == []
    assert 0 < read_ahead_bytes() <= readahead.READ_AHEAD_BYTES
    assert read_ahead_bytes(1 << 62) == readahead.memory_limit() // 8


_PROBE = (
    "import sys, runpy\n"
    "import transformd.readahead as r\n"
    "def imported():\n"  # torch's import is over (not only begun: the cache's warm-up imports it on a thread)
    "    return 'torch' in sys.modules and not getattr(sys.modules['torch'].__spec__, '_initializing', False)\n"
    "init, stop = r.ReadAhead.__init__, r.ReadAhead.stop\n"
    "def started(self, *a, **k):\n"
    "    print('read ahead, torch imported:', imported(), file=sys.stderr)\n"
    "    init(self, *a, **k)\n"
    "def stopped(self):\n"
    "    if not self._stopped.is_set():\n"
    "        by = sys._getframe(1)\n"
    "        if by.f_code.co_name == '_begun':\n"  # the hashing's: by its first update, or only when it ended
    "            by = by.f_back\n"
    "        print('stopped by', by.f_code.co_name, 'torch imported:', imported(), file=sys.stderr)\n"
    "    stop(self)\n"
    "r.ReadAhead.__init__, r.ReadAhead.stop = started, stopped\n"
    "import transformd.cuda_start as c\n"
    "start_cuda = c.start_cuda\n"
    "def cuda(device, shards):\n"
    "    print('cuda started for', device, 'torch imported:', imported(), file=sys.stderr)\n"
    "    return start_cuda(device, shards)\n"
    "c.start_cuda = cuda\n"
    "if '--hashed' in sys.argv:\n"  # every source new to the cache is hashed beside its conversion
    "    sys.argv.remove('--hashed')\n"
    "    import transformd.cache.alongside as al\n"
    "    al.AlongsideMixin.hash_alongside_min_bytes = 0\n"
    "sys.argv = ['transformd', *sys.argv[1:]]\n"
    "runpy.run_module('transformd', run_name='__main__')\n"
)


@pytest.mark.parametrize("where", ["--out", "--cache-dir", "--cache-dir, hashed"])
def test_a_cold_convert_reads_ahead_while_torch_is_imported(tmp_path, where):
    """The read-ahead starts before torch is imported and stops at the conversion's first progress, CUDA is started
    (for the device asked: nothing for the CPU) before torch is imported too; the output is right. Into the cache:
    a source the cache already knows (keyed by the stat cache, converted with a second target), and one new to it,
    hashed beside its conversion: there the hashing's read-ahead reads (the hashing itself waits for the
    conversion's first update), not the command's."""
    src = write_checkpoint(tmp_path / "src")
    for f in src.rglob("*"):  # older than the stat cache's racy window, so that the first run's digests are kept
        os.utime(f, (f.stat().st_atime - 60, f.stat().st_mtime - 60))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs = []
    for n, target in enumerate(("ocp", "fnuz") if where == "--cache-dir" else ("ocp",)):
        dest = tmp_path / ("cache" if where.startswith("--cache-dir") else f"out{n}")
        cmd = [sys.executable, "-c", _PROBE, "convert", str(src), where.split(",")[0], str(dest), "--target", target,
               "--device", "cpu", *(["--hashed"] if "hashed" in where else [])]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        runs.append(done)
    done = runs[-1]
    said = [line for line in done.stderr.splitlines() if "torch imported" in line]
    # stopped by the conversion's first progress update, not at the end
    if "hashed" in where:  # (the hashing's read-ahead starts after the warm-up thread began to import torch)
        assert said == ["cuda started for cpu torch imported: False", "read ahead, torch imported: False",
                        "stopped by converted torch imported: True"], done.stderr
    else:
        assert said == ["read ahead, torch imported: False", "cuda started for cpu torch imported: False",
                        "stopped by update torch imported: True"], done.stderr
    assert ("hashed alongside" in done.stderr) == ("hashed" in where), done.stderr
    assert_converted(src, Path(done.stdout.splitlines()[-1]), "fnuz" if where == "--cache-dir" else "ocp", "exact")


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"),
                    reason="ioprio_get's number is known for x86_64 and aarch64")
def test_it_reads_at_the_idle_io_class(tmp_path, monkeypatch):
    """Its reads must not delay the imports' (a cold torch reads its libraries meanwhile)."""
    import threading

    files = _files(tmp_path / "src", {"a.safetensors": 10})
    classes = []
    real = os.sendfile
    get = {"x86_64": 252, "aarch64": 31}[os.uname().machine]

    def sendfile(out, fd, offset, count):
        classes.append(ctypes.CDLL(None).syscall(get, 1, threading.get_native_id()) >> 13)
        return real(out, fd, offset, count)

    monkeypatch.setattr(os, "sendfile", sendfile)
    ReadAhead(files, budget=100).join(30)
    assert classes and set(classes) == {3}, classes  # IOPRIO_CLASS_IDLE


def test_a_fifo_is_never_waited_on(tmp_path):
    """A FIFO as the index or as a shard (the conversion refuses it, naming it) must not block the read-ahead."""
    d = tmp_path / "src"
    d.mkdir()
    os.mkfifo(d / "model.safetensors.index.json")
    os.mkfifo(d / "a.safetensors")
    (d / "b.safetensors").write_bytes(b"x" * 100)
    files = shard_files(d)
    assert [p.name for p in files] == ["a.safetensors", "b.safetensors"]
    ahead = ReadAhead(files, budget=1000)
    ahead.join(10)
    assert ahead.bytes_read == 100
