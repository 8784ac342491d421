"""Replicas of the real MXFP8 checkpoint layouts (names, dtypes, config keys), small enough for CI.

Each producer writes MXFP8 its own way (shared/DESIGN.md, the engine-correctness issue's table):

| layout | tensors | config |
|---|---|---|
| ``modelopt`` | experts-only recipe: ``X.weight`` F8_E4M3 + ``X.weight_scale`` U8, per-expert 2-D; attention and router BF16; ``k_scale``/``v_scale`` F32 | ``quant_method: modelopt`` + ``hf_quant_config.json``, exclusions as globs (``model.layers.*.self_attn*``) |
| ``minimax`` | ``block_sparse_moe.experts.E.w1/w2/w3`` + ``weight_scale_inv`` F8_E8M0, F32 router gate (M3: shared experts and ``e_score_correction_bias``) | ``quant_method: mxfp8``, ``weight_block_size: [1, 32]``, exact ``ignored_layers`` |
| ``fused`` | HF-v5 fused experts ``mlp.experts.gate_up_proj`` [E, 2I, H] + ``gate_up_proj_scale_inv`` U8 (no ``.weight``) | ``mxfp8`` form |
| ``compressed_tensors`` | ``weight`` + ``weight_scale`` U8 | ``config_groups``, ``ignore`` with ``re:`` patterns |
| ``quark`` | ``weight`` + ``weight_scale`` U8 (``per_group``) | ``quant_method: quark``, ``global_quant_config``, ``exclude`` |
| ``quark_per_block`` | ``weight`` + ``weight_scale`` F8_E8M0 ``[N/R, K/32]`` | ``qscheme: per_block``, ``block_size: [R, 32]`` |

All shapes are multiples of 128, so every replica is loadable by every engine at TP 1 (the partial tiles of
awkward shapes are covered by tests/support/checkpoints.py and the kernel tests).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from transformd.sample import mx_quantize, sample_weight

HIDDEN, INTER, HEAD_DIM, EXPERTS, VOCAB = 256, 128, 128, 2, 256
QUARK_ROWS = 32  # R of the per_block replica


class _Builder:
    def __init__(self, seed: int, *, scale_dtype: torch.dtype = torch.uint8, row_block: int = 1):
        self.seed, self.scale_dtype, self.row_block = seed, scale_dtype, row_block
        self.tensors: dict[str, torch.Tensor] = {}

    def _gen(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 7919 + sum(name.encode()))

    def bf16(self, name: str, shape: tuple[int, ...]) -> None:
        self.tensors[name] = sample_weight(shape, self._gen(name)).to(torch.bfloat16)

    def f32(self, name: str, shape: tuple[int, ...]) -> None:
        self.tensors[name] = sample_weight(shape, self._gen(name)).to(torch.float32)

    def norm(self, name: str, n: int) -> None:
        self.tensors[name] = torch.ones(n, dtype=torch.bfloat16)

    def mx(self, weight: str, scale: str, shape: tuple[int, ...]) -> None:
        """MXFP8 codes at ``weight``, E8M0 at ``scale``; with ``row_block`` R, one scale per Rx32 block."""
        w = sample_weight(shape, self._gen(weight), std=shape[-1] ** -0.5)
        if self.row_block > 1:  # one exponent per R rows: quantize with the block maximum broadcast over R rows
            *lead, n, k = shape
            r = self.row_block
            rows = -(-n // r)
            padded = torch.nn.functional.pad(w, (0, 0, 0, rows * r - n))
            amax = padded.abs().reshape(*lead, rows, r, k // 32, 32).amax(dim=(-3, -1))
            _, s = mx_quantize(amax.repeat_interleave(32, dim=-1))
            per_row = s.repeat_interleave(r, dim=-2)[..., :n, :]
            q = _quantize_with(w, per_row)
        else:
            q, s = mx_quantize(w)
        self.tensors[weight] = q.view(torch.float8_e4m3fn)
        self.tensors[scale] = s.view(self.scale_dtype) if self.scale_dtype != torch.uint8 else s

    def write(self, root: Path, config: dict, *, hf_quant: dict | None = None) -> Path:
        root.mkdir(parents=True)
        names = sorted(self.tensors)
        half = len(names) // 2
        shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
        weight_map = {}
        for fname, members in shards.items():
            save_file({n: self.tensors[n].contiguous() for n in members}, str(root / fname), metadata={"format": "pt"})
            weight_map.update((n, fname) for n in members)
        total = sum(t.numel() * t.element_size() for t in self.tensors.values())
        (root / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
        (root / "config.json").write_text(json.dumps(config, indent=2))
        if hf_quant is not None:
            (root / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
        (root / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
        return root


def _quantize_with(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes of ``w`` divided by the given E8M0 scales (one per 32 elements), saturating at 448."""
    exp = scales.to(torch.int32) - 127
    blocks = w.reshape(*w.shape[:-1], -1, 32) / torch.pow(2.0, exp.to(torch.float32)).unsqueeze(-1)
    return blocks.clamp(-448, 448).reshape(w.shape).to(torch.float8_e4m3fn).view(torch.uint8)


