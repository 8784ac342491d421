"""Who consumes the output: engine profiles, the platform, the target ``auto`` picks, and engine readiness.

No torch (the client and ``transformd inspect`` use it); the platform probe is :mod:`transformd.platform`.

**Target ``auto``** (shared/DESIGN.md, "Targets"): vLLM, SGLang and transformers allocate block-FP8 weights as
``float8_e4m3fn`` and normalise to FNUZ themselves on gfx94x, so they get ``ocp`` everywhere; ``raw``
consumers (``transformd.loader``, own kernels) get ``fnuz`` on gfx94x and ``ocp`` elsewhere; on GPUs with
native MX instructions (gfx950, NVIDIA compute capability 10.x and later) nothing is converted and the
source itself is served, as the engines' own MX paths expect. An explicit target always wins.

**Readiness**: block FP8 needs 128-alignment that MXFP8 does not (rules read from vLLM 0.33
``fp8_utils.validate_fp8_block_shape`` / ``linear.py`` and its MoE variant, SGLang 0.5.23
``fp8.py validate_block_quant_shapes`` and its MoE check, transformers 5 ``FineGrainedFP8``'s dequantize).
:func:`readiness` computes, from the output's tensor shapes and the model config, at which tensor-parallel
sizes each engine loads the checkpoint correctly, and names the tensor and rule that stops the others. A
merged layer whose shards are not aligned is a *problem*, not a warning: vLLM then skips its check and loads
scales at the wrong rows, which computes garbage without an error.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .platform import Platform
from .quant_config import FP8_DTYPES, kv_cache_fp8
from .quant_config import TILE as BLOCK

#: Tensor-parallel sizes the readiness report checks by default.
TP_SIZES = (1, 2, 4, 8)

_NUMBERED = re.compile(r"\.\d+\.")

#: Merged (column-parallel) layers the engines build from separate checkpoint tensors, in shard order.
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: Row-parallel layers: their input (K) is split across ranks.
ROW_PARALLEL = ("o_proj", "down_proj")
#: Per-expert names of an MoE layer's projections: gate/up (split N) and down (split K).
EXPERT_GATE_UP = ("gate_proj", "up_proj", "w1", "w3", "gate_up_proj")
EXPERT_DOWN = ("down_proj", "w2")

#: Architectures whose loader renames ``weight_scale_inv`` to ``weight_scale`` and so drops every block scale
#: without an error (vLLM 0.33 ``models/minimax_m3``, ``mistral3.py``; SGLang 0.5.23 ``models/llama.py``, which
#: these inherit).
SCALE_RENAMING_LOADERS = {
    "vllm": frozenset(
        {
            "MiniMaxM3SparseForCausalLM",
            "MiniMaxM3SparseForConditionalGeneration",
            "MiniMaxM3ForConditionalGeneration",
            "Mistral3ForConditionalGeneration",
        }
    ),
    "sglang": frozenset(
        {
            "LlamaForCausalLM",
            "Phi3ForCausalLM",
            "InternLM3ForCausalLM",
            "IQuestCoderForCausalLM",
            "Llama4ForCausalLM",
            "MistralForCausalLM",
            "Ministral3ForCausalLM",
            "TeleFLMForCausalLM",
            "Mistral3ForConditionalGeneration",
        }
    ),
}


class Engine(str, enum.Enum):
    """Who loads the output."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TRANSFORMERS = "transformers"
    RAW = "raw"  #: transformd.loader or your own kernels: takes FNUZ directly


#: Values of ``--target``; ``auto`` is resolved by :func:`choose_target`.
TARGET_CHOICES = ("auto", "fnuz", "ocp")
#: The engines the readiness report covers.
CHECKED_ENGINES = (Engine.VLLM, Engine.SGLANG, Engine.TRANSFORMERS)


def choose_target(target: str, engine: Engine | str | None, platform: Platform) -> tuple[str | None, str]:
    """``(target, why)``: ``fnuz`` or ``ocp``, or None for "serve the MXFP8 source unconverted"."""
    if target != "auto":
        return target, f"target {target} asked for"
    engine = Engine(engine) if engine is not None else Engine.RAW
    where = platform.arch or (platform.vendor if platform.vendor != "none" else "a machine without a GPU")
    if platform.mx_native:
        return None, f"{where} has native MX instructions: the MXFP8 source is served unconverted"
    if engine is not Engine.RAW:
        return "ocp", f"{engine.value} loads block FP8 as e4m3fn (and normalises to FNUZ itself on gfx94x)"
    if platform.fnuz:
        return "fnuz", f"no engine named (raw: transformd.loader or own kernels) on {where}, FNUZ hardware"
    return "ocp", f"no engine named (raw: transformd.loader or own kernels) on {where}, no FNUZ hardware"


