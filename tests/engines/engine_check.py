#!/usr/bin/env python3
"""Opt-in ENGINE CHECK: run vLLM's / SGLang's own code on a converted block-FP8 checkpoint.

NOT part of the test suite and never run in CI (the file name does not start with
``test_``; it needs a virtual environment with the engine installed, see README.md here).

    python tests/engines/engine_check.py --engine vllm|sglang OUT_DIR [--tp 1 2 4 8]

What it checks, with the engine's own code (only GPU kernels are stubbed):

a. config.json's ``quantization_config`` through the engine's quantization-config machinery
   (vLLM: EngineArgs.create_engine_config -> ModelConfig._verify_quantization -> get_quant_config;
   SGLang: ModelConfig.from_server_args -> model_loader._get_quantization_config), and whether a
   leftover ``hf_quant_config.json`` changes that detection (run again without it, and without
   config.json's quantization_config to show what the engine would then read).
b. every linear weight of the checkpoint (``X.weight`` 2-D/3-D, fused ``experts.gate_up_proj``):
   the real model class is built on the CPU with the engine's Fp8Config, and the quant method
   of the layer that receives the weight (FP8 or unquantized, through the model's own
   packed/fused mapping and is_layer_skipped) must match the tensor: FP8 weight + float32
   ``weight_scale_inv`` -> FP8; BF16/F16/F32 -> unquantized. Leftover MX tensors (U8/F8_E8M0,
   a ``*_scale`` that is not F32) fail too. If the model cannot be built, the decision falls
   back to the engine's is_layer_skipped with generic name rules (and says so).
c. per TP size: the engine's block-shape validation (vLLM fp8_utils.validate_fp8_block_shape,
   ColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch, refine_fp8_moe_block_shape,
   validate_fp8_block_shape_moe; SGLang Fp8LinearMethod.validate_block_quant_shapes and the MoE
   rule of Fp8MoEMethod) on the merged layers per rank: which TP sizes load, which are refused,
   and which load with a shard that starts inside a 128-row scale block (silently wrong).
d. weight loading: the model's own ``load_weights`` gets the checkpoint (all tensors at once, and
   one by one if that raises); parameters it never writes are reported (vLLM's
   track_weights_loading; SGLang: parameters poisoned with NaN beforehand), the loaded FP8 bytes
   must equal the checkpoint's, the loaded scale must equal ``weight_scale_inv``, and the
   dequantized weight the engine's block GEMM would use (fp8 x scale of its 128x128 tile of the
   *merged* parameter) must equal the checkpoint's, for every linear layer and expert.
e. transformd's own readiness report of the checkpoint (``transformd.checkpoint.readiness_of_dir``, when transformd
   is importable) against the engine's verdicts of c and d, per TP size: a TP size readiness says loads where the
   engine refuses (or loads wrongly) fails, and so does a module the engine stops at that TP size for which readiness
   names no reason there (issue 44: every TP verdict lists every reason); where readiness refuses what the engine
   loads, it must say "may load" (else an informational row: readiness more conservative than the engine).
f. a table and ``engine_check: N passed, M failed``; exit status 1 on any failure.

Stubbed, GPU only: vLLM's block-FP8 GEMM kernel choice (init_fp8_linear_kernel raises on a CPU
without AMX) and, where it raises, the FP8 MoE backend choice; for SGLang the ``vllm._custom_ops``
module its CPU rotary embedding imports. Nothing is run through a GEMM. SGLang refuses to build
some models (block checks at layer creation): the refusal is recorded as a failure and the
build goes on with that check bypassed, so that the rest can still be examined.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

BLOCK = 128
FP8_OCP = "F8_E4M3"
FP8_FNUZ = "F8_E4M3FNUZ"
FLOAT_DTYPES = {"BF16", "F16", "F32"}
MX_SCALE_DTYPES = {"U8", "F8_E8M0"}

# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


@dataclass
class Row:
    section: str
    name: str
    klass: str
    decision: str
    expected: str
    ok: bool | None  # None: informational
    note: str = ""


class Report:
    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.notes: list[str] = []

    def add(self, section: str, name: str, klass: str, decision: str, expected: str, ok: bool | None,
            note: str = "") -> None:
        self.rows.append(Row(section, name, klass, decision, expected, ok, note))

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"note: {text}", flush=True)

    @property
    def passed(self) -> int:
        return sum(1 for r in self.rows if r.ok is True)

    @property
    def failed(self) -> int:
        return sum(1 for r in self.rows if r.ok is False)

    def print(self, out=sys.stdout, *, collapse: bool = True) -> None:
        rows = _collapse(self.rows) if collapse else [(r, 1) for r in self.rows]
        heads = ("section", "module", "class", "engine decision", "expected", "result")
        table = []
        for r, n in rows:
            res = "OK" if r.ok else ("FAIL" if r.ok is False else "info")
            name = r.name if n == 1 else f"{r.name}  (x{n})"
            table.append((r.section, name, r.klass, r.decision, r.expected, res + (f"  {r.note}" if r.note else "")))
        widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(heads)]
        widths = [min(w, 60) for w in widths[:-1]] + [0]
        line = "  ".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip()
        print(line, file=out)
        print("-" * len(line), file=out)
        for t in table:
            print("  ".join(str(c).ljust(w) for c, w in zip(t, widths)).rstrip(), file=out)


def _collapse(rows: list[Row]) -> list[tuple[Row, int]]:
    """Merge rows that differ only in layer/expert numbers (same outcome), so the table stays short."""
    out: list[tuple[Row, int]] = []
    index: dict[tuple, int] = {}
    for r in rows:
        key = (r.section, re.sub(r"\.\d+(?=\.|$)", ".N", r.name), r.klass, r.decision, r.expected, r.ok,
               re.sub(r"\d+", "#", r.note))
        if key in index:
            i = index[key]
            out[i] = (out[i][0], out[i][1] + 1)
            if out[i][1] == 2:
                first = out[i][0]
                out[i] = (Row(first.section, re.sub(r"\.\d+(?=\.|$)", ".N", first.name), first.klass, first.decision,
                              first.expected, first.ok, first.note), 2)
        else:
            index[key] = len(out)
            out.append((r, 1))
    return out


# --------------------------------------------------------------------------------------
# Checkpoint (headers read without torch; tensors through safetensors when needed)
# --------------------------------------------------------------------------------------


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path


class Checkpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise SystemExit(f"engine_check: {cfg} does not exist: OUT_DIR must be a converted checkpoint directory")
        self.config: dict[str, Any] = json.loads(cfg.read_text())
        hq = self.path / "hf_quant_config.json"
        self.hf_quant_config: dict[str, Any] | None = json.loads(hq.read_text()) if hq.is_file() else None
        self.tensors: dict[str, TensorInfo] = {}
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise SystemExit(f"engine_check: no *.safetensors in {self.path}")
        for f in files:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                self.tensors[name] = TensorInfo(name, meta["dtype"], tuple(meta["shape"]), f)
        self._open: dict[Path, Any] = {}

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or [])

    @property
    def quant_config(self) -> dict[str, Any] | None:
        return self.config.get("quantization_config")

    def load(self, name: str):
        """The tensor as torch stores it (F8_E4M3 -> float8_e4m3fn, ...)."""
        from safetensors import safe_open

        info = self.tensors[name]
        if info.file not in self._open:
            self._open[info.file] = safe_open(str(info.file), framework="pt")
        return self._open[info.file].get_tensor(name)

    def iter_weights(self) -> Iterator[tuple[str, Any]]:
        for name in self.tensors:
            yield name, self.load(name)


@dataclass
class CkModule:
    """One linear weight of the checkpoint (a dense layer, one expert, or a 3-D expert stack)."""

    name: str  # module name: "model.layers.0.self_attn.q_proj", or the fused tensor name
    weight: TensorInfo
    scale: TensorInfo | None
    fused_experts: bool
    expected: str  # "fp8" | "unquantized" | "invalid"
    problem: str = ""

    @property
    def n(self) -> int:
        return self.weight.shape[-2]

    @property
    def k(self) -> int:
        return self.weight.shape[-1]


_FUSED_EXPERT = re.compile(r"\.experts\.(gate_up_proj|down_proj|gate_proj|up_proj|w13_weight|w2_weight)$")


def checkpoint_modules(ckpt: Checkpoint) -> list[CkModule]:
    mods = []
    for name, t in ckpt.tensors.items():
        fused = False
        if name.endswith(".weight") and len(t.shape) in (2, 3):
            module = name[: -len(".weight")]
            scale_names = [module + ".weight_scale_inv"]
            mx_names = [module + ".weight_scale"]
        elif len(t.shape) == 3 and _FUSED_EXPERT.search(name):
            module, fused = name, True
            scale_names = [name + "_scale_inv", name + ".weight_scale_inv"]
            mx_names = [name + "_scale", name + ".weight_scale"]
        else:
            continue
        scale = next((ckpt.tensors[s] for s in scale_names if s in ckpt.tensors), None)
        mx_scale = next((ckpt.tensors[s] for s in mx_names if s in ckpt.tensors), None)
        m = CkModule(module, t, scale, fused, "invalid")
        if t.dtype in (FP8_OCP, FP8_FNUZ):
            want = (*t.shape[:-2], math.ceil(t.shape[-2] / BLOCK), math.ceil(t.shape[-1] / BLOCK))
            if scale is None:
                m.problem = "FP8 weight without weight_scale_inv" + (f" (has MX scale {mx_scale.name} {mx_scale.dtype})" if mx_scale else "")
            elif scale.dtype != "F32":
                m.problem = f"{scale.name} is {scale.dtype}, not F32"
            elif scale.shape != want:
                m.problem = f"{scale.name} shape {list(scale.shape)} != {list(want)} (ceil(N/128), ceil(K/128))"
            elif t.dtype == FP8_FNUZ:
                m.problem = "weight is F8_E4M3FNUZ: vLLM/SGLang want e4m3fn (target ocp) and value-cast FNUZ codes"
            else:
                m.expected = "fp8"
            if mx_scale is not None:
                m.problem = (m.problem + "; " if m.problem else "") + f"MX scale {mx_scale.name} ({mx_scale.dtype}) still present"
                m.expected = "invalid"
        elif t.dtype in FLOAT_DTYPES:
            if scale is not None or mx_scale is not None:
                m.problem = f"{t.dtype} weight with a scale tensor ({(scale or mx_scale).name})"
            else:
                m.expected = "unquantized"
        else:
            m.problem = f"weight dtype {t.dtype}"
        mods.append(m)
    return sorted(mods, key=lambda m: _natural(m.name))


def _natural(s: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


def check_leftovers(ckpt: Checkpoint, report: Report) -> None:
    """No MX tensor may survive under an fp8 config."""
    bad = []
    for name, t in ckpt.tensors.items():
        if t.dtype in MX_SCALE_DTYPES:
            bad.append((name, f"{t.dtype} tensor (MX scale?)"))
        elif re.search(r"(weight_scale|_scale_inv|weight_scale_inv)$", name) and t.dtype != "F32":
            bad.append((name, f"scale tensor is {t.dtype}, not F32"))
        elif name.endswith(".weight_scale") and t.dtype == "F32" and len(t.shape) >= 2:
            bad.append((name, "F32 '.weight_scale' next to a block weight: vLLM/SGLang block layers read weight_scale_inv"))
    for name, why in bad:
        report.add("tensors", name, "-", "MX/odd tensor present", "none", False, why)
    if not bad:
        report.add("tensors", "(all tensors)", "-", "no MX scale tensors", "none", True)


# --------------------------------------------------------------------------------------
# Architecture knowledge: checkpoint module -> engine module (+ shard)
# --------------------------------------------------------------------------------------

#: expert naming -> (checkpoint projection, role): role is "w1" (gate), "w3" (up), "w2" (down), "w13" (fused gate+up)
_EXPERT_ROLES = {
    "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2",
    "gate_up_proj": "w13", "w13_weight": "w13", "w2_weight": "w2",
}
_PER_EXPERT = re.compile(r"^(?P<moe>.*\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)$")
_FUSED_EXPERT_MOD = re.compile(r"^(?P<moe>.*\.experts)\.(?P<proj>gate_up_proj|down_proj|w13_weight|w2_weight)$")

#: Architectures this script was run on (synthetic checkpoints, both engines); others go through
#: the engine's model class all the same, with a note.
KNOWN_ARCHS = {"Qwen3MoeForCausalLM", "LlamaForCausalLM", "DeepseekV3ForCausalLM", "MiniMaxM2ForCausalLM"}

DEFAULT_PACKED = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


@dataclass
class EngineModule:
    """Where one checkpoint module lands in the engine."""

    prefix: str  # engine layer prefix (qkv_proj, gate_up_proj, ...experts)
    kind: str  # "linear" | "moe" | "embedding"
    shard: str | None  # "q"/"k"/"v", index in a merged layer, or the expert role
    expert: int | None = None
    siblings: list[str] = field(default_factory=list)  # checkpoint modules of the merged layer, in order


def engine_module_for(name: str, packed: dict[str, list[str]], arch_cfg: dict[str, Any]) -> EngineModule:
    m = _PER_EXPERT.match(name)
    if m and m.group("proj") in _EXPERT_ROLES and "shared_expert" not in m.group("moe").rsplit(".", 1)[-1]:
        return EngineModule(m.group("moe"), "moe", _EXPERT_ROLES[m.group("proj")], int(m.group("e")))
    m = _FUSED_EXPERT_MOD.match(name)
    if m:
        return EngineModule(m.group("moe"), "moe", _EXPERT_ROLES[m.group("proj")])
    last = name.rsplit(".", 1)[-1]
    if last in ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out", "output"):
        return EngineModule(name, "embedding", None)
    for fused, parts in packed.items():
        if last in parts:
            base = name[: -len(last)] + fused
            shard: str = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}.get(last, str(parts.index(last))) \
                if fused == "qkv_proj" else str(parts.index(last))
            return EngineModule(base, "linear", shard, siblings=[name[: -len(last)] + p for p in parts])
    return EngineModule(name, "linear", None)


# --------------------------------------------------------------------------------------
# Merged-layer sizes per TP (for the block-shape validation)
# --------------------------------------------------------------------------------------


@dataclass
class Merged:
    """One engine layer built from checkpoint modules: global sizes of its shards."""

    prefix: str
    kind: str  # "qkv" | "merged" | "column" | "row" | "moe" | "replicated"
    shard_sizes: list[int]  # global output sizes of the shards (qkv: q, k, v)
    input_size: int
    heads: tuple[int, int, int] | None = None  # (num_heads, num_kv_heads, head_dim) for qkv
    moe_intermediate: int | None = None
    hidden: int | None = None
    klass: str = ""


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("text_config") or cfg


def merged_layers(mods: list[CkModule], packed: dict[str, list[str]], cfg: dict[str, Any]) -> list[Merged]:
    """Group the checkpoint's FP8 modules the way the engine builds its layers."""
    tc = text_config(cfg)
    groups: dict[str, dict[str, CkModule]] = {}
    moes: dict[str, list[CkModule]] = {}
    for m in mods:
        if m.expected != "fp8":
            continue
        em = engine_module_for(m.name, packed, tc)
        if em.kind == "moe":
            moes.setdefault(em.prefix, []).append(m)
        elif em.kind == "linear":
            groups.setdefault(em.prefix, {})[em.shard or ""] = m
    out = []
    for prefix, shards in groups.items():
        last = prefix.rsplit(".", 1)[-1]
        any_mod = next(iter(shards.values()))
        k = any_mod.k
        if last in packed and len(shards) > 1:
            order = ["q", "k", "v"] if last == "qkv_proj" else [str(i) for i in range(len(packed[last]))]
            sizes = [shards[s].n for s in order if s in shards]
            if last == "qkv_proj":
                hd = tc.get("head_dim") or (tc.get("hidden_size", 0) // max(1, tc.get("num_attention_heads", 1)))
                heads = (shards["q"].n // hd, shards["k"].n // hd, hd) if hd and "q" in shards and "k" in shards else None
                out.append(Merged(prefix, "qkv", sizes, k, heads=heads))
            else:
                out.append(Merged(prefix, "merged", sizes, k))
        else:
            kind = "row" if re.search(r"(o_proj|down_proj|out_proj|dense_4h_to_h|w2|wo|c_proj)$", last) else "column"
            if re.search(r"(^|\.)gate$|shared_expert_gate$|router$", prefix):
                kind = "replicated"
            out.append(Merged(prefix, kind, [any_mod.n], k))
    for prefix, ms in moes.items():
        inter = None
        hidden = None
        for m in ms:
            role = engine_module_for(m.name, packed, tc).shard
            if role in ("w1", "w3"):
                inter, hidden = m.n, m.k
            elif role == "w13":
                inter, hidden = m.n // 2, m.k
            elif role == "w2" and inter is None:
                inter, hidden = m.k, m.n
        out.append(Merged(prefix, "moe", [inter or 0], hidden or 0, moe_intermediate=inter, hidden=hidden))
    return sorted(out, key=lambda g: _natural(g.prefix))


def per_rank(g: Merged, tp: int) -> tuple[list[int], int]:
    """Per-rank output shard sizes and input size, as vLLM/SGLang compute them."""
    if g.kind == "qkv" and g.heads:
        nh, nkv, hd = g.heads
        kv_per_rank = max(1, nkv // tp)  # replicated when tp >= num_kv_heads
        return [nh // tp * hd if nh % tp == 0 else g.shard_sizes[0] / tp, kv_per_rank * hd, kv_per_rank * hd][: len(g.shard_sizes)], g.input_size
    if g.kind in ("qkv", "merged", "column"):
        return [s / tp if s % tp else s // tp for s in g.shard_sizes], g.input_size
    if g.kind == "row":
        return g.shard_sizes, (g.input_size / tp if g.input_size % tp else g.input_size // tp)
    return g.shard_sizes, g.input_size


def aligned_offsets_ok(sizes: list) -> bool:
    """Merged shards give correct scales only if every shard but the last starts and ends on a block."""
    return all(isinstance(s, int) and s % BLOCK == 0 for s in sizes[:-1])


def _linear_split(r, g, tp: int, sizes, insize):
    """(layer class, effective TP, integer per-rank sizes) of a linear group at ``tp``; None (recorded as rejected)
    when its heads or sizes do not split over ``tp`` ranks. Shared by the vLLM and SGLang TP checks."""
    klass = g.klass or {"qkv": "QKVParallelLinear", "merged": "MergedColumnParallelLinear",
                        "column": "ColumnParallelLinear", "row": "RowParallelLinear",
                        "replicated": "ReplicatedLinear"}[g.kind]
    if g.kind == "replicated":
        klass += " (no TP split)"
    eff_tp = 1 if g.kind == "replicated" else tp
    if g.kind == "qkv" and g.heads and g.heads[0] % tp:
        r.add(f"tp={tp}", g.prefix, klass, "rejected", "loads", False,
              f"num_attention_heads {g.heads[0]} not divisible by tp {tp}")
        return None
    if any(not float(s).is_integer() for s in sizes) or not float(insize).is_integer():
        r.add(f"tp={tp}", g.prefix, klass, "rejected", "loads", False,
              f"sizes {_fmt_sizes(sizes)} x {insize} not divisible by tp")
        return None
    return klass, eff_tp, [int(s) for s in sizes]


def _fmt_sizes(sizes: list) -> str:
    return "/".join(str(int(s)) if float(s).is_integer() else f"{s:.1f}" for s in sizes)


def expand_scale(scale, n: int, k: int, bn: int, bk: int):
    return scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]


def scale_block(rows: int, cols: int, n: int, k: int) -> tuple[int, int] | None:
    """The block a scale grid of rows x cols has over an n x k weight (128, or a refined one)."""
    for b in (128, 64, 32, 16):
        if math.ceil(n / b) == rows and math.ceil(k / b) == cols:
            return b, b
    return None


def dequant(w, s):
    """What a block-FP8 GEMM computes with: fp8 value x the scale of its 128x128 tile."""
    import torch

    bn, bk = scale_block(s.shape[-2], s.shape[-1], w.shape[-2], w.shape[-1]) or (BLOCK, BLOCK)
    return w.to(torch.float32) * expand_scale(s.to(torch.float32), w.shape[-2], w.shape[-1], bn, bk)


# --------------------------------------------------------------------------------------
# Shared GPU stubs
# --------------------------------------------------------------------------------------

STUBS: list[str] = []


def stub(what: str) -> None:
    if what not in STUBS:
        STUBS.append(what)


# --------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------


class VllmCheck:
    engine = "vllm"

    def __init__(self, ckpt: Checkpoint, report: Report, tps: list[int], build_model: bool) -> None:
        self.ckpt, self.report, self.tps, self.build_model = ckpt, report, tps, build_model
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        import vllm

        self.version = vllm.__version__
        try:  # vLLM 0.34: an x86 CPU platform without an active Triton back-end (triton-cpu) refuses any config
            import vllm.triton_utils as triton_utils

            if not triton_utils.HAS_TRITON:
                stub("vLLM's x86 CPU platform check for triton-cpu (vllm.triton_utils.HAS_TRITON, 0.34: its CPU model "
                     "runner's kernels; no kernel runs here)")
                triton_utils.HAS_TRITON = True
        except ImportError:
            pass
        self.quant_config = None
        self.vllm_config = None
        self.model_cls = None

    # ---- a. config detection ---------------------------------------------------------

    def _engine_config(self, path: Path):
        from vllm.engine.arg_utils import EngineArgs

        args = EngineArgs(model=str(path), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                          max_model_len=256, load_format="safetensors")
        return args.create_engine_config()

    def check_config(self) -> None:
        r, ckpt = self.report, self.ckpt
        qc = ckpt.quant_config or {}
        try:
            vc = self._engine_config(ckpt.path)
        except Exception as e:  # the engine refuses the config
            r.add("config", "quantization_config", "EngineArgs.create_engine_config", f"raised {type(e).__name__}",
                  "fp8 / Fp8Config", False, _short(e))
            self._fallback_quant_config()
            return
        self.vllm_config = vc
        method = vc.model_config.quantization
        qcfg = vc.quant_config
        self.quant_config = qcfg
        name = type(qcfg).__name__ if qcfg is not None else "None"
        r.add("config", "quant method (ModelConfig._verify_quantization)", "ModelConfig", str(method), "fp8",
              method == "fp8")
        r.add("config", "quant config class (get_quant_config)", name, name, "Fp8Config", name == "Fp8Config")
        if qcfg is not None and name == "Fp8Config":
            wbs = list(qcfg.weight_block_size or [])
            r.add("config", "weight_block_size", name, str(wbs), "[128, 128]", wbs == [128, 128])
            r.add("config", "activation_scheme", name, str(qcfg.activation_scheme), "dynamic",
                  qcfg.activation_scheme == "dynamic")
            r.add("config", "is_checkpoint_fp8_serialized", name, str(qcfg.is_checkpoint_fp8_serialized), "True",
                  bool(qcfg.is_checkpoint_fp8_serialized))
            ign = list(qcfg.ignored_layers or [])
            wild = [x for x in ign if any(c in x for c in "*?[") or x.startswith("re:")]
            r.add("config", "ignored_layers (as parsed)", name, json.dumps(ign)[:80], "exact module names",
                  not wild, f"vLLM matches names exactly; patterns never match: {wild}" if wild else "")
            for key in ("ignored_layers", "modules_to_not_convert", "ignore"):
                if key in qc and key != "ignored_layers" and qc.get(key) != qc.get("ignored_layers"):
                    r.add("config", f"{key} vs ignored_layers", name, "differ", "same list", False,
                          "vLLM reads ignored_layers only (modules_to_not_convert only if ignored_layers is empty)")
        # hf_quant_config.json: does it change the detection?
        if ckpt.hf_quant_config is not None:
            self._hf_quant_variants(method, name)
        else:
            r.add("config", "hf_quant_config.json", "-", "absent", "-", None)

    def _hf_quant_variants(self, method, name) -> None:
        import tempfile

        r, ckpt = self.report, self.ckpt
        with tempfile.TemporaryDirectory(prefix="engine_check_") as tmp:
            t = Path(tmp) / "no_hfq"
            _link_tree(ckpt.path, t, skip={"hf_quant_config.json"})
            try:
                vc = self._engine_config(t)
                m2, n2 = vc.model_config.quantization, type(vc.quant_config).__name__
                same = (m2, n2) == (method, name)
                r.add("config", "hf_quant_config.json present vs removed", "ModelConfig", f"{method}/{name} vs {m2}/{n2}",
                      "same", same, "" if same else "hf_quant_config.json changes what vLLM loads")
            except Exception as e:
                r.add("config", "hf_quant_config.json removed", "ModelConfig", f"raised {type(e).__name__}", "same", False,
                      _short(e))
            # What vLLM does when config.json has no quantization_config: it reads hf_quant_config.json.
            t2 = Path(tmp) / "only_hfq"
            _link_tree(ckpt.path, t2, skip={"config.json"})
            cfg = dict(ckpt.config)
            cfg.pop("quantization_config", None)
            (t2 / "config.json").write_text(json.dumps(cfg))
            try:
                vc = self._engine_config(t2)
                m3, n3 = vc.model_config.quantization, type(vc.quant_config).__name__
                r.add("config", "hf_quant_config.json alone (no quantization_config)", "ModelConfig", f"{m3}/{n3}",
                      "info", None, "what vLLM would read if config.json lost its quantization_config")
            except Exception as e:
                r.add("config", "hf_quant_config.json alone (no quantization_config)", "ModelConfig",
                      f"raised {type(e).__name__}", "info", None, _short(e))
            hq = ckpt.hf_quant_config.get("quantization", ckpt.hf_quant_config)
            algo = hq.get("quant_algo")
            r.add("config", "hf_quant_config.json quant_algo", "-", str(algo), "consistent with fp8 block or absent",
                  algo in (None, "FP8_PB_WO", "FP8"), "stale MX metadata" if algo and "MX" in str(algo) else "")

    def _fallback_quant_config(self) -> None:
        from vllm.model_executor.layers.quantization import get_quantization_config

        try:
            qc = self.ckpt.quant_config or {}
            cls = get_quantization_config(qc.get("quant_method", "fp8"))
            self.quant_config = cls.from_config(qc)
            self.report.note(f"Fp8Config built directly with {cls.__name__}.from_config (EngineArgs failed)")
        except Exception as e:
            self.report.add("config", "quant config from_config", "-", f"raised {type(e).__name__}", "Fp8Config",
                            False, _short(e))

    # ---- model --------------------------------------------------------------------------

    def _ready(self) -> bool:
        return self.vllm_config is not None

    def _init_dist(self) -> None:
        import tempfile

        from vllm.distributed import parallel_state as ps

        if ps._WORLD is not None:
            return
        f = tempfile.NamedTemporaryFile(prefix="engine_check_dist_", delete=False)
        f.close()
        os.unlink(f.name)
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                            distributed_init_method=f"file://{f.name}", backend="gloo")
            ps.initialize_model_parallel(1, 1)

    def _stub_gpu(self) -> None:
        """Stub only what picks or runs GPU kernels (weights are never run through a GEMM here)."""
        import vllm.model_executor.layers.quantization.fp8 as fp8

        orig = fp8.select_fp8_moe_backend

        def select(*a, **k):
            try:
                return orig(*a, **k)
            except Exception as e:  # no FP8 MoE kernel on a CPU
                stub(f"vLLM select_fp8_moe_backend (FP8 MoE kernel choice; on CPU it raises: {_short(e, 90)})")
                return None, None

        fp8.select_fp8_moe_backend = select

        orig_lin = fp8.init_fp8_linear_kernel

        def init_linear(*a, **k):
            try:
                return orig_lin(*a, **k)
            except Exception as e:  # no block-FP8 GEMM kernel on this CPU
                stub(f"vLLM init_fp8_linear_kernel (block-FP8 GEMM kernel choice; here it raises: {_short(e, 110)})")
                return None

        fp8.init_fp8_linear_kernel = init_linear

    def build(self):
        import torch
        from vllm.config import set_current_vllm_config

        self._init_dist()
        self._stub_gpu()
        from vllm.model_executor.model_loader.utils import initialize_model

        with set_current_vllm_config(self.vllm_config):
            with torch.device("cpu"):
                model = initialize_model(vllm_config=self.vllm_config)
        return model

    # ---- b/d. per-module decision and loading ------------------------------------------

    def check_modules(self, mods: list[CkModule]) -> None:
        r = self.report
        model = None
        if self._ready() and self.build_model:
            try:
                model = self.build()
            except Exception as e:
                r.add("model", "initialize_model", ",".join(self.ckpt.architectures), f"raised {type(e).__name__}",
                      "model builds", False, _short(e, 200))
                traceback.print_exc()
        if model is None:
            r.note("model not built: decisions from the engine's is_layer_skipped with generic name rules (q/k/v->qkv_proj, "
                   "gate/up->gate_up_proj, *.experts.E.*->FusedMoE), assuming the model passes quant_config to every layer")
            self._decide_without_model(mods)
            self._load_single_layers(mods)
            return
        r.add("model", "initialize_model", type(model).__name__, "built on CPU", "model builds", True)
        self._model = model
        self._decide_with_model(model, mods)
        self._load_with_model(model, mods)

    def _owner_map(self, model) -> dict[str, Any]:
        return {n: m for n, m in model.named_modules() if getattr(m, "quant_method", None) is not None}

    def _map_name(self, model, weight_name: str) -> tuple[str, Any]:
        mapper = getattr(type(model), "hf_to_vllm_mapper", None)
        if mapper is None:
            return weight_name, None
        try:
            res = mapper._map_name_with_shard(weight_name)
        except Exception:
            res = (mapper.map_name(weight_name) if hasattr(mapper, "map_name") else weight_name, None)
        if res is None:
            return "", None
        return res

    def _owner(self, model, owners: dict[str, Any], m: CkModule) -> tuple[str, Any, EngineModule]:
        packed = dict(getattr(model, "packed_modules_mapping", {}) or DEFAULT_PACKED)
        wname = m.weight.name
        mapped, shard = self._map_name(model, wname)
        base = mapped[: -len(".weight")] if mapped.endswith(".weight") else mapped
        em = engine_module_for(base, {**DEFAULT_PACKED, **packed}, text_config(self.ckpt.config))
        if shard is not None and em.kind == "linear":
            em.shard = str(shard)
        p = em.prefix
        # nearest module with a quant_method: at p, below p (shortest), or above p
        below = sorted((n for n in owners if n == p or n.startswith(p + ".")), key=len)
        if below:
            return below[0], owners[below[0]], em
        parts = p.split(".")
        for i in range(len(parts) - 1, 0, -1):
            q = ".".join(parts[:i])
            if q in owners:
                return q, owners[q], em
        return "", None, em

    @staticmethod
    def _decision(qm) -> str:
        n = type(qm).__name__
        if "Unquantized" in n:
            return "unquantized"
        if "Fp8" in n and "KVCache" not in n:
            return "fp8"
        return n

    def _decide_with_model(self, model, mods: list[CkModule]) -> None:
        r = self.report
        owners = self._owner_map(model)
        self._owners = {}
        for m in mods:
            name, mod, em = self._owner(model, owners, m)
            self._owners[m.name] = (name, mod, em)
            if mod is None:
                try:
                    plain = model.get_submodule(em.prefix if em.kind != "moe" else m.name)
                except Exception:
                    plain = None
                if plain is not None and any(n == "weight" for n, _ in plain.named_parameters(recurse=False)):
                    self._row(m, f"{type(plain).__name__} (no quant_method)", "unquantized")
                else:
                    r.add("modules", m.name, "-", "no engine module", m.expected, False,
                          f"{self.engine} {type(model).__name__} has no layer for this tensor")
                continue
            qm = mod.quant_method
            dec = self._decision(qm)
            klass = f"{type(mod).__name__}/{type(qm).__name__}"
            self._row(m, klass, dec, f"-> {name}" if name != m.name else "")

    def _row(self, m: CkModule, klass: str, dec: str, note: str = "") -> None:
        if m.expected == "invalid":
            self.report.add("modules", m.name, klass, dec, "valid tensor", False, m.problem)
            return
        ok = dec == m.expected
        why = ""
        if not ok:
            why = ("engine quantizes a " + m.weight.dtype + " weight (garbage or load error)") if dec == "fp8" else \
                  ("engine treats an FP8 weight as unquantized: scales dropped (garbage)" if m.expected == "fp8" else "")
        self.report.add("modules", m.name, klass, dec, m.expected, ok, "; ".join(x for x in (why, note) if x))

    def _load_with_model(self, model, mods: list[CkModule]) -> None:
        import torch
        from vllm.config import set_current_vllm_config

        r = self.report
        loaded: set[str] = set()
        failures = 0
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            try:  # as the engine does: every tensor through one load_weights call
                loaded |= set(model.load_weights(self.ckpt.iter_weights()) or ())
                names: list[str] = []
            except Exception as e:
                failures += 1
                r.add("load", "model.load_weights(all tensors at once)", type(model).__name__, f"raised {type(e).__name__}",
                      "loads", False, _short(e, 140) + "; tensors retried one by one below")
                names = sorted(self.ckpt.tensors, key=_natural)
            # One tensor per call, so that one bad tensor does not hide the others.
            for name in names:
                try:
                    got = model.load_weights(iter([(name, self.ckpt.load(name))]))
                    loaded |= set(got or ())
                except Exception as e:
                    failures += 1
                    t = self.ckpt.tensors[name]
                    r.add("load", name, type(model).__name__ + ".load_weights", f"raised {type(e).__name__}", "loads",
                          False, f"{t.dtype} {list(t.shape)}: {_short(e, 110)}")
        if not failures:
            r.add("load", "model.load_weights(every tensor)", type(model).__name__, "loaded", "loads", True)
        # vLLM only tracks unloaded parameters for unquantized models by default; use its own tracker.
        try:
            from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

            DefaultModelLoader.track_weights_loading(None, model, set(loaded or ()), quantized=True)
            r.add("load", "every parameter loaded (track_weights_loading)", "DefaultModelLoader", "all loaded",
                  "all loaded", True)
        except ValueError as e:
            missing = sorted(re.findall(r"'([^']+)'", str(e)))
            for p in missing:
                r.add("load", p, "-", "not in checkpoint: left at its init value", "loaded", False,
                      "silently garbage (vLLM does not check quantized models)")
        except Exception as e:
            r.note(f"track_weights_loading unavailable: {_short(e)}")
        # values
        for m in mods:
            if m.expected != "fp8":
                continue
            name, mod, em = self._owners.get(m.name, ("", None, None))
            if mod is None or self._decision(mod.quant_method) != "fp8":
                continue
            try:
                self._compare(m, name, mod, em)
            except Exception as e:
                r.add("values", m.name, type(mod).__name__, f"compare raised {type(e).__name__}", "equal", False, _short(e))

    def _compare(self, m: CkModule, owner_name: str, mod, em: EngineModule) -> None:
        import torch

        w_ck = self.ckpt.load(m.weight.name)
        s_ck = self.ckpt.load(m.scale.name)
        params = dict(mod.named_parameters())
        if em.kind == "moe":
            self._compare_moe(m, owner_name, params, em, w_ck, s_ck)
            return
        W, S = params.get("weight"), params.get("weight_scale_inv")
        if W is None or S is None:
            self.report.add("values", m.name, type(mod).__name__, f"params {sorted(params)}", "weight + weight_scale_inv",
                            False)
            return
        off = self._shard_offset(mod, em)
        n = m.n
        w_eng = W.data[off: off + n]
        ok_bytes = w_eng.shape == w_ck.shape and torch.equal(w_eng.view(torch.uint8), w_ck.view(torch.uint8))
        rows = math.ceil(n / BLOCK)
        aligned = off % BLOCK == 0
        if aligned:
            s_eng = S.data[off // BLOCK: off // BLOCK + rows]
            ok_scale = s_eng.shape == s_ck.shape and torch.equal(s_eng, s_ck)
        else:
            ok_scale = False
        eff = dequant(W.data, S.data)[off: off + n]
        ref = dequant(w_ck, s_ck)
        ok_eff = eff.shape == ref.shape and torch.equal(eff, ref)
        err = "" if ok_eff else f"max |engine - checkpoint| = {(eff - ref).abs().max().item():.3g}" if eff.shape == ref.shape else "shape"
        shard = f"shard {em.shard} at row {off}" if em.shard is not None else ""
        self.report.add("values", m.name, type(mod).__name__, f"bytes {'=' if ok_bytes else '!='}, scale {'=' if ok_scale else '!='}",
                        "bytes =, scale =", ok_bytes and ok_scale,
                        "; ".join(x for x in (shard, "" if aligned else "shard does not start on a 128-row block") if x))
        self.report.add("values", m.name, type(mod).__name__, "dequantized equal" if ok_eff else "dequantized DIFFERS",
                        "dequantized equal", ok_eff, err)

    def _shard_offset(self, mod, em: EngineModule) -> int:
        if em.shard is None:
            return 0
        if em.shard in ("q", "k", "v") and hasattr(mod, "_get_shard_offset_mapping"):
            return int(mod._get_shard_offset_mapping(em.shard))
        sizes = getattr(mod, "output_sizes", None)
        if sizes is not None and len(sizes) > 1 and em.shard.isdigit():
            tp = getattr(mod, "tp_size", 1)
            return sum(sizes[: int(em.shard)]) // tp
        # a single-output layer the model fills by concatenating the shards itself (SGLang's
        # fused_qkv_a_proj_with_mqa): the shards follow each other in mapping order
        idx = {"q": 0, "k": 1, "v": 2}.get(em.shard, int(em.shard) if em.shard.isdigit() else 0)
        off = 0
        for sib in em.siblings[:idx]:
            t = self.ckpt.tensors.get(sib + ".weight")
            off += t.shape[-2] if t is not None else 0
        return off

    def _compare_moe(self, m: CkModule, owner_name: str, params: dict, em: EngineModule, w_ck, s_ck) -> None:
        import torch

        def find(suffix):
            c = [(k, v) for k, v in params.items() if k == suffix or k.endswith("." + suffix)]
            return c[0][1] if c else None

        role = em.shard
        wn, sn = ("w2_weight", "w2_weight_scale_inv") if role == "w2" else ("w13_weight", "w13_weight_scale_inv")
        W, S = find(wn), find(sn)
        if W is None or S is None:
            self.report.add("values", m.name, "FusedMoE", f"no {wn}/{sn} in {owner_name}", "present", False,
                            f"params: {sorted(params)[:6]}")
            return
        experts = [em.expert] if em.expert is not None else list(range(w_ck.shape[0]))
        bad_bytes = bad_scale = bad_eff = 0
        maxerr = 0.0
        for j, e in enumerate(experts):
            wc = w_ck if em.expert is not None else w_ck[j]
            sc = s_ck if em.expert is not None else s_ck[j]
            We, Se = W.data[e], S.data[e]
            eff_all = dequant(We, Se)
            if role == "w3":
                off = We.shape[0] // 2
            else:
                off = 0
            n = wc.shape[0]
            if not torch.equal(We[off: off + n].view(torch.uint8), wc.view(torch.uint8)):
                bad_bytes += 1
            blk = scale_block(Se.shape[0], Se.shape[1], We.shape[0], We.shape[1])
            if blk == (BLOCK, BLOCK):
                se = Se[off // BLOCK: off // BLOCK + sc.shape[0]]
                if off % BLOCK or se.shape != sc.shape or not torch.equal(se, sc):
                    bad_scale += 1  # an up shard that starts inside a block cannot have its own scales
            eff = eff_all[off: off + n]
            ref = dequant(wc, sc)
            if eff.shape != ref.shape or not torch.equal(eff, ref):
                bad_eff += 1
                if eff.shape == ref.shape:
                    d = (eff - ref).abs().max().item()
                    maxerr = d if math.isnan(d) else max(maxerr, d)
        blk = scale_block(S.shape[-2], S.shape[-1], W.shape[-2], W.shape[-1])
        if blk == (BLOCK, BLOCK):
            self.report.add("values", m.name, "FusedMoE " + wn,
                            f"bytes {'!=' if bad_bytes else '='}, scale {'!=' if bad_scale else '='}",
                            "bytes =, scale =", not bad_bytes and not bad_scale)
        else:
            self.report.add("values", m.name, "FusedMoE " + wn, f"bytes {'!=' if bad_bytes else '='}",
                            "bytes =", not bad_bytes,
                            f"engine refined the scale grid to {blk}: scales compared through the dequantized weight")
        self.report.add("values", m.name, "FusedMoE " + wn, "dequantized equal" if not bad_eff else "dequantized DIFFERS",
                        "dequantized equal", not bad_eff,
                        (f"max err {maxerr:.3g}" + (" (engine holds NaN: never written)" if math.isnan(maxerr) else ""))
                        if bad_eff else "")

    # ---- fallback without the model ------------------------------------------------------

    def _decide_without_model(self, mods: list[CkModule]) -> None:
        qc = self.quant_config
        if qc is None:
            return
        packed = dict(DEFAULT_PACKED)
        if self.model_cls is not None:
            packed.update(getattr(self.model_cls, "packed_modules_mapping", {}) or {})
        qc.packed_modules_mapping = packed
        from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

        for m in mods:
            em = engine_module_for(m.name, packed, text_config(self.ckpt.config))
            if em.kind == "embedding":
                self._row(m, "VocabParallelEmbedding(rule)", "unquantized")
                continue
            try:
                skipped = is_layer_skipped(em.prefix, list(qc.ignored_layers or []), fused_mapping=packed,
                                           match_mode=getattr(qc, "ignored_layers_match_mode", "exact"))
                dec = "unquantized" if skipped else "fp8"
            except Exception as e:
                dec = f"raised {type(e).__name__}: {_short(e, 60)}"
            self._row(m, ("FusedMoE" if em.kind == "moe" else "LinearBase") + "(is_layer_skipped)", dec,
                      f"-> {em.prefix} (quant_config assumed passed by the model)")

    def _load_single_layers(self, mods: list[CkModule]) -> None:
        """Without the model: one real QKVParallelLinear and one RowParallelLinear with the engine's
        Fp8Config, filled through their own weight_loader (FusedMoE is not built outside a model)."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

        r, qc = self.report, self.quant_config
        if self.vllm_config is None or qc is None:
            r.note("single-layer load check not run (no engine config)")
            return
        by = {m.name: m for m in mods if m.expected == "fp8" and m.weight.shape.__len__() == 2}
        q = next((m for m in by.values() if m.name.endswith(".q_proj")), None)
        row = next((m for m in by.values() if re.search(r"\.(o_proj|down_proj)$", m.name) and ".experts." not in m.name), None)
        self._stub_gpu()
        self._init_dist()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            if q is not None:
                base = q.name[: -len("q_proj")]
                k, v = by.get(base + "k_proj"), by.get(base + "v_proj")
                tc = text_config(self.ckpt.config)
                hd = tc.get("head_dim") or q.n // max(1, tc.get("num_attention_heads", 1))
                if k is not None and v is not None and hd:
                    try:
                        layer = QKVParallelLinear(q.k, hd, q.n // hd, k.n // hd, bias=False, quant_config=qc,
                                                  prefix=base + "qkv_proj")
                        for sid, m in (("q", q), ("k", k), ("v", v)):
                            for pn, t in (("weight", m.weight.name), ("weight_scale_inv", m.scale.name)):
                                p = getattr(layer, pn)
                                p.weight_loader(p, self.ckpt.load(t), sid)
                        for sid, m in (("q", q), ("k", k), ("v", v)):
                            self._compare(m, base + "qkv_proj", layer, EngineModule(base + "qkv_proj", "linear", sid))
                    except Exception as e:
                        r.add("values", base + "qkv_proj", "QKVParallelLinear", f"raised {type(e).__name__}", "loads",
                              False, _short(e))
            if row is not None:
                try:
                    layer = RowParallelLinear(row.k, row.n, bias=False, quant_config=qc, prefix=row.name)
                    for pn, t in (("weight", row.weight.name), ("weight_scale_inv", row.scale.name)):
                        p = getattr(layer, pn)
                        p.weight_loader(p, self.ckpt.load(t))
                    self._compare(row, row.name, layer, EngineModule(row.name, "linear", None))
                except Exception as e:
                    r.add("values", row.name, "RowParallelLinear", f"raised {type(e).__name__}", "loads", False, _short(e))
        r.note("model not built: single QKVParallelLinear/RowParallelLinear layers loaded through their weight_loader; "
               "FusedMoE is not built outside a model, so experts were not load-checked")

    # ---- c. TP block-shape validation ---------------------------------------------------

    def check_tp(self, mods: list[CkModule]) -> None:
        from types import SimpleNamespace
        from unittest import mock

        import vllm.distributed as vd
        from vllm.model_executor.layers.quantization.utils import fp8_utils

        r = self.report
        qc = self.quant_config
        block = list(getattr(qc, "weight_block_size", None) or [BLOCK, BLOCK])
        packed = dict(DEFAULT_PACKED)
        mc = self._model_class()
        if mc is not None:
            packed.update(getattr(mc, "packed_modules_mapping", {}) or {})
        groups = merged_layers(mods, packed, self.ckpt.config)
        refine_kinds(groups, getattr(self, "_model", None))
        try:
            from vllm.model_executor.layers.fused_moe.oracle.fp8 import refine_fp8_moe_block_shape
        except Exception:
            refine_fp8_moe_block_shape = None
        for tp in self.tps:
            for g in _dedupe_layers(groups):
                sizes, insize = per_rank(g, tp)
                if g.kind == "moe":
                    ispp = g.moe_intermediate / tp if g.moe_intermediate % tp else g.moe_intermediate // tp
                    what = f"I/tp={_fmt_sizes([ispp])}"
                    try:
                        if not float(ispp).is_integer():
                            raise ValueError(f"moe_intermediate_size {g.moe_intermediate} not divisible by tp {tp}")
                        refined = None
                        if refine_fp8_moe_block_shape is not None:
                            cfg = SimpleNamespace(intermediate_size_per_partition=int(ispp), tp_size=tp, hidden_dim=g.hidden)
                            refined = refine_fp8_moe_block_shape(cfg, block)
                        if refined is not None:
                            r.add(f"tp={tp}", g.prefix, "FusedMoE", f"loads, block refined to {refined}", "loads", True,
                                  f"{what}; validation only, Triton MoE kernels only (refine_fp8_moe_block_shape); see the load rows")
                            continue
                        with mock.patch.object(vd, "get_tensor_model_parallel_world_size", lambda: tp):
                            fp8_utils.validate_fp8_block_shape_moe(int(ispp), block)
                        r.add(f"tp={tp}", g.prefix, "FusedMoE", "loads", "loads", True, what)
                    except ValueError as e:
                        r.add(f"tp={tp}", g.prefix, "FusedMoE", "rejected", "loads", False, f"{what}: {_short(e, 90)}")
                    continue
                split = _linear_split(r, g, tp, sizes, insize)
                if split is None:
                    continue
                klass, eff_tp, sizes = split
                layer = SimpleNamespace(tp_size=eff_tp, prefix=g.prefix,
                                        quant_config=SimpleNamespace(weight_block_size=block),
                                        output_partition_sizes=sizes)
                mismatch = False
                if g.kind in ("qkv", "merged"):
                    from vllm.model_executor.layers.linear import ColumnParallelLinear

                    ColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch(layer)
                    mismatch = bool(getattr(layer, "allow_fp8_block_shape_mismatch", False))
                out_global = sum(sizes) * eff_tp if g.kind != "row" else sum(sizes)
                in_global = insize * eff_tp if g.kind == "row" else insize
                what = f"per rank {_fmt_sizes(sizes)} x {insize}"
                try:
                    with mock.patch.object(vd, "get_tensor_model_parallel_world_size", lambda: eff_tp):
                        fp8_utils.validate_fp8_block_shape(layer, in_global, out_global, int(insize), sizes, block)
                except ValueError as e:
                    r.add(f"tp={tp}", g.prefix, klass, "rejected", "loads", False, f"{what}: {_short(e, 90)}")
                    continue
                if mismatch and not aligned_offsets_ok(sizes):
                    r.add(f"tp={tp}", g.prefix, klass, "loads (validation skipped: shard mismatch allowed)", "loads, aligned",
                          False, f"{what}: a shard starts inside a 128-row scale block -> wrong scales, silently")
                else:
                    r.add(f"tp={tp}", g.prefix, klass, "loads", "loads", True, what)

    def _model_class(self):
        if self.model_cls is not None:
            return self.model_cls
        try:
            from vllm.model_executor.models import ModelRegistry

            for a in self.ckpt.architectures:
                try:
                    self.model_cls = ModelRegistry._try_load_model_cls(a)
                except Exception:
                    self.model_cls = None
                if self.model_cls is not None:
                    break
        except Exception:
            pass
        return self.model_cls


def refine_kinds(groups: list[Merged], model) -> None:
    """Take each layer's parallel style from the built model where it has the layer (e.g. DeepSeek's
    fused_qkv_a_proj is a MergedColumnParallelLinear with disable_tp: replicated on every rank)."""
    if model is None:
        return
    for g in groups:
        try:
            mod = model.get_submodule(g.prefix)
        except Exception:
            continue
        cls = type(mod).__name__
        g.klass = cls
        if g.kind == "moe":
            continue
        if "Replicated" in cls or getattr(mod, "disable_tp", False) or cls == "GateLinear":
            g.kind = "replicated"
            if len(getattr(mod, "output_sizes", None) or [0]) <= 1 and len(g.shard_sizes) > 1:
                g.shard_sizes = [sum(g.shard_sizes)]  # one output: the engine fuses the shards itself
        elif "RowParallel" in cls:
            g.kind = "row"
        elif g.kind == "row" and "Column" in cls:
            g.kind = "column"


def _dedupe_layers(groups: list[Merged]) -> list[Merged]:
    """One representative per distinct shape (layers repeat)."""
    seen: dict[tuple, Merged] = {}
    for g in groups:
        key = (re.sub(r"\.\d+\.", ".N.", g.prefix), g.kind, g.klass, tuple(g.shard_sizes), g.input_size, g.heads, g.moe_intermediate)
        seen.setdefault(key, g)
    out = []
    for key, g in seen.items():
        out.append(Merged(key[0], g.kind, g.shard_sizes, g.input_size, g.heads, g.moe_intermediate, g.hidden, g.klass))
    return out


def _link_tree(src: Path, dst: Path, skip: set[str]) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).symlink_to(f.resolve())


def _short(e: BaseException | str, n: int = 140) -> str:
    s = str(e).replace("\n", " ")
    if not s and isinstance(e, BaseException) and e.__traceback__ is not None:
        tb = traceback.extract_tb(e.__traceback__)[-1]
        s = f"{type(e).__name__} at {Path(tb.filename).name}:{tb.lineno} ({tb.line})"
    return s if len(s) <= n else s[: n - 3] + "..."


# --------------------------------------------------------------------------------------
# SGLang
# --------------------------------------------------------------------------------------


def _stub_vllm_custom_ops() -> None:
    """SGLang's CPU rotary embedding imports ``vllm._custom_ops`` (a CUDA extension): stub that module only."""
    import types

    if "vllm" in sys.modules:
        return
    pkg, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")

    def _kernel(*a, **k):
        raise RuntimeError("engine_check stub: vllm._custom_ops kernels are not available")

    ops.__getattr__ = lambda name: _kernel  # type: ignore[attr-defined]
    pkg._custom_ops = ops  # type: ignore[attr-defined]
    pkg.__path__ = []  # type: ignore[attr-defined]
    sys.modules["vllm"], sys.modules["vllm._custom_ops"] = pkg, ops
    stub("SGLang: `vllm._custom_ops` (imported by SGLang's RotaryEmbedding on CPU; CUDA kernels, never called here)")


class SglangCheck(VllmCheck):
    engine = "sglang"

    def __init__(self, ckpt: Checkpoint, report: Report, tps: list[int], build_model: bool) -> None:
        self.ckpt, self.report, self.tps, self.build_model = ckpt, report, tps, build_model
        import warnings

        warnings.filterwarnings("ignore")
        import sglang

        self.version = sglang.__version__
        self.quant_config = None
        self.model_config = None
        self.server_args = None
        self.model_cls = None
        self.build_errors: list[str] = []

    def _model_config(self, path: Path):
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.server_args import ServerArgs

        sa = ServerArgs(model_path=str(path), device="cpu", skip_tokenizer_init=True)
        return sa, ModelConfig.from_server_args(sa)

    def _quant(self, mc):
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.model_loader.loader import _get_quantization_config

        return _get_quantization_config(mc, LoadConfig())

    def check_config(self) -> None:
        r, ckpt = self.report, self.ckpt
        try:
            sa, mc = self._model_config(ckpt.path)
            qcfg = self._quant(mc)
        except Exception as e:
            r.add("config", "quantization_config", "ModelConfig", f"raised {type(e).__name__}", "fp8 / Fp8Config", False,
                  _short(e))
            return
        self.server_args, self.model_config, self.quant_config = sa, mc, qcfg
        name = type(qcfg).__name__ if qcfg is not None else "None"
        r.add("config", "quant method (ModelConfig)", "ModelConfig", str(mc.quantization), "fp8", mc.quantization == "fp8")
        r.add("config", "quant config class (_get_quantization_config)", name, name, "Fp8Config", name == "Fp8Config")
        if name == "Fp8Config":
            wbs = list(qcfg.weight_block_size or [])
            r.add("config", "weight_block_size", name, str(wbs), "[128, 128]", wbs == [128, 128])
            r.add("config", "activation_scheme", name, str(qcfg.activation_scheme), "dynamic",
                  qcfg.activation_scheme == "dynamic")
            r.add("config", "use_mxfp8", name, str(getattr(qcfg, "use_mxfp8", False)), "False",
                  not getattr(qcfg, "use_mxfp8", False))
            ign = list(qcfg.ignored_layers or [])
            wild = [x for x in ign if any(c in x for c in "*?[")]
            r.add("config", "ignored_layers (as parsed)", name, json.dumps(ign)[:80], "dotted module paths", not wild,
                  f"SGLang matches dotted paths, no patterns: {wild} never match" if wild else "")
        if ckpt.hf_quant_config is not None:
            import tempfile

            with tempfile.TemporaryDirectory(prefix="engine_check_") as tmp:
                t = Path(tmp) / "no_hfq"
                _link_tree(ckpt.path, t, skip={"hf_quant_config.json"})
                try:
                    _, mc2 = self._model_config(t)
                    q2 = self._quant(mc2)
                    same = (mc2.quantization, type(q2).__name__) == (mc.quantization, name)
                    r.add("config", "hf_quant_config.json present vs removed", "ModelConfig",
                          f"{mc.quantization}/{name} vs {mc2.quantization}/{type(q2).__name__}", "same", same)
                except Exception as e:
                    r.add("config", "hf_quant_config.json removed", "ModelConfig", f"raised {type(e).__name__}", "same",
                          False, _short(e))
                t2 = Path(tmp) / "only_hfq"
                _link_tree(ckpt.path, t2, skip={"config.json"})
                cfg = dict(ckpt.config)
                cfg.pop("quantization_config", None)
                (t2 / "config.json").write_text(json.dumps(cfg))
                try:
                    _, mc3 = self._model_config(t2)
                    r.add("config", "hf_quant_config.json alone (no quantization_config)", "ModelConfig",
                          str(mc3.quantization), "info", None, "what SGLang would read if config.json lost it")
                except Exception as e:
                    r.add("config", "hf_quant_config.json alone (no quantization_config)", "ModelConfig",
                          f"raised {type(e).__name__}", "info", None, _short(e))

    def _init_runtime(self) -> None:
        import tempfile

        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(self.server_args)
        publish(self.server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=None))
        if ps._WORLD is None:
            f = tempfile.mktemp(prefix="engine_check_dist_")
            ps.init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                            distributed_init_method=f"file://{f}")
            ps.initialize_model_parallel()

    def build(self):
        import torch
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.layers.quantization import fp8 as sfp8
        from sglang.srt.model_loader.loader import _initialize_model

        _stub_vllm_custom_ops()
        self._init_runtime()
        orig = sfp8.Fp8LinearMethod.validate_block_quant_shapes
        errors = self.build_errors

        def validate(layer, *a, **k):
            try:
                return orig(layer, *a, **k)
            except ValueError as e:  # record, and build on so that the rest can be checked
                sizes = k.get("output_partition_sizes", a[5] if len(a) > 5 else "?")
                errors.append(f"{type(layer).__name__} shards {sizes}: {e}")

        orig_moe = sfp8.Fp8MoEMethod.create_fp8_moe_weight_

        def create_moe(layer, *a, **k):
            try:
                return orig_moe(layer, *a, **k)
            except ValueError as e:
                # The MoE block check is inline; record it, then rebuild with only that check bypassed
                # (the "aiter padding == block" exemption, without aiter's padding of the sizes).
                errors.append(f"{type(layer).__name__} layer {getattr(layer, 'layer_id', '?')}: {e}")
                saved = (sfp8._use_aiter, sfp8.get_moe_padding_size, sfp8.get_moe_weight_sizes)
                bn = (self.quant_config.weight_block_size or [BLOCK])[0]
                sfp8._use_aiter = True
                sfp8.get_moe_padding_size = lambda *_a, **_k: bn
                sfp8.get_moe_weight_sizes = lambda *aa, **kk: saved[2](*aa, **{**kk, "is_aiter_moe": False})
                try:
                    return orig_moe(layer, *a, **k)
                finally:
                    sfp8._use_aiter, sfp8.get_moe_padding_size, sfp8.get_moe_weight_sizes = saved

        sfp8.Fp8LinearMethod.validate_block_quant_shapes = staticmethod(validate)
        sfp8.Fp8MoEMethod.create_fp8_moe_weight_ = staticmethod(create_moe)
        try:
            with torch.device("cpu"):
                model = _initialize_model(self.model_config, LoadConfig(), self.quant_config)
        finally:
            sfp8.Fp8LinearMethod.validate_block_quant_shapes = staticmethod(orig)
            sfp8.Fp8MoEMethod.create_fp8_moe_weight_ = staticmethod(orig_moe)
        for err in errors:
            self.report.add("model", err.split(":")[0], "Fp8 block-shape check",
                            "REJECTS (model build fails)", "accepts", False, _short(err.split(":", 1)[1].strip(), 110))
        if errors:
            self.report.note("SGLang refuses to build this model (rows above); the check went on with that validation "
                             "recorded instead of raised, to examine the rest")
        return model

    def _ready(self) -> bool:
        return self.model_config is not None

    def _load_single_layers(self, mods: list[CkModule]) -> None:
        self.report.note("SGLang: model not built, so no load check (decisions and TP rules only)")

    def _map_name(self, model, weight_name: str):
        return weight_name, None

    def _load_with_model(self, model, mods: list[CkModule]) -> None:
        import torch

        r = self.report
        # Poison every parameter, so that what the loader did not write is visible.
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype.is_floating_point and p.element_size() >= 2:
                    p.data.fill_(float("nan"))
                elif p.element_size() == 1:
                    p.data.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
        failures = 0
        with torch.no_grad():
            try:  # as the engine does: every tensor through one load_weights call
                model.load_weights(self.ckpt.iter_weights())
                names: list[str] = []
            except Exception as e:
                failures += 1
                r.add("load", "model.load_weights(all tensors at once)", type(model).__name__, f"raised {type(e).__name__}",
                      "loads", False, _short(e, 140) + "; tensors retried one by one below")
                names = sorted(self.ckpt.tensors, key=_natural)
            for name in names:
                try:
                    model.load_weights(iter([(name, self.ckpt.load(name))]))
                except Exception as e:
                    failures += 1
                    t = self.ckpt.tensors[name]
                    r.add("load", name, type(model).__name__ + ".load_weights", f"raised {type(e).__name__}", "loads",
                          False, f"{t.dtype} {list(t.shape)}: {_short(e, 110)}")
        if not failures:
            r.add("load", "model.load_weights(every tensor)", type(model).__name__, "loaded", "loads", True)
        bad = 0
        # KV-cache scales fall back to defaults when a checkpoint has none (vLLM's tracker exempts them too).
        kv = {f"{n}.{pn}" for n, mod in model.named_modules() if "KVCache" in type(getattr(mod, "quant_method", None)).__name__
              for pn, _ in mod.named_parameters(recurse=False)}
        for pname, p in model.named_parameters():
            if pname in kv or re.search(r"\.(k|v|q|prob)_scale$", pname):
                continue
            d = p.data
            if d.element_size() == 1:
                nan = d.view(torch.uint8) == 0x7F
            elif d.dtype.is_floating_point:
                nan = torch.isnan(d)
            else:
                continue
            if nan.all():
                bad += 1
                r.add("load", pname, "-", "never written by load_weights", "loaded", False, "silently garbage")
            elif nan.any() and d.element_size() != 1:
                bad += 1
                r.add("load", pname, "-", f"partly written ({int(nan.sum())} of {d.numel()} left)", "loaded", False)
        if not bad:
            r.add("load", "every parameter written", type(model).__name__, "all written", "all written", True)
        for m in mods:
            if m.expected != "fp8":
                continue
            name, mod, em = self._owners.get(m.name, ("", None, None))
            if mod is None or self._decision(mod.quant_method) != "fp8":
                continue
            try:
                self._compare(m, name, mod, em)
            except Exception as e:
                r.add("values", m.name, type(mod).__name__, f"compare raised {type(e).__name__}", "equal", False, _short(e))

    def _decide_without_model(self, mods: list[CkModule]) -> None:
        from sglang.srt.layers.quantization.utils import is_layer_skipped

        qc = self.quant_config
        if qc is None:
            return
        packed = dict(DEFAULT_PACKED)
        packed.update(getattr(qc, "packed_modules_mapping", {}) or {})
        for m in mods:
            em = engine_module_for(m.name, packed, text_config(self.ckpt.config))
            if em.kind == "embedding":
                self._row(m, "VocabParallelEmbedding(rule)", "unquantized")
                continue
            try:
                dec = "unquantized" if is_layer_skipped(em.prefix, list(qc.ignored_layers or []), fused_mapping=packed) else "fp8"
            except Exception as e:
                dec = f"raised {type(e).__name__}: {_short(e, 60)}"
            self._row(m, ("FusedMoE" if em.kind == "moe" else "LinearBase") + "(is_layer_skipped)", dec,
                      f"-> {em.prefix} (quant_config assumed passed by the model)")

    def check_tp(self, mods: list[CkModule]) -> None:
        from types import SimpleNamespace

        from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod

        r = self.report
        qc = self.quant_config
        block = list(getattr(qc, "weight_block_size", None) or [BLOCK, BLOCK])
        qcs = SimpleNamespace(weight_block_size=block)
        packed = dict(DEFAULT_PACKED)
        packed.update(getattr(qc, "packed_modules_mapping", {}) or {})
        groups = merged_layers(mods, packed, self.ckpt.config)
        refine_kinds(groups, getattr(self, "_model", None))
        for tp in self.tps:
            for g in _dedupe_layers(groups):
                sizes, insize = per_rank(g, tp)
                if g.kind == "moe":
                    ispp = g.moe_intermediate / tp
                    what = f"I/tp={_fmt_sizes([ispp])}"
                    # fp8.py Fp8MoEMethod.create_weights (inline in SGLang 0.5.23, no refinement):
                    # I/tp % block_n, and for tp > 1 I/tp % block_k.
                    ok = float(ispp).is_integer() and ispp % block[0] == 0 and (tp == 1 or ispp % block[1] == 0)
                    r.add(f"tp={tp}", g.prefix, "FusedMoE", "loads" if ok else "rejected", "loads", ok,
                          what + ("" if ok else f": not a multiple of {block[0]} (Fp8MoEMethod.create_weights)"))
                    continue
                split = _linear_split(r, g, tp, sizes, insize)
                if split is None:
                    continue
                klass, eff_tp, sizes = split
                layer = SimpleNamespace(tp_group=SimpleNamespace(world_size=eff_tp))
                out_global = sum(sizes) * eff_tp if g.kind != "row" else sum(sizes)
                in_global = int(insize) * eff_tp if g.kind == "row" else int(insize)
                what = f"per rank {_fmt_sizes(sizes)} x {insize}"
                try:
                    Fp8LinearMethod.validate_block_quant_shapes(layer, qcs, in_global, int(insize), out_global, sum(sizes),
                                                                sizes)
                    r.add(f"tp={tp}", g.prefix, klass, "loads", "loads", True, what)
                except ValueError as e:
                    r.add(f"tp={tp}", g.prefix, klass, "rejected", "loads", False, f"{what}: {_short(e, 90)}")


# --------------------------------------------------------------------------------------
# e. transformd's readiness against the engine's verdicts
# --------------------------------------------------------------------------------------


def compare_readiness(engine: str, out_dir: str, tps: list[int], report: Report) -> None:
    """transformd's readiness of ``out_dir`` for ``engine`` against the engine's own verdicts in ``report``."""
    try:
        from transformd.checkpoint import readiness_of_dir
    except Exception as e:  # transformd not installed in this venv
        report.note(f"transformd's readiness not compared: {_short(e, 80)}")
        return
    ours = readiness_of_dir(out_dir)[engine]
    said = f"(rules: {ours.rules_from})"
    general = [p for p in ours.problems if not re.match(r"TP [\d,]+: ", p)]
    loading_failures = [row for row in report.rows if row.section in ("load", "modules") and row.ok is False]
    for tp in tps:
        stopped = [row for row in report.rows if row.section == f"tp={tp}" and row.ok is False]
        engine_loads = not stopped and not loading_failures
        reasons = general + [p for p in ours.problems if re.match(rf"TP (\d+,)*{tp}(,\d+)*: ", p)]
        if tp in ours.loads_at:
            verdict = "loads"
        elif tp in ours.may_load_at:
            verdict = "may load"
        else:
            verdict = "does not load"
        if engine_loads:
            ok = verdict != "does not load" or None
            report.add("readiness", f"TP {tp}", "transformd readiness", verdict, "loads (as the engine)", ok,
                       said if ok else f"more conservative than the engine, without 'may load': {reasons[:1]}")
            continue
        report.add("readiness", f"TP {tp}", "transformd readiness", verdict, "does not load (as the engine)",
                   verdict == "does not load", said)
        for row in stopped:  # every module the engine stops at this TP size must have a reason of its own
            parent = re.sub(r"\.(\d+|N)(?=\.|$)", ".*", row.name).rsplit(".", 1)[0]
            named = any(parent + "." in p or parent + ":" in p for p in reasons) or bool(general)
            report.add("readiness", f"TP {tp}: {row.name}", "transformd readiness",
                       "names a reason" if named else "names no reason", "a reason for each", named,
                       "" if named else f"engine: {row.decision}, {row.note[:90]}")


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------


def run(engine: str, out_dir: str, tps: list[int], build_model: bool = True) -> Report:
    ckpt = Checkpoint(out_dir)
    report = Report()
    archs = ckpt.architectures
    known = [a for a in archs if a in KNOWN_ARCHS]
    if not known:
        report.note(f"architectures {archs} are not among those this script was tried on ({', '.join(sorted(KNOWN_ARCHS))}): "
                    "it relies on the engine's own model class; if the engine cannot build it, generic name rules "
                    "(q/k/v->qkv_proj, gate/up->gate_up_proj, *.experts.E.*->FusedMoE) are used instead")
    qc = ckpt.quant_config
    if not qc:
        report.add("config", "quantization_config", "-", "missing", "fp8 block config", False)
    mods = checkpoint_modules(ckpt)
    check_leftovers(ckpt, report)
    if engine == "vllm":
        chk: Any = VllmCheck(ckpt, report, tps, build_model)
    else:
        chk = SglangCheck(ckpt, report, tps, build_model)
    print(f"engine_check: {engine} {chk.version}, checkpoint {ckpt.path}, architectures {archs}, "
          f"{len(mods)} linear weights", flush=True)
    steps: list[tuple[str, Callable[[], None]]] = [
        ("config", chk.check_config),
        ("modules", lambda: chk.check_modules(mods)),
        ("tp", lambda: chk.check_tp(mods)),
        ("readiness", lambda: compare_readiness(engine, out_dir, tps, report)),
    ]
    for step, fn in steps:
        try:
            fn()
        except Exception as e:
            traceback.print_exc()
            report.add(step, f"({step} step)", "-", f"raised {type(e).__name__}", "runs", False, _short(e, 200))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    ap.add_argument("out_dir", help="a converted (block-FP8) checkpoint directory")
    ap.add_argument("--tp", type=int, nargs="+", default=[1], help="tensor-parallel sizes to validate (default 1)")
    ap.add_argument("--no-model", action="store_true",
                    help="do not instantiate the engine's model class (rule-based decisions only)")
    ap.add_argument("--full-table", action="store_true", help="one row per layer/expert (default: repeated rows merged)")
    args = ap.parse_args(argv)
    report = run(args.engine, args.out_dir, args.tp, build_model=not args.no_model)
    print()
    report.print(collapse=not args.full_table)
    if STUBS:
        print("\nstubbed (GPU-only):")
        for s in STUBS:
            print(f"  - {s}")
    if report.notes:
        print("\nnotes:")
        for n in report.notes:
            print(f"  - {n}")
    print(f"\nengine_check: {report.passed} passed, {report.failed} failed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
