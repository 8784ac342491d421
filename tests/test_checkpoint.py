"""Whole-checkpoint conversion: round trips checked tensor by tensor against the reference, byte-identity of
everything untouched, config/index rewriting, and every invalid input refused with nothing left behind.

The tests build their own tiny checkpoints (:func:`tests.support.checkpoints.write_checkpoint`), so that each defect
can be planted exactly; the sample checkpoint of :mod:`transformd.sample` is converted too.
"""

from __future__ import annotations

import filecmp
import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from transformd.checkpoint import (
    CheckpointError,
    ConversionResult,
    Progress,
    convert_checkpoint,
    plan_conversion,
)
from transformd.checkpoint.pieces import CpuConverter
from transformd.formats import MxFormatError
from transformd.kernels import GroupMemberError
from transformd import sample
from transformd.safetensors_io import read_header

from .support.checkpoints import (
    SHARD_A,
    SHARD_B,
    O,
    Q,
    add_tensor,
    assert_converted,
    assert_converted_sample,
    default_shards,
    model_config,
    overflow,
    poke,
    remove_tensor,
    replace_pair,
    set_tensor,
    write_checkpoint,
    write_json,
)


def _record_rewritten_shards(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the shards the converter writes through SafetensorsWriter (rather than copying whole)."""
    from transformd.checkpoint import pipeline as checkpoint

    names: list[str] = []
    real = checkpoint.SafetensorsWriter

    def recording(path, *args, **kwargs):
        names.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "SafetensorsWriter", recording)
    return names


def _parent_listing(path: Path) -> list[str]:
    return sorted(os.listdir(path))


# ---------------------------------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("target", ["fnuz", "ocp"])
@pytest.mark.parametrize("scale_mode", ["exact", "amax"])
def test_round_trip_targets_and_modes(tmp_path: Path, target: str, scale_mode: str, monkeypatch) -> None:
    src = write_checkpoint(tmp_path / "src")
    rewritten = _record_rewritten_shards(monkeypatch)
    result = convert_checkpoint(src, tmp_path / "out", target=target, scale_mode=scale_mode, device="cpu")
    assert rewritten == [SHARD_B], "a shard without MXFP8 tensors is copied, not rewritten"
    assert isinstance(result, ConversionResult) and result.out == tmp_path / "out"
    converted = assert_converted(src, tmp_path / "out", target, scale_mode)
    assert sorted(result.converted) == sorted(converted) and len(converted) == 8
    assert result.shards == [SHARD_A, SHARD_B]
    assert filecmp.cmp(src / SHARD_A, tmp_path / "out" / SHARD_A, shallow=False), "shard without MXFP8 copied as is"
    assert result.bytes_written > 0 and result.bytes_read > 0 and result.seconds > 0
    assert _parent_listing(tmp_path) == ["out", "src"], "no staging directory left behind"


@pytest.mark.parametrize(
    "suffix,scale_dtype,fused",
    [
        ("weight_scale", torch.float8_e8m0fnu, False),
        ("weight_scale_inv", torch.uint8, False),  # MiniMax style: the output scale reuses the name
        ("weight_scale_inv", torch.float8_e8m0fnu, True),
        ("weight_scale", torch.uint8, True),
    ],
)
def test_round_trip_scale_names_dtypes_and_fused_experts(tmp_path: Path, suffix, scale_dtype, fused) -> None:
    src = write_checkpoint(tmp_path / "src", default_shards(suffix=suffix, scale_dtype=scale_dtype, fused=fused))
    convert_checkpoint(src, tmp_path / "out", device="cpu")
    converted = assert_converted(src, tmp_path / "out")
    assert len(converted) == (4 if fused else 8)
    out_b = read_header(tmp_path / "out" / SHARD_B).tensors
    assert all(not n.endswith(".weight_scale") for n in out_b), "old ModelOpt scales are dropped"


def test_fused_experts_in_small_chunks_match(tmp_path: Path) -> None:
    """3-D experts read and converted a few experts at a time give the same bytes as all at once."""
    src = write_checkpoint(tmp_path / "src", default_shards(fused=True))
    convert_checkpoint(src, tmp_path / "whole", device="cpu")
    convert_checkpoint(src, tmp_path / "chunked", device="cpu", chunk_bytes=136 * 96)  # one expert per chunk
    assert_converted(src, tmp_path / "chunked")
    for shard in (SHARD_A, SHARD_B):
        assert filecmp.cmp(tmp_path / "whole" / shard, tmp_path / "chunked" / shard, shallow=False)


def test_config_without_quantization_config(tmp_path: Path) -> None:
    """ModelOpt exports where only hf_quant_config.json describes the quantization: its glob exclusions become the
    exact names of the unquantized layers, and the globs are kept as provenance."""
    config = {k: v for k, v in model_config().items() if k != "quantization_config"}
    src = write_checkpoint(tmp_path / "src", config=config)
    convert_checkpoint(src, tmp_path / "out", device="cpu")
    out_config = json.loads((tmp_path / "out" / "config.json").read_text())
    qc = out_config.pop("quantization_config")
    assert out_config == config
    assert qc["ignored_layers"] == qc["modules_to_not_convert"] == [
        "lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"
    ]
    assert qc["transformd"]["source_exclusions"] == {
        "hf_quant_config.json:quantization:exclude_modules": ["lm_head", "model.layers.*.mlp.gate", "mtp"]
    }
    assert "ignore" not in qc and "kv_cache_scheme" not in qc
    assert qc["transformd"]["source_quantization"] == {"quant_algo": "MXFP8"}


def test_unreferenced_safetensors_not_carried(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src")
    (src / "model.safetensors").write_bytes((src / SHARD_B).read_bytes())  # stale single-file copy
    result = convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert result.left_out == ["model.safetensors"]
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert_converted(src, tmp_path / "out")


def test_single_file_checkpoint(tmp_path: Path) -> None:
    merged = {name: t for ts in default_shards().values() for name, t in ts.items()}
    src = write_checkpoint(tmp_path / "src", {"model.safetensors": merged}, with_hf_quant=False)
    result = convert_checkpoint(src, tmp_path / "out", target="ocp", device="cpu")
    assert result.shards == ["model.safetensors"]
    assert_converted(src, tmp_path / "out", "ocp")
    assert not (tmp_path / "out" / "hf_quant_config.json").exists(), "not invented when the input has none"


def test_hf_cache_snapshot_of_symlinks(tmp_path: Path) -> None:
    """An HF hub snapshot is a directory of symlinks into blobs/: the output holds real files."""
    blobs = write_checkpoint(tmp_path / "blobs")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for f in blobs.iterdir():
        if f.is_file():
            (snapshot / f.name).symlink_to(f)
    (snapshot / "assets").mkdir()
    (snapshot / "assets" / "chat_template.jinja").symlink_to(blobs / "assets" / "chat_template.jinja")
    convert_checkpoint(snapshot, tmp_path / "out", device="cpu")
    assert_converted(snapshot, tmp_path / "out")
    assert not any(p.is_symlink() for p in (tmp_path / "out").rglob("*"))


def test_scale_in_another_shard(tmp_path: Path) -> None:
    """A scale stored in a different shard than its weight: the new scale goes next to the weight."""
    shards = default_shards()
    moved = "model.layers.0.self_attn.q_proj.weight_scale"
    shards[SHARD_A][moved] = shards[SHARD_B].pop(moved)
    src = write_checkpoint(tmp_path / "src", shards)
    convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert_converted(src, tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.0.self_attn.q_proj.weight_scale_inv"] == SHARD_B
    assert moved not in load_file(str(tmp_path / "out" / SHARD_A))


def test_select_that_leaves_mxfp8_weights_is_refused(tmp_path: Path) -> None:
    """A block-FP8 output may not carry MXFP8 tensors: engines would read them as block FP8 without an error."""
    src = write_checkpoint(tmp_path / "src")
    with pytest.raises(CheckpointError, match=r"leaves 2 of the 8 MXFP8 weights unconverted \(first: .*o_proj.weight"):
        convert_checkpoint(src, tmp_path / "out", select=r"\.experts\.", device="cpu")
    assert _parent_listing(tmp_path) == ["src"]
    result = convert_checkpoint(src, tmp_path / "out", select=r"proj", device="cpu")
    assert len(result.converted) == 8
    rec = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["transformd"]
    assert rec["select"] == "proj"


def test_per_tensor_fp8_weight_is_refused(tmp_path: Path) -> None:
    """A per-tensor FP8 layer (F32 scale) would sit under a block-FP8 config without its block scale: refused."""
    shards = default_shards()
    shards[SHARD_B]["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(32, 96, dtype=torch.float8_e4m3fn)
    shards[SHARD_B]["model.layers.0.self_attn.v_proj.weight_scale"] = torch.tensor(0.5)
    src = write_checkpoint(tmp_path / "src", shards)
    for select in (None, "[^v]_proj"):  # (v_proj left out of the selection: still refused)
        with pytest.raises(CheckpointError, match="v_proj.weight_scale is F32 \\[\\], not E8M0"):
            convert_checkpoint(src, tmp_path / "out", select=select, device="cpu")
    assert _parent_listing(tmp_path) == ["src"]


def test_sample_checkpoint_round_trip(tmp_path: Path) -> None:
    for i, (suffix, fused) in enumerate([("weight_scale", False), ("weight_scale_inv", True)]):
        src = sample.write_sample_checkpoint(tmp_path / f"src{i}", layers=1, experts=2, scale_suffix=suffix,
                                             fused_experts=fused)
        result = convert_checkpoint(src, tmp_path / f"out{i}", scale_mode="amax", device="cpu")
        converted = assert_converted_sample(src, tmp_path / f"out{i}", "fnuz", "amax")
        assert set(result.converted) == converted and converted




def test_progress_reports_every_tensor_and_byte(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src")
    seen: list[Progress] = []
    convert_checkpoint(src, tmp_path / "out", device="cpu", progress=seen.append)
    plan = plan_conversion(src)
    assert seen[-1].tensors_done == seen[-1].tensors_total == plan.tensor_count
    assert seen[-1].bytes_done == seen[-1].bytes_total
    assert [p.bytes_done for p in seen] == sorted(p.bytes_done for p in seen)
    assert {p.shard for p in seen} == {SHARD_A, SHARD_B}


# ---------------------------------------------------------------------------------------------------------------------
# Output directory handling


def test_non_empty_out_refused_and_overwrite(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="not empty"):
        convert_checkpoint(src, out, device="cpu")
    assert _parent_listing(out) == ["keep.txt"] and _parent_listing(tmp_path) == ["out", "src"]
    # --overwrite replaces an earlier conversion's output only (before, it removed whatever was there)
    with pytest.raises(CheckpointError, match="not a transformd output"):
        convert_checkpoint(src, out, device="cpu", overwrite=True)
    assert _parent_listing(out) == ["keep.txt"] and _parent_listing(tmp_path) == ["out", "src"]
    (out / "keep.txt").unlink()
    convert_checkpoint(src, out, device="cpu", target="ocp")
    (out / "stray.txt").write_text("x")
    convert_checkpoint(src, out, device="cpu", overwrite=True)
    assert not (out / "stray.txt").exists()
    assert_converted(src, out)
    assert _parent_listing(tmp_path) == ["out", "src"], "the replaced directory is removed"


def test_empty_existing_out_accepted(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src")
    (tmp_path / "out").mkdir()
    convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert_converted(src, tmp_path / "out")


@pytest.mark.parametrize("out", ["src", "src/inner", "."])
def test_out_overlapping_src_refused(tmp_path: Path, out: str) -> None:
    src = write_checkpoint(tmp_path / "src")
    before = sorted(p.name for p in src.rglob("*"))
    with pytest.raises(CheckpointError, match="outside the input"):
        convert_checkpoint(src, tmp_path / out, device="cpu", overwrite=True)
    assert sorted(p.name for p in src.rglob("*")) == before


# ---------------------------------------------------------------------------------------------------------------------
# Invalid input: refused with file, tensor and problem; nothing left next to the output


MX, CK = MxFormatError, CheckpointError
INVALID = {  # case: (mutation, error type, tensor named, problem stated)
    "NaN code 0x7F": (
        set_tensor(f"{O}.weight", poke((3, 70), 0x7F)), MX, f"{O}.weight", "NaN weight code (0x7F/0xFF) at index (3, 70)"
    ),
    "NaN code 0xFF": (set_tensor(f"{O}.weight", poke((95, 0), 0xFF)), MX, f"{O}.weight", "NaN weight code"),
    "E8M0 0xFF": (
        set_tensor(f"{O}.weight_scale", poke((7, 4), 0xFF)), MX, f"{O}.weight",
        "E8M0 scale byte 0xFF (NaN) at scale index (7, 4)",
    ),
    "overflow": (overflow, MX, f"{O}.weight", "not finite in float32"),
    "K % 32": (replace_pair(f"{O}", (32, 80), (32, 2)), MX, f"{O}.weight", "K = 80"),
    "scale shape": (
        replace_pair(f"{O}", (32, 96), (32, 2)), MX, f"{O}.weight", "scale shape [32, 2] does not match"
    ),
    "3-D scale shape": (replace_pair(f"{O}", (2, 32, 96), (2, 3, 3)), MX, f"{O}.weight", "does not match"),
    "1-D weight": (replace_pair(f"{O}", (96,), (3,)), MX, f"{O}.weight", "1 dimensions"),
    "weight without scale": (remove_tensor(f"{Q}.weight_scale"), CK, f"{Q}.weight", "F8_E4M3 weight without its scale"),
    "scale without weight": (remove_tensor(f"{Q}.weight"), CK, f"{Q}.weight_scale", "E8M0 scale without its weight"),
    "weight not F8_E4M3": (set_tensor(f"{Q}.weight", lambda t: t.view(torch.uint8)), CK, f"{Q}.weight", "weight is U8"),
    "two scales": (
        add_tensor(f"{Q}.weight_scale_inv", torch.zeros(160, 3, dtype=torch.uint8)), CK, f"{Q}.weight", "two E8M0 scales"
    ),
    "output name taken": (
        add_tensor(f"{Q}.weight_scale_inv", torch.zeros(2, 1)), CK, f"{Q}.weight_scale_inv", "already has a F32 tensor"
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_input_refused_nothing_written(tmp_path: Path, case: str) -> None:
    mutate, error, tensor, problem = INVALID[case]
    shards = default_shards()
    mutate(shards)
    src = write_checkpoint(tmp_path / "src", shards)
    with pytest.raises(error) as info:
        convert_checkpoint(src, tmp_path / "out", device="cpu")
    err = info.value
    assert problem in str(err), str(err)
    assert err.tensor == tensor and f"tensor {tensor}" in str(err)
    assert err.file is not None and Path(err.file).name == SHARD_B and str(src) in str(err)
    assert _parent_listing(tmp_path) == ["src"], "nothing may be left next to the output"


def test_invalid_values_in_fused_experts_name_the_expert(tmp_path: Path) -> None:
    shards = default_shards(fused=True)
    name = "model.layers.0.mlp.experts.down_proj.weight"
    set_tensor(name, poke((2, 10, 33), 0xFF))(shards)
    src = write_checkpoint(tmp_path / "src", shards)
    with pytest.raises(MxFormatError, match=r"NaN weight code \(0x7F/0xFF\) at index \(2, 10, 33\)") as info:
        convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert info.value.tensor == name
    with pytest.raises(MxFormatError, match=r"at index \(0, 10, 33\) \(indices relative to expert 2 of 3\)"):
        convert_checkpoint(src, tmp_path / "out", device="cpu", chunk_bytes=1)  # one expert at a time
    assert _parent_listing(tmp_path) == ["src"]


def test_error_after_partial_output_leaves_existing_out_as_it_was(tmp_path: Path, monkeypatch) -> None:
    shards = default_shards()
    set_tensor(f"{O}.weight", poke((0, 0), 0x7F))(shards)
    src = write_checkpoint(tmp_path / "src", shards)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    (out / "config.json").write_text('{"quantization_config": {"transformd": {}}}')  # an earlier output's
    written: list[Progress] = []
    a_written = lambda: written and written[-1].tensors_done > len(shards[SHARD_A])  # noqa: E731
    convert = CpuConverter.__call__

    def after_shard_a(self, slot, out, pieces):  # the invalid weight fails only once shard A is on disk
        try:
            return convert(self, slot, out, pieces)
        except GroupMemberError:
            deadline = time.monotonic() + 60
            while not a_written() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise

    monkeypatch.setattr(CpuConverter, "__call__", after_shard_a)
    with pytest.raises(MxFormatError):
        convert_checkpoint(src, out, device="cpu", overwrite=True, progress=written.append)
    assert a_written(), "the error came after output was written"
    assert _parent_listing(tmp_path) == ["out", "src"] and _parent_listing(out) == ["config.json", "old.txt"]


def test_no_mxfp8_weights_refused(tmp_path: Path) -> None:
    shards = default_shards()
    shards[SHARD_B] = {n: t for n, t in shards[SHARD_B].items() if t.dtype not in (torch.float8_e4m3fn, torch.uint8)}
    src = write_checkpoint(tmp_path / "src", shards)
    with pytest.raises(CheckpointError, match="no MXFP8 weights") as info:
        convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert info.value.file == str(src)
    assert _parent_listing(tmp_path) == ["src"]


def test_select_matching_nothing_and_bad_regex_refused(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src")
    with pytest.raises(CheckpointError, match="matches none of the 8 MXFP8 weights"):
        convert_checkpoint(src, tmp_path / "out", select="nothing-like-this", device="cpu")
    with pytest.raises(CheckpointError, match="not a valid regular expression"):
        convert_checkpoint(src, tmp_path / "out", select="(", device="cpu")
    assert _parent_listing(tmp_path) == ["src"]


def test_corrupt_shard_header_refused(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src")
    raw = (src / SHARD_B).read_bytes()
    (src / SHARD_B).write_bytes(raw[:-10])  # truncated: the last tensor runs past the end
    with pytest.raises(CheckpointError, match="run past the end of the file") as info:
        convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert info.value.file == str(src / SHARD_B) and info.value.tensor
    (src / SHARD_B).write_bytes(raw[:8] + b"[" + raw[9:])
    with pytest.raises(CheckpointError, match="not valid UTF-8 JSON"):
        convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert _parent_listing(tmp_path) == ["src"]


def test_inconsistent_index_refused(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = SHARD_B
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not hold it") as info:
        convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert info.value.tensor == "model.norm.weight" and info.value.file == str(src / SHARD_B)
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a file name in the directory"):
        convert_checkpoint(src, tmp_path / "out", device="cpu")
    assert _parent_listing(tmp_path) == ["src"]


def test_missing_config_and_shards_refused(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src")
    (src / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: is missing"):
        convert_checkpoint(src, tmp_path / "out", device="cpu")
    empty = tmp_path / "empty"
    empty.mkdir()
    write_json(empty / "config.json", {})
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        convert_checkpoint(empty, tmp_path / "out", device="cpu")
    assert _parent_listing(tmp_path) == ["empty", "src"]


def test_a_conversions_output_fed_back_in_is_refused_as_such(tmp_path: Path) -> None:
    """Before, converting an output again failed on its first FP8 weight ("scale is F32 [2, 1], not E8M0 ... not an
    MXFP8 weight"), which did not say that the directory is converted already."""
    src = write_checkpoint(tmp_path / "src")
    convert_checkpoint(src, tmp_path / "out", device="cpu", target="ocp")
    with pytest.raises(CheckpointError, match="records a transformd conversion") as info:
        convert_checkpoint(tmp_path / "out", tmp_path / "again", device="cpu")
    assert str(tmp_path / "out" / "config.json") in str(info.value)
    assert _parent_listing(tmp_path) == ["out", "src"]
