"""A small, realistic MXFP8 MoE checkpoint for the README, the tests and the demo.

:func:`write_sample_checkpoint` writes a Qwen3-MoE-shaped checkpoint in the
layout NVIDIA ModelOpt exports for ``--qformat mxfp8`` (``hf_quant_config.json``
with ``quant_algo: MXFP8``, ``group_size: 32``; ``config.json`` with
``quant_method: modelopt``):

* BF16: ``model.embed_tokens``, ``model.norm``, ``lm_head`` (excluded from
  quantization), every RMSNorm, the per-layer router ``mlp.gate``;
* MXFP8 (``X.weight`` float8_e4m3fn codes + ``X.weight_scale`` uint8 E8M0, or
  ``X.weight_scale_inv`` with ``scale_suffix="weight_scale_inv"``, MiniMax
  style): attention ``q/k/v/o_proj`` and the experts, either 2-D per expert
  ``mlp.experts.E.{gate,up,down}_proj.weight`` or, with ``fused_experts=True``,
  3-D stacks in transformers 5's (HF-v5) fused naming, without ``.weight``:
  ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows) and
  ``mlp.experts.down_proj`` ``[E, H, I]``, scales ``X_scale`` (``X_scale_inv``
  with ``scale_suffix="weight_scale_inv"``);
* float32 scalars ``k_proj.k_scale`` / ``v_proj.v_scale`` (ModelOpt's FP8 KV
  cache scales), which are not weight scales and must be carried over as is.

The default shapes (hidden 256, MoE intermediate 128, q ``[256, 256]``, k/v
``[128, 256]``) are multiples of 128, as block FP8 in vLLM, SGLang and
transformers needs for every merged sub-matrix (so the converted sample loads in
all three at tensor-parallel size 1); tests that need partial 128x128 tiles pass
other sizes (any multiple of 32 works). Shard 1 holds only BF16 tensors
(embeddings, final norm, lm_head), so a converter's "carry the shard over
unchanged" path is exercised.

Values are drawn like real weights (normal, log-normal per-row spread, a few
outliers, rounded to BF16) and quantized the way MX quantizers do
(:func:`mx_quantize`). Everything is deterministic for a seed: each tensor has
its own generator seeded from ``seed`` and its name, so the tensors are made in
parallel (a thread per CPU; the benchmarks' 16 GiB samples are CPU-bound) and
the files hold the same bytes whatever the order.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

from .formats import E4M3FN_MAX, E8M0_BIAS, MX_BLOCK
from .reference import exp2_int

__all__ = ["mx_quantize", "sample_weight", "write_sample_checkpoint"]

#: floor(log2(448)): the largest power of two of float8_e4m3fn (OCP MX v1.0, emax_elem).
E4M3FN_EMAX = 8
#: What ModelOpt records as its producer; the version is that of the PR that added MXFP8 export.
PRODUCER = {"name": "modelopt", "version": "0.41.0"}
EXCLUDE_MODULES = ["lm_head", "model.layers.*.mlp.gate"]
_ST_METADATA = {"format": "pt"}


def mx_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w`` ``[..., K]`` (K a multiple of 32) to MXFP8, as OCP MX v1.0 section 6.3 does.

    Per block of 32 along the last axis: the shared exponent is
    ``floor(log2(amax)) - 8`` (8 = e4m3fn's largest power of two), clamped to
    E8M0's range [-127, 127] (an all-zero block gets -127); the elements are
    divided by ``2**shared`` and cast to float8_e4m3fn (round to nearest even),
    saturating to +-448. Returns ``(codes, scales)``: uint8 e4m3fn codes
    ``[..., K]`` and uint8 E8M0 bytes ``[..., K/32]`` (``2**(byte - 127)``).
    """
    k = w.shape[-1]
    if w.dim() < 1 or k % MX_BLOCK:
        raise ValueError(f"last axis of {list(w.shape)} is not a multiple of {MX_BLOCK}")
    blocks = w.to(torch.float32).reshape(*w.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)  # NaN or inf anywhere in a block shows in its amax
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("cannot MX-quantize NaN or infinite values")
    _, exp = torch.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1): floor(log2(amax)) = exp - 1
    shared = torch.where(amax > 0, exp - 1 - E4M3FN_EMAX, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = blocks / exp2_int(shared).unsqueeze(-1)  # exact: division by a power of two
    codes = scaled.clamp(-E4M3FN_MAX, E4M3FN_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.reshape(w.shape), (shared + E8M0_BIAS).to(torch.uint8)


def sample_weight(shape: tuple[int, ...], generator: torch.Generator, std: float = 0.02) -> torch.Tensor:
    """BF16-like weights ``[..., N, K]``: normal, per-row log-normal spread, ~0.1% outliers (x4..x24).

    Returned as float32 holding BF16 values.
    """
    *lead, n, _ = shape
    row_std = std * torch.exp(0.5 * torch.randn((*lead, n, 1), generator=generator))
    w = torch.randn(shape, generator=generator) * row_std
    flat = w.view(-1)
    picks = torch.randint(0, max(1, flat.numel()), (flat.numel() // 1000,), generator=generator).unique()
    flat[picks] *= 4.0 + 20.0 * torch.rand(picks.numel(), generator=generator)
    return w.to(torch.bfloat16).to(torch.float32)


def write_sample_checkpoint(
    path: str | Path,
    *,
    layers: int = 2,
    experts: int = 4,
    seed: int = 0,
    scale_suffix: str = "weight_scale",
    fused_experts: bool = False,
    shards: int = 2,
    hidden: int = 256,
    moe_intermediate: int = 128,
    head_dim: int = 128,
    kv_heads: int = 1,
    vocab: int = 512,
    fp8_kv_cache: bool = False,
) -> Path:
    """Write a ModelOpt-layout MXFP8 MoE checkpoint into ``path`` and return it.

    ``path`` is created; an existing non-empty directory is refused. ``shards``
    safetensors files are written (``model-0000i-of-0000N.safetensors`` with
    ``model.safetensors.index.json``; a single ``model.safetensors`` when
    ``shards == 1``); shard 1 holds no MXFP8 tensor. ``hidden``,
    ``moe_intermediate``, ``head_dim``, ``kv_heads`` and ``vocab`` size the
    model (a benchmark can ask for a multi-GB one); the defaults give ~3 MB.
    ``fp8_kv_cache``: the configs ask for an FP8 KV cache, as many ModelOpt exports do (vLLM then needs
    ``--kv-cache-dtype fp8``, which readiness warns of); off by default, so the sample loads in every engine
    without a warning.
    """
    if scale_suffix not in ("weight_scale", "weight_scale_inv"):
        raise ValueError(f"scale_suffix must be 'weight_scale' or 'weight_scale_inv', not {scale_suffix!r}")
    if layers < 1 or experts < 1:
        raise ValueError("layers and experts must be >= 1")
    if not 1 <= shards <= layers + 1:
        raise ValueError(f"shards must be in [1, layers + 1] = [1, {layers + 1}], not {shards}")
    for name, value in (("hidden", hidden), ("moe_intermediate", moe_intermediate)):
        if value <= 0 or value % MX_BLOCK:
            raise ValueError(f"{name} = {value} must be a positive multiple of {MX_BLOCK}")
    if vocab < 3:
        raise ValueError("vocab must be >= 3 (<unk>, <s>, </s>)")
    if head_dim <= 0 or hidden % head_dim or kv_heads < 1 or (hidden // head_dim) % kv_heads:
        raise ValueError("hidden must be a multiple of head_dim, and the head count a multiple of kv_heads")
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not an empty directory")
    # written into a hidden directory, then moved into place: a sample stopped part-way (Ctrl-C, SIGTERM) leaves no
    # directory holding some of its shards, which the next run would refuse as not empty (an attack review). Inside
    # an existing (empty) ``path``, whose files are moved out of it: a mount point, or a directory of another owner
    # or mode, stays what it is; else beside it, renamed to ``path``.
    existing = path.is_dir()
    if not existing:
        path.parent.mkdir(parents=True, exist_ok=True)
    tag = f"sample-{os.getpid()}.{secrets.token_hex(4)}"
    out = path / f".{tag}" if existing else path.parent / f".{path.name}.{tag}"
    out.mkdir()
    moved: list[Path] = []
    try:
        dims = _Dims(hidden, moe_intermediate, head_dim, kv_heads, vocab, experts)
        make = _Maker(seed, scale_suffix)
        embeddings = [
            partial(make.named, make.bf16, "model.embed_tokens.weight", (vocab, hidden)),
            partial(make.named, make.norm, "model.norm.weight", hidden),
            partial(make.named, make.bf16, "lm_head.weight", (vocab, hidden)),
        ]
        with _in_parallel() as made:
            if shards == 1:
                parts = embeddings + [part for n in range(layers)
                                      for part in _layer_parts(make, dims, n, fused_experts)]
                _save(made(parts), out / "model.safetensors")
            else:
                # Shard 1: BF16 only. Layers go, in contiguous runs, to shards 2..N; each shard is
                # written as soon as it is complete, so memory holds one shard at a time.
                writer = _ShardWriter(out, shards)
                writer.write(made(embeddings))
                for shard in range(shards - 1):
                    run = [layer for layer in range(layers) if layer * (shards - 1) // layers == shard]
                    writer.write(made(part for layer in run for part in _layer_parts(make, dims, layer, fused_experts)))
                writer.write_index()

        config = _model_config(dims, layers, fp8_kv_cache)
        _write_json(out / "config.json", config)
        _write_json(out / "hf_quant_config.json", _hf_quant_config(fp8_kv_cache))
        _write_json(out / "generation_config.json", _generation_config())
        _write_json(out / "tokenizer_config.json", _tokenizer_config())
        _write_json(out / "tokenizer.json", _tokenizer(vocab))
        if existing:
            for f in sorted(out.iterdir()):
                moved.append(path / f.name)
                os.rename(f, moved[-1])
            out.rmdir()
        else:
            os.rename(out, path)
    except BaseException:
        for f in moved:
            f.unlink(missing_ok=True)
        shutil.rmtree(out, ignore_errors=True)
        raise
    return path


@dataclass(frozen=True)
class _Dims:
    hidden: int
    inter: int
    head_dim: int
    kv_heads: int
    vocab: int
    experts: int

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim


class _Maker:
    """Tensors of the sample, each from its own generator (seed, name)."""

    def __init__(self, seed: int, scale_suffix: str):
        self.seed, self.scale_suffix = seed, scale_suffix

    def _gen(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    @staticmethod
    def named(make: Callable[..., torch.Tensor], name: str, *args) -> dict[str, torch.Tensor]:
        return {name: make(name, *args)}

    def bf16(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return sample_weight(shape, self._gen(name)).to(torch.bfloat16)

    def norm(self, name: str, n: int) -> torch.Tensor:
        return (1.0 + 0.05 * torch.randn(n, generator=self._gen(name))).to(torch.bfloat16)

    def mxfp8(self, module: str, shape: tuple[int, ...], *, fused: bool = False) -> dict[str, torch.Tensor]:
        """``{module.weight: e4m3fn codes, module.<scale_suffix>: uint8 E8M0}``, one matrix at a time; ``fused``: HF-v5
        naming, ``{module: codes, module_scale[_inv]: E8M0}``."""
        gen = self._gen(module)
        std = shape[-1] ** -0.5
        codes = torch.empty(shape, dtype=torch.uint8)
        scales = torch.empty((*shape[:-1], shape[-1] // MX_BLOCK), dtype=torch.uint8)
        mats = list(zip(codes, scales)) if len(shape) == 3 else [(codes, scales)]
        for q_out, s_out in mats:  # one expert at a time: memory of one [N, K] matrix
            q, s = mx_quantize(sample_weight(shape[-2:], gen, std))
            q_out.copy_(q)
            s_out.copy_(s)
        if fused:
            return {module: codes.view(torch.float8_e4m3fn), module + self.scale_suffix.removeprefix("weight"): scales}
        return {f"{module}.weight": codes.view(torch.float8_e4m3fn), f"{module}.{self.scale_suffix}": scales}


Part = Callable[[], dict[str, torch.Tensor]]


def _layer_parts(make: _Maker, d: _Dims, layer: int, fused: bool) -> Iterator[Part]:
    """The layer's tensors, as calls that make one or two of them each (in any order, on any thread)."""
    p = f"model.layers.{layer}"
    for norm, n in (("input_layernorm", d.hidden), ("post_attention_layernorm", d.hidden),
                    ("self_attn.q_norm", d.head_dim), ("self_attn.k_norm", d.head_dim)):
        yield partial(make.named, make.norm, f"{p}.{norm}.weight", n)
    kv = d.kv_heads * d.head_dim
    for proj, shape in (("q", (d.heads * d.head_dim, d.hidden)), ("k", (kv, d.hidden)), ("v", (kv, d.hidden))):
        yield partial(make.mxfp8, f"{p}.self_attn.{proj}_proj", shape)
    yield partial(make.mxfp8, f"{p}.self_attn.o_proj", (d.hidden, d.heads * d.head_dim))
    # ModelOpt's FP8 KV-cache scales: float32 scalars, not weight scales.
    yield partial(dict, {f"{p}.self_attn.{x}_proj.{x}_scale": torch.tensor(1.0) for x in "kv"})
    yield partial(make.named, make.bf16, f"{p}.mlp.gate.weight", (d.experts, d.hidden))
    if fused:
        yield partial(make.mxfp8, f"{p}.mlp.experts.gate_up_proj", (d.experts, 2 * d.inter, d.hidden), fused=True)
        yield partial(make.mxfp8, f"{p}.mlp.experts.down_proj", (d.experts, d.hidden, d.inter), fused=True)
        return
    for e in range(d.experts):
        for proj, shape in (("gate", (d.inter, d.hidden)), ("up", (d.inter, d.hidden)), ("down", (d.hidden, d.inter))):
            yield partial(make.mxfp8, f"{p}.mlp.experts.{e}.{proj}_proj", shape)


@contextmanager
def _in_parallel() -> Iterator[Callable[[Iterable[Part]], dict[str, torch.Tensor]]]:
    """``made(parts)``: every part's tensors, in the parts' order, made by a thread per CPU.

    Each thread runs torch single-threaded meanwhile (one operation at a time per CPU, not a team of threads per
    operation per thread); the setting is restored after.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="sample") as pool:
            def made(parts: Iterable[Part]) -> dict[str, torch.Tensor]:
                tensors: dict[str, torch.Tensor] = {}
                for part in pool.map(lambda make_part: make_part(), parts):
                    tensors.update(part)
                return tensors

            yield made
    finally:
        torch.set_num_threads(threads)


class _ShardWriter:
    """Writes ``model-0000i-of-0000N.safetensors`` one after the other, then the index."""

    def __init__(self, path: Path, shards: int):
        self.path, self.shards = path, shards
        self.weight_map: dict[str, str] = {}
        self.total_size = 0

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        fname = f"model-{len(set(self.weight_map.values())) + 1:05d}-of-{self.shards:05d}.safetensors"
        _save(tensors, self.path / fname)
        for name, t in tensors.items():
            self.weight_map[name] = fname
            self.total_size += t.numel() * t.element_size()

    def write_index(self) -> None:
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(self.weight_map.items()))}
        _write_json(self.path / "model.safetensors.index.json", index)


def _save(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """A shard, with the mode the other files get (safetensors creates its files 0600: a daemon running as another
    user could not read a sample someone wrote for it)."""
    save_file(tensors, str(file), metadata=_ST_METADATA)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(file, 0o666 & ~mask)


def _write_json(file: Path, obj: dict) -> None:
    file.write_text(json.dumps(obj, indent=2) + "\n")


def _hf_quant_config(fp8_kv_cache: bool) -> dict:
    """What ModelOpt writes next to an MXFP8 export (NVIDIA/Model-Optimizer PR #736)."""
    quantization = {"quant_algo": "MXFP8", "kv_cache_quant_algo": "FP8", "group_size": MX_BLOCK,
                    "exclude_modules": list(EXCLUDE_MODULES)}
    if not fp8_kv_cache:
        del quantization["kv_cache_quant_algo"]
    return {"producer": dict(PRODUCER), "quantization": quantization}


def _model_config(d: _Dims, layers: int, fp8_kv_cache: bool) -> dict:
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": d.hidden,
        "intermediate_size": 3 * d.inter,
        "moe_intermediate_size": d.inter,
        "num_experts": d.experts,
        "num_experts_per_tok": min(2, d.experts),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "swiglu_alpha": 1.702,
        "swiglu_beta": 1.0,
        "swiglu_limit": 7.0,
        "vocab_size": d.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        # config.json's form of hf_quant_config.json, as ModelOpt writes it for MXFP8.
        "quantization_config": {
            "ignore": list(EXCLUDE_MODULES),
            "quant_algo": "MXFP8",
            "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
            "producer": dict(PRODUCER),
            "quant_method": "modelopt",
        },
    }
    if not fp8_kv_cache:
        del config["quantization_config"]["kv_cache_scheme"]
    return config


def _generation_config() -> dict:
    return {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
    }


def _tokenizer(vocab: int) -> dict:
    """A valid word-level ``tokenizers`` file: ``<unk>``, ``<s>``, ``</s>``, then ``t3``...``t{vocab-1}``."""
    words = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, vocab)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": w, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, w in enumerate(words[:3])
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(words)}, "unk_token": "<unk>"},
    }
