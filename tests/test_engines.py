"""Engine-correct output: every real MXFP8 layout converts into a checkpoint that vLLM, SGLang and transformers
read right, and readiness, target choice and refusals say what the engines would do.

The name matching of the engines is restated here from their sources (vLLM 0.33
``quantization/utils/quant_utils.py is_layer_skipped``, SGLang 0.5.23 ``quantization/utils.py``), as an oracle
independent of transformd's own code; the opt-in check in ``tests/engines/`` runs the engines' own code.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from transformd import cli
from transformd.checkpoint import CheckpointError, convert_checkpoint, readiness_of_dir
from transformd.engines import Engine, Platform, choose_target, readiness, readiness_line
from transformd.quant_config import excluded_by
from transformd.reference import dequantize_block, dequantize_mx
from transformd.safetensors_io import read_header
from transformd.sample import write_sample_checkpoint

from .support.daemon import Daemons, wait_ready
from .support.layouts import LAYOUTS, QUARK_ROWS, minimax

FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def vllm_skipped(prefix: str, ignored: list[str]) -> bool:
    """vLLM 0.33 ``is_layer_skipped`` in Fp8Config's "exact" mode (fused shards all-or-none, experts by substring)."""
    proj = prefix.split(".")[-1]
    if proj in FUSED:
        if prefix in ignored:
            return True
        flags = {prefix.replace(proj, shard) in ignored for shard in FUSED[proj]}
        if len(flags) > 1:
            raise ValueError(f"Detected some but not all shards of {prefix} are quantized")
        return flags.pop()
    if "experts" in prefix:
        return any(prefix in name for name in ignored if "experts" in name)
    return prefix in ignored


def sglang_skipped(prefix: str, ignored: list[str]) -> bool:
    """SGLang 0.5.23: an ignored name matches itself, any dotted ancestor, or a dotted run of components."""
    parts = prefix.split(".")
    for name in ignored:
        want = name.split(".")
        if any(parts[i : i + len(want)] == want for i in range(len(parts) - len(want) + 1)):
            return True
    return False


def _tensors(path: Path) -> dict:
    return {n: i for f in sorted(path.glob("*.safetensors")) for n, i in read_header(f).tensors.items()}


def _engine_modules(tensors: dict) -> dict[str, bool]:
    """module prefix the engines ask about -> whether its weight is FP8 (per-expert and fused experts: the
    FusedMoE prefix ``...experts``)."""
    out: dict[str, bool] = {}
    for name, info in tensors.items():
        if len(info.shape) < 2 or name.endswith("_scale_inv") or "embed_tokens" in name:
            continue
        module = name.removesuffix(".weight")
        head, sep, _ = module.partition(".experts.")
        if sep and not head.endswith("shared"):
            module = head + ".experts"
        fp8 = info.dtype.startswith("F8_")
        assert out.get(module, fp8) == fp8, f"{module}: mixed precision"
        out[module] = fp8
    return out


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    src = LAYOUTS[request.param](root / "src")
    convert_checkpoint(src, root / "out", target="ocp", device="cpu", engine="vllm")
    return request.param, src, root / "out"


