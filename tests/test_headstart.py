"""The head start (transformd.checkpoint.headstart): a worker process converting shards with NumPy while the
pipeline's process imports torch. Whatever it takes, the output is byte for byte the pipeline's own; what it
cannot convert goes back to the pipeline, which reports it; a cancel leaves nothing of it behind."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from transformd.checkpoint import convert_checkpoint, plan_conversion, write_checkpoint
from transformd.checkpoint import headstart
from transformd.checkpoint.headstart import HeadStart
from transformd.formats import MxFormatError, ScaleMode, Target
from transformd.readahead import in_page_cache, last_shard_in_page_cache
from transformd.sample import write_sample_checkpoint

from .support.checkpoints import SHARD_B, assert_converted_sample, default_shards, poke, set_tensor
from .support.checkpoints import write_checkpoint as write_src
from .support.layouts import LAYOUTS

AWKWARD = {"hidden": 320, "moe_intermediate": 224, "head_dim": 64}  # partial tiles on both axes


def sample(path: Path, **kw) -> Path:
    return write_sample_checkpoint(path, layers=4, experts=3, shards=5, **{**AWKWARD, **kw})


def same_tree(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert names and names == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), f"{name} differs"


def wait_for_finished(head: HeadStart, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while len(head.finished) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(head.finished) >= count, f"the worker finished {len(head.finished)} shards, not {count}"


@pytest.mark.parametrize("target", ["fnuz", "ocp"])
@pytest.mark.parametrize("layout", ["sample", "sample, fused experts", *LAYOUTS])
def test_every_shard_from_the_worker_is_the_pipelines_own(tmp_path: Path, layout: str, target: str) -> None:
    """The worker converts the whole checkpoint (the pipeline starts only once it has finished): the same bytes as
    the pipeline alone, on every producer's layout (Quark's Rx32 blocks, fused experts, F8_E8M0 scales, ...)."""
    if layout.startswith("sample"):
        src = sample(tmp_path / "src", fused_experts="fused" in layout)
    else:
        src = LAYOUTS[layout](tmp_path / "src")
    convert_checkpoint(src, tmp_path / "pipeline", target=target, device="cpu", head_start=False)
    plan = plan_conversion(src)
    out = tmp_path / "worker"
    out.mkdir()
    head = HeadStart(plan, out, Target(target), ScaleMode.EXACT, threads=2)
    wait_for_finished(head, len(plan.shards))
    result = write_checkpoint(plan, out, target=target, devices=None, head_start=head)
    assert sorted(result.head_start_shards) == sorted(s.name for s in plan.shards)
    assert result.stage_busy.get("head start", 0) > 0
    same_tree(tmp_path / "pipeline", out)


@pytest.mark.parametrize("target", ["fnuz", "ocp"])
def test_worker_and_pipeline_share_the_shards(tmp_path: Path, target: str) -> None:
    """The worker takes the last shards, the pipeline the rest (it stops the worker when it starts): the result is
    the reference's, and each shard was written once."""
    src = write_sample_checkpoint(tmp_path / "src", layers=12, experts=3, shards=13, **AWKWARD)
    plan = plan_conversion(src)
    out = tmp_path / "out"
    out.mkdir()
    head = HeadStart(plan, out, Target(target), ScaleMode.EXACT, threads=1)
    wait_for_finished(head, 2)
    progress = []
    result = write_checkpoint(plan, out, target=target, devices=None, head_start=head, progress=progress.append)
    taken = result.head_start_shards  # (the pipeline would have failed to create a shard the worker wrote)
    assert len(taken) >= 2 and taken == [s.name for s in reversed(plan.shards)][: len(taken)]
    assert progress[-1].tensors_done == plan.tensor_count and progress[-1].bytes_done == plan.data_bytes
    assert result.bytes_written == sum(f.stat().st_size for f in out.glob("*.safetensors")) + sum(
        f.stat().st_size for f in out.iterdir() if f.suffix == ".json")
    assert_converted_sample(src, out, target, "exact")


