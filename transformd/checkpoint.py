"""Convert a whole HF-style MXFP8 checkpoint directory into a 128x128 block-FP8 one.

The work has two phases, so that bad input never leaves anything behind:

1. :func:`plan_conversion` reads ``config.json``, ``hf_quant_config.json`` (when
   present), the safetensors index (or the single ``model.safetensors``) and
   every shard *header*, finds every MXFP8 weight/scale pair and checks names,
   dtypes and shapes. Nothing is written, no tensor data is read.
2. :func:`convert_checkpoint` streams the shards into a private staging
   directory next to ``out``, one tensor (or one chunk of experts) at a time,
   and renames the directory into place at the end. The values of a pair (NaN
   codes, E8M0 0xFF, overflow) are checked by :func:`transformd.convert_weight`
   as each weight is converted; any error removes the staging directory, so
   ``out`` either holds a complete conversion or is untouched.

What is an MXFP8 pair: a tensor ``X.weight`` stored ``F8_E4M3`` with exactly one
scale ``X.weight_scale`` (ModelOpt) or ``X.weight_scale_inv`` (MiniMax style),
stored ``U8`` or ``F8_E8M0``, 2-D ``[N, K]`` or 3-D fused experts ``[E, N, K]``.
Every other tensor is copied byte for byte.

``select`` (a regular expression, ``re.search`` on the weight name) restricts
which pairs are converted. Pairs it leaves out are carried over *unchanged*:
they stay MXFP8, so the output is then not a pure block-FP8 checkpoint. Their
module names are recorded in ``quantization_config.transformd.unconverted_mxfp8``
so a loader can tell.

Output (shared/DESIGN.md, "Output" and "config.json"):

* ``X.weight`` as ``F8_E4M3FNUZ`` (target ``fnuz``) or ``F8_E4M3`` (``ocp``),
  followed in the same shard by ``X.weight_scale_inv`` float32
  ``[..., ceil(N/128), ceil(K/128)]``; the input scale is dropped. Shard names
  stay the same; a shard that neither holds a converted weight nor loses a
  scale is copied without being rewritten.
* ``config.json``: ``quantization_config`` is replaced by vLLM's/transformers'
  block-FP8 form (``quant_method: fp8``, ``weight_block_size: [128, 128]``, dynamic
  activations), with the excluded-module list of the input carried over under
  its original key and under ``ignored_layers`` and ``modules_to_not_convert``
  (the keys vLLM's ``Fp8Config`` and transformers' ``FineGrainedFP8Config``
  read), the KV-cache settings carried over, and a ``transformd`` record
  (target, scale mode, format version). Every other field is kept as it was.
* ``hf_quant_config.json`` (only when the input has one): ``quant_algo`` becomes
  ``FP8_PB_WO`` (ModelOpt's name for 128x128 block FP8 weights) with
  ``group_size`` 128; producer, KV-cache and exclusion entries are kept. vLLM
  and SGLang read ``config.json``'s ``quantization_config`` first, which is the
  authoritative description of the output.
* ``model.safetensors.index.json``: ``weight_map`` and ``metadata.total_size``
  rewritten. Every other file (tokenizer, generation config, code, ...) is copied;
  names that start with ``.`` are skipped, and so are ``*.safetensors`` files the
  index does not reference (they would be unconverted weights; see
  ``ConversionResult.left_out``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .convert import convert_weight, resolve_device
from .formats import FORMAT_VERSION, TILE, MxFormatError, ScaleMode, Target, check_pair_shapes, tile_grid
from .safetensors_io import (
    TORCH_DTYPES,
    CheckpointError,
    Header,
    SafetensorsWriter,
    TensorInfo,
    read_header,
    read_range,
    tensor_nbytes,
)

__all__ = [
    "CheckpointError",
    "ConversionPlan",
    "ConversionResult",
    "MxPair",
    "Progress",
    "ShardPlan",
    "convert_checkpoint",
    "plan_conversion",
]

CONFIG_NAME = "config.json"
HF_QUANT_NAME = "hf_quant_config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_SHARD_NAME = "model.safetensors"
#: Scale names of an MXFP8 weight ``X.weight``: ``X.<suffix>``.
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")
#: safetensors dtypes that hold E8M0 scale bytes.
E8M0_DTYPES = ("U8", "F8_E8M0")
#: safetensors dtype of MXFP8 weight codes.
MX_CODE_DTYPE = "F8_E4M3"
#: Output scale name ``X.weight_scale_inv`` (multiply to dequantize), as vLLM's block-FP8 layers expect.
OUT_SCALE_SUFFIX = "weight_scale_inv"
#: Keys under which quantization configs list unquantized modules (vLLM, transformers, ModelOpt, compressed-tensors).
EXCLUDE_KEYS = ("ignored_layers", "modules_to_not_convert", "exclude_modules", "ignore")
#: KV-cache settings of the input's quantization config, carried over as they are.
KV_CACHE_KEYS = ("kv_cache_scheme", "kv_cache_quant_algo")
#: ModelOpt's quant_algo for 128x128 block FP8 weights.
BLOCK_QUANT_ALGO = "FP8_PB_WO"
#: Largest slice of one weight (input code bytes) read and converted at once.
DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024


# -------------------------------------------------------------------------------------------------------------------
# Plan


@dataclass(frozen=True)
class MxPair:
    """One MXFP8 weight and its E8M0 scale (possibly in another shard)."""

    weight: TensorInfo
    weight_shard: str
    scale: TensorInfo
    scale_shard: str

    @property
    def module(self) -> str:
        return self.weight.name.removesuffix(".weight")

    @property
    def out_scale_name(self) -> str:
        return f"{self.module}.{OUT_SCALE_SUFFIX}"

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
    unselected: tuple[MxPair, ...]
    select: str | None
    other_files: tuple[Path, ...]
    left_out: tuple[Path, ...] = ()

    @property
    def tensor_count(self) -> int:
        return sum(len(s.header.tensors) for s in self.shards)

    @property
    def data_bytes(self) -> int:
        """Tensor bytes of all shards (headers not counted): the total that progress reports count up to."""
        return sum(s.header.data_bytes for s in self.shards)


@dataclass(frozen=True)
class Progress:
    """Reported to ``progress`` after each tensor (and after each shard copied whole)."""

    shard: str
    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int


@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` did."""

    out: Path
    converted: list[str]
    unconverted: list[str]
    shards: list[str]
    left_out: list[str]
    bytes_read: int
    bytes_written: int
    seconds: float
    target: str
    scale_mode: str
    device: str