def test_nothing_mx_left_and_every_fp8_weight_has_its_block_scale(converted) -> None:
    _, _, out = converted
    tensors = _tensors(out)
    for name, info in tensors.items():
        assert info.dtype not in ("U8", "F8_E8M0"), f"{name}: an MX scale left in an fp8 checkpoint"
        if info.dtype.startswith("F8_"):
            scale = tensors[name + "_scale_inv"]
            *lead, n, k = info.shape
            assert (scale.dtype, list(scale.shape)) == ("F32", [*lead, -(-n // 128), -(-k // 128)]), name
    assert not (out / "hf_quant_config.json").exists()


def test_exclusions_are_exact_names_the_engines_match(converted) -> None:
    layout, src, out = converted
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    ignored = qc["ignored_layers"]
    assert qc["modules_to_not_convert"] == ignored
    assert not any(c in n for n in ignored for c in "*?[]") and not any(n.startswith("re:") for n in ignored)
    for module, fp8 in _engine_modules(_tensors(out)).items():
        assert vllm_skipped(module, ignored) is not fp8, (layout, module, "vLLM")
        assert sglang_skipped(module, ignored) is not fp8, (layout, module, "SGLang")
        # transformers 5 should_convert_module: a listed name skips the module and its children
        assert any(module == n or module.startswith(n + ".") for n in ignored) is not fp8, (layout, module)
    assert "lm_head" in ignored, "transformers skips lm_head only when it is listed"


def test_input_exclusion_syntax_understood(converted) -> None:
    """What the input config excluded (globs, re:, names) is exactly what stays unquantized, among linear layers."""
    layout, src, out = converted
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    patterns = [p for lst in qc["transformd"]["source_exclusions"].values() for p in lst]
    assert patterns, layout
    for name, info in _tensors(out).items():
        if name.endswith(".weight") and len(info.shape) == 2 and "embed_tokens" not in name:
            module = name.removesuffix(".weight")
            assert excluded_by(module, patterns) is not info.dtype.startswith("F8_"), (layout, module)


def test_values_are_the_mx_values(converted) -> None:
    """exact mode: within its error (DESIGN.md: relative L2 1e-7..3e-5, most elements bit-exact; only elements
    far below their tile's maximum lose bits)."""
    layout, src, out = converted
    src_t, out_t = _tensors(src), _tensors(out)
    checked = 0
    for f in sorted(out.glob("*.safetensors")):
        out_data = load_file(str(f))
        for name, q in out_data.items():
            if not q.dtype.is_floating_point or q.element_size() != 1:
                continue
            scale_name = next(name + s for s in ("_scale", "_scale_inv") if src_t.get(name + s, None) is not None
                              and src_t[name + s].dtype in ("U8", "F8_E8M0"))
            src_data = {**load_file(str(src / _shard_of(src, name))), **load_file(str(src / _shard_of(src, scale_name)))}
            codes, scales = src_data[name].view(torch.uint8), src_data[scale_name].view(torch.uint8)
            if scales.shape[-2] != codes.shape[-2]:
                assert layout == "quark_per_block" and scales.shape[-2] * QUARK_ROWS == codes.shape[-2]
                scales = scales.repeat_interleave(QUARK_ROWS, dim=-2)
            want = dequantize_mx(codes, scales)
            got = dequantize_block(q, out_data[name + "_scale_inv"].double(), "ocp").float()
            rel_l2 = float((got - want).norm() / want.norm())
            exact = float((got == want).float().mean())
            assert rel_l2 < 1e-4 and exact > 0.9, (layout, name, rel_l2, exact)
            checked += 1
    assert checked == sum(1 for i in out_t.values() if i.dtype == "F8_E4M3")


def _shard_of(src: Path, name: str) -> str:
    return json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_every_layout_loads_in_every_engine_at_tp1(converted) -> None:
    """Except fused expert stacks in transformers (loaded without their scales) and SGLang (skipped), as the
    engines' own code does (test_transformers_load, tests/engines)."""
    layout, _, out = converted
    report = readiness_of_dir(out)
    for engine, r in report.items():
        if layout == "fused" and engine in ("transformers", "sglang"):
            assert r.loads_at == [] and "fused" in r.problems[0], (engine, r.problems)
        else:
            assert 1 in r.loads_at, (layout, engine, r.problems)


# -- readiness from shapes -----------------------------------------------------------------------------------------


def _qwen3_like(moe_inter: int, *, heads: int = 32, kv: int = 4, hidden: int = 2048, arch: str = "Qwen3MoeForCausalLM"):
    p = "model.layers.0"
    hd = 128
    specs = [
        (f"{p}.self_attn.q_proj.weight", "F8_E4M3", [heads * hd, hidden]),
        (f"{p}.self_attn.k_proj.weight", "F8_E4M3", [kv * hd, hidden]),
        (f"{p}.self_attn.v_proj.weight", "F8_E4M3", [kv * hd, hidden]),
        (f"{p}.self_attn.o_proj.weight", "F8_E4M3", [hidden, heads * hd]),
        (f"{p}.mlp.gate.weight", "BF16", [128, hidden]),
    ]
    for e in range(2):
        specs += [
            (f"{p}.mlp.experts.{e}.gate_proj.weight", "F8_E4M3", [moe_inter, hidden]),
            (f"{p}.mlp.experts.{e}.up_proj.weight", "F8_E4M3", [moe_inter, hidden]),
            (f"{p}.mlp.experts.{e}.down_proj.weight", "F8_E4M3", [hidden, moe_inter]),
        ]
    config = {"architectures": [arch], "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
              "hidden_size": hidden}
    return config, specs


def test_qwen3_30b_a3b_moe_loads_at_tp1_and_tp2_only() -> None:
    """768 / 4 = 192 is not a multiple of 128: SGLang refuses TP 4 and 8 (the issue's measurement); vLLM's Triton MoE
    refines the block scales to 64x64 (192) and 32x32 (96), so there it may load, and says with what (issue 44)."""
    report = readiness(*_qwen3_like(768))
    assert report["vllm"].loads_at == [1, 2] and report["sglang"].loads_at == [1, 2]
    assert any(p.startswith("TP 4:") and "192" in p for p in report["sglang"].problems), report["sglang"].problems
    vllm = report["vllm"]
    assert vllm.may_load_at == [4, 8] and vllm.problems == [], vllm
    assert "TP 4:" in vllm.conditions[0] and "192" in vllm.conditions[0] and "64x64" in vllm.conditions[0]
    assert "TP 8:" in vllm.conditions[1] and "32x32" in vllm.conditions[1]
    assert readiness_line(vllm.loads_at, vllm.problems, vllm.may_load_at) == "loads at TP 1,2; may load at TP 4,8"
    assert report["transformers"].loads_at == [1]
    # 640 / 8 = 80 rows per rank: gcd(128, 80) = 16 < 32, which the Triton MoE cannot refine to: not loaded
    odd = readiness(*_qwen3_like(640))["vllm"]
    assert odd.may_load_at == [2, 4] and odd.loads_at == [1], odd  # (320: 64x64; 160: 32x32)
    assert any(p.startswith("TP 8:") and "80" in p for p in odd.problems), odd.problems


def test_the_old_sample_shapes_are_reported_not_loadable_in_sglang() -> None:
    """q/k/v 320/64/64 and experts 224 (the sample before it was made loadable): SGLang checks every shard."""
    config, specs = _qwen3_like(224, heads=5, kv=1, hidden=320)
    specs = [(n, d, [64 if s == 128 else s for s in shape]) if ".k_proj" in n or ".v_proj" in n else (n, d, shape)
             for n, d, shape in specs]
    config["head_dim"] = 64
    specs = [(n, d, [320 if s == 640 else s for s in shape]) for n, d, shape in specs]
    report = readiness(config, specs)
    assert report["sglang"].loads_at == [] and report["transformers"].loads_at == []
    assert any("k_proj" in p or "q_proj" in p or "experts" in p for p in report["sglang"].problems)
    assert report["vllm"].loads_at == [], report["vllm"].problems  # MoE 224 is no multiple of 128 either


def test_scale_renaming_loaders_are_refused() -> None:
    config, specs = _qwen3_like(768, arch="LlamaForCausalLM")
    report = readiness(config, specs)
    assert report["sglang"].loads_at == [] and "renames every weight_scale_inv" in report["sglang"].problems[0]
    assert report["vllm"].loads_at == [1, 2]
    report = readiness({**config, "architectures": ["MiniMaxM3SparseForCausalLM"]}, specs)
    assert report["vllm"].loads_at == [] and report["sglang"].loads_at == [1, 2]


def test_partly_quantized_merged_layer_is_a_problem() -> None:
    config, specs = _qwen3_like(768)
    specs = [(n, "BF16" if ".v_proj" in n else d, s) for n, d, s in specs]
    report = readiness(config, specs)
    assert all(r.loads_at == [] for r in report.values())
    assert "partly FP8" in report["vllm"].problems[0]


def test_fnuz_output_warns_engines_and_transformers_refuses() -> None:
    config, specs = _qwen3_like(768)
    config["quantization_config"] = {"weight_block_size": [128, 128], "transformd": {"target": "fnuz"}}
    report = readiness(config, [(n, "F8_E4M3FNUZ" if d == "F8_E4M3" else d, s) for n, d, s in specs])
    assert report["transformers"].loads_at == [] and report["vllm"].loads_at == [1, 2]
    assert "16 codes change" in report["vllm"].warnings[0] and "safetensors >= 0.8" in report["vllm"].warnings[0]


# -- the KV cache --------------------------------------------------------------------------------------------------


def sglang_kv_cache_dtype(qc: dict) -> str:
    """SGLang 0.5.23 with ``--kv-cache-dtype auto``: ``Fp8Config.from_config`` keeps ``kv_cache_quant_algo``
    (``layers/quantization/fp8.py``), ``configure_kv_cache_dtype`` makes the KV cache FP8 when it is "FP8"
    (``mem_cache/kv_cache_dtype.py``), else the model's dtype."""
    algo = qc.get("kv_cache_quant_algo")
    return "fp8" if isinstance(algo, str) and algo.upper() == "FP8" else "model dtype"


def vllm_kv_cache_dtype(qc: dict) -> str:
    """vLLM 0.33 with ``--kv-cache-dtype auto`` (``utils/torch_utils.py get_kv_cache_quant_algo_string``): a KV-cache
    dtype is taken from a quantization config only when its ``quant_method`` starts with ``modelopt``."""
    if not qc.get("quant_method", "").startswith("modelopt"):
        return "model dtype"
    inner = qc.get("quantization", qc)
    algo = inner.get("kv_cache_scheme") or qc.get("kv_cache_scheme") or inner.get("kv_cache_quant_algo") \
        or qc.get("kv_cache_quant_algo")
    if isinstance(algo, dict):
        return "fp8" if (algo.get("dynamic") is False and algo.get("num_bits") == 8 and algo.get("type") == "float") \
            else "model dtype"
    return "fp8" if isinstance(algo, str) and algo.lower() == "fp8" else "model dtype"


_FP8_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}


@pytest.mark.parametrize(
    ("config_qc", "hf_quant", "fp8"),
    [
        ({"quant_method": "modelopt", "quant_algo": "MXFP8", "kv_cache_scheme": _FP8_SCHEME}, None, True),
        (None, {"quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": "FP8"}}, True),  # ModelOpt legacy
        ({"quant_method": "modelopt", "quantization": {"kv_cache_quant_algo": "fp8"}}, None, True),
        ({"quant_method": "compressed-tensors", "kv_cache_scheme": {**_FP8_SCHEME, "strategy": "tensor"}}, None, True),
        ({"quant_method": "mxfp8", "kv_cache_scheme": {**_FP8_SCHEME, "dynamic": True}}, None, False),
        ({"quant_method": "modelopt", "kv_cache_scheme": {**_FP8_SCHEME, "num_bits": 4}}, None, False),
        ({"quant_method": "modelopt", "kv_cache_scheme": {**_FP8_SCHEME, "type": "int"}}, None, False),
        ({"quant_method": "mxfp8", "kv_cache_quant_algo": "NVFP4"}, None, False),
        ({"quant_method": "modelopt", "quant_algo": "MXFP8"}, {"quantization": {"quant_algo": "MXFP8"}}, False),
    ],
    ids=["modelopt-config", "modelopt-hf-quant-only", "quantization-part", "compressed-tensors", "dynamic",
         "fp4", "int8", "other-algo", "none"],
)
def test_an_fp8_kv_cache_asked_for_stays_fp8_in_sglang_and_vllm_is_told_the_flag(
    tmp_path: Path, config_qc: dict | None, hf_quant: dict | None, fp8: bool
) -> None:
    """An input that asks for an FP8 KV cache (the sample's ModelOpt configs do, in both files) gets an FP8 KV
    cache from the engines with their default ``--kv-cache-dtype auto`` as it would have had itself: SGLang reads
    the output's ``kv_cache_quant_algo``; vLLM reads none from an fp8 config, so its readiness says to pass
    ``--kv-cache-dtype fp8``. An input that asks for none gets neither."""
    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    if config_qc is not None:
        config["quantization_config"] = {**config_qc, "ignore": ["lm_head", "model.layers.*.mlp.gate"]}
    (src / "config.json").write_text(json.dumps(config))
    (src / "hf_quant_config.json").unlink()
    if hf_quant is not None:
        (src / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    source_asks = "fp8" if fp8 else "model dtype"
    if config_qc is not None and config_qc["quant_method"] == "modelopt":  # (what the input gets in vLLM itself)
        assert vllm_kv_cache_dtype(config["quantization_config"]) == source_asks
    result = convert_checkpoint(src, tmp_path / "out", target="ocp", device="cpu")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert sglang_kv_cache_dtype(qc) == source_asks
    assert vllm_kv_cache_dtype(qc) == "model dtype", "vLLM never takes it from an fp8 config"
    for report in (result.readiness, readiness_of_dir(tmp_path / "out")):  # planned, and read back
        told = [w for w in report["vllm"].warnings if "--kv-cache-dtype fp8" in w]
        assert len(told) == (1 if fp8 else 0), report["vllm"].warnings
        assert not any("kv-cache" in w for e in ("sglang", "transformers") for w in report[e].warnings)


# -- target choice -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("platform", "engine", "expected"),
    [
        (Platform("amd", "gfx942"), "vllm", "ocp"),
        (Platform("amd", "gfx942"), "sglang", "ocp"),
        (Platform("amd", "gfx942"), "transformers", "ocp"),
        (Platform("amd", "gfx942"), "raw", "fnuz"),
        (Platform("amd", "gfx942"), None, "fnuz"),
        (Platform("nvidia", "sm_90"), "raw", "ocp"),
        (Platform("nvidia", "sm_90"), "vllm", "ocp"),
        (Platform("none"), None, "ocp"),
        (Platform("amd", "gfx950"), "vllm", None),
        (Platform("nvidia", "sm_100"), "raw", None),
        (Platform("nvidia", "sm_120"), "sglang", None),
    ],
)
def test_target_auto(platform: Platform, engine: str | None, expected: str | None) -> None:
    target, why = choose_target("auto", engine, platform)
    assert target == expected, why
    assert choose_target("fnuz", engine, platform)[0] == "fnuz", "an explicit target always wins"


# -- refusals and the command line ---------------------------------------------------------------------------------


def test_engine_that_cannot_load_is_refused_before_anything_is_written(tmp_path: Path, capsys) -> None:
    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2, hidden=320, moe_intermediate=224, head_dim=64,
                                  fp8_kv_cache=True)
    with pytest.raises(CheckpointError, match="sglang could not load the converted checkpoint at any TP size"):
        convert_checkpoint(src, tmp_path / "out", target="ocp", device="cpu", engine="sglang")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert cli.main(["convert", str(src), "--out", str(tmp_path / "out"), "--device", "cpu", "--engine", "sglang"]) == 2
    assert "sglang could not load" in capsys.readouterr().err
    # without --engine: converted (no engine would load it wrong without an error), with a warning per engine that
    # cannot load it (its first reason and how many more)
    assert cli.main(["convert", str(src), "--out", str(tmp_path / "out"), "--device", "cpu"]) == 0
    *err, summary = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("transformd: warning: ") for line in err), err
    assert "vllm could not load" in err[0] and "--kv-cache-dtype fp8" in err[1]  # (this sample asks for an FP8 KV)
    assert "sglang could not load this checkpoint at any TP size: TP 1: model.layers.*" in err[2]
    assert "more: transformd inspect DIR)" in err[2]
    assert summary.startswith("transformd: converted ")
    assert cli.main(["inspect", str(tmp_path / "out")]) == 2
    out = capsys.readouterr().out
    assert "sglang: does not load" in out and "vllm: does not load" in out
    first = next(line for line in out.splitlines() if line.startswith("sglang: does not load: "))
    assert f"  {first.removeprefix('sglang: does not load: ')}" not in out.splitlines(), "said once, not twice"