def test_convert_checkpoint_with_a_head_start(tmp_path: Path) -> None:
    src = sample(tmp_path / "src")
    convert_checkpoint(src, tmp_path / "plain", device="cpu", head_start=False)
    result = convert_checkpoint(src, tmp_path / "out", device="cpu", head_start=True)
    same_tree(tmp_path / "plain", tmp_path / "out")
    assert not list(tmp_path.glob(".out.*")), "no staging directory left beside the output"
    assert set(result.head_start_shards) <= {s.name for s in plan_conversion(src).shards}


@pytest.mark.parametrize("target", ["fnuz", "ocp"])
def test_the_amax_mode_from_the_worker_is_the_pipelines_own(tmp_path: Path, target: str) -> None:
    """The amax scale mode too: the worker converts every shard (its own tables per tile), the same bytes as the
    pipeline alone; and convert_checkpoint gives it a head start in that mode."""
    src = sample(tmp_path / "src")
    convert_checkpoint(src, tmp_path / "pipeline", target=target, scale_mode="amax", device="cpu", head_start=False)
    plan = plan_conversion(src)
    out = tmp_path / "worker"
    out.mkdir()
    head = HeadStart(plan, out, Target(target), ScaleMode.AMAX, threads=2)
    wait_for_finished(head, len(plan.shards))
    result = write_checkpoint(plan, out, target=target, scale_mode="amax", devices=None, head_start=head)
    assert sorted(result.head_start_shards) == sorted(s.name for s in plan.shards)
    same_tree(tmp_path / "pipeline", out)
    result = convert_checkpoint(src, tmp_path / "out", target=target, scale_mode="amax", device="cpu",
                                head_start=True)
    same_tree(tmp_path / "pipeline", tmp_path / "out")
    assert set(result.head_start_shards) <= {s.name for s in plan.shards}


@pytest.mark.parametrize("mode", ["exact", "amax"])
def test_an_invalid_value_is_given_back_and_reported_by_the_pipeline(tmp_path: Path, mode: str) -> None:
    """A NaN code in the last shard: the worker gives the shard back, the pipeline converts it and fails with the
    file and the tensor named; nothing is left of the output. In either scale mode."""
    shards = default_shards()
    set_tensor("model.layers.0.mlp.experts.1.up_proj.weight", poke((3, 5), 0x7F))(shards)
    src = write_src(tmp_path / "src", shards)
    plan = plan_conversion(src)
    out = tmp_path / "staging"
    out.mkdir()
    head = HeadStart(plan, out, Target.FNUZ, ScaleMode(mode), threads=2)
    deadline = time.monotonic() + 60
    while head.gave_back == [] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert head.gave_back == [SHARD_B]
    assert not (out / SHARD_B).exists(), "its partial file is removed"
    with pytest.raises(MxFormatError) as caught:
        write_checkpoint(plan, out, scale_mode=mode, devices=None, head_start=head)
    assert "experts.1.up_proj.weight" in str(caught.value) and SHARD_B in str(caught.value)
    assert "NaN" in str(caught.value)
    with pytest.raises(MxFormatError):
        convert_checkpoint(src, tmp_path / "out", scale_mode=mode, device="cpu", head_start=True)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("after", [0.0, 0.5], ids=["before it read its plan", "while it converts"])
def test_cancel_leaves_only_finished_shards(tmp_path: Path, after: float) -> None:
    src = sample(tmp_path / "src")
    plan = plan_conversion(src)
    out = tmp_path / "out"
    out.mkdir()
    head = HeadStart(plan, out, Target.OCP, ScaleMode.EXACT, threads=1)
    time.sleep(after)
    head.cancel()
    finished = {f.shard.name for f in head.finished}
    assert {p.name for p in out.iterdir()} == finished
    assert head._proc.returncode is not None


def test_a_worker_that_dies_leaves_the_work_to_the_pipeline(tmp_path: Path) -> None:
    src = sample(tmp_path / "src")
    convert_checkpoint(src, tmp_path / "plain", device="cpu", head_start=False)
    plan = plan_conversion(src)
    out = tmp_path / "out"
    out.mkdir()
    head = HeadStart(plan, out, Target.FNUZ, ScaleMode.EXACT, threads=1)
    head._proc.kill()
    result = write_checkpoint(plan, out, devices=None, head_start=head)
    assert result.head_start_shards == [f.shard.name for f in head.finished]
    same_tree(tmp_path / "plain", out)


