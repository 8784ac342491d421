"""The pipelined conversion: byte-identical to a plain sequential conversion however it is cut up and spread,
stopped by an error in any stage with nothing left behind, and host memory bounded by its budget.

The expected output is built here by :func:`sequential_reference`, independently of the pipeline: shard by
shard, whole tensors, the PyTorch reference, written with :class:`SafetensorsWriter` in header order.
"""

from __future__ import annotations

import errno
import filecmp
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from transformd.checkpoint import convert as checkpoint_convert
from transformd.checkpoint import pieces, pipeline
from transformd.checkpoint import CheckpointError, Progress, convert_checkpoint, plan_conversion
from transformd.formats import MxFormatError, ScaleMode, Target
from transformd.reference import convert_reference
from transformd.safetensors_io import SafetensorsWriter, read_header, read_tensor
from transformd.sample import write_sample_checkpoint

#: Shapes with partial 128x128 tiles on every weight (the sample's defaults are engine-aligned).
AWKWARD = {"hidden": 320, "moe_intermediate": 224, "head_dim": 64}

from .support.checkpoints import SHARD_B, assert_converted, assert_converted_sample, default_shards, write_checkpoint
from .support.kernel_cases import AWKWARD as AWKWARD_VALUES
from .support.kernel_cases import spread_row_mx

REPO = Path(__file__).resolve().parents[1]


def sequential_reference(src: Path, out: Path, target: str = "fnuz", scale_mode: str = "exact") -> None:
    """What a conversion of ``src`` must produce, shard by shard, made the simplest way."""
    plan = plan_conversion(src)
    out.mkdir()

    def load(shard: str, info) -> torch.Tensor:
        with open(src / shard, "rb") as f:
            return read_tensor(f, info)

    for shard in plan.shards:
        if not shard.rewrite:
            (out / shard.name).write_bytes((src / shard.name).read_bytes())
            continue
        pairs = {p.weight.name: p for p in shard.pairs}
        specs, data = [], []
        for t in shard.header.tensors.values():  # offset order
            if t.name in shard.dropped:
                continue
            pair = pairs.get(t.name)
            if pair is None:
                specs.append((t.name, t.dtype, t.shape))
                data.append(load(shard.name, t))
                continue
            q, s = convert_reference(load(shard.name, pair.weight), load(pair.scale_shard, pair.scale), target,
                                     scale_mode)
            specs += [(t.name, Target(target).safetensors_dtype, t.shape), (pair.out_scale_name, "F32", s.shape)]
            data += [q, s]
        with SafetensorsWriter(out / shard.name, specs, shard.header.metadata) as writer:
            for (name, _, _), tensor in zip(specs, data):
                writer.write(name, tensor)


def assert_same_shards(expected: Path, got: Path) -> None:
    names = sorted(p.name for p in expected.glob("*.safetensors"))
    assert names and names == sorted(p.name for p in got.glob("*.safetensors"))
    for name in names:
        assert filecmp.cmp(expected / name, got / name, shallow=False), f"{name} differs from the sequential path"


def sample(path: Path, **kw) -> Path:
    """A multi-shard sample: 4 layers over 4 shards after the BF16 one, matrices of 320 rows (partial tiles)."""
    return write_sample_checkpoint(path, layers=4, experts=3, shards=5, **{**AWKWARD, **kw})


def transformd_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("transformd-")]


# ---------------------------------------------------------------------------------------------------------------------
# Same bytes as the sequential path, however the work is cut up and spread


@pytest.mark.parametrize("target", ["fnuz", "ocp"])
@pytest.mark.parametrize("scale_mode", ["exact", "amax"])
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_byte_identical_to_sequential(tmp_path: Path, target: str, scale_mode: str, fused: bool) -> None:
    src = sample(tmp_path / "src", fused_experts=fused)
    sequential_reference(src, tmp_path / "expected", target, scale_mode)
    convert_checkpoint(src, tmp_path / "default", target=target, scale_mode=scale_mode, device="cpu")
    assert_same_shards(tmp_path / "expected", tmp_path / "default")
    # A budget far below the checkpoint: pieces of 128 rows, every slot reused many times, stages waiting.
    result = convert_checkpoint(src, tmp_path / "tight", target=target, scale_mode=scale_mode, device="cpu",
                                host_memory_bytes=64 * 1024, chunk_bytes=1)
    assert_same_shards(tmp_path / "expected", tmp_path / "tight")
    assert_converted_sample(src, tmp_path / "tight", target, scale_mode)
    assert result.bytes_read == convert_checkpoint(src, tmp_path / "again", device="cpu").bytes_read
    assert transformd_threads() == []


