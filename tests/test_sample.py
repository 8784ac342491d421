"""The sample checkpoint (layout, names, dtypes, determinism) and the MX quantizer behind it."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open

from transformd.reference import dequantize_mx
from transformd.sample import mx_quantize, write_sample_checkpoint

SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"


def _tensors(ckpt: Path) -> dict[str, tuple[str, str, list[int]]]:
    """name -> (file, safetensors dtype, shape), over every shard."""
    files = sorted(p.name for p in ckpt.glob("*.safetensors"))
    out = {}
    for fname in files:
        with safe_open(str(ckpt / fname), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                sl = f.get_slice(name)
                out[name] = (fname, sl.get_dtype(), list(sl.get_shape()))
    return out


def _load(ckpt: Path, fname: str, name: str) -> torch.Tensor:
    with safe_open(str(ckpt / fname), framework="pt") as f:
        return f.get_tensor(name)


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    return write_sample_checkpoint(tmp_path_factory.mktemp("ckpt") / "sample")


# --- layout -------------------------------------------------------------------------------------


def test_files_and_configs(sample: Path):
    names = sorted(p.name for p in sample.iterdir())
    assert names == sorted(
        [
            "config.json",
            "generation_config.json",
            "hf_quant_config.json",
            "model.safetensors.index.json",
            SHARD_1,
            SHARD_2,
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    config = json.loads((sample / "config.json").read_text())
    for key, value in {
        "hidden_size": 256,
        "moe_intermediate_size": 128,
        "num_experts": 4,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "vocab_size": 512,
        "swiglu_alpha": 1.702,
        "swiglu_beta": 1.0,
        "swiglu_limit": 7.0,
    }.items():
        assert config[key] == value, key
    qc = config["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MXFP8" and "lm_head" in qc["ignore"]
    hf = json.loads((sample / "hf_quant_config.json").read_text())
    assert hf["producer"]["name"] == "modelopt"
    assert hf["quantization"]["quant_algo"] == "MXFP8"
    assert hf["quantization"]["group_size"] == 32
    assert "lm_head" in hf["quantization"]["exclude_modules"]


def test_index_matches_shards(sample: Path):
    index = json.loads((sample / "model.safetensors.index.json").read_text())
    tensors = _tensors(sample)
    assert index["weight_map"] == {name: fname for name, (fname, _, _) in tensors.items()}
    sizes = {"BF16": 2, "F8_E4M3": 1, "U8": 1, "F32": 4}
    assert index["metadata"]["total_size"] == sum(sizes[dt] * math.prod(shape) for _, dt, shape in tensors.values())


def test_names_dtypes_shapes(sample: Path):
    tensors = _tensors(sample)
    expected = {
        "model.embed_tokens.weight": (SHARD_1, "BF16", [512, 256]),
        "model.norm.weight": (SHARD_1, "BF16", [256]),
        "lm_head.weight": (SHARD_1, "BF16", [512, 256]),
    }
    for layer in range(2):
        p = f"model.layers.{layer}"
        for norm, n in (("input_layernorm", 256), ("post_attention_layernorm", 256)):
            expected[f"{p}.{norm}.weight"] = (SHARD_2, "BF16", [n])
        for norm in ("q_norm", "k_norm"):
            expected[f"{p}.self_attn.{norm}.weight"] = (SHARD_2, "BF16", [128])
        expected[f"{p}.mlp.gate.weight"] = (SHARD_2, "BF16", [4, 256])
        expected[f"{p}.self_attn.k_proj.k_scale"] = (SHARD_2, "F32", [])
        expected[f"{p}.self_attn.v_proj.v_scale"] = (SHARD_2, "F32", [])
        mx = {f"{p}.self_attn.{x}_proj": [256 if x in "qo" else 128, 256] for x in "qkvo"}
        for e in range(4):
            mx |= {f"{p}.mlp.experts.{e}.{x}_proj": [128, 256] for x in ("gate", "up")}
            mx[f"{p}.mlp.experts.{e}.down_proj"] = [256, 128]
        for module, shape in mx.items():
            expected[f"{module}.weight"] = (SHARD_2, "F8_E4M3", shape)
            expected[f"{module}.weight_scale"] = (SHARD_2, "U8", [shape[0], shape[1] // 32])
    assert tensors == expected
    # Whole 128x128 tiles everywhere, as engines need (tests that want partial tiles pass other sizes).
    assert all(s[0] % 128 == 0 and s[1] % 128 == 0 for _, dt, s in tensors.values() if dt == "F8_E4M3")


def test_one_shard_has_no_mxfp8_tensor(sample: Path):
    dtypes_per_file: dict[str, set[str]] = {}
    for fname, dtype, _ in _tensors(sample).values():
        dtypes_per_file.setdefault(fname, set()).add(dtype)
    assert dtypes_per_file[SHARD_1] == {"BF16"}
    assert {"F8_E4M3", "U8"} <= dtypes_per_file[SHARD_2]


def test_values_are_mx_quantized(sample: Path):
    """Each 32-block's largest code is in [256, 448]: the shared exponent is floor(log2 amax) - 8."""
    for name, (fname, dtype, _) in _tensors(sample).items():
        if dtype != "F8_E4M3":
            continue
        codes = _load(sample, fname, name).view(torch.uint8)
        mag = codes.view(torch.float8_e4m3fn).float().abs()
        block_max = mag.reshape(*mag.shape[:-1], -1, 32).amax(-1)
        assert bool(((block_max >= 256) & (block_max <= 448)).all()), name
        assert not bool(((codes & 0x7F) == 0x7F).any()), name  # no NaN codes
        scales = _load(sample, fname, name + "_scale")
        assert scales.dtype == torch.uint8 and int(scales.max()) < 0xFF
        assert bool(torch.isfinite(dequantize_mx(codes, scales)).all())


