"""Tiny MXFP8 checkpoints built tensor by tensor, mutations that plant one defect in them, and the checks of a
converted checkpoint against :func:`transformd.reference.convert_reference` (tensor by tensor, byte-identity of
everything untouched, config and index rewriting).

Shared by the conversion, CLI, pipeline and fault tests.
"""

from __future__ import annotations

import filecmp
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from transformd.formats import FORMAT_VERSION, Target, tile_grid
from transformd.reference import convert_reference
from transformd.quant_config import KV_CACHE_FP8, kv_cache_fp8
from transformd.safetensors_io import read_header

SHARD_A = "model-00001-of-00002.safetensors"  # BF16 only: must be carried over byte for byte
SHARD_B = "model-00002-of-00002.safetensors"
PRODUCER = {"name": "modelopt", "version": "0.41.0"}
Shards = dict[str, dict[str, torch.Tensor]]


# ---------------------------------------------------------------------------------------------------------------------
# A tiny checkpoint builder


def mx_pair(module: str, shape: tuple[int, ...], *, seed: int, suffix: str = "weight_scale",
            scale_dtype: torch.dtype = torch.uint8) -> dict[str, torch.Tensor]:
    """Random valid MXFP8 ``{module.weight, module.<suffix>}``: every non-NaN code, E8M0 bytes in [118, 131)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    q = torch.where((q & 0x7F) == 0x7F, q ^ 1, q)  # 0x7F/0xFF are NaN
    s = torch.randint(118, 131, (*shape[:-1], shape[-1] // 32), dtype=torch.uint8, generator=g)
    return {f"{module}.weight": q.view(torch.float8_e4m3fn), f"{module}.{suffix}": s.view(scale_dtype)}


def default_shards(
    *, suffix: str = "weight_scale", scale_dtype: torch.dtype = torch.uint8, fused: bool = False
) -> Shards:
    """Shard A: BF16 embeddings, norm, lm_head. Shard B: one layer with MXFP8 attention and experts.

    Shapes are multiples of 32 but not of 128 (partial tiles on both axes), plus one > 128 on each axis.
    """
    g = torch.Generator().manual_seed(1)
    kw = {"suffix": suffix, "scale_dtype": scale_dtype}
    p = "model.layers.0"
    b: dict[str, torch.Tensor] = {
        f"{p}.input_layernorm.weight": torch.randn(96, generator=g).to(torch.bfloat16),
        f"{p}.mlp.gate.weight": torch.randn(3, 96, generator=g).to(torch.bfloat16),
        f"{p}.self_attn.k_proj.k_scale": torch.tensor(1.0),
        **mx_pair(f"{p}.self_attn.q_proj", (160, 96), seed=10, **kw),
        **mx_pair(f"{p}.self_attn.o_proj", (96, 160), seed=11, **kw),
    }
    if fused:
        b.update(mx_pair(f"{p}.mlp.experts.gate_up_proj", (3, 136, 96), seed=12, **kw))
        b.update(mx_pair(f"{p}.mlp.experts.down_proj", (3, 96, 64), seed=13, **kw))
    else:
        for e in range(3):
            b.update(mx_pair(f"{p}.mlp.experts.{e}.up_proj", (64, 96), seed=20 + e, **kw))
            b.update(mx_pair(f"{p}.mlp.experts.{e}.down_proj", (96, 64), seed=30 + e, **kw))
    a = {
        "model.embed_tokens.weight": torch.randn(40, 96, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(96, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(40, 96, generator=g).to(torch.bfloat16),
    }
    return {SHARD_A: a, SHARD_B: b}


def model_config() -> dict:
    return {
        "architectures": ["TinyMoeForCausalLM"],
        "model_type": "tiny_moe",
        "hidden_size": 96,
        "num_experts": 3,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "text_config": {"nested": [1, 2, {"deep": True}]},
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "MXFP8",
            "ignore": ["lm_head", "model.layers.*.mlp.gate"],
            "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
            "producer": dict(PRODUCER),
        },
    }


def hf_quant_config() -> dict:
    return {
        "producer": dict(PRODUCER),
        "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": "FP8", "group_size": 32,
                         "exclude_modules": ["lm_head", "model.layers.*.mlp.gate", "mtp"]},
    }


def write_checkpoint(root: Path, shards: Shards | None = None, *, config: dict | None = None,
                     hf_quant: dict | None = None, with_hf_quant: bool = True) -> Path:
    """Write shards (one dict per file), the index (unless a single model.safetensors), configs, extra files."""
    shards = default_shards() if shards is None else shards
    root.mkdir(parents=True)
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(root / name), metadata={"format": "pt"})
        weight_map.update({t: name for t in tensors})
    if list(shards) != ["model.safetensors"]:
        total = sum(t.numel() * t.element_size() for ts in shards.values() for t in ts.values())
        write_json(root / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json(root / "config.json", config or model_config())
    if with_hf_quant:
        write_json(root / "hf_quant_config.json", hf_quant or hf_quant_config())
    write_json(root / "generation_config.json", {"do_sample": True, "temperature": 0.7})
    write_json(root / "tokenizer.json", {"model": {"type": "WordLevel", "vocab": {"a": 0}}})
    (root / "assets").mkdir()
    (root / "assets" / "chat_template.jinja").write_text("{{ messages }}\n")
    (root / ".cache").mkdir()
    (root / ".cache" / "download.lock").write_text("x")
    return root


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2))


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------------------------------------------------------
# Checking a conversion


def assert_converted(src: Path, out: Path, target: str = "fnuz", scale_mode: str = "exact", *,
                     select: str | None = None) -> set[str]:
    """Check ``out`` against ``src`` tensor by tensor; return the converted weight names."""
    index_path = src / "model.safetensors.index.json"
    single = not index_path.exists()
    if single:
        shard_names = ["model.safetensors"]
    else:
        shard_names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    inputs = {s: load_file(str(src / s)) for s in shard_names}
    outputs = {s: load_file(str(out / s)) for s in shard_names}
    where = {name: s for s, ts in inputs.items() for name in ts}
    every_input = {name: t for ts in inputs.values() for name, t in ts.items()}
    pairs = _mx_pairs(every_input)
    converted = {w for w in pairs if select is None or re.search(select, w)}
    dtype = Target(target).torch_dtype
    expected_names = {s: set() for s in shard_names}

    for weight, scale in pairs.items():
        if weight not in converted:
            continue
        shard = where[weight]
        module = weight.removesuffix(".weight")
        q_ref, s_ref = convert_reference(every_input[weight], every_input[scale], target, scale_mode)
        q, s = outputs[shard][weight], outputs[shard][f"{module}.weight_scale_inv"]
        assert q.dtype == dtype and q.shape == every_input[weight].shape, weight
        *lead, n, k = q.shape
        assert s.dtype == torch.float32 and tuple(s.shape) == (*lead, *tile_grid(n, k)), weight
        assert torch.equal(q.view(torch.uint8), q_ref), f"{weight}: codes differ from the reference"
        assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32)), f"{weight}: scales differ from the reference"
        expected_names[shard] |= {weight, f"{module}.weight_scale_inv"}

    dropped = {pairs[w] for w in converted}
    for name, t in every_input.items():
        if name in dropped or name in converted:
            continue
        expected_names[where[name]].add(name)
        got = outputs[where[name]][name]
        assert got.dtype == t.dtype and got.shape == t.shape and tensor_bytes(got) == tensor_bytes(t), f"{name} changed"
    for s in shard_names:
        assert set(outputs[s]) == expected_names[s], f"{s}: unexpected tensor names"
        _assert_untouched_bytes_identical(src / s, out / s, converted | dropped)

    if not single:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == {n: s for s in shard_names for n in expected_names[s]}
        assert index["metadata"]["total_size"] == sum(
            t.numel() * t.element_size() for ts in outputs.values() for t in ts.values()
        )
    else:
        assert not (out / "model.safetensors.index.json").exists()
    _assert_config(src, out, target, scale_mode)
    for rel in ("generation_config.json", "tokenizer.json", "assets/chat_template.jinja"):
        assert filecmp.cmp(src / rel, out / rel, shallow=False), f"{rel} not carried over"
    assert not (out / ".cache").exists(), "dot-directories are not carried over"
    return converted


def _mx_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """weight -> scale: ``X.weight`` + ``X.weight_scale[_inv]``, or a fused HF-v5 stack ``X`` + ``X_scale[_inv]``."""
    pairs = {}
    for name, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn:
            pairs[name] = next(name + s for s in ("_scale", "_scale_inv") if name + s in tensors)
    return pairs


def _assert_untouched_bytes_identical(src: Path, out: Path, touched: set[str]) -> None:
    """Raw byte ranges of every untouched tensor are the same in both files (not merely equal values)."""
    hs, ho = read_header(src), read_header(out)
    raw_s, raw_o = src.read_bytes(), out.read_bytes()
    for name, info in hs.tensors.items():
        if name in touched:
            continue
        o = ho.tensors[name]
        assert (o.dtype, o.shape) == (info.dtype, info.shape)
        assert raw_s[info.begin : info.end] == raw_o[o.begin : o.end], name
    assert ho.metadata == hs.metadata


def _assert_config(src: Path, out: Path, target: str, scale_mode: str) -> None:
    cfg_in = json.loads((src / "config.json").read_text())
    cfg_out = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in cfg_out.items() if k != "quantization_config"} == {
        k: v for k, v in cfg_in.items() if k != "quantization_config"
    }, "fields other than quantization_config must be preserved"
    qc = cfg_out["quantization_config"]
    assert (qc["quant_method"], qc["fmt"], qc["activation_scheme"], qc["weight_block_size"]) == (
        "fp8", "e4m3", "dynamic", [128, 128]
    )
    rec = qc["transformd"]
    assert (rec["target"], rec["scale_mode"], rec["format_version"]) == (target, scale_mode, FORMAT_VERSION)
    old = cfg_in.get("quantization_config", {})
    unquantized = sorted(
        name.removesuffix(".weight")
        for name, info in _output_tensor_infos(out).items()
        if name.endswith(".weight") and info.dtype in ("BF16", "F16", "F32") and len(info.shape) >= 2
    )
    assert qc["ignored_layers"] == unquantized, "exact names of the unquantized layers, derived from the output"
    assert qc["modules_to_not_convert"] == unquantized
    assert "ignore" not in qc and "exclude_modules" not in qc, "input patterns are not copied where engines read"
    if "ignore" in old:
        assert rec["source_exclusions"]["config.json:ignore"] == old["ignore"], "kept as provenance"
    if "kv_cache_scheme" in old:
        assert qc["kv_cache_scheme"] == old["kv_cache_scheme"]
    hf_quant = json.loads((src / "hf_quant_config.json").read_text()) if (src / "hf_quant_config.json").exists() else None
    assert (qc.get("kv_cache_quant_algo") == KV_CACHE_FP8) == kv_cache_fp8(cfg_in, hf_quant), "an FP8 KV cache kept"
    assert not (out / "hf_quant_config.json").exists(), "the MXFP8 recipe file is not carried over"
    assert not any(
        info.dtype in ("U8", "F8_E8M0") or (info.dtype.startswith("F8_") and name + "_scale_inv" not in infos)
        for infos in [_output_tensor_infos(out)]
        for name, info in infos.items()
    ), "nothing MX left, and every FP8 weight has its block scale"


def _output_tensor_infos(out: Path) -> dict:
    return {name: info for f in sorted(out.glob("*.safetensors")) for name, info in read_header(f).tensors.items()}


def assert_converted_sample(src: Path, out: Path, target: str, scale_mode: str) -> set[str]:
    """The sample has no extra files of our builder; check tensors, index and config only."""
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    every_input = {n: t for s in shards for n, t in load_file(str(src / s)).items()}
    outputs = {n: t for s in shards for n, t in load_file(str(out / s)).items()}
    pairs = _mx_pairs(every_input)
    for weight, scale in pairs.items():
        q_ref, s_ref = convert_reference(every_input[weight], every_input[scale], target, scale_mode)
        assert torch.equal(outputs[weight].view(torch.uint8), q_ref)
        assert torch.equal(outputs[weight + "_scale_inv"], s_ref)
    for name, t in every_input.items():
        if name not in pairs and name not in pairs.values():
            assert tensor_bytes(outputs[name]) == tensor_bytes(t) and outputs[name].dtype == t.dtype
    _assert_config(src, out, target, scale_mode)
    assert filecmp.cmp(src / "tokenizer.json", out / "tokenizer.json", shallow=False)
    return set(pairs)


# ---------------------------------------------------------------------------------------------------------------------
# Mutations of default_shards(): each plants one defect

Q = "model.layers.0.self_attn.q_proj"
O = "model.layers.0.self_attn.o_proj"  # written last among the MXFP8 pairs of shard B: errors come mid-conversion


def set_tensor(name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Shards], None]:
    def mutate(shards: Shards) -> None:
        for ts in shards.values():
            if name in ts:
                ts[name] = value(ts[name])
    return mutate


def poke(index: tuple[int, ...], byte: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(t: torch.Tensor) -> torch.Tensor:
        u = t.view(torch.uint8).clone()
        u[index] = byte
        return u.view(t.dtype)
    return f


def remove_tensor(name: str) -> Callable[[Shards], None]:
    def mutate(shards: Shards) -> None:
        for ts in shards.values():
            ts.pop(name, None)
    return mutate


def add_tensor(name: str, t: torch.Tensor) -> Callable[[Shards], None]:
    return lambda shards: shards[SHARD_B].__setitem__(name, t)


def replace_pair(module: str, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> Callable[[Shards], None]:
    def mutate(shards: Shards) -> None:
        shards[SHARD_B][f"{module}.weight"] = torch.zeros(shape, dtype=torch.float8_e4m3fn)
        shards[SHARD_B][f"{module}.weight_scale"] = torch.full(scale_shape, 127, dtype=torch.uint8)
    return mutate


def overflow(shards: Shards) -> None:
    set_tensor(f"{O}.weight", poke((5, 40), 0x7E))(shards)  # 448
    set_tensor(f"{O}.weight_scale", poke((5, 1), 254))(shards)  # * 2**127: not finite in float32
