"""Plan a conversion: read and check everything but tensor data (see :mod:`transformd.checkpoint`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ..engines import CHECKED_ENGINES, Engine, EngineReadiness, readiness, unnamed_refusal
from ..errors import CheckpointError, MxFormatError
from ..formats import Target, check_pair_geometry, infer_row_block, tile_grid
from ..quant_config import output_quantization_config, quark_row_block, unquantized_modules
from ..progress import human_bytes
from ..readahead import INDEX_NAME
from ..safetensors_header import Header, TensorInfo, read_header, tensor_nbytes
from .layout import Layout, Split, expert_splits, is_fused_stack, layout_for

CONFIG_NAME = "config.json"
HF_QUANT_NAME = "hf_quant_config.json"
#: Largest config.json, hf_quant_config.json or index read (an index of 100,000 tensors is about 10 MB): a
#: larger one is refused before it is read, not parsed into memory many times its size.
MAX_JSON_BYTES = 64 << 20
SINGLE_SHARD_NAME = "model.safetensors"
#: Scale names of an MXFP8 weight ``W`` (``X.weight``, or ``X`` in fused HF-v5 naming): ``W<suffix>``.
SCALE_SUFFIXES = ("_scale_inv", "_scale")
#: safetensors dtypes that hold E8M0 scale bytes.
E8M0_DTYPES = ("U8", "F8_E8M0")
#: safetensors dtype of MXFP8 weight codes.
MX_CODE_DTYPE = "F8_E4M3"
#: Output scale name ``W_scale_inv`` (``X.weight_scale_inv``; multiply to dequantize), as the engines' block-FP8
#: layers name it.
OUT_SCALE_SUFFIX = "_scale_inv"


# -------------------------------------------------------------------------------------------------------------------
# Plan


@dataclass(frozen=True)
class MxPair:
    """One MXFP8 weight and its E8M0 scale (possibly in another shard).

    Named ``X.weight`` + ``X.weight_scale`` / ``X.weight_scale_inv``, or, in fused HF-v5 expert naming,
    ``X`` + ``X_scale_inv`` / ``X_scale`` (``mlp.experts.gate_up_proj``); the converted scale is
    ``<weight name>_scale_inv`` either way (``X.weight_scale_inv``, ``X_scale_inv``). ``row_block`` rows share
    one row of scales: 1 for MXFP8's 1x32 blocks, R for AMD Quark's ``per_block`` Rx32 blocks.
    """

    weight: TensorInfo
    weight_shard: str
    scale: TensorInfo
    scale_shard: str
    row_block: int = 1

    @property
    def module(self) -> str:
        return self.weight.name.removesuffix(".weight")

    @property
    def out_scale_name(self) -> str:
        return self.weight.name + OUT_SCALE_SUFFIX

    @property
    def out_scale_shape(self) -> tuple[int, ...]:
        *lead, n, k = self.weight.shape
        return (*lead, *tile_grid(n, k))


@dataclass(frozen=True)
class ShardPlan:
    """What happens to one shard: which pairs are converted in it, which scales leave it."""

    name: str
    header: Header
    pairs: tuple[MxPair, ...]
    dropped: frozenset[str]
    #: Converted fused expert stacks of this shard written per expert (:mod:`.layout`), by weight name.
    splits: Mapping[str, Split] = field(default_factory=dict)

    @property
    def rewrite(self) -> bool:
        """False: the shard is copied as it is, without parsing its data."""
        return bool(self.pairs or self.dropped)


@dataclass(frozen=True)
class ConversionPlan:
    """Everything known about a checkpoint before a byte is written (see :func:`plan_conversion`)."""

    src: Path
    config: dict[str, Any]
    hf_quant_config: dict[str, Any] | None
    index: dict[str, Any] | None
    shards: tuple[ShardPlan, ...]
    selected: tuple[MxPair, ...]
    select: str | None
    other_files: tuple[Path, ...]
    left_out: tuple[Path, ...] = ()
    layout: str = Layout.AS_IS.value  #: :class:`.layout.Layout` of the output

    # Cached: every progress report reads them, and summing thousands of weights each time held the interpreter
    # lock from the conversion's threads (0.8 s of 5 s converting 8 GiB on the H200).
    @cached_property
    def tensor_count(self) -> int:
        return sum(len(s.header.tensors) for s in self.shards)

    @cached_property
    def data_bytes(self) -> int:
        """Tensor bytes of all shards (headers not counted): the total that progress reports count up to."""
        return sum(s.header.data_bytes for s in self.shards)

    @cached_property
    def convert_bytes(self) -> int:
        """Code bytes of the MXFP8 weights to convert (``Progress.convert_bytes_total``)."""
        return sum(p.weight.nbytes for p in self.selected)



def plan_conversion(src: str | os.PathLike[str], *, select: str | None = None,
                    layout: Layout | str = Layout.AS_IS) -> ConversionPlan:
    """Read and check everything but tensor data; raise :class:`CheckpointError` or :class:`MxFormatError`.

    Errors name the file, the tensor and the problem. ``layout`` (:mod:`.layout`): ``per-expert`` writes fused
    expert stacks as per-expert tensors (for SGLang).
    """
    layout = Layout(layout)
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError("is not a directory" if src.exists() else "does not exist", file=src)
    select_re = _compile_select(select)
    config = load_json(src / CONFIG_NAME, required=True)
    if records_a_conversion(config):  # (its shards would say so too; this says it plainly)
        raise CheckpointError("records a transformd conversion (quantization_config.transformd): this is block-FP8 "
                              "output already, for an engine to load as it is; its MXFP8 source is what converts",
                              file=src / CONFIG_NAME)
    hf_quant = load_json(src / HF_QUANT_NAME, required=False)
    index, shard_names = _shard_layout(src)
    headers = {name: read_header(src / name) for name in shard_names}
    if index is not None:
        _check_index(src, index, headers)
    tensors = {t.name: (shard, t) for shard, h in headers.items() for t in h.tensors.values()}
    pairs = _find_pairs(src, tensors, quark_row_block(config))
    if not pairs:
        raise CheckpointError(
            "no MXFP8 weights: found no F8_E4M3 weight (X.weight, or X in fused expert naming) with a U8/F8_E8M0 "
            "scale (X.weight_scale, X.weight_scale_inv, X_scale_inv); nothing to convert",
            file=src,
        )
    if select_re is not None:
        left = [p.weight.name for p in pairs if select_re.search(p.weight.name) is None]
        if len(left) == len(pairs):
            raise CheckpointError(f"--select {select!r} matches none of the {len(pairs)} MXFP8 weights", file=src)
        if left:
            raise CheckpointError(
                f"--select {select!r} leaves {len(left)} of the {len(pairs)} MXFP8 weights unconverted (first: "
                f"{left[0]}); a block-FP8 checkpoint cannot carry MXFP8 tensors (engines would read them as block "
                "FP8 without an error), so every MXFP8 weight must be selected",
                file=src,
            )
    for pair in pairs:
        _check_pair(src, pair, tensors)
    shards = tuple(_plan_shard(name, headers[name], pairs) for name in shard_names)
    skip = {CONFIG_NAME, HF_QUANT_NAME, INDEX_NAME, *shard_names}
    other_files = list(_other_files(src, skip))
    # Weights the index does not reference (e.g. a stale model.safetensors next to an index) are not converted;
    # carrying them would hand loaders an MXFP8 copy (transformers prefers model.safetensors over an index).
    left_out = [f for f in other_files if f.parent == Path(".") and f.suffix == ".safetensors"]
    plan = ConversionPlan(
        src=src,
        config=config,
        hf_quant_config=hf_quant,
        index=index,
        shards=shards,
        selected=tuple(pairs),
        select=select,
        other_files=tuple(f for f in other_files if f not in left_out),
        left_out=tuple(left_out),
    )
    return with_layout(plan, layout)


def source_layout(src: str | os.PathLike[str], engine: Engine | str | None) -> Layout:
    """The layout of ``engine``'s output for the checkpoint ``src``: per-expert for SGLang when ``src`` has a fused
    expert stack (named in its index, or in its single shard's header), else as-is: without a stack to split the bytes
    are as-is's, and so is the cache key (one entry for every engine). A source that cannot be read says so later."""
    layout = layout_for(engine)
    if layout is Layout.AS_IS:
        return layout
    try:
        index, shard_names = _shard_layout(Path(src))
        names = index["weight_map"] if index is not None else read_header(Path(src) / shard_names[0]).tensors
    except (CheckpointError, MxFormatError, OSError, ValueError):
        return layout
    return layout if any(is_fused_stack(name) for name in names) else Layout.AS_IS


def misloads_of_source(src: str | os.PathLike[str]) -> dict[str, EngineReadiness]:
    """What each engine would load wrong without an error whatever the shapes (``misloads`` of the readiness report;
    its other fields are not meaningful): from config.json and the tensor names alone (the index, or the single
    shard's header), for a request that names no engine, without a plan of every header."""
    src = Path(src)
    config = load_json(src / CONFIG_NAME, required=True)
    index, shard_names = _shard_layout(src)
    names = set(index["weight_map"] if index is not None else read_header(src / shard_names[0]).tensors)
    stacks = [(name, "F8_E4M3", (1, 1, 1)) for name in sorted(names)
              if is_fused_stack(name) and any(name + suffix in names for suffix in SCALE_SUFFIXES)]
    return readiness({**config, "quantization_config": {"weight_block_size": [128, 128]}}, stacks)


def with_layout(plan: ConversionPlan, layout: Layout | str) -> ConversionPlan:
    """``plan`` writing the output in ``layout`` (:mod:`.layout`); nothing is read."""
    layout = Layout(layout)
    archs = plan.config.get("architectures") if isinstance(plan.config.get("architectures"), list) else []
    splits = expert_splits(((p.weight.name, p.weight.shape) for p in plan.selected), layout,
                           [a for a in archs if isinstance(a, str)])
    names = {t.name: shard.name for shard in plan.shards for t in shard.header.tensors.values()}
    for split in splits.values():
        for name, _ in (*split.weight, *split.scale):
            if name in names:
                raise CheckpointError(f"{name}: the per-expert layout would write this name, which the checkpoint "
                                      "holds already", file=plan.src / names[name])
    shards = tuple(dataclasses.replace(s, splits={p.weight.name: splits[p.weight.name] for p in s.pairs
                                                  if p.weight.name in splits}) for s in plan.shards)
    return dataclasses.replace(plan, shards=shards, layout=layout.value)


def plan_readiness(plan: ConversionPlan, target: Target | str) -> dict[str, EngineReadiness]:
    """Engine readiness of the output ``plan`` will write (from shapes and config alone; nothing is read)."""
    target = Target(target)
    specs = [spec for shard in plan.shards for spec in output_specs(target, shard)]
    qc = output_quantization_config(plan.config, plan.hf_quant_config, unquantized_modules(specs),
                                    {"target": target.value})  # (as it will be written)
    return readiness({**plan.config, "quantization_config": qc}, specs)


def readiness_of_dir(path: str | os.PathLike[str]) -> dict[str, EngineReadiness]:
    """Engine readiness of a block-FP8 checkpoint directory, from its config.json and shard headers."""
    path = Path(path)
    config = load_json(path / CONFIG_NAME, required=True)
    _, shard_names = _shard_layout(path)
    specs = [(t.name, t.dtype, t.shape) for name in shard_names for t in read_header(path / name).tensors.values()]
    return readiness(config, specs)


def check_engine(report: dict[str, EngineReadiness], engine: Engine | str | None, src: Path,
                 plan: ConversionPlan | None = None, target: Target | str | None = None) -> None:
    """Refuse a conversion that the named engine could not load at any TP size (``raw``: no check); with no engine
    named, one that any engine would load wrong without an error (:func:`transformd.engines.unnamed_refusal`;
    ``plan`` and ``target``, when given, let the message say whether ``--engine sglang``'s layout loads)."""
    if engine is None:
        per_expert = None
        if plan is not None and target is not None and plan.layout == Layout.AS_IS.value:
            split = with_layout(plan, Layout.PER_EXPERT)
            per_expert = plan_readiness(split, target) if any(s.splits for s in split.shards) else None
        refusal = unnamed_refusal(report, per_expert)
        if refusal is not None:
            raise CheckpointError(refusal, file=src)
        return
    if Engine(engine) not in CHECKED_ENGINES:
        return
    r = report[Engine(engine).value]
    if not r.loads:
        problems = "; ".join(r.problems[:3]) + (f"; and {len(r.problems) - 3} more" if len(r.problems) > 3 else "")
        raise CheckpointError(f"{r.engine} could not load the converted checkpoint at any TP size: {problems}",
                              file=src)


def _compile_select(select: str | None) -> Any:
    """``select`` compiled for linear-time matching (:mod:`transformd.selectre`), or None."""
    if select is None:
        return None
    from ..selectre import SelectError, compile_select

    try:
        return compile_select(select)
    except SelectError as err:
        raise CheckpointError(f"--select {select[:200]!r} is refused: {err}") from None


def records_a_conversion(config: dict[str, Any] | None) -> bool:
    """Whether a config.json (its dict) is a transformd output's: ``quantization_config.transformd`` records it."""
    qc = (config or {}).get("quantization_config")
    return isinstance(qc, dict) and isinstance(qc.get("transformd"), dict)


def load_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    """A config or index JSON object, read through checked reads: a regular file (never a FIFO waited on), at most
    :data:`MAX_JSON_BYTES`, not nested past the parser's depth; :class:`CheckpointError` naming the file otherwise."""
    if not path.exists():
        if required:
            raise CheckpointError("is missing; an HF checkpoint directory needs it", file=path)
        return None
    if not path.is_file():  # a FIFO would block the read forever; a directory or device is no JSON file either
        raise CheckpointError("is not a regular file", file=path)
    try:
        # O_NONBLOCK, then fstat: a file swapped for a FIFO after the check above is refused, never waited on
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError("is not a regular file", file=path)
            raw = f.read(MAX_JSON_BYTES + 1)  # (the size checked on what is read: a file may grow meanwhile)
            if max(st.st_size, len(raw)) > MAX_JSON_BYTES:
                raise CheckpointError(f"is {human_bytes(max(st.st_size, len(raw)))}, above the limit of "
                                      f"{human_bytes(MAX_JSON_BYTES)} for a config or index file", file=path)
            data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad UTF-8/JSON, integers past the digit limit
        raise CheckpointError(f"cannot be read as JSON: {str(err)[:200]}", file=path) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"holds a JSON {type(data).__name__}, not an object", file=path)
    return data