def test_kernel_converter_path_byte_identical(tmp_path: Path, monkeypatch) -> None:
    """The GPU path's code (device buffers, out= kernel launch, copies back), run by Triton's CPU interpreter."""
    if torch.cuda.is_available():
        pytest.skip("runs the GPU path on the CPU; on a GPU machine the real path is exercised by the benchmark")
    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2, shards=2, fused_experts=True,
                                  hidden=160, moe_intermediate=64, head_dim=32, vocab=64)
    sequential_reference(src, tmp_path / "expected")
    made: list[object] = []
    batches: list[int] = []

    class Counting(pieces.KernelConverter):
        def __call__(self, slot, out, pieces):
            batches.append(len(pieces))
            return super().__call__(slot, out, pieces)

    def kernel_on_cpu(device, slot_bytes, target, scale_mode):
        made.append(Counting(torch.device("cpu"), slot_bytes, target, scale_mode))
        return made[-1]

    monkeypatch.setattr(pipeline, "make_converter", kernel_on_cpu)
    convert_checkpoint(src, tmp_path / "out", device="cpu", chunk_bytes=1)  # 128-row pieces of the 160-row q_proj
    assert made and made[0]._in is None, "device buffers are dropped when the job ends"
    assert_same_shards(tmp_path / "expected", tmp_path / "out")
    assert max(batches) > 1, "pieces that fit one slot share a batch (one launch)"


def test_batches_of_many_small_weights_byte_identical(tmp_path: Path, monkeypatch) -> None:
    """Per-expert 2-D weights (as ModelOpt and MiniMax store them) go many to a slot: one launch per batch, same bytes.

    The GPU converter's code (one copy each way, one grouped launch) runs in Triton's CPU interpreter; a slot as
    large as a GPU's (``BATCH_BYTES``) holds every expert of a shard, and a tight budget cuts batches short.
    """
    if torch.cuda.is_available():
        pytest.skip("runs the GPU path on the CPU; on a GPU machine the real path is exercised by the benchmark")
    src = write_sample_checkpoint(tmp_path / "src", layers=2, experts=8, shards=2, hidden=160, moe_intermediate=64,
                                  head_dim=32, vocab=64)
    sequential_reference(src, tmp_path / "expected")
    batches: list[int] = []

    class Counting(pieces.KernelConverter):
        def __call__(self, slot, out, pieces):
            batches.append(len(pieces))
            return super().__call__(slot, out, pieces)

    monkeypatch.setattr(pipeline, "make_converter", lambda device, *args: Counting(torch.device("cpu"), *args))
    real_size = pieces.size_buffers
    monkeypatch.setattr(pipeline, "size_buffers", lambda *a, **kw: real_size(*a, **{**kw, "pinned": True}))
    plan = plan_conversion(src)
    weights = sum(len(s.pairs) for s in plan.shards)
    convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert_same_shards(tmp_path / "expected", tmp_path / "out")
    assert sum(batches) == weights and len(batches) < weights / 4, (batches, weights)
    batches.clear()
    convert_checkpoint(src, tmp_path / "tight", device="cpu", host_memory_bytes=96 * 1024)
    assert_same_shards(tmp_path / "expected", tmp_path / "tight")
    assert sum(batches) >= weights and max(batches) > 1, batches  # (pieces: some weights cut in rows)


def test_the_engine_report_is_made_while_the_shards_are_written_unless_an_engine_is_checked(tmp_path: Path,
                                                                                           monkeypatch) -> None:
    """Without ``engine`` the report of the engines' readiness is made on a thread beside the writing (the first
    write does not wait for it) and is the same report; with ``engine`` it is made first, before any file of the
    output exists, so that a refusal writes nothing."""
    src = sample(tmp_path / "src")
    made: list[tuple[str, bool]] = []
    real = checkpoint_convert.plan_readiness

    def readiness(plan, target):
        made.append((threading.current_thread().name, sorted(p.name for p in tmp_path.iterdir())))
        return real(plan, target)

    monkeypatch.setattr(checkpoint_convert, "plan_readiness", readiness)
    result = convert_checkpoint(src, tmp_path / "out", target="ocp", device="cpu")
    assert len(made) == 1 and made[0][0].startswith("transformd-readiness")
    assert result.readiness == real(plan_conversion(src), Target.OCP)
    assert not result.readiness["vllm"].loads, "(the sample's shapes: vLLM is refused below)"
    with pytest.raises(CheckpointError, match="vllm could not load"):
        convert_checkpoint(src, tmp_path / "out2", target="ocp", device="cpu", engine="vllm")
    assert made[1] == (threading.current_thread().name, ["out", "src"]), "made first, on the caller's thread"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"], "the refusal wrote nothing"


