"""Reconstruction-error report: hand-checked numbers, identity cases, and the sample's measured error."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import transformd.report as report_module
from transformd.errors import CheckpointError
from transformd.formats import FORMAT_VERSION, Target
from transformd.reference import convert_reference
from transformd.report import (
    LEGEND,
    Report,
    TensorError,
    TensorRow,
    compare_checkpoints,
    compare_modes,
    compare_modes_checkpoint,
    tensor_error,
)
from transformd.sample import mx_quantize, sample_weight, write_sample_checkpoint

#: Shapes with partial 128x128 tiles on every weight (the sample's defaults are engine-aligned).
AWKWARD = {"hidden": 320, "moe_intermediate": 224, "head_dim": 64}

ONE_E4M3FN = 0x38  # 1.0 in float8_e4m3fn; 0.5 in float8_e4m3fnuz
NINE_EIGHTHS_E4M3FN = 0x39  # 1.125 in float8_e4m3fn; 0.5625 in float8_e4m3fnuz


# --- tensor_error on hand-built cases -------------------------------------------------------------


@pytest.mark.parametrize("target, scale_inv", [("ocp", 1.0), ("fnuz", 2.0)])
def test_known_error(target: str, scale_inv: float):
    """32 ones in, one of them 1.125 out: every number of the result is known in closed form."""
    codes = torch.full((1, 32), ONE_E4M3FN, dtype=torch.uint8)
    scales = torch.full((1, 1), 127, dtype=torch.uint8)  # 2**0
    out = codes.clone()
    out[0, 5] = NINE_EIGHTHS_E4M3FN
    err = tensor_error(codes, scales, out, torch.tensor([[scale_inv]]), target)
    assert err.numel == 32
    assert err.rel_l2 == 0.125 / math.sqrt(32)
    assert err.exact_fraction == 31 / 32
    assert err.max_abs_err == 0.125


def test_known_error_with_block_scales():
    """Two MX blocks at different scales vs one tile scale; errors add up in squares."""
    codes = torch.full((1, 64), ONE_E4M3FN, dtype=torch.uint8)
    scales = torch.tensor([[127 + 3, 127 - 2]], dtype=torch.uint8)  # 8.0 and 0.25
    # Output: tile scale 2**3; first block 1.0 * 8 exact, second block 0.25 = 2**-5 * 8 (exact),
    # except element 40 written as 0 (error 0.25) and element 2 as 1.125 * 8 = 9 (error 1).
    out = torch.empty(1, 64, dtype=torch.uint8)
    out[0, :32] = ONE_E4M3FN
    out[0, 32:] = 0x10  # 2**-5 in e4m3fn: exponent field 2, bias 7
    out[0, 40] = 0x00
    out[0, 2] = NINE_EIGHTHS_E4M3FN
    err = tensor_error(codes, scales, out, torch.tensor([[8.0]]), "ocp")
    ref_sq = 32 * 64.0 + 32 * 0.0625
    assert err.rel_l2 == math.sqrt(1.0 + 0.0625) / math.sqrt(ref_sq)
    assert err.exact_fraction == 62 / 64
    assert err.max_abs_err == 1.0


def _lossless_pair(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random finite codes under one shared E8M0 scale, and a +-448 code in every 128x128 tile.

    One scale for all blocks: the exact tile scale is at most that scale, so
    nothing falls below e4m3fn's normal range. A 448 in every tile: the amax
    scale is the same power of two, so both modes are lossless.
    """
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes)  # no NaN codes
    codes[..., ::128, ::128] = 0xFE  # -448
    scales = torch.full((*shape[:-1], shape[-1] // 32), 120, dtype=torch.uint8)
    return codes, scales


@pytest.mark.parametrize("target", ["fnuz", "ocp"])
@pytest.mark.parametrize("shape", [(200, 96), (2, 130, 160)])
def test_identity_is_lossless(target: str, shape: tuple[int, ...]):
    codes, scales = _lossless_pair(shape)
    assert bool((codes == 0x80).any())  # -0 is in the input; FNUZ writes it as +0, which counts as exact
    for mode, err in compare_modes(codes, scales, target).items():
        assert err.rel_l2 == 0.0, mode
        assert err.exact_fraction == 1.0, mode
        assert err.max_abs_err == 0.0, mode
        assert err.numel == math.prod(shape)


def test_3d_is_the_combination_of_its_experts():
    gen = torch.Generator().manual_seed(1)
    codes, scales = mx_quantize(sample_weight((3, 160, 224), gen))
    q, s = convert_reference(codes, scales, "fnuz", "amax")
    whole = tensor_error(codes, scales, q, s, "fnuz")
    parts = [tensor_error(codes[i], scales[i], q[i], s[i], "fnuz") for i in range(3)]
    merged = TensorError.combine(parts)
    assert whole == merged
    assert whole.numel == 3 * 160 * 224
    assert whole.exact == sum(p.exact for p in parts)
    assert whole.rel_l2 == pytest.approx(math.sqrt(sum(p.sq_err for p in parts) / sum(p.sq_ref for p in parts)))
    assert whole.max_abs_err == max(p.max_abs_err for p in parts)


def test_rel_l2_is_computed_in_float64_over_exact_values():
    gen = torch.Generator().manual_seed(2)
    codes, scales = mx_quantize(sample_weight((130, 256), gen))
    q, s = convert_reference(codes, scales, "ocp", "amax")
    err = tensor_error(codes, scales, q, s, "ocp")
    ref = codes.view(torch.float8_e4m3fn).double() * torch.exp2(scales.double() - 127).repeat_interleave(32, -1)
    tile = s.double().repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :256]
    out = q.view(torch.float8_e4m3fn).double() * tile
    assert err.rel_l2 == pytest.approx(float((out - ref).norm() / ref.norm()), rel=1e-12)
    assert err.exact_fraction == float((out == ref).double().mean())
    assert err.max_abs_err == float((out - ref).abs().max())


def test_all_zero_tensor():
    codes = torch.zeros(4, 32, dtype=torch.uint8)
    err = compare_modes(codes, torch.full((4, 1), 127, dtype=torch.uint8))["exact"]
    assert (err.rel_l2, err.exact_fraction, err.max_abs_err) == (0.0, 1.0, 0.0)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError):
        tensor_error(
            torch.zeros(4, 32, dtype=torch.uint8),
            torch.zeros(4, 1, dtype=torch.uint8),
            torch.zeros(4, 64, dtype=torch.uint8),
            torch.ones(1, 1),
            "ocp",
        )


