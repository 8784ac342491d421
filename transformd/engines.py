"""Who consumes the output: engine profiles, the platform, the target ``auto`` picks, and engine readiness.

No torch (the client and ``transformd inspect`` use it); the platform probe is :mod:`transformd.platform`.

**Target ``auto``** (shared/DESIGN.md, "Targets"): vLLM, SGLang and transformers allocate block-FP8 weights as
``float8_e4m3fn`` and normalise to FNUZ themselves on gfx94x, so they get ``ocp`` everywhere; ``raw``
consumers (``transformd.loader``, own kernels) get ``fnuz`` on gfx94x and ``ocp`` elsewhere; on GPUs with
native MX instructions (gfx950, NVIDIA compute capability 10.x and later) nothing is converted and the
source itself is served, as the engines' own MX paths expect. An explicit target always wins.

**Readiness**: block FP8 needs 128-alignment that MXFP8 does not (rules read from vLLM 0.33
``fp8_utils.validate_fp8_block_shape`` / ``linear.py`` and its MoE variant, SGLang 0.5.23
``fp8.py validate_block_quant_shapes`` and its MoE check, transformers 5 ``FineGrainedFP8``'s dequantize; the
versions each engine's rules were read from and checked against are :data:`RULES_FROM`, carried in every report).
:func:`readiness` computes, from the output's tensor shapes and the model config, at which tensor-parallel
sizes each engine loads the checkpoint correctly, and names every tensor and rule that stops the others. A
merged layer whose shards are not aligned is a *problem*, not a warning: vLLM then skips its check and loads
scales at the wrong rows, which computes garbage without an error. Where the engine may still load what the rules
refuse, under a condition (vLLM's Triton MoE refines the block of a rank's unaligned expert share), that TP size is
``may_load_at``, with the condition. Problems with which an engine loads the checkpoint *without an error* at every
TP size and computes garbage are also its ``misloads``: a conversion that names no engine refuses a checkpoint any
engine misloads (:func:`misloaded_by`), since whoever loads it would never be told.

**Which engine**: ``--engine``, else :data:`ENGINE_ENV` (set once in the engine's container). It is not guessed from
the calling process: the start-up hook runs before the engine (``vllm serve "$(transformd resolve ...)"``: its
parent is a shell, the engine does not exist yet), so no process says which engine will load the output.
"""

from __future__ import annotations

import enum
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .platform import Platform
from .quant_config import FP8_DTYPES, kv_cache_fp8
from .quant_config import TILE as BLOCK

#: The environment variable that names the engine when ``--engine`` is not given (set it in the engine's container).
ENGINE_ENV = "TRANSFORMD_ENGINE"
#: Per engine, the releases its rules were read from, and those the opt-in engine check (tests/engines/) ran them
#: against with the engine's own code (results in tests/engines/RESULTS.md).
RULES_FROM = {
    "vllm": "vLLM 0.33.0 (read); engine check: 0.33.0, 0.34.0",  # 0.34.0: tests/engines/RESULTS.md
    "sglang": "SGLang 0.5.23 (read); engine check: 0.5.23",
    "transformers": "transformers 5 FineGrainedFP8 (read)",
}
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
    #: TP sizes at which it may load, under the conditions named in ``conditions`` (each with its TP sizes)
    may_load_at: list[int] = field(default_factory=list)
    conditions: list[str] = field(default_factory=list)
    #: the problems with which it loads without an error at every TP size, and computes garbage
    misloads: list[str] = field(default_factory=list)
    rules_from: str = ""  #: the engine releases the rules were read from and checked against (:data:`RULES_FROM`)

    @property
    def loads(self) -> bool:
        """At some TP size, or may (under a condition)."""
        return bool(self.loads_at or self.may_load_at)

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
    out = EngineReadiness(engine.value, rules_from=RULES_FROM.get(engine.value, ""))
    if engine is Engine.TRANSFORMERS:
        tp_sizes = [1]  # transformers loads on one process here; its dequantize needs whole 128x128 tiles
    blocked: dict[int, list[str]] = {tp: [] for tp in tp_sizes}
    conditional: dict[int, list[str]] = {tp: [] for tp in tp_sizes}
    general: list[str] = []
    renamers = SCALE_RENAMING_LOADERS.get(engine.value, frozenset())
    for arch in m.architectures:
        if arch in renamers:
            general.append(
                f"{engine.value}'s loader for {arch} renames every weight_scale_inv to weight_scale, so the block "
                "scales are never loaded (the model computes garbage without an error; no layout of the output "
                "changes that)"
            )
            out.misloads.append(general[-1])
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
    fused, silent = _fused_expert_problems(engine, m)
    general += fused
    out.misloads += silent
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
            blocked[tp] += _tp_problems(engine, m, tp, conditional[tp])
    for tp in tp_sizes:
        if not general and not blocked[tp]:
            (out.may_load_at if conditional[tp] else out.loads_at).append(tp)
    out.problems = general + _by_problem(blocked)
    out.conditions = _by_problem({tp: c for tp, c in conditional.items() if tp in out.may_load_at})
    return out