def test_deterministic_for_a_seed(tmp_path: Path, sample: Path):
    again = write_sample_checkpoint(tmp_path / "again")
    other = write_sample_checkpoint(tmp_path / "other", seed=1)
    for p in sample.iterdir():
        assert (again / p.name).read_bytes() == p.read_bytes(), p.name
    for fname in (SHARD_1, SHARD_2):
        assert (other / fname).read_bytes() != (sample / fname).read_bytes()
    assert (other / "config.json").read_bytes() == (sample / "config.json").read_bytes()


def test_same_bytes_whatever_the_threads(tmp_path: Path, sample: Path, monkeypatch):
    """The tensors are made by a thread per CPU: one thread or eight write the same files, and torch's own thread
    count (set to 1 meanwhile) is restored."""
    threads = torch.get_num_threads()
    for cpus in (1, 8):
        monkeypatch.setattr(os, "cpu_count", lambda: cpus)
        again = write_sample_checkpoint(tmp_path / f"cpus{cpus}")
        for p in sample.iterdir():
            assert (again / p.name).read_bytes() == p.read_bytes(), (cpus, p.name)
        assert torch.get_num_threads() == threads


def test_weight_scale_inv_suffix(tmp_path: Path):
    ckpt = write_sample_checkpoint(tmp_path / "s", layers=1, experts=2, scale_suffix="weight_scale_inv")
    tensors = _tensors(ckpt)
    assert not any(n.endswith(".weight_scale") for n in tensors)
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"][1:] == ("U8", [256, 8])
    assert tensors["model.layers.0.mlp.experts.1.down_proj.weight_scale_inv"][1:] == ("U8", [256, 4])


def test_fused_experts(tmp_path: Path):
    ckpt = write_sample_checkpoint(tmp_path / "s", layers=1, experts=3, fused_experts=True)
    tensors = _tensors(ckpt)
    p = "model.layers.0.mlp.experts"
    # transformers 5's fused naming (no .weight; vLLM reads only this), ModelOpt's scale suffix
    assert tensors[f"{p}.gate_up_proj"][1:] == ("F8_E4M3", [3, 256, 256])
    assert tensors[f"{p}.gate_up_proj_scale"][1:] == ("U8", [3, 256, 8])
    assert tensors[f"{p}.down_proj"][1:] == ("F8_E4M3", [3, 256, 128])
    assert tensors[f"{p}.down_proj_scale"][1:] == ("U8", [3, 256, 4])
    assert not any(".experts.0." in n or n.startswith(f"{p}.") and ".weight" in n for n in tensors)
    # Experts differ from each other.
    codes = _load(ckpt, tensors[f"{p}.down_proj"][0], f"{p}.down_proj").view(torch.uint8)
    assert not torch.equal(codes[0], codes[1])