# --- the sample checkpoint: exact vs amax, measured --------------------------------------------


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    return write_sample_checkpoint(tmp_path_factory.mktemp("src") / "sample", **AWKWARD)


@pytest.mark.parametrize("target", ["fnuz", "ocp"])
def test_sample_exact_vs_amax(sample: Path, target: str):
    """Measured on the sample with partial tiles (AWKWARD): exact 3.63e-6 rel L2, 99.888% bit-exact; amax 2.26e-2, 23.2%.

    Ranges (not guesses) around those numbers catch a regression of either the
    conversion or the sample's realism; DESIGN.md's contract is exact <= 3e-5 and >= 93%.
    """
    reports = compare_modes_checkpoint(sample, target)
    assert set(reports) == {"exact", "amax"}
    exact, amax = reports["exact"].overall, reports["amax"].overall
    assert exact.numel == amax.numel == 2 * (2 * 320 * 320 + 2 * 64 * 320 + 4 * 3 * 224 * 320)
    assert 1e-6 < exact.rel_l2 < 1e-5
    assert 0.997 < exact.exact_fraction < 0.9995
    assert all(r.error.rel_l2 <= 3e-5 and r.error.exact_fraction >= 0.93 for r in reports["exact"].rows)
    assert 1.5e-2 < amax.rel_l2 < 3.5e-2
    assert 0.1 < amax.exact_fraction < 0.4
    assert len(reports["exact"].rows) == 32


# --- compare_checkpoints on an output built here with the reference -------------------------------


def _convert_dir(src: Path, out: Path, target: str, scale_mode: str) -> Path:
    """What transformd.checkpoint will write, built with convert_reference and save_file."""
    out.mkdir()
    index_file = src / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    weight_map = {}
    for fname in files:
        tensors = load_file(str(src / fname))
        for name in [n for n in tensors if n.endswith(("_scale", "_scale_inv"))]:  # (X.weight_scale, fused X_scale)
            if tensors[name].dtype != torch.uint8:
                continue
            weight = name.removesuffix("_inv").removesuffix("_scale")
            q, s = convert_reference(tensors[weight], tensors.pop(name), target, scale_mode)
            tensors[weight] = q.view(Target(target).torch_dtype)
            tensors[weight + "_scale_inv"] = s
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, fname)
    if index:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "ignored_layers": ["lm_head"],
        "transformd": {"target": target, "scale_mode": scale_mode, "format_version": FORMAT_VERSION},
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("target", ["fnuz", "ocp"])
@pytest.mark.parametrize("scale_mode", ["exact", "amax"])
def test_compare_checkpoints_matches_in_memory(sample: Path, tmp_path: Path, target: str, scale_mode: str):
    out = _convert_dir(sample, tmp_path / "out", target, scale_mode)
    report = compare_checkpoints(sample, out)
    assert (report.target, report.scale_mode) == (target, scale_mode)
    expected = compare_modes_checkpoint(sample, target)[scale_mode]
    assert [(r.name, r.shape) for r in report.rows] == [(r.name, r.shape) for r in expected.rows]
    assert [r.error for r in report.rows] == [r.error for r in expected.rows]
    assert report.overall == expected.overall
    assert report.rows[0].name == "model.layers.0.mlp.experts.0.down_proj.weight"
    assert report.rows[-1].name == "model.layers.1.self_attn.v_proj.weight"