def test_last_shard_in_page_cache_only_on_a_source_in_the_page_cache(tmp_path: Path) -> None:
    src = sample(tmp_path / "src")
    last = sorted(src.glob("*.safetensors"))[-1]
    last.read_bytes()
    assert in_page_cache(last) and last_shard_in_page_cache(src)
    fd = os.open(last, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if in_page_cache(last):
        pytest.skip("this kernel kept the file's pages after POSIX_FADV_DONTNEED")
    assert not last_shard_in_page_cache(src)
    assert not in_page_cache(last), "asking starts no read (mincore, not RWF_NOWAIT)"
    assert not in_page_cache(tmp_path / "missing") and not last_shard_in_page_cache(tmp_path)


@pytest.mark.parametrize("into", ["--out", "--cache-dir"])
@pytest.mark.parametrize("flag", [[], ["--no-head-start"]])
def test_the_cli_in_a_fresh_process(tmp_path: Path, flag: list[str], into: str) -> None:
    """What a user runs: torch not imported yet, the source just written (in the page cache): the head start runs
    beside the import (unless turned off), into an output directory or, without a daemon, into the cache (reading the
    cache's checked descriptors); the output is the pipeline's either way, and a cache entry verifies."""
    src = sample(tmp_path / "src")
    convert_checkpoint(src, tmp_path / "plain", target="ocp", device="cpu", head_start=False)
    for shard in src.glob("*.safetensors"):
        shard.read_bytes()
    cli = [sys.executable, "-m", "transformd"]
    more = ["--no-daemon"] if into == "--cache-dir" else []
    proc = subprocess.run([*cli, "convert", str(src), into, str(tmp_path / "out"), "--device", "cpu", "--target",
                           "ocp", *more, *flag], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    same_tree(tmp_path / "plain", Path(proc.stdout.strip().splitlines()[-1]))
    summary = proc.stderr.strip().splitlines()[-1]
    if flag:
        assert "head start" not in summary and "on the CPU while" not in summary, summary
    else:
        assert "head start" in summary and " of 5 shards on the CPU while torch was imported" in summary, summary
    if into == "--cache-dir":
        check = subprocess.run([*cli, "cache", "verify", "--cache-dir", str(tmp_path / "out")], capture_output=True,
                               text=True, timeout=300)
        assert check.returncode == 0 and "1 entries checked, 0 corrupt" in check.stdout, check.stdout + check.stderr


def test_the_caches_conversion_starts_the_worker_before_torchs_import(tmp_path: Path) -> None:
    """A fresh process converting into the cache alongside the hashing: the cache's ``prepare`` leaves the imports
    to the conversion, which plans and starts the worker first, as ``convert --out`` does (a warm-up thread
    importing torch beside the plan slowed it and the worker's start)."""
    src = sample(tmp_path / "src")
    convert_checkpoint(src, tmp_path / "plain", target="ocp", device="cpu", head_start=False)
    for f in src.iterdir():  # older than the stat cache's racy window (else it is hashed first, without prepare)
        os.utime(f, (f.stat().st_atime - 60, f.stat().st_mtime - 60))
        f.read_bytes()
    code = f"""if True:
        import sys
        from transformd.cache import Cache, Recipe, TransformdConverter
        from transformd.cache import converter
        from transformd.checkpoint import headstart
        real = headstart.HeadStart.start
        def start(*args):
            print("worker started:", "torch" in sys.modules, converter._warming is not None, flush=True)
            return real(*args)
        headstart.HeadStart.start = start
        cache = Cache({str(tmp_path / "cache")!r}, converter=TransformdConverter("cpu", head_start=True))
        cache.hash_alongside_min_bytes = 0
        entry = cache.get_or_convert({str(src)!r}, Recipe(target="ocp"))
        print(entry.path, sorted(entry.manifest.timings), entry.manifest.result.get("head_start_shards"))
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    started, done = proc.stdout.strip().splitlines()
    assert started == "worker started: False False", "torch imported, or importing, before the worker started"
    path, rest = done.split(" ", 1)
    assert "'hash_alongside'" in rest and rest.count(".safetensors") == 5, rest
    same_tree(tmp_path / "plain", Path(path))


def test_a_checked_source_is_read_through_its_descriptors(tmp_path: Path) -> None:
    """The cache converts a view of a source whose entries link to ``/proc/self/fd/N`` of its checked descriptors:
    the worker gets those descriptors under the same numbers and reads the files that were checked, whatever the
    source's names lead to by then (here: another checkpoint's values under the same names)."""
    from transformd.cache.securefs import open_source

    src = sample(tmp_path / "src")
    convert_checkpoint(src, tmp_path / "plain", target="ocp", device="cpu", head_start=False)
    out = tmp_path / "out"
    out.mkdir()
    with open_source(src) as tree:
        view = tree.view()
        src.rename(tmp_path / "moved")
        sample(src, seed=7)
        plan = plan_conversion(view)
        assert headstart.source_descriptors(plan) == tuple(sorted(f.fd for f in tree.files
                                                                  if f.rel.endswith(".safetensors")))
        head = HeadStart(plan, out, Target.OCP, ScaleMode.EXACT)
        try:
            wait_for_finished(head, len(plan.shards))
        finally:
            head.cancel()
    assert not head.gave_back
    for shard in plan.shards:
        assert filecmp.cmp(out / shard.name, tmp_path / "plain" / shard.name, shallow=False), shard.name
    assert not filecmp.cmp(src / plan.shards[-1].name, tmp_path / "moved" / plan.shards[-1].name, shallow=False)


def test_a_descriptor_among_the_standard_streams_gets_no_head_start(tmp_path: Path, monkeypatch) -> None:
    """A source descriptor numbered 0-2 (a parent started with its standard streams closed) would be shadowed by
    the worker's own pipes: no worker is started, the pipeline converts everything."""
    src = sample(tmp_path / "src")
    monkeypatch.setattr(headstart, "source_descriptors", lambda plan: (2, 5))
    assert HeadStart.start(plan_conversion(src), tmp_path, Target.OCP, ScaleMode.EXACT) is None


def test_the_worker_takes_no_shard_once_it_said_it_stopped(tmp_path: Path) -> None:
    """Taking a shard and stopping are one step: a stop that comes while a shard is being taken is answered after
    that shard's ``take`` line, and no shard is taken after the answer (the parent's list of the worker's shards is
    complete when it reads ``stopped``)."""
    src = sample(tmp_path / "src")
    plan = plan_conversion(src)
    out = tmp_path / "out"
    out.mkdir()
    lines: list[str] = []
    probing, release = threading.Event(), threading.Event()
    worker = headstart._Worker(plan, out, Target.OCP, ScaleMode.EXACT, 1, lines.append)

    def probe(shard) -> bool:  # (called while the shard is being taken)
        probing.set()
        release.wait(10)
        return True

    worker._in_page_cache = probe
    running = threading.Thread(target=worker.run)
    running.start()
    assert probing.wait(10)
    stopping = threading.Thread(target=worker.stop)
    stopping.start()
    time.sleep(0.2)
    assert lines == [], "the stop waits for the shard being taken"
    assert worker.stopped.is_set(), "the stop is heard before it waits for the lock, so however soon the run takes " \
        "the lock again it takes no other shard (a lock is not fair: the full suite once saw a second take first)"
    release.set()
    stopping.join(10)
    running.join(60)
    last = plan.shards[-1].name
    assert lines[:2] == [f'take "{last}"', "stopped"]
    assert [line for line in lines if line.startswith("take")] == [lines[0]]
    assert lines[-1].startswith(f'done ["{last}"') and sorted(p.name for p in out.iterdir()) == [last]


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (8, 6), (16, 14), (192, headstart.MAX_THREADS)])
def test_the_worker_leaves_two_cores_and_takes_at_most_max_threads(monkeypatch, cores: int, threads: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert headstart.head_start_threads() == threads