def test_shard_counts(tmp_path: Path):
    single = write_sample_checkpoint(tmp_path / "one", layers=1, experts=1, shards=1)
    assert not (single / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in single.glob("*.safetensors")) == ["model.safetensors"]
    three = write_sample_checkpoint(tmp_path / "three", layers=3, experts=1, shards=3)
    index = json.loads((three / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(index.values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["model.layers.0.self_attn.q_proj.weight"] == "model-00002-of-00003.safetensors"
    assert index["model.layers.2.self_attn.q_proj.weight"] == "model-00003-of-00003.safetensors"


def test_size_knobs(tmp_path: Path):
    ckpt = write_sample_checkpoint(
        tmp_path / "s", layers=1, experts=2, hidden=512, moe_intermediate=96, head_dim=128, kv_heads=2, vocab=64
    )
    tensors = _tensors(ckpt)
    assert tensors["model.layers.0.self_attn.q_proj.weight"][2] == [512, 512]
    assert tensors["model.layers.0.self_attn.k_proj.weight"][2] == [256, 512]
    assert tensors["model.layers.0.mlp.experts.1.gate_proj.weight"][2] == [96, 512]
    assert tensors["model.layers.0.mlp.experts.1.down_proj.weight"][2] == [512, 96]
    assert tensors["lm_head.weight"][2] == [64, 512]


def test_refuses_bad_arguments(tmp_path: Path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        write_sample_checkpoint(tmp_path / "full")
    for kwargs in (
        {"scale_suffix": "scale"},
        {"shards": 4, "layers": 2},
        {"shards": 0},
        {"hidden": 300},
        {"moe_intermediate": 100},
        {"head_dim": 96},
    ):
        with pytest.raises(ValueError):
            write_sample_checkpoint(tmp_path / "bad", **kwargs)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_sample_checkpoint(empty, layers=1, experts=1) == empty


# --- mx_quantize against an independent float64 / ml_dtypes computation -------------------------


def _mx_quantize_oracle(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP MX v1.0 6.3 with Python floats and ml_dtypes: X = 2**(floor(log2 amax) - 8), clamp, cast."""
    blocks = w.astype(np.float64).reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1)
    shared = np.full(amax.shape, -127, dtype=np.int64)
    for idx in np.ndindex(amax.shape):
        if amax[idx] > 0:
            shared[idx] = min(127, max(-127, math.floor(math.log2(amax[idx])) - 8))
    scaled = np.clip(blocks / np.exp2(shared.astype(np.float64))[..., None], -448.0, 448.0)
    codes = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(w.shape)
    return codes, (shared + 127).astype(np.uint8)


def _edge_weights() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(16, 256, generator=gen) * torch.exp(2 * torch.randn(16, 1, generator=gen))
    w = w.to(torch.bfloat16).to(torch.float32)
    w[0, :32] = 0.0  # all-zero block: scale byte 0
    w[1, :32] = 1e-40  # float32 subnormal amax: exponent clamped to -127
    w[1, 7] = -3e-41
    w[2, :32] = torch.linspace(-1e38, 3e38, 32, dtype=torch.float64).float()  # near float32 max
    w[3, :32] = 256.0  # amax a power of two: shared exponent 0, codes 256
    w[3, 32:64] = torch.linspace(-1, 1, 32) * 511.0  # saturation: 511 > 448 at scale 2**0
    w[4, :32] = torch.arange(32) * 2.0**-20  # values below e4m3fn's normal range after scaling
    return w


def test_mx_quantize_matches_oracle_bit_for_bit():
    w = _edge_weights()
    codes, scales = mx_quantize(w)
    want_codes, want_scales = _mx_quantize_oracle(w.numpy())
    assert codes.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert codes.shape == (16, 256) and scales.shape == (16, 8)
    np.testing.assert_array_equal(scales.numpy(), want_scales)
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    assert int(scales[0, 0]) == 0 and int(scales[1, 0]) == 0
    assert int(scales[3, 0]) == 127 and bool((codes[3, :32] == 0x78).all())  # 256 = e4m3fn 0x78
    assert int(codes[3, 63]) == 0x7E  # 511 saturates to 448


def test_mx_quantize_3d_is_per_matrix():
    w = _edge_weights().reshape(2, 8, 256)
    codes, scales = mx_quantize(w)
    flat_codes, flat_scales = mx_quantize(w.reshape(16, 256))
    assert torch.equal(codes.reshape(16, 256), flat_codes) and scales.shape == (2, 8, 8)
    assert torch.equal(scales.reshape(16, 8), flat_scales)


def test_mx_quantize_error_is_within_mx_rounding():
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 512, generator=gen) * 0.02).to(torch.bfloat16).to(torch.float32)
    codes, scales = mx_quantize(w)
    decoded = dequantize_mx(codes, scales)
    unit = 2.0 ** (scales.to(torch.float32) - 127).repeat_interleave(32, dim=-1)  # 2**shared per element
    err = (decoded - w).abs()
    rounding = torch.maximum(w.abs() * 2.0**-4, unit * 2.0**-10)  # half an ulp: normal, subnormal
    saturated = (w.abs() > 448 * unit) & (decoded.abs() == 448 * unit)
    assert bool(((err <= rounding) | saturated).all())
    rel = float((decoded - w).norm() / w.norm())
    assert 1e-2 < rel < 3e-2  # e4m3's 3 mantissa bits: ~2% for Gaussian weights


def test_mx_quantize_rejects_bad_input():
    with pytest.raises(ValueError):
        mx_quantize(torch.zeros(4, 48))
    with pytest.raises(ValueError):
        mx_quantize(torch.full((1, 32), float("nan")))


def test_every_file_has_the_mode_of_the_others(sample: Path):
    """safetensors creates its files 0600: the sample's shards were unreadable by a daemon running as another
    user (the container's uid 10001). Every file now has the umask's mode, as the JSON files do."""
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in sample.iterdir()}
    assert set(modes.values()) == {modes["config.json"]}, modes


@pytest.mark.parametrize("existing", [False, True], ids=["new", "empty-dir"])
def test_a_sample_stopped_part_way_leaves_nothing(tmp_path: Path, monkeypatch, existing: bool):
    """SIGTERM (or Ctrl-C) while `transformd sample DIR` wrote left DIR with its first shard, and the next run
    refused DIR as not empty (an attack review). It is written beside DIR and renamed into place at the end."""
    from transformd import sample as sample_module

    saved, real_save = [], sample_module._save

    def stop_at_the_second(tensors, path):
        if saved:
            raise KeyboardInterrupt  # what SIGTERM raises in the CLI (cli.common.Terminated)
        saved.append(path)
        real_save(tensors, path)

    out = tmp_path / "s"
    if existing:  # (a prepared directory: its mode and inode are kept, a mount point cannot be replaced)
        out.mkdir()
        os.chmod(out, 0o2775)
        before = out.stat()
    monkeypatch.setattr(sample_module, "_save", stop_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        write_sample_checkpoint(out, shards=2)
    assert saved and sorted(os.listdir(tmp_path)) == (["s"] if existing else [])
    assert not existing or os.listdir(out) == []
    monkeypatch.setattr(sample_module, "_save", real_save)
    assert write_sample_checkpoint(out, shards=2) == out and len(list(out.glob("*.safetensors"))) == 2
    assert sorted(os.listdir(tmp_path)) == ["s"] and not [n for n in os.listdir(out) if n.startswith(".")]
    if existing:
        assert (out.stat().st_ino, stat.S_IMODE(out.stat().st_mode)) == (before.st_ino, 0o2775)


def test_the_sample_loads_in_every_engine_without_a_warning(tmp_path: Path, capsys) -> None:
    """The project's own sample is the first thing a newcomer converts: ``sample``, ``convert`` and ``inspect`` print
    no warning (it printed vLLM's three-line KV-cache advice on every call), and every engine loads it. A checkpoint
    that asks for an FP8 KV cache still gets the warning."""
    from transformd import cli

    for kv, name in ((False, "plain"), (True, "kv")):
        if kv:
            write_sample_checkpoint(tmp_path / name, fp8_kv_cache=True)
        else:
            assert cli.main(["sample", str(tmp_path / name)]) == 0
        assert cli.main(["convert", str(tmp_path / name), "--out", str(tmp_path / f"{name}-out"), "--device",
                         "cpu"]) == 0
        assert cli.main(["inspect", str(tmp_path / f"{name}-out")]) == 0
        captured = capsys.readouterr()
        warnings = [line for line in captured.err.splitlines() if "warning" in line]
        if kv:
            assert warnings and all("--kv-cache-dtype fp8" in w for w in warnings), captured.err
        else:
            assert warnings == [], captured.err
            assert "warning" not in captured.out.lower() and "kv-cache" not in captured.out, captured.out
            for engine in ("vllm", "sglang", "transformers"):
                assert f"{engine}: loads" in captured.out, captured.out
