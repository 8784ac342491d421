"""The output's tensor layout: the source's (``as-is``), or fused expert stacks written per expert (``per-expert``).

SGLang skips 3-D expert stacks in transformers 5's (HF-v5) fused naming when it loads a checkpoint, and loads
per-expert 2-D tensors (measured with its own loader, SGLang 0.5.23). For ``--engine sglang`` the stacks are
written as such: an MXFP8 pair ``P.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows, as transformers
5 chunks them) becomes ``P.experts.{e}.gate_proj.weight`` and ``P.experts.{e}.up_proj.weight`` ``[I, H]`` with their
``weight_scale_inv`` ``[I/128, ceil(H/128)]``; ``P.experts.down_proj`` ``[E, H, I]`` becomes
``P.experts.{e}.down_proj.weight`` ``[H, I]`` and its ``weight_scale_inv`` (``.weight`` after the stack's name is
accepted too).

No byte moves: in a row-major ``[E, N, K]`` stack each expert's matrix, and within it the gate rows and the up rows,
are contiguous byte ranges, and so are their 128x128 scale tiles when ``I`` is a multiple of 128 (a tile of 128 rows
never holds gate and up rows together). The split only renames those ranges in the shard's header: the data section
is byte for byte the fused conversion's (:class:`Split`, written through
:class:`transformd.safetensors_writer.SafetensorsWriter`'s ``groups``). A layer whose gate/up split would cut a
128-row tile (``I`` not a multiple of 128: no engine loads it as block FP8 anyway) stays fused, and readiness says
why. The layout changes the output's bytes, so it is part of the cache key (:class:`transformd.cache.Recipe`), where
a source has a fused stack (:func:`transformd.checkpoint.plan.source_layout`): for any other, SGLang's conversion is
the same entry as the other engines'.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..engines import Engine
from ..quant_config import TILE

__all__ = ["Layout", "Split", "expert_splits", "is_fused_stack", "layout_for"]

#: A fused expert stack's weight name: ``P.experts.gate_up_proj`` or ``P.experts.down_proj`` (``.weight`` optional).
_FUSED = re.compile(r"^(?P<layer>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<suffix>\.weight)?$")
#: Architectures whose ``gate_up_proj`` interleaves gate and up rows (or is stored transposed): never split.
_NOT_CHUNKED = ("GptOss",)


class Layout(str, enum.Enum):
    """How the output names and shapes the converted weights."""

    AS_IS = "as-is"  #: the source's names and shapes
    PER_EXPERT = "per-expert"  #: fused HF-v5 expert stacks as per-expert 2-D tensors (for SGLang)


def is_fused_stack(name: str) -> bool:
    """Whether ``name`` is that of a fused expert stack (``P.experts.gate_up_proj``, ``P.experts.down_proj``)."""
    return _FUSED.match(name) is not None


def layout_for(engine: Engine | str | None) -> Layout:
    """The layout ``engine`` loads right: per-expert tensors for SGLang, the source's for the others."""
    return Layout.PER_EXPERT if engine is not None and Engine(engine) is Engine.SGLANG else Layout.AS_IS


@dataclass(frozen=True)
class Split:
    """One converted fused stack written as per-expert tensors: the header entries that replace the stack's weight
    and its ``_scale_inv``, each as (name, shape) in the order of their bytes."""

    weight: tuple[tuple[str, tuple[int, ...]], ...]
    scale: tuple[tuple[str, tuple[int, ...]], ...]


def expert_splits(
    pairs: Iterable[tuple[str, tuple[int, ...]]], layout: Layout | str, architectures: Iterable[str] = ()
) -> dict[str, Split]:
    """``{weight name: Split}`` for the MXFP8 weights (name, shape) that ``layout`` writes per expert.

    A layer is split only as a whole: its ``gate_up_proj`` (when it has one) must have an even row count whose half
    is a multiple of 128, and its stacks must agree on the expert count.
    """
    if Layout(layout) is not Layout.PER_EXPERT or any(a.startswith(_NOT_CHUNKED) for a in architectures):
        return {}
    layers: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for name, shape in pairs:
        m = _FUSED.match(name)
        if m and len(shape) == 3:
            layers.setdefault(m["layer"], {})[m["proj"]] = (name, tuple(shape))
    out: dict[str, Split] = {}
    for layer, stacks in layers.items():
        if not _splittable(stacks):
            continue
        for proj, (name, (experts, n, k)) in stacks.items():
            out[name] = _split(layer, proj, experts, n, k)
    return out


def _splittable(stacks: Mapping[str, tuple[str, tuple[int, ...]]]) -> bool:
    if len({shape[0] for _, shape in stacks.values()}) != 1:
        return False
    gate_up = stacks.get("gate_up_proj")
    return gate_up is None or (gate_up[1][1] % 2 == 0 and (gate_up[1][1] // 2) % TILE == 0)


def _split(layer: str, proj: str, experts: int, n: int, k: int) -> Split:
    kt = -(-k // TILE)
    if proj == "gate_up_proj":
        half = n // 2
        names = [(f"{layer}.{e}.{p}.weight", half) for e in range(experts) for p in ("gate_proj", "up_proj")]
    else:
        names = [(f"{layer}.{e}.down_proj.weight", n) for e in range(experts)]
    return Split(
        weight=tuple((name, (rows, k)) for name, rows in names),
        scale=tuple((f"{name}_scale_inv", (-(-rows // TILE), kt)) for name, rows in names),
    )