def plan_conversion(src: str | os.PathLike[str], *, select: str | None = None) -> ConversionPlan:
    """Read and check everything but tensor data; raise :class:`CheckpointError` or :class:`MxFormatError`.

    Errors name the file, the tensor and the problem.
    """
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError("is not a directory", file=src)
    select_re = _compile_select(select)
    config = _load_json(src / CONFIG_NAME, required=True)
    hf_quant = _load_json(src / HF_QUANT_NAME, required=False)
    index, shard_names = _shard_layout(src)
    headers = {name: read_header(src / name) for name in shard_names}
    if index is not None:
        _check_index(src, index, headers)
    tensors = {t.name: (shard, t) for shard, h in headers.items() for t in h.tensors.values()}
    selected, unselected = _find_pairs(src, tensors, select_re)
    if not selected and not unselected:
        raise CheckpointError(
            "no MXFP8 weights: found no F8_E4M3 X.weight with a U8/F8_E8M0 X.weight_scale or X.weight_scale_inv; "
            "nothing to convert",
            file=src,
        )
    if not selected:
        raise CheckpointError(f"--select {select!r} matches none of the {len(unselected)} MXFP8 weights", file=src)
    for pair in selected:
        _check_pair(src, pair, tensors)
    shards = tuple(_plan_shard(name, headers[name], selected) for name in shard_names)
    skip = {CONFIG_NAME, HF_QUANT_NAME, INDEX_NAME, *shard_names}
    other_files = list(_other_files(src, skip))
    # Weights the index does not reference (e.g. a stale model.safetensors next to an index) are not converted;
    # carrying them would hand loaders an MXFP8 copy (transformers prefers model.safetensors over an index).
    left_out = [f for f in other_files if f.parent == Path(".") and f.suffix == ".safetensors"]
    return ConversionPlan(
        src=src,
        config=config,
        hf_quant_config=hf_quant,
        index=index,
        shards=shards,
        selected=tuple(selected),
        unselected=tuple(unselected),
        select=select,
        other_files=tuple(f for f in other_files if f not in left_out),
        left_out=tuple(left_out),
    )