# -- readiness ---------------------------------------------------------------------------------------------------


@dataclass
class EngineReadiness:
    """Whether one engine loads the checkpoint right, per tensor-parallel size."""

    engine: str
    loads_at: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  #: each names the tensor, the rule and the TP sizes
    warnings: list[str] = field(default_factory=list)

    @property
    def loads(self) -> bool:
        return bool(self.loads_at)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Model:
    """What the rules need: FP8 weights by module, unquantized ones, and the attention geometry."""

    fp8: dict[str, tuple[int, ...]]  # module -> weight shape
    unquantized: frozenset[str]
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    architectures: tuple[str, ...]
    target: str | None
    fused_experts: tuple[str, ...] = ()  # 3-D FP8 expert stacks (``experts.gate_up_proj[.weight]``)
    kv_cache_fp8: bool = False  # the config asks for an FP8 KV cache (:func:`transformd.quant_config.kv_cache_fp8`)
    block_size: Any = (BLOCK, BLOCK)  # quantization_config.weight_block_size (as found; a config without one: ok)


def readiness(
    config: Mapping[str, Any],
    tensors: Iterable[tuple[str, str, Sequence[int]]],
    tp_sizes: Sequence[int] = TP_SIZES,
    engines: Sequence[Engine] = CHECKED_ENGINES,
) -> dict[str, EngineReadiness]:
    """Per engine: the TP sizes (of ``tp_sizes``) at which it loads a block-FP8 checkpoint right, and why not.

    ``tensors``: (name, safetensors dtype, shape) of the output; ``config``: its config.json.
    """
    model = _model(config, tensors)
    return {e.value: _engine_readiness(e, model, tp_sizes) for e in engines}