def _base_config(arch: str, model_type: str, quantization_config: dict, **extra) -> dict:
    return {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * INTER,
        "moe_intermediate_size": INTER,
        "num_experts": EXPERTS,
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 1,
        "num_attention_heads": HIDDEN // HEAD_DIM,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "quantization_config": quantization_config,
        **extra,
    }


def _attention(b: _Builder, p: str, *, mx: bool, scale: str = "weight_scale", qk_norm: bool = True) -> None:
    if qk_norm:  # Qwen3's per-head RMSNorms of q and k
        b.norm(f"{p}.self_attn.q_norm.weight", HEAD_DIM)
        b.norm(f"{p}.self_attn.k_norm.weight", HEAD_DIM)
    shapes = {"q": (HIDDEN, HIDDEN), "k": (HEAD_DIM, HIDDEN), "v": (HEAD_DIM, HIDDEN), "o": (HIDDEN, HIDDEN)}
    for x, shape in shapes.items():
        name = f"{p}.self_attn.{x}_proj"
        if mx:
            b.mx(f"{name}.weight", f"{name}.{scale}", shape)
        else:
            b.bf16(f"{name}.weight", shape)


def _embeddings(b: _Builder) -> None:
    b.bf16("model.embed_tokens.weight", (VOCAB, HIDDEN))
    b.bf16("lm_head.weight", (VOCAB, HIDDEN))
    b.norm("model.norm.weight", HIDDEN)
    b.norm("model.layers.0.input_layernorm.weight", HIDDEN)
    b.norm("model.layers.0.post_attention_layernorm.weight", HIDDEN)


def _per_expert(b: _Builder, p: str, names: tuple[str, str, str], scale: str) -> None:
    gate, up, down = names
    for e in range(EXPERTS):
        for proj, shape in ((gate, (INTER, HIDDEN)), (up, (INTER, HIDDEN)), (down, (HIDDEN, INTER))):
            b.mx(f"{p}.{e}.{proj}.weight", f"{p}.{e}.{proj}.{scale}", shape)


def modelopt(root: Path, seed: int = 0) -> Path:
    """NVIDIA ModelOpt MXFP8, experts-only recipe (attention excluded with a glob)."""
    b = _Builder(seed)
    _embeddings(b)
    p = "model.layers.0"
    _attention(b, p, mx=False)
    b.tensors[f"{p}.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
    b.tensors[f"{p}.self_attn.v_proj.v_scale"] = torch.tensor(1.0)
    b.bf16(f"{p}.mlp.gate.weight", (EXPERTS, HIDDEN))
    _per_expert(b, f"{p}.mlp.experts", ("gate_proj", "up_proj", "down_proj"), "weight_scale")
    excluded = ["lm_head", "model.layers.*.mlp.gate", "model.layers.*.self_attn*"]
    producer = {"name": "modelopt", "version": "0.41.0"}
    qc = {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": excluded, "producer": producer,
          "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}
    hf_quant = {"producer": producer, "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": "FP8",
                                                       "group_size": 32, "exclude_modules": excluded}}
    return b.write(root, _base_config("Qwen3MoeForCausalLM", "qwen3_moe", qc), hf_quant=hf_quant)


def minimax(root: Path, seed: int = 0, *, arch: str = "MiniMaxM2ForCausalLM") -> Path:
    """MiniMax-style MXFP8: w1/w2/w3 experts, F8_E8M0 weight_scale_inv, F32 router; MiniMax-M3 (``arch``
    ``MiniMaxM3...``) adds shared experts and ``e_score_correction_bias``."""
    m3 = "MiniMaxM3" in arch
    b = _Builder(seed, scale_dtype=torch.float8_e8m0fnu)
    _embeddings(b)
    p = "model.layers.0"
    b.norm(f"{p}.self_attn.q_norm.weight", HIDDEN)  # MiniMax normalises q and k over all heads at once
    b.norm(f"{p}.self_attn.k_norm.weight", HEAD_DIM)
    _attention(b, p, mx=True, scale="weight_scale_inv", qk_norm=False)
    moe = f"{p}.block_sparse_moe"
    b.f32(f"{moe}.gate.weight", (EXPERTS, HIDDEN))
    _per_expert(b, f"{moe}.experts", ("w1", "w3", "w2"), "weight_scale_inv")
    if m3:
        b.tensors[f"{moe}.e_score_correction_bias"] = torch.zeros(EXPERTS, dtype=torch.float32)
        for proj, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER))):
            b.mx(f"{moe}.shared_experts.{proj}.weight", f"{moe}.shared_experts.{proj}.weight_scale_inv", shape)
    qc = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
          "ignored_layers": ["lm_head", f"{moe}.gate"]}
    extra = {"intermediate_size": INTER, "rotary_dim": HEAD_DIM, "scoring_func": "sigmoid",
             "max_position_embeddings": 4096}
    return b.write(root, _base_config(arch, "minimax_m3" if m3 else "minimax_m2", qc, **extra))