def test_the_kernel_warm_up_is_for_gpus_only_and_never_raises(monkeypatch) -> None:
    """``warm_up`` loads the converters' kernel on each GPU before the first batch comes (the GPU suite checks that
    a conversion after it compiles and loads nothing new). It launches nothing for the CPU and starts no thread
    without a GPU; its errors (here: no CUDA, or a failing launch) are left to the conversion, which meets and
    reports them: it neither raises nor keeps the converters' first-launch lock."""
    launched: list[bool] = []

    def failing(*args, **kwargs):
        launched.append(pieces.KernelConverter._first_launch.locked())
        raise RuntimeError("launch failed")

    monkeypatch.setattr(pieces, "convert_packed", failing)
    pieces.warm_up([torch.device("cpu")], Target.FNUZ, ScaleMode.EXACT)
    assert launched == []
    assert pieces.start_warm_up([torch.device("cpu")], Target.FNUZ, ScaleMode.EXACT) is None
    pieces.warm_up([torch.device("cuda", 0)], Target.OCP, ScaleMode.AMAX)
    assert launched == ([True] if torch.cuda.is_available() else [])
    assert not pieces.KernelConverter._first_launch.locked()


def test_convert_checkpoint_warms_the_recipes_kernel_and_waits_for_it(tmp_path: Path, monkeypatch) -> None:
    """The warm-up starts before the plan (after the output's checks: a refused output waits for no kernel), with the
    conversion's devices and recipe, and has ended when ``convert_checkpoint`` returns, also when it raises (its
    buffers are given back with the conversion's)."""
    src = sample(tmp_path / "src")
    started: list[tuple] = []
    threads: list[threading.Thread] = []

    def start(devices, target, scale_mode):
        started.append((devices, target, scale_mode, (tmp_path / "out").exists()))
        threads.append(threading.Thread(target=time.sleep, args=(0.3,)))
        threads[-1].start()
        return threads[-1]

    monkeypatch.setattr(pieces, "start_warm_up", start)
    convert_checkpoint(src, tmp_path / "out", target="ocp", scale_mode="amax", device="cpu")
    assert started == [([torch.device("cpu")], Target.OCP, ScaleMode.AMAX, False)]
    assert not threads[-1].is_alive()
    with pytest.raises(CheckpointError, match="not empty"):
        convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert len(started) == 1, "no warm-up for an output refused at once"
    (src / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        convert_checkpoint(src, tmp_path / "out2", device="cpu")  # refused by the plan, while the kernel loads
    assert len(threads) == 2 and not threads[-1].is_alive()


def test_several_devices_byte_identical(tmp_path: Path, monkeypatch) -> None:
    """Three lanes (as for three GPUs; all on the CPU here): shards spread, same bytes, progress complete."""
    src = sample(tmp_path / "src")
    sequential_reference(src, tmp_path / "expected")
    assignments: list[list[list[str]]] = []
    real_assign = pipeline._assign_shards

    def spy(shards, lanes):
        groups = real_assign(shards, lanes)
        assignments.append([[s.name for s in g] for g in groups])
        return groups

    monkeypatch.setattr(pipeline, "conversion_devices", lambda device: [torch.device("cpu")] * 3)
    monkeypatch.setattr(pipeline, "_assign_shards", spy)
    seen: list[Progress] = []
    result = convert_checkpoint(src, tmp_path / "out", device="cpu", progress=seen.append,
                                host_memory_bytes=256 * 1024)
    assert_same_shards(tmp_path / "expected", tmp_path / "out")
    assert assignments and all(assignments[0]), f"every lane gets shards: {assignments}"
    assert result.device == "cpu,cpu,cpu"
    assert seen[-1].tensors_done == seen[-1].tensors_total and seen[-1].bytes_done == seen[-1].bytes_total
    assert [p.tensors_done for p in seen] == sorted(p.tensors_done for p in seen)


def test_row_pieces_of_a_matrix_name_the_row(tmp_path: Path) -> None:
    """A 2-D weight cut into 128-row pieces reports invalid values relative to its piece, and says so."""
    src = sample(tmp_path / "src")
    bad = "model.layers.2.self_attn.q_proj.weight"  # [320, 320]
    plan = plan_conversion(src)
    shard, info = next((s.name, s.header.tensors[bad]) for s in plan.shards if bad in s.header.tensors)
    with open(src / shard, "r+b") as f:
        f.seek(info.begin + 200 * 320 + 7)
        f.write(b"\x7f")
    with pytest.raises(MxFormatError, match=r"at index \(200, 7\)$") as whole:
        convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert whole.value.tensor == bad and Path(whole.value.file).name == shard
    with pytest.raises(MxFormatError, match=r"at index \(72, 7\) \(indices relative to row 128 of 320\)"):
        convert_checkpoint(src, tmp_path / "out", device="cpu", chunk_bytes=1)
    assert sorted(os.listdir(tmp_path)) == ["src"]


# ---------------------------------------------------------------------------------------------------------------------
# An error in any stage stops all of them, is raised as it was, and leaves nothing


def _plant_nan_in_middle_shard(src: Path) -> tuple[str, str]:
    """A NaN code in an expert weight of the middle shard; returns (shard, tensor)."""
    plan = plan_conversion(src)
    middle = plan.shards[len(plan.shards) // 2]
    info = next(p.weight for p in middle.pairs if ".experts." in p.weight.name)
    with open(src / middle.name, "r+b") as f:
        f.seek(info.begin + 5)
        f.write(b"\xff")
    return middle.name, info.name


@pytest.mark.parametrize("budget", [pipeline.DEFAULT_HOST_MEMORY_BYTES, 64 * 1024])
def test_error_in_middle_shard_stops_everything(tmp_path: Path, budget: int) -> None:
    src = sample(tmp_path / "src")
    shard, tensor = _plant_nan_in_middle_shard(src)
    shards = [s.name for s in plan_conversion(src).shards]
    seen: list[Progress] = []
    with pytest.raises(MxFormatError) as info:
        convert_checkpoint(src, tmp_path / "out", device="cpu", progress=seen.append, host_memory_bytes=budget)
    err = info.value
    assert err.tensor == tensor and err.file == str(src / shard)
    assert "NaN weight code (0x7F/0xFF)" in str(err) and f"tensor {tensor}" in str(err)
    assert seen, "work before the bad tensor was reported"
    assert {p.shard for p in seen} <= set(shards[: shards.index(shard) + 1]), "nothing after the error"
    assert sorted(os.listdir(tmp_path)) == ["src"], "no staging directory, no output"
    assert transformd_threads() == [], "every stage thread has ended"


def test_error_in_reader_stops_everything(tmp_path: Path, monkeypatch) -> None:
    """A shard that shrinks after planning: the reader's CheckpointError, naming the file, comes out."""
    src = sample(tmp_path / "src")
    plan = plan_conversion(src)
    middle = plan.shards[len(plan.shards) // 2]
    real_plan = checkpoint_convert.plan_conversion

    def plan_then_truncate(*args, **kwargs):
        result = real_plan(*args, **kwargs)
        os.truncate(src / middle.name, middle.header.data_start + 100)
        return result

    monkeypatch.setattr(checkpoint_convert, "plan_conversion", plan_then_truncate)
    with pytest.raises(CheckpointError, match="bytes early while") as info:
        convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert info.value.file == str(src / middle.name)
    assert sorted(os.listdir(tmp_path)) == ["src"] and transformd_threads() == []


def test_error_in_writer_stops_everything(tmp_path: Path, monkeypatch) -> None:
    """A full disk in the middle shard: the writer's OSError (errno intact, for the cache) comes out."""
    src = sample(tmp_path / "src")
    middle = plan_conversion(src).shards[2].name
    real = pipeline.SafetensorsWriter

    class FullDisk(real):
        def write(self, name, data):
            if self.path.name == middle:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().write(name, data)

    monkeypatch.setattr(pipeline, "SafetensorsWriter", FullDisk)
    with pytest.raises(OSError) as info:
        convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == ["src"] and transformd_threads() == []


def test_error_stops_a_slow_writer_promptly(tmp_path: Path, monkeypatch) -> None:
    """After a conversion error the writer stops at its next item instead of draining its backlog.

    The writer is slow (50 ms a write) and the converter fast, so a backlog of converted pieces waits for the
    writer when the error comes; draining it would take many more writes.
    """
    src = sample(tmp_path / "src")
    _plant_nan_in_middle_shard(src)
    failed_at: list[float] = []
    late_writes: list[float] = []
    real_convert = pieces.CpuConverter.__call__
    real_write = pipeline.SafetensorsWriter.write

    def convert(self, codes, scales, out):
        try:
            return real_convert(self, codes, scales, out)
        except MxFormatError:
            failed_at.append(time.monotonic())
            raise

    def slow_write(self, name, data):
        if failed_at:
            late_writes.append(time.monotonic())
        time.sleep(0.05)
        real_write(self, name, data)

    monkeypatch.setattr(pieces.CpuConverter, "__call__", convert)
    monkeypatch.setattr(pipeline.SafetensorsWriter, "write", slow_write)
    started = time.monotonic()
    with pytest.raises(MxFormatError):
        convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert failed_at and time.monotonic() - failed_at[0] < 3.0, "raised promptly after the error"
    assert len(late_writes) <= 2, f"the writer went on with {len(late_writes)} writes after the error"
    assert time.monotonic() - started < 30
    assert sorted(os.listdir(tmp_path)) == ["src"] and transformd_threads() == []


def test_progress_callback_error_stops_everything(tmp_path: Path) -> None:
    src = sample(tmp_path / "src")

    def progress(p: Progress) -> None:
        assert threading.current_thread() is threading.main_thread(), "progress runs on the calling thread"
        if p.tensors_done > 40:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(src, tmp_path / "out", device="cpu", progress=progress)
    assert sorted(os.listdir(tmp_path)) == ["src"] and transformd_threads() == []


@pytest.mark.parametrize("mode", ["exact", "amax"])
@pytest.mark.parametrize("target", ["fnuz", "ocp"])
def test_cpu_path_is_the_references_bytes_by_table_lookups_in_bands(tmp_path: Path, target: str, mode: str,
                                                                   monkeypatch) -> None:
    """The CPU path converts by NumPy table lookups on a pool of threads, one band of 128-row tiles at a time (one
    tile row here), in both scale modes: the reference's bytes on every input at the edges of the contract (-0,
    subnormals, extreme and mixed scales, partial tiles, one-row weights), and the reference is not asked for them."""
    shards = default_shards()
    for i, (_, (codes, scales)) in enumerate(AWKWARD_VALUES.items()):
        shards[SHARD_B].update({
            f"model.layers.0.mlp.awkward.{i}.weight": codes.clone().view(torch.float8_e4m3fn),
            f"model.layers.0.mlp.awkward.{i}.weight_scale": scales.clone(),
        })
    src = write_checkpoint(tmp_path / "src", shards)
    monkeypatch.setattr(pieces, "CPU_BAND_BYTES", 1)
    bands: list[int] = []
    real_bands = pieces._bands

    def counting(piece, source, dest, band_bytes):
        made = list(real_bands(piece, source, dest, band_bytes))
        bands.append(len(made))
        return made

    def no_reference(*args, **kwargs):
        raise AssertionError("the CPU path asked the PyTorch reference for a valid weight")

    monkeypatch.setattr(pieces, "_bands", counting)
    monkeypatch.setattr(pieces, "convert_reference_checked", no_reference)
    convert_checkpoint(src, tmp_path / "out", target=target, scale_mode=mode, device="cpu")
    assert_converted(src, tmp_path / "out", target, mode)
    assert max(bands) >= 8, "a weight of several experts or tile rows is cut into bands"
    assert transformd_threads() == []


@pytest.mark.parametrize("mode", ["exact", "amax"])
def test_cpu_bands_shrink_on_a_node_of_many_cores(tmp_path: Path, mode: str, monkeypatch) -> None:
    """64 threads on a small budget: each band is at most a quarter of the work space over the threads (one tile row
    at the least), so the lookups' temporaries stay within it; the bytes are the reference's."""
    monkeypatch.setattr(pieces, "usable_cores", lambda: 64)
    made: list[tuple[int, int]] = []  # (work bytes, band bytes) of each converter
    real_init, real_bands = pieces.CpuConverter.__init__, pieces._bands
    seen: list[int] = []

    def init(self, target, scale_mode, work_bytes, threads=None):
        real_init(self, target, scale_mode, work_bytes, threads)
        made.append((work_bytes, self.band_bytes))

    def bands(piece, source, dest, band_bytes):
        for codes, scales, converted in real_bands(piece, source, dest, band_bytes):
            seen.append(codes.nbytes)
            yield codes, scales, converted

    monkeypatch.setattr(pieces.CpuConverter, "__init__", init)
    monkeypatch.setattr(pieces, "_bands", bands)
    src = sample(tmp_path / "src")
    convert_checkpoint(src, tmp_path / "out", scale_mode=mode, device="cpu", host_memory_bytes=8 << 20)
    assert_converted_sample(src, tmp_path / "out", "fnuz", mode)
    [(work, band)] = made
    assert band == work // (4 * 64) < pieces.CPU_BAND_BYTES
    widest = max(p.weight.shape[-1] for s in plan_conversion(src).shards for p in s.pairs)
    assert seen and max(seen) <= max(band, 128 * widest)


def test_cpu_invalid_values_and_amax_weights_of_too_many_tables_go_to_the_reference(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """A weight whose values the lookups refuse, and in the amax mode one whose tables would outnumber its codes
    (a row of tiles with spread E8M0 bytes), are the PyTorch reference's: the bytes are the reference's, and an
    invalid value's error names the tensor and the file as it always did."""
    asked: list[str] = []
    real = pieces.convert_reference_checked

    def recording(codes, scales, target, scale_mode):
        asked.append(ScaleMode(scale_mode).value)
        return real(codes, scales, target, scale_mode)

    monkeypatch.setattr(pieces, "convert_reference_checked", recording)
    shards = default_shards()
    q, s = spread_row_mx()
    shards[SHARD_B].update({"model.layers.0.mlp.spread.weight": q.view(torch.float8_e4m3fn),
                            "model.layers.0.mlp.spread.weight_scale": s})
    src = write_checkpoint(tmp_path / "wide", shards)
    convert_checkpoint(src, tmp_path / "amax", scale_mode="amax", device="cpu")
    assert asked == ["amax"], "only the weight of too many scales goes to the reference"
    assert_converted(src, tmp_path / "amax", "fnuz", "amax")
    src = sample(tmp_path / "src")
    shard, tensor = _plant_nan_in_middle_shard(src)
    asked.clear()
    with pytest.raises(MxFormatError) as info:
        convert_checkpoint(src, tmp_path / "exact", device="cpu")
    assert asked == ["exact"], "only the weight with the NaN goes to the reference"
    assert info.value.tensor == tensor and info.value.file == str(src / shard)
    assert "NaN weight code (0x7F/0xFF)" in str(info.value)
    assert not (tmp_path / "exact").exists()
    assert transformd_threads() == []


# ---------------------------------------------------------------------------------------------------------------------
# Host memory is bounded by the budget, not by the checkpoint

_MEASURE = textwrap.dedent(
    """
    import json, sys
    from transformd.checkpoint import convert_checkpoint

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    warm, src, out, budget = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    convert_checkpoint(warm, out + "-warm", device="cpu", host_memory_bytes=budget)  # first-use allocations
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = status("VmRSS")
    result = convert_checkpoint(src, out, device="cpu", host_memory_bytes=budget)
    print(json.dumps({"growth": status("VmHWM") - before, "buffers": result.host_buffer_bytes,
                      "read": result.bytes_read}))
    """
)


def _peak_rss_growth(warm: Path, src: Path, out: Path, budget: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(warm), str(src), str(out), str(budget)],
                          check=False, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs")
def test_host_memory_bounded_by_budget(tmp_path: Path) -> None:
    """~110 MB of tensors through an 8 MiB budget: peak RSS grows by the budget plus a fixed slack.

    Measured in a fresh process each (psutil is not needed: /proc's VmHWM, reset after a warm-up). The
    control run with the default 2 GiB budget shows the measurement can see the buffers.
    """
    budget, slack = 8 << 20, 24 << 20
    src = write_sample_checkpoint(tmp_path / "src", layers=4, experts=16, hidden=1024, moe_intermediate=512,
                                  shards=3, fused_experts=True)
    warm = write_sample_checkpoint(tmp_path / "warm", layers=1, experts=2, shards=2)
    total = plan_conversion(src).data_bytes
    assert total > 12 * budget
    tight = _peak_rss_growth(warm, src, tmp_path / "tight", budget)
    assert tight["read"] >= total
    assert tight["buffers"] <= budget, tight
    assert tight["growth"] <= budget + slack, f"peak RSS grew by {tight['growth'] / 2**20:.1f} MiB"
    control = _peak_rss_growth(warm, src, tmp_path / "control", pipeline.DEFAULT_HOST_MEMORY_BYTES)
    assert control["growth"] > budget + slack, f"control grew by {control['growth'] / 2**20:.1f} MiB only"


def test_buffer_sizes_fit_the_budget() -> None:
    pairs = [SimpleNamespace(weight=SimpleNamespace(shape=shape)) for shape in [(256, 7168, 2048), (7168, 7168)]]
    for budget in (64 << 20, 300 << 20, 2 << 30, 64 << 30):
        for pinned, work in ((True, 0), (False, pieces.CPU_WORK_FACTOR)):
            sizes = pieces.size_buffers(pairs, budget, pipeline.DEFAULT_CHUNK_BYTES, pinned=pinned,
                                             work_factor=work)
            assert sizes.bound_bytes <= budget and sizes.slots >= pieces.MIN_SLOTS, (budget, pinned, sizes)
            assert sizes.piece_bytes <= pipeline.DEFAULT_CHUNK_BYTES
            assert not pinned or sizes.slot_bytes & (sizes.slot_bytes - 1) == 0, "pinned slots: powers of two"
    small = pieces.size_buffers([SimpleNamespace(weight=SimpleNamespace(shape=(64, 96)))], 2 << 30,
                                     pipeline.DEFAULT_CHUNK_BYTES, pinned=False, work_factor=0)
    assert small.slot_bytes < 8192, "slots no larger than the largest piece needs"
    # Below one 128-row piece of the widest weight: exceeded by that much, not refused.
    tiny = pieces.size_buffers(pairs, 1 << 20, 1, pinned=False, work_factor=0)
    assert tiny.slot_bytes >= 128 * 7168 and tiny.slots == pieces.MIN_SLOTS


@pytest.mark.parametrize("shape", [(320, 96), (3, 96, 64), (5, 300, 256), (2, 1000, 32), (0, 64, 32), (0, 32)])
@pytest.mark.parametrize("piece", [1, 1000, 70_000, 1 << 30])
def test_units_tile_the_weight(shape: tuple[int, ...], piece: int) -> None:
    """Pieces cover the weight's codes exactly, in order, cut at expert or 128-row boundaries."""
    units = pieces.units(shape, piece)
    assert units
    pos = 0
    for u in units:
        assert u.code_offset == pos and (u.r0 % 128 == 0) and (u.r0 == 0 and u.r1 == shape[-2] or u.e1 - u.e0 == 1)
        pos += u.code_bytes
        assert u.code_bytes <= piece or u.r1 - u.r0 <= 128 or (u.e1 - u.e0 == 1 and shape[-2] <= 128)
    assert pos == torch.Size(shape).numel()


# ---------------------------------------------------------------------------------------------------------------------
# Several GPUs: devices found and shards spread (no GPU needed)


def test_conversion_devices_spread_over_visible_gpus(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cuda = [torch.device("cuda", i) for i in range(4)]
    assert pipeline.conversion_devices("auto") == cuda
    assert pipeline.conversion_devices(None) == cuda
    assert pipeline.conversion_devices("cuda") == cuda
    assert pipeline.conversion_devices(torch.device("cuda")) == cuda
    assert pipeline.conversion_devices("cuda:2") == [torch.device("cuda", 2)], "an index asks for that GPU"
    assert pipeline.conversion_devices("cpu") == [torch.device("cpu")]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pipeline.conversion_devices("auto") == [torch.device("cuda")]


def _fake_shards(sizes: list[int]) -> list[SimpleNamespace]:
    return [SimpleNamespace(name=f"s{i}", header=SimpleNamespace(file_size=n)) for i, n in enumerate(sizes)]


@pytest.mark.parametrize(
    "sizes,lanes",
    [([5] * 8, 4), ([100, 1, 1, 1, 1, 50, 50], 2), ([7, 3, 9, 1, 4, 4, 8, 2, 6, 5], 3), ([3, 2], 8), ([1], 1)],
)
def test_assign_shards_balances_and_keeps_order(sizes: list[int], lanes: int) -> None:
    shards = _fake_shards(sizes)
    groups = pipeline._assign_shards(shards, lanes)
    assert len(groups) == lanes
    names = [s.name for g in groups for s in g]
    assert sorted(names) == sorted(s.name for s in shards) and len(names) == len(set(names)), "each shard once"
    for g in groups:
        assert [s.name for s in g] == [s.name for s in shards if s in g], "checkpoint order within a lane"
    loads = [sum(s.header.file_size for s in g) for g in groups]
    assert max(loads) - min(loads) <= max(sizes), f"balanced within one shard: {loads}"
    assert sum(1 for g in groups if g) == min(lanes, len(sizes)), "no idle lane while a lane has two shards"


def test_assign_shards_of_a_real_plan(tmp_path: Path) -> None:
    plan = plan_conversion(sample(tmp_path / "src"))
    groups = pipeline._assign_shards(plan.shards, 2)
    assert all(groups) and sorted(s.name for g in groups for s in g) == [s.name for s in plan.shards]
    assert read_header(plan.src / groups[0][0].name).file_size > 0


class _ReverseOrder:
    """A ShardOrder that always picks the last pending shard and records every call."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []
        self.finished: list[tuple[str, Path, bytes]] = []

    def next(self, pending):
        self.asked.append(list(pending))
        return pending[-1]

    def done(self, name, path):
        self.finished.append((name, Path(path), Path(path).read_bytes()))


def test_shard_order_reorders_shards_and_reports_final_files(tmp_path: Path) -> None:
    """The hook behind the daemon's just-in-time shards: order changes, bytes do not."""
    src = sample(tmp_path / "src")
    order = _ReverseOrder()
    out = tmp_path / "out"
    convert_checkpoint(src, out, device="cpu", shard_order=order)
    shards = [s.name for s in plan_conversion(src).shards]
    assert len(shards) > 2
    assert order.asked == [shards[:n] for n in range(len(shards), 0, -1)]  # before each shard, with what is left
    assert [name for name, _, _ in order.finished] == shards[::-1]
    for name, path, data in order.finished:
        assert path.name == name and data == (out / name).read_bytes()  # final when reported
    expected = tmp_path / "expected"
    convert_checkpoint(src, expected, device="cpu")
    assert_same_shards(expected, out)
    assert isinstance(order, pipeline.ShardOrder)


def test_a_burst_of_ticks_makes_one_progress_report() -> None:
    """Thousands of small tensors finish in bursts: the calling thread applies every waiting tick, then reports
    once, instead of running the progress callback (and taking the interpreter from the stages) per tensor."""
    import threading

    from transformd.checkpoint.stages import Stages

    stages, emitted = Stages(), threading.Event()

    def burst() -> None:
        for _ in range(1000):
            stages.tick("a.safetensors", 1, 10)
        emitted.set()

    stages.start("burst", burst)
    assert emitted.wait(10)
    ticks, reports = [], []
    stages.wait(lambda *payload: ticks.append(payload), lambda: reports.append(len(ticks)))
    assert len(ticks) == 1000 and reports == [1000]


def test_ticks_waiting_with_an_error_are_reported_before_it_is_raised() -> None:
    """A stage that finished tensors and then failed: the caller's last progress report counts those tensors
    (what was done before the failure), even when the ticks and the error are taken in one burst."""
    import time

    from transformd.checkpoint.stages import Stages

    stages = Stages()

    def work_then_fail() -> None:
        for _ in range(3):
            stages.tick("a.safetensors", 1, 10)
        raise ValueError("bad tensor")

    stages.start("fail", work_then_fail)
    deadline = time.monotonic() + 10
    while stages._events.qsize() < 5:  # 3 ticks, the error, the exit: all taken in one burst below
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ticks, reports = [], []
    with pytest.raises(ValueError, match="bad tensor"):
        stages.wait(lambda *payload: ticks.append(payload), lambda: reports.append(len(ticks)))
    assert len(ticks) == 3 and reports == [3]