def _compile_select(select: str | None) -> re.Pattern[str] | None:
    if select is None:
        return None
    try:
        return re.compile(select)
    except re.error as err:
        raise CheckpointError(f"--select {select!r} is not a valid regular expression: {err}") from None


def _load_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.exists():
        if required:
            raise CheckpointError("is missing; an HF checkpoint directory needs it", file=path)
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot be read as JSON: {err}", file=path) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"holds a JSON {type(data).__name__}, not an object", file=path)
    return data


def _shard_layout(src: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """(index or None, shard file names in order)."""
    index = _load_json(src / INDEX_NAME, required=False)
    if index is None:
        if not (src / SINGLE_SHARD_NAME).is_file():
            raise CheckpointError(f"has neither {INDEX_NAME} nor {SINGLE_SHARD_NAME}", file=src)
        return None, [SINGLE_SHARD_NAME]
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError("has no weight_map object (or it is empty)", file=src / INDEX_NAME)
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            problem = f"maps to {shard!r}, which is not a file name in the directory"
            raise CheckpointError(problem, file=src / INDEX_NAME, tensor=name)
        if not (src / shard).is_file():
            raise CheckpointError(f"maps to {shard}, which does not exist", file=src / INDEX_NAME, tensor=name)
    return index, sorted(set(weight_map.values()))


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


def _find_pairs(
    src: Path, tensors: dict[str, tuple[str, TensorInfo]], select_re: re.Pattern[str] | None
) -> tuple[list[MxPair], list[MxPair]]:
    """All MXFP8 pairs, split into (selected, unselected); malformed selected ones raise."""
    selected: list[MxPair] = []
    unselected: list[MxPair] = []
    weights = {
        name.removesuffix(".weight")
        for name, (_, t) in tensors.items()
        if name.endswith(".weight") and t.dtype == MX_CODE_DTYPE
    }
    scaled = {
        name[: -len(suffix) - 1]
        for name, (_, t) in tensors.items()
        for suffix in SCALE_SUFFIXES
        if name.endswith("." + suffix) and t.dtype in E8M0_DTYPES
    }
    for module in sorted(weights | scaled):
        weight_name = f"{module}.weight"
        is_selected = select_re is None or select_re.search(weight_name) is not None
        pair = _pair_of(src, module, tensors, strict=is_selected)
        if pair is not None:
            (selected if is_selected else unselected).append(pair)
    return selected, unselected


def _pair_of(src: Path, module: str, tensors: dict[str, tuple[str, TensorInfo]], *, strict: bool) -> MxPair | None:
    """The pair of ``module``, or None when it is not MXFP8; with ``strict``, a malformed pair raises."""
    weight_name = f"{module}.weight"
    scales = [tensors[f"{module}.{s}"] for s in SCALE_SUFFIXES if f"{module}.{s}" in tensors]
    e8m0 = [(shard, t) for shard, t in scales if t.dtype in E8M0_DTYPES]
    weight = tensors.get(weight_name)

    def fail(problem: str, shard: str, tensor: str) -> CheckpointError:
        return CheckpointError(problem, file=src / shard, tensor=tensor)

    if weight is None:
        shard, scale = e8m0[0]
        if strict:
            raise fail(f"E8M0 scale without its weight {weight_name}", shard, scale.name)
        return None
    w_shard, w = weight
    if len(e8m0) == 1 and w.dtype == MX_CODE_DTYPE:
        s_shard, s = e8m0[0]
        return MxPair(w, w_shard, s, s_shard)
    if not strict:
        return None
    if w.dtype != MX_CODE_DTYPE:
        raise fail(
            f"weight is {w.dtype}, but its scale {e8m0[0][1].name} is E8M0: MXFP8 weights are {MX_CODE_DTYPE} "
            "(other MX formats, e.g. packed MXFP4, are not supported)",
            w_shard,
            weight_name,
        )
    if len(e8m0) > 1:
        names = " and ".join(f"{module}.{s}" for s in SCALE_SUFFIXES)
        raise fail(f"weight has two E8M0 scales, {names}", w_shard, weight_name)
    if not scales:
        names = " and ".join(f"{module}.{s}" for s in SCALE_SUFFIXES)
        raise fail(f"{MX_CODE_DTYPE} weight without its scale (looked for {names})", w_shard, weight_name)
    shard, scale = scales[0]
    raise fail(
        f"{MX_CODE_DTYPE} weight whose scale {scale.name} is {scale.dtype} {list(scale.shape)}, not E8M0 "
        f"({' or '.join(E8M0_DTYPES)}): not an MXFP8 weight (use --select to leave it out)",
        w_shard,
        weight_name,
    )


def _check_pair(src: Path, pair: MxPair, tensors: dict[str, tuple[str, TensorInfo]]) -> None:
    """Shapes and dtypes by the contract's own check, on meta tensors (no data); and no name clash on output."""
    codes = torch.empty(pair.weight.shape, dtype=torch.float8_e4m3fn, device="meta")
    scales = torch.empty(pair.scale.shape, dtype=TORCH_DTYPES[pair.scale.dtype], device="meta")
    try:
        check_pair_shapes(codes, scales)
    except MxFormatError as err:
        raise err.located(tensor=pair.weight.name, file=str(src / pair.weight_shard)) from None
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
    """Files to carry over, relative to ``src``: everything but the shards, index and configs; no dot-names."""
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel_root = Path(root).relative_to(src)
        for f in sorted(files):
            rel = rel_root / f
            if f.startswith(".") or (rel_root == Path(".") and f in skip):
                continue
            yield rel


# -------------------------------------------------------------------------------------------------------------------
# Conversion


@dataclass
class _Run:
    """State shared by the steps of one conversion."""

    plan: ConversionPlan
    staging: Path
    target: Target
    scale_mode: ScaleMode
    device: torch.device
    chunk_bytes: int
    progress: Callable[[Progress], None] | None
    tensors_done: int = 0
    bytes_done: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    output_tensors: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (shard, nbytes)

    def tick(self, shard: str, tensors: int, nbytes: int) -> None:
        self.tensors_done += tensors
        self.bytes_done += nbytes
        if self.progress is not None:
            self.progress(
                Progress(shard, self.tensors_done, self.plan.tensor_count, self.bytes_done, self.plan.data_bytes)
            )


def convert_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    target: Target | str = Target.FNUZ,
    scale_mode: ScaleMode | str = ScaleMode.EXACT,
    select: str | None = None,
    device: str | torch.device | None = "auto",
    overwrite: bool = False,
    progress: Callable[[Progress], None] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> ConversionResult:
    """Convert the MXFP8 checkpoint directory ``src`` into a block-FP8 checkpoint directory ``out``.

    Refuses a non-empty ``out`` unless ``overwrite``. Everything is written to a
    staging directory next to ``out`` and renamed into place at the end; on any
    error the staging directory is removed and ``out`` is left as it was.
    ``progress`` is called with a :class:`Progress` after each tensor.
    ``chunk_bytes`` bounds the slice of a 3-D expert weight converted at once.
    """
    started = time.monotonic()
    target, scale_mode = Target(target), ScaleMode(scale_mode)
    src, out = Path(src), Path(out)
    dev = resolve_device(device)
    _check_out(src, out, overwrite)
    plan = plan_conversion(src, select=select)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.transformd-staging-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    run = _Run(plan, staging, target, scale_mode, dev, max(1, chunk_bytes), progress)
    try:
        for shard in plan.shards:
            _convert_shard(run, shard)
        _write_metadata_files(run, select)
        _copy_other_files(run)
        _fsync_tree(staging)
        _publish(staging, out, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ConversionResult(
        out=out,
        converted=[p.weight.name for p in plan.selected],
        unconverted=[p.weight.name for p in plan.unselected],
        shards=[s.name for s in plan.shards],
        left_out=[str(f) for f in plan.left_out],
        bytes_read=run.bytes_read,
        bytes_written=run.bytes_written,
        seconds=time.monotonic() - started,
        target=target.value,
        scale_mode=scale_mode.value,
        device=str(dev),
    )


def _check_out(src: Path, out: Path, overwrite: bool) -> None:
    s, o = src.resolve(), out.resolve()
    if s == o or s in o.parents or o in s.parents:
        raise CheckpointError(f"the output directory must be outside the input {src} (and not contain it)", file=out)
    if not out.exists():
        return
    if not out.is_dir():
        raise CheckpointError("exists and is not a directory", file=out)
    if any(out.iterdir()) and not overwrite:
        problem = "the output directory is not empty; pass --overwrite (overwrite=True) to replace it"
        raise CheckpointError(problem, file=out)


def _convert_shard(run: _Run, shard: ShardPlan) -> None:
    """Produce one output shard in the staging directory.

    One shard in, one shard out, with no state but ``run``'s counters: the
    unit a pipelined version (read i+1 / convert i / write i-1) would overlap.
    """
    src_path = run.plan.src / shard.name
    dst_path = run.staging / shard.name
    if not shard.rewrite:
        _copy_file(src_path, dst_path)
        run.bytes_read += shard.header.file_size
        run.bytes_written += shard.header.file_size
        for t in shard.header.tensors.values():
            run.output_tensors[t.name] = (shard.name, t.nbytes)
        run.tick(shard.name, len(shard.header.tensors), shard.header.data_bytes)
        return
    pairs = {p.weight.name: p for p in shard.pairs}
    specs = list(_output_specs(run.target, shard, pairs))
    for name, dtype, shape in specs:
        run.output_tensors[name] = (shard.name, tensor_nbytes(dtype, shape))
    with ExitStack() as stack:
        files: dict[str, BinaryIO] = {}

        def open_shard(name: str) -> BinaryIO:
            if name not in files:
                files[name] = stack.enter_context(open(run.plan.src / name, "rb"))
            return files[name]

        writer = stack.enter_context(SafetensorsWriter(dst_path, specs, shard.header.metadata))
        for t in shard.header.tensors.values():
            if t.name in shard.dropped:
                pass
            elif t.name in pairs:
                _convert_pair(run, pairs[t.name], writer, open_shard)
            else:
                writer.copy_from(t.name, open_shard(shard.name), t.begin)
                run.bytes_read += t.nbytes
            run.tick(shard.name, 1, t.nbytes)
        writer.close()
        run.bytes_written += writer.bytes_written


def _output_specs(
    target: Target, shard: ShardPlan, pairs: dict[str, MxPair]
) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of the output shard, in the input's order; a new scale right after its weight."""
    for t in shard.header.tensors.values():
        if t.name in shard.dropped:
            continue
        pair = pairs.get(t.name)
        if pair is None:
            yield t.name, t.dtype, t.shape
        else:
            yield t.name, target.safetensors_dtype, t.shape
            yield pair.out_scale_name, "F32", pair.out_scale_shape


def _convert_pair(run: _Run, pair: MxPair, writer: SafetensorsWriter, open_shard: Callable[[str], BinaryIO]) -> None:
    """Convert one weight in slices of whole experts; write its codes as they come, then its scale."""
    w, s = pair.weight, pair.scale
    fw, fs = open_shard(pair.weight_shard), open_shard(pair.scale_shard)
    *lead, n, k = w.shape
    experts = lead[0] if lead else 1
    w_step, s_step = n * k, n * (k // 32)  # bytes per expert (1 byte per code / scale)
    per_chunk = max(1, run.chunk_bytes // max(1, w_step)) if lead else 1
    scale_pieces: list[torch.Tensor] = []
    for e0 in range(0, experts, per_chunk):
        e1 = min(experts, e0 + per_chunk)
        shape = (e1 - e0, n, k) if lead else (n, k)
        codes = read_range(fw, w.begin + e0 * w_step, (e1 - e0) * w_step, path=fw.name).view(torch.float8_e4m3fn)
        scales = read_range(fs, s.begin + e0 * s_step, (e1 - e0) * s_step, path=fs.name).view(TORCH_DTYPES[s.dtype])
        run.bytes_read += codes.numel() + scales.numel()
        try:
            q, scale_inv = convert_weight(
                codes.reshape(shape), scales.reshape(*shape[:-1], k // 32), run.target, run.scale_mode, run.device
            )
        except MxFormatError as err:
            where = f" (indices relative to expert {e0} of {experts})" if lead and e0 else ""
            problem = f"{err.problem}{where}"
            raise MxFormatError(problem, tensor=w.name, file=str(run.plan.src / pair.weight_shard)) from None
        writer.write(w.name, q)
        scale_pieces.append(scale_inv)
    for piece in scale_pieces:
        writer.write(pair.out_scale_name, piece.to(torch.float32))


# -------------------------------------------------------------------------------------------------------------------
# Index, config.json, hf_quant_config.json, other files


def _write_metadata_files(run: _Run, select: str | None) -> None:
    plan = run.plan
    record = _transformd_record(run, select)
    if plan.index is not None:
        run.bytes_written += _write_json(run.staging / INDEX_NAME, _rewrite_index(plan.index, run.output_tensors))
    config = _rewrite_config(plan.config, plan.hf_quant_config, record)
    run.bytes_written += _write_json(run.staging / CONFIG_NAME, config)
    if plan.hf_quant_config is not None:
        hf_quant = _rewrite_hf_quant_config(plan.hf_quant_config, record)
        run.bytes_written += _write_json(run.staging / HF_QUANT_NAME, hf_quant)


def _rewrite_index(index: dict[str, Any], output_tensors: dict[str, tuple[str, int]]) -> dict[str, Any]:
    new = dict(index)
    metadata = dict(index.get("metadata") or {})
    metadata["total_size"] = sum(nbytes for _, nbytes in output_tensors.values())
    new["metadata"] = metadata
    new["weight_map"] = {name: shard for name, (shard, _) in sorted(output_tensors.items())}
    return new


def _transformd_record(run: _Run, select: str | None) -> dict[str, Any]:
    from . import __version__

    record: dict[str, Any] = {
        "version": __version__,
        "format_version": FORMAT_VERSION,
        "target": run.target.value,
        "scale_mode": run.scale_mode.value,
        "weight_dtype": run.target.safetensors_dtype,
    }
    source = _source_quantization(run.plan.config, run.plan.hf_quant_config)
    if source:
        record["source_quantization"] = source
    if select is not None:
        record["select"] = select
        record["unconverted_mxfp8"] = [p.module for p in run.plan.unselected]
    return record


def _source_quantization(config: dict[str, Any], hf_quant: dict[str, Any] | None) -> dict[str, str]:
    """quant_method / quant_algo of the input, wherever its configs state them (for the record only)."""
    qc = config.get("quantization_config")
    places = [qc, qc.get("quantization") if isinstance(qc, dict) else None]
    if hf_quant is not None:
        places.append(hf_quant.get("quantization"))
    found: dict[str, str] = {}
    for place in places:
        if isinstance(place, dict):
            for key in ("quant_method", "quant_algo"):
                if isinstance(place.get(key), str):
                    found.setdefault(key, place[key])
    return found


def _rewrite_config(config: dict[str, Any], hf_quant: dict[str, Any] | None, record: dict[str, Any]) -> dict[str, Any]:
    """config.json with ``quantization_config`` replaced by the block-FP8 form; all other fields untouched."""
    old = config.get("quantization_config")
    old = old if isinstance(old, dict) else {}
    excluded = _excluded_modules(old, hf_quant)
    qc: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [TILE, TILE],
    }
    for key in EXCLUDE_KEYS:
        if key in old:
            qc[key] = old[key]
    qc["ignored_layers"] = excluded
    qc["modules_to_not_convert"] = excluded
    for key in KV_CACHE_KEYS:
        if key in old:
            qc[key] = old[key]
    qc["transformd"] = record
    new = dict(config)
    new["quantization_config"] = qc
    return new


def _excluded_modules(config_qc: dict[str, Any], hf_quant: dict[str, Any] | None) -> list[str]:
    """Union, in order, of every excluded-module list the input's configs give (flat or under ``quantization``)."""
    sources: list[Any] = [config_qc, config_qc.get("quantization")]
    if hf_quant is not None:
        sources += [hf_quant.get("quantization"), hf_quant]
    seen: dict[str, None] = {}
    for source in sources:
        if not isinstance(source, dict):
            continue
        for key in EXCLUDE_KEYS:
            value = source.get(key)
            if isinstance(value, list):
                seen.update((v, None) for v in value if isinstance(v, str))
    return list(seen)


def _rewrite_hf_quant_config(hf_quant: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """ModelOpt's file, saying FP8_PB_WO (128x128 block FP8 weights); producer, KV-cache and exclusions kept."""
    new = dict(hf_quant)
    quant = hf_quant.get("quantization")
    quant = dict(quant) if isinstance(quant, dict) else {}
    quant["quant_algo"] = BLOCK_QUANT_ALGO
    quant["group_size"] = TILE
    new["quantization"] = quant
    new["transformd"] = record
    return new


def _copy_other_files(run: _Run) -> None:
    for rel in run.plan.other_files:
        dst = run.staging / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        size = _copy_file(run.plan.src / rel, dst)
        run.bytes_read += size
        run.bytes_written += size


# -------------------------------------------------------------------------------------------------------------------
# Durable file operations


def _copy_file(src: Path, dst: Path) -> int:
    """Copy a file's bytes (following symlinks, as in an HF cache snapshot) and fsync the copy."""
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _write_json(path: Path, obj: dict[str, Any]) -> int:
    data = (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data)


def _fsync_tree(path: Path) -> None:
    """fsync every directory of the staging tree, so the renamed directory's entries are durable too."""
    for root, _, _ in os.walk(path, topdown=False):
        _fsync_dir(Path(root))


def _publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished staging directory to ``out``; an old non-empty ``out`` (overwrite) goes only after."""
    old: Path | None = None
    if out.exists():
        if any(out.iterdir()):
            if not overwrite:  # appeared while we were converting
                raise CheckpointError("the output directory became non-empty during the conversion", file=out)
            old = out.parent / f".{out.name}.transformd-old-{uuid.uuid4().hex[:12]}"
            os.rename(out, old)
        else:
            out.rmdir()
    try:
        os.rename(staging, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