@pytest.mark.parametrize(
    "kwargs", [{"scale_suffix": "weight_scale_inv"}, {"fused_experts": True}, {"shards": 1}, {"shards": 3}]
)
def test_compare_checkpoints_layouts(tmp_path: Path, kwargs: dict):
    src = write_sample_checkpoint(tmp_path / "src", layers=2, experts=2, **AWKWARD, **kwargs)
    out = _convert_dir(src, tmp_path / "out", "fnuz", "exact")
    report = compare_checkpoints(src, out, target="fnuz")
    n_mx = 2 * (4 + (2 if kwargs.get("fused_experts") else 2 * 3))
    assert len(report.rows) == n_mx
    assert 0 < report.overall.rel_l2 < 3e-5 and report.overall.exact_fraction > 0.99
    if kwargs.get("fused_experts"):
        assert report.rows[0].shape == (2, 320, 224)  # experts.down_proj, [E, N, K]


def test_compare_checkpoints_target_must_agree(sample: Path, tmp_path: Path):
    out = _convert_dir(sample, tmp_path / "out", "ocp", "exact")
    with pytest.raises(ValueError, match="not target fnuz"):
        compare_checkpoints(sample, out, target="fnuz")
    # Without a config record the target comes from the tensors' dtype, and the mode is unknown.
    (out / "config.json").write_text("{}")
    report = compare_checkpoints(sample, out)
    assert (report.target, report.scale_mode) == ("ocp", None)
    assert "scale mode unknown" in report.format_table()


def test_compare_checkpoints_refuses_unconverted(sample: Path, tmp_path: Path):
    copy = tmp_path / "copy"
    shutil.copytree(sample, copy)
    with pytest.raises(ValueError, match="no converted MXFP8 weight"):
        compare_checkpoints(sample, copy)
    with pytest.raises(FileNotFoundError):
        compare_checkpoints(sample, tmp_path)


def test_compare_checkpoints_names_a_file_shortened_meanwhile(sample: Path, tmp_path: Path, monkeypatch):
    """Tensors are read, not memory-mapped: a file shortened after its header was read is an error naming it (a
    memory map would have killed the process with SIGBUS, had it shrunk while a tensor was copied out)."""
    out = _convert_dir(sample, tmp_path / "out", "ocp", "exact")
    weight = "model.layers.0.mlp.experts.0.down_proj.weight"
    shard = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][weight]
    real = report_module.read_header

    def read_header_then_shorten(path):
        header = real(path)
        if Path(path) == shard:
            os.truncate(shard, header.tensors[weight].begin + 1)
        return header

    monkeypatch.setattr(report_module, "read_header", read_header_then_shorten)
    with pytest.raises(CheckpointError, match=f"file {re.escape(str(shard))}, tensor {re.escape(weight)}: file ended"):
        compare_checkpoints(sample, out)


def test_format_table(sample: Path):
    report = compare_modes_checkpoint(sample, "fnuz")["exact"]
    table = report.format_table()
    lines = table.splitlines()
    assert lines[0] == "target fnuz, scale mode exact"
    assert lines[1].split() == ["tensor", "shape", "rel", "L2", "exact", "%", "max", "abs", "err"]
    assert len(lines) == 2 + 1 + 32 + 1 + 1
    assert len({len(line) for line in lines[1:]}) == 1  # fixed width
    row = next(line for line in lines if line.startswith("model.layers.0.self_attn.q_proj.weight "))
    err = next(r.error for r in report.rows if r.name == "model.layers.0.self_attn.q_proj.weight")
    assert "[320, 320]" in row and f"{err.rel_l2:.3e}" in row and f"{100 * err.exact_fraction:.3f}" in row
    overall = report.overall
    assert lines[-1].startswith("overall (32 tensors)")
    assert f"{overall.rel_l2:.3e}" in lines[-1] and f"{100 * overall.exact_fraction:.3f}" in lines[-1]
    with_legend = report.format_table(legend=True).splitlines()
    assert with_legend[:-1] == lines and with_legend[-1] == LEGEND
    assert "rel L2 = " in LEGEND and "exact % = " in LEGEND and "max abs err = " in LEGEND
    data = report.as_dict()
    assert data["overall"]["rel_l2"] == overall.rel_l2 and len(data["tensors"]) == 32
    json.dumps(data)


def test_report_overall_is_element_weighted():
    small = TensorError.from_sums(numel=10, exact=0, sq_err=1.0, sq_ref=1.0, max_abs_err=0.5)
    big = TensorError.from_sums(numel=90, exact=90, sq_err=0.0, sq_ref=3.0, max_abs_err=0.0)
    report = Report("ocp", "exact", [TensorRow("a", (10,), small), TensorRow("b", (90,), big)])
    assert report.overall.numel == 100
    assert report.overall.exact_fraction == 0.9  # not the mean of 0.0 and 1.0
    assert report.overall.rel_l2 == 0.5  # sqrt(1 / (1 + 3)), not the mean of 1.0 and 0.0
    assert report.overall.max_abs_err == 0.5
    assert TensorError.from_sums(numel=1, exact=0, sq_err=1.0, sq_ref=0.0, max_abs_err=1.0).rel_l2 == math.inf