def fused(root: Path, seed: int = 0, *, arch: str = "HYV4ForCausalLM") -> Path:
    """HY-V4 / HF-v5 fused expert naming: 3-D gate_up_proj/down_proj + *_scale_inv, no .weight suffix
    (transformers 5's own parameter names for Qwen3-MoE, with ``arch="Qwen3MoeForCausalLM"``)."""
    b = _Builder(seed)
    _embeddings(b)
    p = "model.layers.0"
    _attention(b, p, mx=True, scale="weight_scale_inv")
    b.bf16(f"{p}.mlp.gate.weight", (EXPERTS, HIDDEN))
    b.mx(f"{p}.mlp.experts.gate_up_proj", f"{p}.mlp.experts.gate_up_proj_scale_inv", (EXPERTS, 2 * INTER, HIDDEN))
    b.mx(f"{p}.mlp.experts.down_proj", f"{p}.mlp.experts.down_proj_scale_inv", (EXPERTS, HIDDEN, INTER))
    qc = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
          "ignored_layers": ["lm_head", "model.layers.0.mlp.gate"]}
    model_type = "qwen3_moe" if arch == "Qwen3MoeForCausalLM" else "hy_v4"
    return b.write(root, _base_config(arch, model_type, qc))


def compressed_tensors(root: Path, seed: int = 0) -> Path:
    """compressed-tensors ``mxfp8-quantized``: weight + weight_scale U8, ``re:`` exclusions."""
    b = _Builder(seed)
    _embeddings(b)
    p = "model.layers.0"
    _attention(b, p, mx=True)
    b.bf16(f"{p}.mlp.gate.weight", (EXPERTS, HIDDEN))
    _per_expert(b, f"{p}.mlp.experts", ("gate_proj", "up_proj", "down_proj"), "weight_scale")
    scheme = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
              "dynamic": False, "scale_dtype": "uint8"}
    qc = {"quant_method": "compressed-tensors", "format": "mxfp8-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme, "input_activations": None,
                                        "format": "mxfp8-quantized"}},
          "ignore": ["lm_head", "re:.*mlp.gate$"], "quantization_status": "compressed"}
    return b.write(root, _base_config("Qwen3MoeForCausalLM", "qwen3_moe", qc))


def quark(root: Path, seed: int = 0, *, per_block: bool = False) -> Path:
    """AMD Quark OCP-MX: per_group (U8 [N, K/32]) or per_block (F8_E8M0 [N/R, K/32], block_size [R, 32])."""
    b = _Builder(seed, scale_dtype=torch.float8_e8m0fnu if per_block else torch.uint8,
                 row_block=QUARK_ROWS if per_block else 1)
    _embeddings(b)
    p = "model.layers.0"
    _attention(b, p, mx=True)
    b.bf16(f"{p}.mlp.gate.weight", (EXPERTS, HIDDEN))
    _per_expert(b, f"{p}.mlp.experts", ("gate_proj", "up_proj", "down_proj"), "weight_scale")
    if per_block:
        weight = {"dtype": "fp8_e4m3", "qscheme": "per_block", "block_size": [QUARK_ROWS, 32],
                  "scale_type": "float8_e8m0fnu", "symmetric": True, "is_dynamic": False}
    else:
        weight = {"dtype": "fp8_e4m3", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0",
                  "symmetric": True, "is_dynamic": False}
    qc = {"quant_method": "quark", "global_quant_config": {"weight": weight, "input_tensors": None},
          "layer_quant_config": {}, "exclude": ["lm_head", "re:.*mlp\\.gate$"], "export": {"kv_cache_group": []}}
    return b.write(root, _base_config("Qwen3MoeForCausalLM", "qwen3_moe", qc))


def quark_per_block(root: Path, seed: int = 0) -> Path:
    return quark(root, seed, per_block=True)


#: Every layout, by name.
LAYOUTS: dict[str, Callable[[Path], Path]] = {
    "modelopt": modelopt,
    "minimax": minimax,
    "fused": fused,
    "compressed_tensors": compressed_tensors,
    "quark": quark,
    "quark_per_block": quark_per_block,
}