def _shard_layout(src: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """(index or None, shard file names in order)."""
    index = load_json(src / INDEX_NAME, required=False)
    if index is None:
        if not (src / SINGLE_SHARD_NAME).is_file():
            raise CheckpointError(f"has neither {INDEX_NAME} nor {SINGLE_SHARD_NAME}", file=src)
        return None, [SINGLE_SHARD_NAME]
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError("has no weight_map object (or it is empty)", file=src / INDEX_NAME)
    if not isinstance(index.get("metadata", {}), (dict, type(None))):  # rewritten (total_size) in the output
        raise CheckpointError("has a metadata entry that is not an object", file=src / INDEX_NAME)
    checked: set[str] = set()  # each shard file is checked once, not once per tensor (thousands per shard)
    for name, shard in weight_map.items():
        if isinstance(shard, str) and shard in checked:
            continue
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            problem = f"maps to {shard!r}, which is not a file name in the directory"
            raise CheckpointError(problem, file=src / INDEX_NAME, tensor=name)
        if shard.startswith("."):  # hidden names are never read (nor identified, nor carried over)
            problem = f"maps to {shard!r}, a hidden name; shards must not start with '.'"
            raise CheckpointError(problem, file=src / INDEX_NAME, tensor=name)
        if not (src / shard).is_file():
            raise CheckpointError(f"maps to {shard}, which does not exist", file=src / INDEX_NAME, tensor=name)
        checked.add(shard)
    return index, sorted(checked)


def _check_index(src: Path, index: dict[str, Any], headers: dict[str, Header]) -> None:
    """Every index entry must be in the shard it names, and every shard tensor in the index."""
    weight_map: dict[str, str] = index["weight_map"]
    for name, shard in weight_map.items():
        if name not in headers[shard].tensors:
            problem = f"{INDEX_NAME} places this tensor here, but the shard does not hold it"
            raise CheckpointError(problem, file=src / shard, tensor=name)
    for shard, header in headers.items():
        for name in header.tensors:
            if weight_map.get(name) != shard:
                where = f"places it in {weight_map[name]}" if name in weight_map else "does not list it"
                problem = f"shard holds this tensor, but {INDEX_NAME} {where}"
                raise CheckpointError(problem, file=src / shard, tensor=name)


def _find_pairs(src: Path, tensors: dict[str, tuple[str, TensorInfo]], row_block_hint: int | None) -> list[MxPair]:
    """Every MXFP8 pair, checked; any F8_E4M3 or E8M0 tensor that is not part of a valid pair raises.

    An output that says ``fp8`` must hold nothing MX and no FP8 weight without its block scale: engines would
    read either as block FP8 and compute garbage without a word.
    """
    scales_of: dict[str, list[tuple[str, TensorInfo]]] = {}
    for name, (shard, t) in tensors.items():
        if t.dtype in E8M0_DTYPES:
            suffix = next((x for x in SCALE_SUFFIXES if name.endswith(x)), None)
            if suffix is not None:
                scales_of.setdefault(name.removesuffix(suffix), []).append((shard, t))
    for weight_name, found in sorted(scales_of.items()):
        if weight_name not in tensors:
            shard, scale = found[0]
            problem = f"E8M0 scale without its weight {weight_name}"
            raise CheckpointError(problem, file=src / shard, tensor=scale.name)
    pairs = []
    for name in sorted(set(scales_of) | {n for n, (_, t) in tensors.items() if t.dtype == MX_CODE_DTYPE}):
        pairs.append(_pair_of(src, name, tensors, scales_of.get(name, []), row_block_hint))
    return pairs


def _pair_of(
    src: Path,
    weight_name: str,
    tensors: dict[str, tuple[str, TensorInfo]],
    e8m0: list[tuple[str, TensorInfo]],
    row_block_hint: int | None,
) -> MxPair:
    """The pair of ``weight_name`` (which has an E8M0 scale or F8_E4M3 codes); raise when it is not a valid one."""
    w_shard, w = tensors[weight_name]

    def fail(problem: str, shard: str = w_shard, tensor: str = weight_name) -> CheckpointError:
        return CheckpointError(problem, file=src / shard, tensor=tensor)

    names = " or ".join(weight_name + x for x in SCALE_SUFFIXES)
    if w.dtype != MX_CODE_DTYPE:
        raise fail(
            f"weight is {w.dtype}, but its scale {e8m0[0][1].name} is E8M0: MXFP8 weights are {MX_CODE_DTYPE} "
            "(other MX formats, e.g. packed MXFP4, are not supported)"
        )
    if len(e8m0) > 1:
        raise fail(f"weight has two E8M0 scales, {' and '.join(t.name for _, t in e8m0)}")
    if not e8m0:
        other = next((tensors[weight_name + x] for x in SCALE_SUFFIXES if weight_name + x in tensors), None)
        if other is None:
            raise fail(f"{MX_CODE_DTYPE} weight without its scale (looked for an E8M0 {names}); not an MXFP8 weight")
        shard, scale = other
        raise fail(
            f"{MX_CODE_DTYPE} weight whose scale {scale.name} is {scale.dtype} {list(scale.shape)}, not E8M0 "
            f"({' or '.join(E8M0_DTYPES)}): not an MXFP8 weight, and transformd writes only pure block-FP8 "
            "checkpoints"
        )
    s_shard, s = e8m0[0]
    row_block = 1  # when no R fits, the shape check of _check_pair names the expected 1x32 shape
    if len(w.shape) >= 2 and len(s.shape) == len(w.shape) and s.shape[-2] != w.shape[-2]:
        n, rows = w.shape[-2], s.shape[-2]
        hinted = row_block_hint if row_block_hint and -(-n // row_block_hint) == rows else None
        row_block = hinted or infer_row_block(n, rows) or 1
    return MxPair(w, w_shard, s, s_shard, row_block)


def _check_pair(src: Path, pair: MxPair, tensors: dict[str, tuple[str, TensorInfo]]) -> None:
    """Shapes by the contract's own check (the dtypes made it a pair; no data); and no name clash on output."""
    try:
        check_pair_geometry(pair.weight.shape, pair.scale.shape, pair.row_block)
    except MxFormatError as err:
        raise err.located(tensor=pair.weight.name, file=str(src / pair.weight_shard)) from None
    if pair.weight.numel == 0:  # the header may declare any number of empty experts; there is nothing to convert
        problem = f"weight {list(pair.weight.shape)} has no elements"
        raise MxFormatError(problem, tensor=pair.weight.name, file=str(src / pair.weight_shard))
    clash = tensors.get(pair.out_scale_name)
    if clash is not None and clash[1].name != pair.scale.name:
        raise CheckpointError(
            f"the converted scale of {pair.weight.name} would be named {pair.out_scale_name}, but the input already "
            f"has a {clash[1].dtype} tensor of that name",
            file=src / clash[0],
            tensor=pair.out_scale_name,
        )


def _plan_shard(name: str, header: Header, selected: list[MxPair]) -> ShardPlan:
    return ShardPlan(
        name=name,
        header=header,
        pairs=tuple(p for p in selected if p.weight_shard == name),
        dropped=frozenset(p.scale.name for p in selected if p.scale_shard == name),
    )


def _other_files(src: Path, skip: set[str]) -> Iterator[Path]:
    """Files to carry over, relative to ``src``: everything but the shards, index and configs; no dot-names.

    Symlinks to files are followed (as in an HF cache snapshot); anything that is not a regular file
    then (a FIFO, which would block the copy forever, a device, a socket, a broken link) is refused.
    """
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel_root = Path(root).relative_to(src)
        for f in sorted(files):
            rel = rel_root / f
            if f.startswith(".") or (rel_root == Path(".") and f in skip):
                continue
            try:
                mode = os.stat(src / rel).st_mode
            except OSError as err:
                raise CheckpointError(f"cannot be read ({err.strerror}; a broken symlink?)", file=src / rel) from None
            if not stat.S_ISREG(mode):
                problem = "is not a regular file (a FIFO, device or socket); cannot carry it over"
                raise CheckpointError(problem, file=src / rel)
            yield rel




#: Added to the estimate of the output's size: the rewritten config/index files and directory entries.
_OUTPUT_SLACK_BYTES = 1 << 20


def output_bytes(plan: ConversionPlan, target: Target | str = Target.FNUZ) -> int:
    """About how many bytes :func:`convert_checkpoint` writes for ``plan``: every output shard (tensor data at its
    output size, headers as in the input plus the new scale names), the files carried over, and some slack."""
    target = Target(target)
    total = _OUTPUT_SLACK_BYTES
    for shard in plan.shards:
        if not shard.rewrite:
            total += shard.header.file_size
            continue
        header = shard.header.file_size - shard.header.data_bytes
        parts = sum(len(split.weight) + len(split.scale) for split in shard.splits.values())
        data = sum(tensor_nbytes(d, s) for _, d, s in output_specs(target, shard))
        total += header + 96 * (len(shard.pairs) + parts) + data
    for rel in plan.other_files:
        with contextlib.suppress(OSError):
            total += os.stat(plan.src / rel).st_size
    for name in (CONFIG_NAME, HF_QUANT_NAME, INDEX_NAME):
        with contextlib.suppress(OSError):
            total += os.stat(plan.src / name).st_size
    return total



def output_specs(target: Target, shard: ShardPlan) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of the output shard's header, in the input's order; a new scale right after its weight (a
    split stack: its per-expert weights, then their scales, :mod:`.layout`)."""
    pairs = {p.weight.name: p for p in shard.pairs}
    for t in shard.header.tensors.values():
        if t.name in shard.dropped:
            continue
        pair = pairs.get(t.name)
        split = shard.splits.get(t.name)
        if pair is None:
            yield t.name, t.dtype, t.shape
        elif split is not None:
            yield from ((name, target.safetensors_dtype, shape) for name, shape in split.weight)
            yield from ((name, "F32", shape) for name, shape in split.scale)
        else:
            yield t.name, target.safetensors_dtype, t.shape
            yield pair.out_scale_name, "F32", pair.out_scale_shape


def output_groups(shard: ShardPlan) -> dict[str, tuple[str, ...]]:
    """The tensors the converter writes under one name (a split stack's weight and scale, :mod:`.layout`) ->
    the header entries their bytes fill, in order (:class:`transformd.safetensors_writer.SafetensorsWriter`)."""
    groups: dict[str, tuple[str, ...]] = {}
    for pair in shard.pairs:
        split = shard.splits.get(pair.weight.name)
        if split is not None:
            groups[pair.weight.name] = tuple(name for name, _ in split.weight)
            groups[pair.out_scale_name] = tuple(name for name, _ in split.scale)
    return groups


# -- devices ----------------------------------------------------------------------------------------------------------