def test_inspect_refuses_a_dir_that_is_not_block_fp8(tmp_path: Path, capsys) -> None:
    """What engines would make of an MXFP8 source, or a BF16 model, is not a converted checkpoint's readiness:
    before, ``inspect`` said "vllm: loads at TP 1" of both (exit 0)."""
    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2)
    bf16 = tmp_path / "bf16"
    shutil.copytree(src, bf16)
    config = json.loads((bf16 / "config.json").read_text())
    del config["quantization_config"]
    (bf16 / "config.json").write_text(json.dumps(config))
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")  # read through the checked reads: refused, never waited on (a review saw a hang)
    for path, said in ((src, "says quant_method 'modelopt'"), (bf16, "says no quantization_config"),
                       (tmp_path / "none", "does not exist"), (fifo, "is not a regular file")):
        assert cli.main(["inspect", str(path)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and said in captured.err and str(path) in captured.err, captured.err


def test_inspect_a_loadable_dir(tmp_path: Path, capsys) -> None:
    src = minimax(tmp_path / "src")
    assert cli.main(["convert", str(src), "--out", str(tmp_path / "out"), "--device", "cpu", "--engine", "vllm"]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [line for line in lines if not line.startswith(" ")]
    assert heads == ["vllm: loads at TP 1; may load at TP 2", "sglang: loads at TP 1", "transformers: loads at TP 1",
                     str(tmp_path / "out")]
    text = "\n".join(lines)
    assert ("  may load, TP 2: model.layers.*.block_sparse_moe.experts: MoE intermediate size per rank 64 (= 128 / 2) "
            "is not a multiple of 128, with vLLM's Triton MoE, which refines the block scales to 64x64") in text
    assert "  (rules: vLLM 0.33.0 (read); engine check: 0.33.0, 0.34.0)" in lines
    # an edited config whose block size is not 128x128 does not load right (it said "loads": an attack review)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    for block in ([0, 128], "x", None, [128, 128, 1]):
        if block is None:
            del config["quantization_config"]["weight_block_size"]
        else:
            config["quantization_config"]["weight_block_size"] = block
        (tmp_path / "out" / "config.json").write_text(json.dumps(config))
        assert cli.main(["inspect", str(tmp_path / "out")]) == 2  # (no engine loads it)
        lines = capsys.readouterr().out.splitlines()
        assert [line for line in lines if not line.startswith(" ")][:3] == [
            f"{engine}: does not load: quantization_config.weight_block_size is {block!r}, not [128, 128]: the "
            f"weight_scale_inv tensors hold one scale per 128x128 block, which {engine} reads as such only when the "
            "config says so" for engine in ("vllm", "sglang", "transformers")], lines


def test_minimax_m3_is_refused_for_vllm(tmp_path: Path) -> None:
    src = minimax(tmp_path / "src", arch="MiniMaxM3SparseForCausalLM")
    with pytest.raises(CheckpointError, match="renames every weight_scale_inv to weight_scale"):
        convert_checkpoint(src, tmp_path / "out", target="ocp", device="cpu", engine=Engine.VLLM)
    convert_checkpoint(src, tmp_path / "out", target="ocp", device="cpu", engine="sglang")


# -- the daemon ----------------------------------------------------------------------------------------------------


def _daemon(daemons: Daemons, tmp_path: Path, models: Path, platform: Platform):
    return daemons.start(cache_dir=tmp_path / "cache", allow_roots=[models], platform=platform)


def test_daemon_target_auto_engine_readiness_and_refusal(tmp_path: Path, daemons: Daemons) -> None:
    models = tmp_path / "models"
    good = write_sample_checkpoint(models / "good", layers=1, experts=2, fp8_kv_cache=True)
    odd = write_sample_checkpoint(models / "odd", layers=1, experts=2, hidden=320, moe_intermediate=224, head_dim=64)
    daemon = _daemon(daemons, tmp_path, models, Platform("amd", "gfx942"))
    try:
        with daemon.client() as http:
            health = http.get("/healthz").json()
            assert health["platform"] == {"vendor": "amd", "arch": "gfx942", "name": None, "fnuz": True,
                                          "mx_native": False}
            r = http.post("/v1/checkpoints", json={"source": str(good), "engine": "vllm"})
            assert r.status_code == 202 and "vllm loads block FP8 as e4m3fn" in r.json()["target_reason"]
            ready = wait_ready(http, r.json()["key"])
            assert ready["recipe"]["target"] == "ocp" and ready["readiness"]["vllm"]["loads_at"] == [1]
            assert any("--kv-cache-dtype fp8" in w for w in ready["readiness"]["vllm"]["warnings"]), ready
            raw = http.post("/v1/checkpoints", json={"source": str(good)})  # no engine: a raw consumer on gfx942
            assert raw.json()["key"] != r.json()["key"]
            assert wait_ready(http, raw.json()["key"])["recipe"]["target"] == "fnuz"
            hit = http.post("/v1/checkpoints", json={"source": str(good), "engine": "sglang"})
            assert hit.status_code == 200 and hit.json()["key"] == r.json()["key"], "same bytes, same entry"
            refused = http.post("/v1/checkpoints", json={"source": str(odd), "engine": "sglang"})
            assert refused.status_code == 422, refused.text
            error = refused.json()["error"]
            assert error["code"] == "engine_cannot_load" and "not a multiple of 128" in error["message"]
            conversions = http.get("/v1/cache").json()["conversions"]
            assert all(c["source"] != str(odd) for c in conversions), "nothing started for a refused request"
    finally:
        daemon.stop()


def test_resolve_says_the_engines_warnings(capsys) -> None:
    """``transformd resolve`` prints, from the daemon's answer, each engine's warnings beside its readiness (the
    flag vLLM needs for an FP8 KV cache, say), for the engine named or, without ``--engine``, for all."""
    from transformd.cli.resolve import _say_target_and_readiness

    answer = {"readiness": {"vllm": {"loads_at": [1], "problems": [], "warnings": ["pass --kv-cache-dtype fp8"]},
                            "sglang": {"loads_at": [1], "problems": [], "warnings": []}}}
    _say_target_and_readiness(answer, "vllm")
    assert capsys.readouterr().err.splitlines() == [
        "transformd: vllm: loads at TP 1", "transformd: warning: vllm: pass --kv-cache-dtype fp8"]
    _say_target_and_readiness(answer, "sglang")
    assert capsys.readouterr().err.splitlines() == ["transformd: sglang: loads at TP 1"]


def test_daemon_on_native_mx_serves_the_source(tmp_path: Path, daemons: Daemons) -> None:
    models = tmp_path / "models"
    good = write_sample_checkpoint(models / "good", layers=1, experts=2)
    daemon = _daemon(daemons, tmp_path, models, Platform("amd", "gfx950"))
    try:
        with daemon.client() as http:
            r = http.post("/v1/checkpoints", json={"source": str(good), "engine": "vllm"})
            body = r.json()
            assert r.status_code == 200 and body["state"] == "ready" and body["path"] == str(good.resolve())
            assert body["key"] == "passthrough" and "native MX" in body["target_reason"]
            outside = http.post("/v1/checkpoints", json={"source": str(tmp_path), "engine": "vllm"})
            assert outside.status_code == 403, "the allowed roots hold for the source served as it is"
            explicit = http.post("/v1/checkpoints", json={"source": str(good), "target": "ocp"})
            assert explicit.status_code == 202, "an explicit target always converts"
    finally:
        daemon.stop()


def test_fused_stacks_with_a_weight_suffix_do_not_load_in_vllm() -> None:
    config, specs = _qwen3_like(768)
    specs = [s for s in specs if ".experts." not in s[0]] + [
        ("model.layers.0.mlp.experts.gate_up_proj.weight", "F8_E4M3", [2, 1536, 2048]),
        ("model.layers.0.mlp.experts.down_proj.weight", "F8_E4M3", [2, 2048, 768]),
    ]
    report = readiness(config, specs)
    assert report["vllm"].loads_at == [] and "only in HF-v5 naming" in report["vllm"].problems[0]
    hf_v5 = [(n.removesuffix(".weight") if ".experts." in n else n, d, s) for n, d, s in specs]
    assert readiness(config, hf_v5)["vllm"].loads_at == [1, 2]