def _model(config: Mapping[str, Any], tensors: Iterable[tuple[str, str, Sequence[int]]]) -> _Model:
    fp8: dict[str, tuple[int, ...]] = {}
    unquantized: set[str] = set()
    fused: list[str] = []
    for name, dtype, shape in tensors:
        if len(shape) < 2 or name.endswith("_scale_inv"):
            continue
        module = name.removesuffix(".weight")
        if dtype in FP8_DTYPES:
            fp8[module] = tuple(shape)
            if len(shape) == 3:
                fused.append(name)
        elif name.endswith(".weight") or module.rpartition(".")[0].endswith("experts"):
            unquantized.add(module)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def num(key: str) -> int | None:
        value = config.get(key, text.get(key))
        return value if isinstance(value, int) and value > 0 else None

    heads, kv = num("num_attention_heads"), num("num_key_value_heads")
    head_dim = num("head_dim") or (num("hidden_size") // heads if heads and num("hidden_size") else None)
    archs = config.get("architectures")
    qc = config.get("quantization_config")
    record = qc.get("transformd") if isinstance(qc, dict) else None
    target = record.get("target") if isinstance(record, dict) else None
    return _Model(
        fp8,
        frozenset(unquantized),
        heads,
        kv or heads,
        head_dim,
        tuple(a for a in archs if isinstance(a, str)) if isinstance(archs, list) else (),
        target if isinstance(target, str) else None,
        tuple(sorted(fused)),
        kv_cache_fp8(config),
        qc.get("weight_block_size") if isinstance(qc, dict) else (BLOCK, BLOCK),
    )


def _engine_readiness(engine: Engine, m: _Model, tp_sizes: Sequence[int]) -> EngineReadiness:
    out = EngineReadiness(engine.value)
    if engine is Engine.TRANSFORMERS:
        tp_sizes = [1]  # transformers loads on one process here; its dequantize needs whole 128x128 tiles
    blocked: dict[int, list[str]] = {tp: [] for tp in tp_sizes}
    general: list[str] = []
    renamers = SCALE_RENAMING_LOADERS.get(engine.value, frozenset())
    for arch in m.architectures:
        if arch in renamers:
            general.append(
                f"{engine.value}'s loader for {arch} renames every weight_scale_inv to weight_scale, so the block "
                "scales are never loaded (the model computes garbage without an error)"
            )
    if engine is Engine.TRANSFORMERS and m.target == "fnuz":
        general.append("transformers has no float8_e4m3fnuz support: convert with --target ocp")
    elif engine in (Engine.VLLM, Engine.SGLANG) and m.target == "fnuz":
        out.warnings.append(
            f"{engine.value} value-casts F8_E4M3FNUZ weights into float8_e4m3fn parameters (16 codes change), "
            "and reads them only with safetensors >= 0.8 (older ones refuse the dtype); use --target ocp (or "
            "--engine, which picks it)"
        )
    if engine is Engine.VLLM and m.kv_cache_fp8:
        out.warnings.append(
            "the checkpoint asks for an FP8 KV cache (kv_cache_quant_algo FP8), which vLLM reads from a ModelOpt "
            "config only, not from an fp8 one: start it with --kv-cache-dtype fp8 to keep it (else its KV cache is "
            "in the model's dtype, twice the memory)"
        )
    if not (isinstance(m.block_size, list | tuple) and list(m.block_size) == [BLOCK, BLOCK]):
        general.append(  # (inspect of an edited config said "loads" of [0, 128], "x" or none: an attack review)
            f"quantization_config.weight_block_size is {m.block_size!r:.40}, not [{BLOCK}, {BLOCK}]: the "
            f"weight_scale_inv tensors hold one scale per {BLOCK}x{BLOCK} block, which {engine.value} reads as such "
            "only when the config says so"
        )
    general += _mixed_precision_problems(m)
    general += _fused_expert_problems(engine, m)
    if engine is Engine.TRANSFORMERS:
        for module, shape in sorted(m.fp8.items()):
            n, k = shape[-2:]
            if n % BLOCK or k % BLOCK:
                general.append(
                    f"{module}: weight {list(shape)} is not made of whole {BLOCK}x{BLOCK} tiles; transformers' "
                    "FP8 dequantize needs both of its last two dimensions to be multiples of 128"
                )
                break
    else:
        for tp in tp_sizes:
            blocked[tp] += _tp_problems(engine, m, tp)
    for tp in tp_sizes:
        if not general and not blocked[tp]:
            out.loads_at.append(tp)
    out.problems = general + _by_problem(blocked)
    return out


def _fused_expert_problems(engine: Engine, m: _Model) -> list[str]:
    """3-D FP8 expert stacks: what each engine's loader makes of them (measured with the engines' own code)."""
    if not m.fused_experts:
        return []
    first = _NUMBERED.sub(".*.", m.fused_experts[0])
    if engine is Engine.TRANSFORMERS:
        return [
            f"{first}: transformers 5 loads FP8 expert stacks in fused HF-v5 naming without applying their "
            "*_scale_inv (measured with FineGrainedFP8Config(dequantize=True): values off by the scale, no error)"
        ]
    if engine is Engine.SGLANG:
        return [f"{first}: SGLang 0.5.23 skips fused expert stacks when loading (the experts stay unloaded, no error)"]
    with_suffix = [name for name in m.fused_experts if name.endswith(".weight")]
    if engine is Engine.VLLM and with_suffix:
        return [
            f"{_NUMBERED.sub('.*.', with_suffix[0])}: vLLM 0.33 reads fused expert stacks only in HF-v5 naming "
            "(experts.gate_up_proj, no .weight); with .weight it fails to start"
        ]
    return []


def _by_problem(blocked: dict[int, list[str]]) -> list[str]:
    """One line per distinct problem (layers and experts folded into ``*``), with the TP sizes it stops."""
    sizes: dict[str, list[int]] = {}
    for tp, problems in blocked.items():
        for p in dict.fromkeys(_NUMBERED.sub(".*.", p) for p in problems):
            sizes.setdefault(p, []).append(tp)
    return [f"TP {','.join(map(str, tps))}: {p}" for p, tps in sizes.items()]


def _mixed_precision_problems(m: _Model) -> list[str]:
    """Merged layers and MoE layers must be all FP8 or all unquantized (vLLM raises, or treats a whole MoE
    layer as unquantized when one expert is listed)."""
    problems = []
    parents: dict[str, set[str]] = {}
    for module in [*m.fp8, *m.unquantized]:
        parent, _, leaf = module.rpartition(".")
        parents.setdefault(parent, set()).add(leaf)
    for parent, leaves in sorted(parents.items()):
        for fused, shards in MERGED.items():
            present = [s for s in shards if s in leaves]
            kinds = {f"{parent}.{s}" in m.fp8 for s in present}
            if len(kinds) > 1:
                problems.append(f"{parent}: {'/'.join(present)} (merged into {fused}) are partly FP8, partly not")
    moe: dict[str, set[bool]] = {}
    for module in [*m.fp8, *m.unquantized]:
        head, sep, _ = module.partition(".experts.")  # ".shared_experts." does not contain ".experts."
        if sep:
            moe.setdefault(head + ".experts", set()).add(module in m.fp8)
    problems += [f"{layer}: some experts are FP8 and some are not"
                 for layer, kinds in sorted(moe.items()) if len(kinds) > 1]
    return problems


def _tp_problems(engine: Engine, m: _Model, tp: int) -> list[str]:
    problems: list[str] = []
    parents: dict[str, dict[str, tuple[int, ...]]] = {}
    for module, shape in m.fp8.items():
        parent, _, leaf = module.rpartition(".")
        parents.setdefault(parent, {})[leaf] = shape
    moe_done: set[str] = set()
    for parent, leaves in sorted(parents.items()):
        layer, sep, rest = parent.partition(".experts")
        if sep and ".shared_experts" not in parent and (rest == "" or rest.startswith(".")):
            if layer not in moe_done:
                moe_done.add(layer)
                problems += _moe_problems(engine, f"{layer}.experts", leaves, tp)
            continue
        problems += _linear_problems(engine, m, parent, leaves, tp)
    return problems


def _linear_problems(engine: Engine, m: _Model, parent: str, leaves: dict[str, tuple[int, ...]], tp: int) -> list[str]:
    problems = []
    for fused, shards in MERGED.items():
        present = [s for s in shards if s in leaves]
        if not present:
            continue
        sizes = [_rank_rows(m, s, leaves[s][-2], tp) for s in present]
        if any(size is None for size in sizes):
            bad = present[sizes.index(None)]
            problems.append(f"{parent}.{bad}: {leaves[bad][-2]} rows do not split over {tp} ranks")
            continue
        # vLLM checks only when every shard is aligned (else it skips the check and loads the scales of the
        # shards after an unaligned one at the wrong rows); at TP 1 its last shard may be unaligned. SGLang
        # requires every shard to be aligned.
        check = sizes if (engine is Engine.SGLANG or tp > 1) else sizes[:-1]
        for s, size in zip(present, check):
            if size % BLOCK:
                problems.append(
                    f"{parent}.{s}: {size} rows per rank (of {fused} {'/'.join(present)}) is not a multiple of {BLOCK}"
                )
                break
    for leaf, shape in leaves.items():
        if any(leaf in shards for shards in MERGED.values()):
            continue
        if tp > 1 and leaf in ROW_PARALLEL:
            k = shape[-1]
            if k % tp or (k // tp) % BLOCK:
                problems.append(f"{parent}.{leaf}: input {k} / TP {tp} is not a multiple of {BLOCK} (row parallel)")
    return problems


def _rank_rows(m: _Model, shard: str, n: int, tp: int) -> int | None:
    """Rows of ``shard`` on one rank; k/v heads are replicated when there are fewer than ranks."""
    if shard in ("k_proj", "v_proj") and m.kv_heads and m.head_dim and n == m.kv_heads * m.head_dim:
        if m.kv_heads >= tp:
            return n // tp if m.kv_heads % tp == 0 else None
        return m.head_dim if tp % m.kv_heads == 0 else None
    return n // tp if n % tp == 0 else None


def _moe_problems(engine: Engine, layer: str, leaves: dict[str, tuple[int, ...]], tp: int) -> list[str]:
    """Every rank's share of the MoE intermediate size must be a multiple of 128."""
    inter = None
    for leaf, shape in leaves.items():
        name = leaf.rpartition(".")[2] or leaf
        if name in EXPERT_DOWN:
            inter = shape[-1]
        elif name == "gate_up_proj":
            inter = shape[-2] // 2
        elif name in EXPERT_GATE_UP and inter is None:
            inter = shape[-2]
    if inter is None:
        return []
    if inter % tp:
        return [f"{layer}: MoE intermediate size {inter} does not split over {tp} ranks"]
    per_rank = inter // tp
    if per_rank % BLOCK:
        note = ""
        if engine is Engine.VLLM and math.gcd(BLOCK, per_rank) >= 32:
            note = " (vLLM's Triton MoE may refine the block, other backends refuse)"
        return [f"{layer}: MoE intermediate size per rank {per_rank} (= {inter} / {tp}) "
                f"is not a multiple of {BLOCK}{note}"]
    return []


def readiness_line(loads_at: Sequence[int], problems: Sequence[str]) -> str:
    """For people, one engine's readiness: ``loads at TP 1,2``, or ``does not load: <its first problem>``.

    Takes the fields, so a report read back from the API's JSON prints the same as one computed here.
    """
    if loads_at:
        return f"loads at TP {','.join(map(str, loads_at))}"
    return f"does not load: {problems[0]}" if problems else "does not load"