def _fused_expert_problems(engine: Engine, m: _Model) -> tuple[list[str], list[str]]:
    """3-D FP8 expert stacks: what each engine's loader makes of them (measured with the engines' own code), as
    (problems, those of them it loads without an error)."""
    if not m.fused_experts:
        return [], []
    first = _NUMBERED.sub(".*.", m.fused_experts[0])
    if engine is Engine.TRANSFORMERS:
        silent = [
            f"{first}: transformers 5 loads FP8 expert stacks in fused HF-v5 naming without applying their "
            "*_scale_inv (measured with FineGrainedFP8Config(dequantize=True): values off by the scale, no error)"
        ]
        return silent, silent
    if engine is Engine.SGLANG:
        silent = [f"{first}: SGLang 0.5.23 skips fused expert stacks when loading (the experts stay unloaded, no "
                  "error); --engine sglang writes them as per-expert tensors, which it loads, where the gate/up split "
                  f"falls on {BLOCK}-row tiles"]
        return silent, silent
    with_suffix = [name for name in m.fused_experts if name.endswith(".weight")]
    if engine is Engine.VLLM and with_suffix:
        return [
            f"{_NUMBERED.sub('.*.', with_suffix[0])}: vLLM 0.33 reads fused expert stacks only in HF-v5 naming "
            "(experts.gate_up_proj, no .weight); with .weight it fails to start"
        ], []
    return [], []


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


def _tp_problems(engine: Engine, m: _Model, tp: int, conditions: list[str]) -> list[str]:
    """What stops ``engine`` at TP ``tp``; what it may load under a condition goes into ``conditions``."""
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
                problems += _moe_problems(engine, f"{layer}.experts", leaves, tp, conditions)
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
        for s, size in zip(present, check):  # every shard that is not aligned (each is a reason of its own)
            if size % BLOCK:
                problems.append(
                    f"{parent}.{s}: {size} rows per rank (of {fused} {'/'.join(present)}) is not a multiple of {BLOCK}"
                )
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


def _moe_problems(engine: Engine, layer: str, leaves: dict[str, tuple[int, ...]], tp: int,
                  conditions: list[str]) -> list[str]:
    """Every rank's share of the MoE intermediate size must be a multiple of 128 (vLLM: or its Triton MoE refines
    the block, a condition)."""
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
        hidden = next((shape[-2] for leaf, shape in leaves.items() if (leaf.rpartition(".")[2] or leaf) in EXPERT_DOWN),
                      BLOCK)
        refine = math.gcd(BLOCK, per_rank, hidden)
        said = f"{layer}: MoE intermediate size per rank {per_rank} (= {inter} / {tp}) is not a multiple of {BLOCK}"
        if engine is Engine.VLLM and refine >= 32:  # vLLM fused_moe/oracle/fp8.py refine_fp8_moe_block_shape
            conditions.append(f"{said}: with vLLM's Triton MoE, which refines the block scales to {refine}x{refine} "
                              "(its automatic MoE backend choice; other MoE backends need whole 128-row blocks)")
            return []
        return [said]
    return []


def readiness_line(loads_at: Sequence[int], problems: Sequence[str], may_load_at: Sequence[int] = ()) -> str:
    """For people, one engine's readiness in one line: ``loads at TP 1,2``, ``loads at TP 1; may load at TP 2``, or
    ``does not load: <its first problem>`` (:func:`readiness_lines` has every reason).

    Takes the fields, so a report read back from the API's JSON prints the same as one computed here.
    """
    said = [f"loads at TP {','.join(map(str, loads_at))}"] if loads_at else []
    if may_load_at:
        said.append(f"may load at TP {','.join(map(str, may_load_at))}")
    if said:
        return "; ".join(said)
    return f"does not load: {problems[0]}" if problems else "does not load"


def readiness_lines(r: Mapping[str, Any] | EngineReadiness) -> list[str]:
    """For people, every verdict of one engine's readiness: its :func:`readiness_line`, then each reason it does
    not load at a TP size (every one), each "may load, with ..." condition, and where the rules come from."""
    get = r.get if isinstance(r, Mapping) else lambda key, default=None: getattr(r, key, default)
    loads_at, problems = list(get("loads_at") or []), [str(p) for p in get("problems") or []]
    may, conditions = list(get("may_load_at") or []), [str(c) for c in get("conditions") or []]
    lines = [readiness_line(loads_at, problems, may)]
    below = problems if (loads_at or may) else problems[1:]
    lines += [f"  does not load: {p}" if loads_at or may else f"  and: {p}" for p in below]
    lines += [f"  may load, {c.replace(': with ', ', with ', 1)}" for c in conditions]
    if get("rules_from"):
        lines.append(f"  (rules: {get('rules_from')})")
    return lines


def misloaded_by(report: Mapping[str, EngineReadiness | Mapping[str, Any]]) -> dict[str, list[str]]:
    """Per engine of ``report``, the problems with which it loads the checkpoint without an error (garbage)."""
    out = {}
    for name, r in report.items():
        silent = r.get("misloads") if isinstance(r, Mapping) else r.misloads
        if silent:
            out[name] = [str(p) for p in silent]
    return out


def loaders_of(report: Mapping[str, EngineReadiness | Mapping[str, Any]]) -> list[str]:
    """The engines of ``report`` that load the checkpoint at some TP size (or may)."""
    def loads(r: Any) -> bool:
        return bool(r.get("loads_at") or r.get("may_load_at")) if isinstance(r, Mapping) else bool(
            r.loads_at or r.may_load_at)
    return [name for name, r in report.items() if loads(r)]


def engine_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The engine :data:`ENGINE_ENV` names (None when unset or empty); a value that is no engine is refused."""
    value = (os.environ if environ is None else environ).get(ENGINE_ENV, "").strip()
    if not value:
        return None
    if value not in {e.value for e in Engine}:
        raise ValueError(f"{ENGINE_ENV}={value[:40]!r} is not an engine: one of {', '.join(e.value for e in Engine)}")
    return value


def unnamed_refusal(report: Mapping[str, EngineReadiness | Mapping[str, Any]],
                    per_expert: Mapping[str, EngineReadiness | Mapping[str, Any]] | None = None,
                    *, shapes: bool = True) -> str | None:
    """Why a conversion that names no engine is refused (None: it is not): some engine of ``report`` would load the
    output without an error and compute garbage. Says which engines load it and how to name one; ``per_expert``:
    the readiness of the per-expert layout (what ``--engine sglang`` writes), when the source has fused stacks;
    ``shapes`` false: ``report`` was made without the tensors' shapes (:func:`~transformd.checkpoint.plan.
    misloads_of_source`), so the engines it does not fault are named as candidates, each checked once named."""
    silent = misloaded_by(report)
    if not silent:
        return None
    wrong = "; ".join(f"{name}: {problems[0]}" for name, problems in silent.items())
    loaders = [name for name in loaders_of(report) if name not in silent]
    if per_expert is not None and Engine.SGLANG.value in silent and Engine.SGLANG.value in loaders_of(per_expert):
        loaders.append(Engine.SGLANG.value)
    names = [f"--engine {name}" for name in loaders] + ["--engine raw (transformd.loader or your own kernels)"]
    if not shapes:
        which = f"{', '.join(loaders)} may load it (each is checked once named)" if loaders else "no engine loads it"
    else:
        which = (f"{', '.join(loaders)} load{'s' if len(loaders) == 1 else ''} it" if loaders
                 else "no checked engine loads it")
    return (f"no engine named, and an engine would load this checkpoint wrong without an error ({wrong}); {which}. "
            f"Name the engine that will load it: {', '.join(names)}, or set {ENGINE_ENV} in its container")
