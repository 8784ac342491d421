"""Convert a whole HF-style MXFP8 checkpoint directory into a 128x128 block-FP8 one.

The work has two phases, so that bad input never leaves anything behind:

1. :func:`plan_conversion` reads ``config.json``, ``hf_quant_config.json`` (when
   present), the safetensors index (or the single ``model.safetensors``) and
   every shard *header*, finds every MXFP8 weight/scale pair and checks names,
   dtypes and shapes. Nothing is written, no tensor data is read.
2. :func:`convert_checkpoint` streams the shards into a private staging
   directory next to ``out`` and renames the directory into place at the end.
   Reading, converting, writing and fsyncing overlap (a thread each, joined by
   bounded queues; one such lane per GPU when several are visible); weights go
   through in pieces of whole experts or 128-row blocks, in a fixed set of
   reusable (pinned, for a GPU) host buffers, so host memory is bounded by
   ``host_memory_bytes`` whatever the checkpoint's size. The values of a pair
   (NaN codes, E8M0 0xFF, overflow) are checked as each piece is converted; an
   error in any stage stops all of them and removes the staging directory, so
   ``out`` either holds a complete conversion or is untouched. A process killed
   outright leaves its staging directory (flock-ed while in use); the next
   conversion into the same ``out`` removes it, and puts back an old ``out``
   that ``overwrite`` had moved aside when the kill came in the middle of the
   publish.

What is an MXFP8 pair: an ``F8_E4M3`` tensor ``X.weight`` with exactly one scale
``X.weight_scale`` (ModelOpt, compressed-tensors, Quark) or ``X.weight_scale_inv``
(MiniMax style), or a fused expert stack ``X`` (HF-v5 naming, no ``.weight``) with
``X_scale_inv``; scales stored ``U8`` or ``F8_E8M0``, 1x32 blocks ``[..., N, K/32]``
or Quark ``per_block`` Rx32 blocks ``[..., ceil(N/R), K/32]``; weights 2-D
``[N, K]`` or 3-D experts ``[E, N, K]``. Every other tensor is copied byte for
byte. Any ``F8_E4M3`` or E8M0 tensor that is not part of a valid pair is refused:
an ``fp8`` output must hold nothing MX and no FP8 weight without its block scale.

``select`` (a regular expression, RE2's ``search`` on the weight name) must match
every MXFP8 weight; one it would leave out is refused for the same reason.

Before anything is written, :func:`plan_readiness` computes from shapes and
config at which tensor-parallel sizes vLLM, SGLang and transformers load the
output (:mod:`transformd.engines`); with ``engine`` a checkpoint that engine
could not load at all is refused.

Output (shared/DESIGN.md, "Output" and "config.json"):

* the weight as ``F8_E4M3FNUZ`` (target ``fnuz``) or ``F8_E4M3`` (``ocp``),
  followed in the same shard by ``<weight>_scale_inv`` (``X.weight_scale_inv``,
  ``X_scale_inv``) float32 ``[..., ceil(N/128), ceil(K/128)]``; the input scale
  is dropped. Shard names stay the same; a shard that neither holds a converted
  weight nor loses a scale is copied without being rewritten.
* ``config.json``: ``quantization_config`` is replaced by the block-FP8 form
  vLLM, SGLang and transformers read (:mod:`transformd.quant_config`), whose
  ``ignored_layers`` and ``modules_to_not_convert`` name exactly the modules
  whose weights stay unquantized in the output; the input's own exclusion lists
  (globs, ``re:`` patterns) are kept only in the ``transformd`` record, with
  target, scale mode and format version. Every other field is kept as it was.
* ``hf_quant_config.json`` is not carried over: it states the MXFP8 recipe.
* ``model.safetensors.index.json``: ``weight_map`` and ``metadata.total_size``
  rewritten. Every other file (tokenizer, generation config, code, ...) is copied;
  names that start with ``.`` are skipped, and so are ``*.safetensors`` files the
  index does not reference (they would be unconverted weights; see
  ``ConversionResult.left_out``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import queue
import re
import shutil
import stat
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

import torch

from .convert import convert_weight, resolve_device
from .engines import CHECKED_ENGINES, Engine, EngineReadiness, readiness
from .formats import (
    FORMAT_VERSION,
    MX_BLOCK,
    TILE,
    MxFormatError,
    ScaleMode,
    Target,
    check_pair_shapes,
    expand_row_blocks,
    infer_row_block,
    tile_grid,
)
from .kernels import convert_triton
from .quant_config import output_quantization_config, quark_row_block, source_quantization, unquantized_modules
from .safetensors_io import (
    TORCH_DTYPES,
    CheckpointError,
    Header,
    SafetensorsWriter,
    TensorInfo,
    read_header,
    tensor_nbytes,
)

__all__ = [
    "CheckpointError",
    "ConversionPlan",
    "ConversionResult",
    "MxPair",
    "OutputError",
    "Progress",
    "ShardOrder",
    "ShardPlan",
    "check_engine",
    "convert_checkpoint",
    "plan_conversion",
    "plan_readiness",
    "readiness_of_dir",
]

CONFIG_NAME = "config.json"
HF_QUANT_NAME = "hf_quant_config.json"
INDEX_NAME = "model.safetensors.index.json"
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
#: Largest slice of one weight (input code bytes) read and converted at once.
DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024


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

    @property
    def tensor_count(self) -> int:
        return sum(len(s.header.tensors) for s in self.shards)

    @property
    def data_bytes(self) -> int:
        """Tensor bytes of all shards (headers not counted): the total that progress reports count up to."""
        return sum(s.header.data_bytes for s in self.shards)

    @property
    def convert_bytes(self) -> int:
        """Code bytes of the MXFP8 weights to convert (``Progress.convert_bytes_total``)."""
        return sum(p.weight.nbytes for p in self.selected)


@dataclass(frozen=True)
class Progress:
    """Reported to ``progress`` after each tensor (and after each shard copied whole).

    ``bytes_*`` count every input tensor byte; ``convert_bytes_*`` only the MXFP8 weights' codes, the
    bytes that are converted rather than copied (much slower on the CPU): an ETA should come from
    those (:class:`transformd.progress.Eta`).
    """

    shard: str
    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int
    convert_bytes_done: int = 0
    convert_bytes_total: int = 0


class OutputError(OSError):
    """The output directory cannot be written: too little free space (checked before anything is written, and
    ENOSPC/EDQUOT while writing), a read-only file system, no permission.

    An :class:`OSError` with the original ``errno``; the message names the output directory the caller gave
    (never the hidden staging directory beside it) and, for space, the bytes needed and free.
    """

    def __init__(self, errno_: int, message: str, *, out: Path, needed_bytes: int | None = None,
                 free_bytes: int | None = None):
        super().__init__(errno_, message)
        self.out = out
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes

    def __str__(self) -> str:
        return str(self.strerror)


@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` did."""

    out: Path
    converted: list[str]
    shards: list[str]
    left_out: list[str]
    bytes_read: int
    bytes_written: int
    seconds: float
    target: str
    scale_mode: str
    device: str
    #: Peak bytes of the host buffers between the pipeline's stages (see ``host_memory_bytes``).
    host_buffer_bytes: int = 0
    #: Per engine, the TP sizes at which it loads the output right, and why not at others (:func:`plan_readiness`).
    readiness: dict[str, EngineReadiness] = field(default_factory=dict)
    #: Tensors in the input shards, and their bytes (what progress counts up to).
    tensors: int = 0
    data_bytes: int = 0


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
    return ConversionPlan(
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


def plan_readiness(plan: ConversionPlan, target: Target | str) -> dict[str, EngineReadiness]:
    """Engine readiness of the output ``plan`` will write (from shapes and config alone; nothing is read)."""
    target = Target(target)
    specs = [spec for shard in plan.shards for spec in _output_specs(target, shard)]
    return readiness({**plan.config, "quantization_config": {"transformd": {"target": target.value}}}, specs)


def readiness_of_dir(path: str | os.PathLike[str]) -> dict[str, EngineReadiness]:
    """Engine readiness of a block-FP8 checkpoint directory, from its config.json and shard headers."""
    path = Path(path)
    config = _load_json(path / CONFIG_NAME, required=True)
    _, shard_names = _shard_layout(path)
    specs = [(t.name, t.dtype, t.shape) for name in shard_names for t in read_header(path / name).tensors.values()]
    return readiness(config, specs)


def check_engine(report: dict[str, EngineReadiness], engine: Engine | str | None, src: Path) -> None:
    """Refuse a conversion that the named engine could not load at any TP size (``raw``/None: no check)."""
    if engine is None or Engine(engine) not in CHECKED_ENGINES:
        return
    r = report[Engine(engine).value]
    if not r.loads:
        problems = "; ".join(r.problems[:3]) + (f"; and {len(r.problems) - 3} more" if len(r.problems) > 3 else "")
        raise CheckpointError(f"{r.engine} could not load the converted checkpoint at any TP size: {problems}", file=src)


def _compile_select(select: str | None) -> Any:
    """``select`` compiled for linear-time matching (:mod:`transformd.selectre`), or None."""
    if select is None:
        return None
    from .selectre import SelectError, compile_select

    try:
        return compile_select(select)
    except SelectError as err:
        raise CheckpointError(f"--select {select[:200]!r} is refused: {err}") from None


def _load_json(path: Path, *, required: bool) -> dict[str, Any] | None:
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
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointError("is not a regular file", file=path)
            data = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad UTF-8/JSON, integers past the digit limit
        raise CheckpointError(f"cannot be read as JSON: {str(err)[:200]}", file=path) from None
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
    if not isinstance(index.get("metadata", {}), (dict, type(None))):  # rewritten (total_size) in the output
        raise CheckpointError("has a metadata entry that is not an object", file=src / INDEX_NAME)
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            problem = f"maps to {shard!r}, which is not a file name in the directory"
            raise CheckpointError(problem, file=src / INDEX_NAME, tensor=name)
        if shard.startswith("."):  # hidden names are never read (nor identified, nor carried over)
            problem = f"maps to {shard!r}, a hidden name; shards must not start with '.'"
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
    """Shapes and dtypes by the contract's own check, on meta tensors (no data); and no name clash on output."""
    codes = torch.empty(pair.weight.shape, dtype=torch.float8_e4m3fn, device="meta")
    scales = torch.empty(pair.scale.shape, dtype=TORCH_DTYPES[pair.scale.dtype], device="meta")
    try:
        check_pair_shapes(codes, scales, pair.row_block)
    except MxFormatError as err:
        raise err.located(tensor=pair.weight.name, file=str(src / pair.weight_shard)) from None
    if codes.numel() == 0:  # the header may declare any number of empty experts; there is nothing to convert
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


# -------------------------------------------------------------------------------------------------------------------
# Conversion
#
# One lane per device, each four threads joined by bounded channels:
#
#     reader --(pieces, in input slots)--> converter --(converted pieces, in output slots)--> writer --> syncer
#
# * reader: reads each MXFP8 weight of its shards one piece at a time (whole experts, or blocks of 128 rows of a
#   large matrix) into a reusable host buffer (a "slot"; pinned when it feeds a GPU).
# * converter: converts a piece on the device into an output slot (and hands the input slot back).
# * writer: appends converted pieces to the output shard, copies the tensors that are not converted straight
#   from the input file (copy_file_range, never through memory), and copies whole the shards that need no
#   rewrite.
# * syncer: fsyncs each file the writer has finished while the writer goes on with the next, so that flushing
#   shard i to disk overlaps reading and writing shard i+1.
#
# Host memory is therefore the slots (two pools of a fixed number of fixed-size slots, cut from
# ``host_memory_bytes``) plus, on the CPU, the PyTorch reference's temporaries for one piece: it does not grow
# with the checkpoint. The calling thread only waits: it calls ``progress`` for each tensor the converter hands
# on, and when any stage fails it stops the others, joins them and raises that stage's exception.

#: Default bound on the host memory of a conversion's buffers (``host_memory_bytes``).
DEFAULT_HOST_MEMORY_BYTES = 2 << 30
#: Slots of each pool (input pieces, converted pieces) that the budget must hold at the least.
MIN_SLOTS = 3
#: Slots of each pool at the most: enough read-ahead and write-behind for a disk; a slot is as large as the
#: largest piece, so more would mostly hold smaller pieces in oversized buffers.
MAX_SLOTS = 16
#: Host bytes the PyTorch reference (the CPU path) needs while it converts a piece, per code byte of the piece:
#: float32 decode, tile maxima, the quotient, the outputs (measured 12-14).
CPU_WORK_FACTOR = 16
#: Items a channel between two stages holds (memory is bounded by the slots, not by this).
CHANNEL_ITEMS = 4 * MAX_SLOTS
#: Finished files waiting for the syncer at the most (bounds the dirty page cache the writer runs ahead by).
SYNC_BACKLOG = 2
#: How often a waiting stage checks whether the conversion was stopped (seconds).
POLL_S = 0.05
#: Alignment of the scale bytes that follow the codes in a slot.
SLOT_ALIGN = 256
#: A whole-file copy checks for a stop between steps of this many bytes.
COPY_STEP = 64 * 1024 * 1024


class _Tally:
    """Byte counts the stage threads add to: data read and written, host buffers allocated (and their peak)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.read = self.written = self.buffers = self.buffers_peak = 0

    def add(self, *, read: int = 0, written: int = 0, buffers: int = 0) -> None:
        with self._lock:
            self.read += read
            self.written += written
            self.buffers += buffers
            self.buffers_peak = max(self.buffers_peak, self.buffers)


@runtime_checkable
class ShardOrder(Protocol):
    """Chooses the next shard of a running conversion and hears of each finished one.

    ``next(pending)`` is called from a conversion thread right before a shard is
    started, with the names not started yet in index order; it returns one of them.
    ``done(name, path)`` is called once the output shard ``path`` (in the staging
    directory) is completely written and fsynced; the file keeps its inode through
    the renames that publish the checkpoint, so a reader that opened it stays valid.
    """

    def next(self, pending: Sequence[str]) -> str: ...

    def done(self, name: str, path: Path) -> None: ...


@dataclass
class _Run:
    """State of one conversion, kept by the calling thread (stage threads only add to ``tally``)."""

    plan: ConversionPlan
    staging: Path
    target: Target
    scale_mode: ScaleMode
    chunk_bytes: int
    host_memory_bytes: int
    progress: Callable[[Progress], None] | None
    shard_order: ShardOrder | None = None
    tally: _Tally = field(default_factory=_Tally)
    tensors_done: int = 0
    bytes_done: int = 0
    convert_bytes_done: int = 0
    output_tensors: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (shard, nbytes)

    def tick(self, shard: str, tensors: int, nbytes: int, converted: int = 0) -> None:
        self.tensors_done += tensors
        self.bytes_done += nbytes
        self.convert_bytes_done += converted
        if self.progress is not None:
            self.progress(
                Progress(shard, self.tensors_done, self.plan.tensor_count, self.bytes_done, self.plan.data_bytes,
                         self.convert_bytes_done, self.plan.convert_bytes)
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
    host_memory_bytes: int = DEFAULT_HOST_MEMORY_BYTES,
    shard_order: ShardOrder | None = None,
    engine: Engine | str | None = None,
) -> ConversionResult:
    """Convert the MXFP8 checkpoint directory ``src`` into a block-FP8 checkpoint directory ``out``.

    ``engine`` (vllm, sglang, transformers): refuse, before anything is written, a checkpoint that engine
    could not load at any tensor-parallel size (see :mod:`transformd.engines`); the result's ``readiness``
    reports every engine either way.

    Refuses a non-empty ``out`` unless ``overwrite``. Everything is written to a
    staging directory next to ``out`` and renamed into place at the end; on any
    error the staging directory is removed and ``out`` is left as it was.

    Reading, converting, writing and fsyncing overlap (a thread each); ``device``
    ``auto`` or ``cuda`` with several GPUs visible spreads the shards over all of them.
    ``host_memory_bytes`` bounds the host buffers between the stages (input
    pieces, converted pieces, and on the CPU the reference's temporaries), split
    evenly between the GPUs; ``chunk_bytes`` bounds the slice of one weight (whole
    experts, or blocks of 128 rows) read and converted at once. The bound holds
    whatever the checkpoint's size; only a budget smaller than a few 128-row blocks
    of the widest weight is exceeded (by that much). Cached GPU memory and pinned
    host memory are given back when the conversion ends.

    ``progress`` is called on the calling thread with a :class:`Progress` as each
    tensor leaves the converter (the writer trails it by at most the buffers).

    ``shard_order`` (see :class:`ShardOrder`) lets a caller change the order of the
    shards while the conversion runs and learn when each output shard is final, so
    that a shard can be served before the whole checkpoint is done.
    """
    started = time.monotonic()
    target, scale_mode = Target(target), ScaleMode(scale_mode)
    src, out = Path(src), Path(out)
    devices = _conversion_devices(device)
    _remove_leftovers(out)
    _check_out(src, out, overwrite)
    plan = plan_conversion(src, select=select)
    report = plan_readiness(plan, target)
    check_engine(report, engine, src)
    needed = output_bytes(plan, target)
    _check_free_space(out, needed)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging, staging_lock = _make_staging(out)
    except OSError as err:
        wrapped = _output_error(err, src, out, needed, None)
        if wrapped is None:
            raise
        raise wrapped from err
    run = _Run(
        plan, staging, target, scale_mode, max(1, chunk_bytes), max(1, host_memory_bytes), progress, shard_order
    )
    try:
        _convert_shards(run, devices)
        _write_metadata_files(run, select)
        _copy_other_files(run)
        _fsync_tree(staging)
        _publish(staging, out, overwrite)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        wrapped = _output_error(exc, src, out, needed, staging) if isinstance(exc, OSError) else None
        if wrapped is not None:
            raise wrapped from exc
        raise
    finally:
        os.close(staging_lock)
    return ConversionResult(
        out=out,
        converted=[p.weight.name for p in plan.selected],
        shards=[s.name for s in plan.shards],
        left_out=[str(f) for f in plan.left_out],
        bytes_read=run.tally.read,
        bytes_written=run.tally.written,
        seconds=time.monotonic() - started,
        target=target.value,
        scale_mode=scale_mode.value,
        device=",".join(str(d) for d in devices),
        host_buffer_bytes=run.tally.buffers_peak,
        readiness=report,
        tensors=plan.tensor_count,
        data_bytes=plan.data_bytes,
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
        total += header + 96 * len(shard.pairs) + sum(tensor_nbytes(d, s) for _, d, s in _output_specs(target, shard))
    for rel in plan.other_files:
        with contextlib.suppress(OSError):
            total += os.stat(plan.src / rel).st_size
    for name in (CONFIG_NAME, HF_QUANT_NAME, INDEX_NAME):
        with contextlib.suppress(OSError):
            total += os.stat(plan.src / name).st_size
    return total


def _existing_parent(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


def _free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (or its nearest parent)."""
    try:
        st = os.statvfs(_existing_parent(path))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _check_free_space(out: Path, needed: int) -> None:
    """Refuse before writing anything when the file system of ``out`` has less free space than the output needs."""
    free = _free_bytes(out.parent)
    if free is not None and free < needed:
        raise OutputError(
            errno.ENOSPC,
            f"not enough free space for the output directory {out}: the conversion writes about {_human(needed)} "
            f"({needed} bytes) and only {_human(free)} ({free} bytes) are free on the file system of "
            f"{_existing_parent(out.parent)}; nothing was written. Free space there or choose another output "
            "directory (--out)",
            out=out, needed_bytes=needed, free_bytes=free,
        )


def _output_error(err: OSError, src: Path, out: Path, needed: int, staging: Path | None) -> OutputError | None:
    """``err`` restated about ``out`` (the caller's directory, not the staging path) when it is a failure to write
    the output; None when it is something else (e.g. reading the source)."""
    if isinstance(err, OutputError):
        return err
    code = err.errno
    where = _existing_parent(out.parent)
    cleaned = "the partial output was removed and nothing" if staging is not None else "nothing"
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(out.parent)
        what = "ran out of disk space" if code == errno.ENOSPC else "ran out of disk quota"
        return OutputError(
            code,
            f"{what} writing the output directory {out}: the conversion writes about {_human(needed)} ({needed} "
            f"bytes), {_human(free) if free is not None else '?'} are free on the file system of {where} now; "
            f"{cleaned} was left beside it. Free space there or choose another output directory (--out)",
            out=out, needed_bytes=needed, free_bytes=free,
        )
    if code == errno.EROFS:
        return OutputError(
            code,
            f"cannot write the output directory {out}: {where} is on a read-only file system; {cleaned} was "
            "written. Choose an output directory (--out) on a writable file system",
            out=out,
        )
    if code in (errno.EACCES, errno.EPERM):
        name = os.fspath(err.filename) if err.filename is not None else None
        within = (lambda d: name == str(d) or name.startswith(str(d).rstrip(os.sep) + os.sep)) if name else None
        # a path beside or inside out (the staging directory) is ours; a source file we may not read is not
        if name is None or (within(out.parent) and not within(src)):
            return OutputError(
                code,
                f"cannot write the output directory {out}: permission denied in {out.parent} (the conversion "
                f"writes a staging directory beside {out.name} and renames it into place); {cleaned} was written",
                out=out,
            )
    return None


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _convert_shards(run: _Run, devices: list[torch.device]) -> None:
    """Write every output shard into the staging directory: a lane per device, the shards spread over them."""
    for shard in run.plan.shards:
        if shard.rewrite:
            outputs = [(name, tensor_nbytes(dtype, shape)) for name, dtype, shape in _output_specs(run.target, shard)]
        else:
            outputs = [(t.name, t.nbytes) for t in shard.header.tensors.values()]
        run.output_tensors.update((name, (shard.name, nbytes)) for name, nbytes in outputs)
    assigned = [(dev, shards) for dev, shards in zip(devices, _assign_shards(run.plan.shards, len(devices))) if shards]
    stages = _Stages()
    lanes = [_Lane(run, stages, dev, shards, run.host_memory_bytes // len(assigned)) for dev, shards in assigned]
    try:
        for lane in lanes:
            lane.start()
        stages.wait(run.tick)
    finally:
        for lane in lanes:
            lane.close()
        _release_cached_memory(devices)


def _output_specs(target: Target, shard: ShardPlan) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of the output shard, in the input's order; a new scale right after its weight."""
    pairs = {p.weight.name: p for p in shard.pairs}
    for t in shard.header.tensors.values():
        if t.name in shard.dropped:
            continue
        pair = pairs.get(t.name)
        if pair is None:
            yield t.name, t.dtype, t.shape
        else:
            yield t.name, target.safetensors_dtype, t.shape
            yield pair.out_scale_name, "F32", pair.out_scale_shape


# -- devices ----------------------------------------------------------------------------------------------------------


def _conversion_devices(device: str | torch.device | None) -> list[torch.device]:
    """Every visible GPU for ``auto``/``cuda`` (no index) when there are several; else the one device asked for."""
    dev = resolve_device(device)
    any_gpu = dev.type == "cuda" and (device is None or str(device) in ("auto", "cuda"))
    return _spread_devices(dev, torch.cuda.device_count() if any_gpu else 1)


def _spread_devices(dev: torch.device, count: int) -> list[torch.device]:
    """``count`` > 1: one device of ``dev``'s type per index; else ``dev`` itself."""
    return [torch.device(dev.type, i) for i in range(count)] if count > 1 else [dev]


def _assign_shards(shards: Sequence[ShardPlan], lanes: int) -> list[list[ShardPlan]]:
    """Spread shards over ``lanes`` devices with about equal bytes each (largest first to the least loaded).

    Every shard goes to exactly one lane; each lane keeps the checkpoint's order (sequential reads).
    """
    load = [0] * lanes
    picked: list[list[int]] = [[] for _ in range(lanes)]
    for i in sorted(range(len(shards)), key=lambda i: -shards[i].header.file_size):
        lane = min(range(lanes), key=lambda j: (load[j], j))
        picked[lane].append(i)
        load[lane] += shards[i].header.file_size
    return [[shards[i] for i in sorted(p)] for p in picked]


def _release_cached_memory(devices: list[torch.device]) -> None:
    """Give PyTorch's cached GPU memory and pinned host memory back, so that an idle process holds none."""
    if any(d.type == "cuda" for d in devices) and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()


# -- pieces and buffers -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Unit:
    """The part of an [N, K] or [E, N, K] weight converted at once: experts [e0, e1), rows [r0, r1) of each.

    Either whole experts (r0 = 0, r1 = N) or rows of one expert with r0 a multiple of 128, so its codes and
    its output scales are each one contiguous range, and it converts to the same bytes as the whole weight.
    """

    shape: tuple[int, ...]
    e0: int
    e1: int
    r0: int
    r1: int

    @property
    def piece_shape(self) -> tuple[int, ...]:
        k = self.shape[-1]
        return (self.e1 - self.e0, self.r1 - self.r0, k) if len(self.shape) == 3 else (self.r1 - self.r0, k)

    @property
    def code_bytes(self) -> int:
        return math.prod(self.piece_shape)

    @property
    def code_offset(self) -> int:
        n, k = self.shape[-2:]
        return (self.e0 * n + self.r0) * k

    @property
    def slot_bytes(self) -> int:
        """Input slot bytes: the codes, then (aligned) the E8M0 scales."""
        return _align(self.code_bytes) + self.code_bytes // MX_BLOCK

    def where(self) -> str:
        """What error indices inside this piece are relative to ("" when they are the weight's own)."""
        n = self.shape[-2]
        if len(self.shape) == 2:
            return f" (indices relative to row {self.r0} of {n})" if self.r0 else ""
        experts = self.shape[0]
        if self.r1 - self.r0 < n and (self.e0 or self.r0):
            return f" (indices relative to row {self.r0} of expert {self.e0} of {experts})"
        return f" (indices relative to expert {self.e0} of {experts})" if self.e0 else ""


def _units(shape: tuple[int, ...], piece_bytes: int) -> list[_Unit]:
    """Cut a weight into pieces of at most ``piece_bytes`` code bytes: whole experts, else blocks of 128 rows.

    A piece is never smaller than one expert of at most 128 rows, or 128 rows of a larger one.
    """
    *lead, n, k = shape
    experts = lead[0] if lead else 1
    matrix = n * k
    if matrix <= piece_bytes or n <= TILE:
        step = max(1, piece_bytes // max(1, matrix))
        units = [_Unit(shape, e0, min(experts, e0 + step), 0, n) for e0 in range(0, experts, step)]
        return units or [_Unit(shape, 0, 0, 0, n)]  # no experts: one empty piece
    rows = max(TILE, piece_bytes // k // TILE * TILE)
    return [_Unit(shape, e, e + 1, r0, min(n, r0 + rows)) for e in range(experts) for r0 in range(0, n, rows)]


def _slot_views(slot: torch.Tensor, unit: _Unit) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, E8M0 scales) of ``unit`` in an input slot, as shaped uint8 views."""
    shape, nc = unit.piece_shape, unit.code_bytes
    codes = slot[:nc].view(shape)
    scales = slot[_align(nc) : _align(nc) + nc // MX_BLOCK].view(*shape[:-1], shape[-1] // MX_BLOCK)
    return codes, scales


@dataclass(frozen=True)
class _BufferSizes:
    """How one lane cuts its share of ``host_memory_bytes`` (see :func:`_size_buffers`)."""

    piece_bytes: int  # most code bytes of one weight read and converted at once
    slot_bytes: int  # one host buffer: a piece's codes and scales (input), or its converted codes (output)
    slots: int  # buffers in each of the two pools
    work_bytes: int  # the CPU reference's temporaries while it converts one piece

    @property
    def bound_bytes(self) -> int:
        return 2 * self.slots * self.slot_bytes + self.work_bytes


def _size_buffers(
    pairs: Iterable[MxPair], memory_bytes: int, chunk_bytes: int, *, pinned: bool, work_factor: int
) -> _BufferSizes:
    """Cut ``memory_bytes`` into two pools of at least ``MIN_SLOTS`` slots each, plus the CPU's work space.

    Pieces are at most ``chunk_bytes`` of codes and small enough for that; a slot is as large as the largest
    piece of ``pairs`` needs, and no larger. Pinned slots are powers of two (the pinned allocator rounds every
    size up to one). A budget too small for one 128-row piece is exceeded by the pieces' size, not refused.
    """
    cap = memory_bytes // (2 * MIN_SLOTS + work_factor)
    if pinned:
        cap = 1 << max(0, cap.bit_length() - 1)
    piece = max(1, min(chunk_bytes, cap * MX_BLOCK // (MX_BLOCK + 1) - SLOT_ALIGN))
    need = max((u.slot_bytes for p in pairs for u in _units(p.weight.shape, piece)), default=0)
    slot = max(SLOT_ALIGN, 1 << (need - 1).bit_length() if pinned else _align(need))
    slots = max(MIN_SLOTS, min(MAX_SLOTS, (memory_bytes - work_factor * slot) // (2 * slot)))
    return _BufferSizes(piece, slot, slots, work_factor * slot)


def _align(n: int) -> int:
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


class _SlotPool:
    """At most ``count`` host buffers of ``slot_bytes`` each, allocated on first need and then reused.

    One stage takes slots (only that one thread), a later stage gives them back; taking waits while all
    are out, until the stages stop. Pinned (page-locked) when they feed a GPU, for full-speed copies.
    """

    def __init__(self, sizes: _BufferSizes, *, pinned: bool, stages: _Stages, tally: _Tally):
        self.slot_bytes, self.count, self.pinned = sizes.slot_bytes, sizes.slots, pinned
        self._stages, self._tally = stages, tally
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._made = 0

    def take(self) -> torch.Tensor:
        if self._free.empty() and self._made < self.count:
            self._made += 1
            self._tally.add(buffers=self.slot_bytes)
            return torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        while True:
            self._stages.check()
            try:
                return self._free.get(timeout=POLL_S)
            except queue.Empty:
                pass

    def give(self, slot: torch.Tensor) -> None:
        self._free.put(slot)

    def close(self) -> None:
        while not self._free.empty():
            self._free.get_nowait()
        self._tally.add(buffers=-self._made * self.slot_bytes)
        self._made = 0


# -- converters: one piece, on one device -------------------------------------------------------------------------


class _ReferenceConverter:
    """CPU: :func:`transformd.convert_weight` (the PyTorch reference); the codes go into the output slot."""

    def __init__(self, target: Target, scale_mode: ScaleMode):
        self.target, self.scale_mode = target, scale_mode

    def __call__(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        q, scale_inv = convert_weight(codes, scales, self.target, self.scale_mode, "cpu")
        out.copy_(q.view(torch.uint8))
        return scale_inv

    def close(self) -> None:
        pass


class _KernelConverter:
    """GPU: the fused Triton kernel, between two device buffers of one slot each, reused for every piece.

    Host slot -> device (asynchronous copy from pinned memory) -> kernel -> host slot; one synchronisation per
    piece (the kernel's status check). Also runs on the CPU under ``TRITON_INTERPRET=1`` (tests).
    """

    #: Each converter's first launch (which may JIT-compile and load the kernel) runs alone: lanes on several
    #: GPUs would otherwise fill Triton's caches from several threads at once.
    _first_launch = threading.Lock()

    def __init__(self, device: torch.device, slot_bytes: int, target: Target, scale_mode: ScaleMode):
        if device.type == "cuda":
            torch.cuda.set_device(device)  # Triton launches on the thread's current device
        self.device, self.target, self.scale_mode = device, target, scale_mode
        self._in: torch.Tensor | None = torch.empty(slot_bytes, dtype=torch.uint8, device=device)
        self._out: torch.Tensor | None = torch.empty(slot_bytes, dtype=torch.uint8, device=device)
        self._launched = False

    def __call__(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        assert self._in is not None and self._out is not None
        n = codes.numel()
        d_codes = self._in[:n].view(codes.shape)
        d_scales = self._in[_align(n) : _align(n) + scales.numel()].view(scales.shape)
        d_codes.copy_(codes, non_blocking=True)
        d_scales.copy_(scales, non_blocking=True)
        *lead, rows, k = codes.shape
        d_q = self._out[:n].view(codes.shape)
        d_scale_inv = torch.empty((*lead, *tile_grid(rows, k)), dtype=torch.float32, device=self.device)
        if self._launched:
            convert_triton(d_codes, d_scales, self.target, self.scale_mode, out=(d_q, d_scale_inv))
        else:
            with self._first_launch:
                convert_triton(d_codes, d_scales, self.target, self.scale_mode, out=(d_q, d_scale_inv))
            self._launched = True
        out.copy_(d_q, non_blocking=True)
        scale_inv = d_scale_inv.cpu()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the slots may be reused once this returns
        return scale_inv

    def close(self) -> None:
        self._in = self._out = None


def _make_converter(
    device: torch.device, slot_bytes: int, target: Target, scale_mode: ScaleMode
) -> _ReferenceConverter | _KernelConverter:
    if device.type == "cpu":
        return _ReferenceConverter(target, scale_mode)
    return _KernelConverter(device, slot_bytes, target, scale_mode)


# -- what flows between the stages ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CopyShard:
    """Copy this shard's file as it is (nothing in it changes)."""

    shard: ShardPlan


@dataclass(frozen=True)
class _OpenShard:
    """Start writing this output shard (header first)."""

    shard: ShardPlan


@dataclass(frozen=True)
class _CopyTensor:
    """Copy this tensor's bytes from the input shard into the output shard."""

    shard: str
    tensor: TensorInfo


@dataclass(frozen=True)
class _DropTensor:
    """An input scale of a converted weight: nothing to write (counted for progress only)."""

    shard: str
    tensor: TensorInfo


@dataclass(frozen=True)
class _Piece:
    """Reader -> converter: one piece of an MXFP8 weight, read into an input slot."""

    pair: MxPair
    unit: _Unit
    slot: torch.Tensor
    last: bool


@dataclass(frozen=True)
class _Append:
    """Converter -> writer: the next bytes of tensor ``name``; ``slot`` goes back to the output pool after."""

    name: str
    data: torch.Tensor
    slot: torch.Tensor | None = None


@dataclass(frozen=True)
class _CloseShard:
    """This output shard is complete: hand it to the syncer (which checks, fsyncs and closes it)."""

    shard: ShardPlan


_END = object()  # the last item a stage sends


# -- the pipeline helper ----------------------------------------------------------------------------------------


class _Stopped(Exception):
    """Unwinds a stage quietly once another stage has failed or the caller gave up."""


class _Stages:
    """Threads joined by bounded channels; the first error stops them all.

    Stage threads report to the calling thread through one queue, in the order things happen: progress
    ticks, their error, their exit. :meth:`wait` (on the calling thread) applies the ticks, and re-raises
    the first error once every stage has been stopped and joined.
    """

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def channel(self, maxsize: int = CHANNEL_ITEMS) -> _Channel:
        return _Channel(self, maxsize)

    def check(self) -> None:
        """Raise :class:`_Stopped` if the stages were stopped (stages call this wherever they wait)."""
        if self._stop.is_set():
            raise _Stopped

    def tick(self, shard: str, tensors: int, nbytes: int, converted: int = 0) -> None:
        self._events.put(("tick", (shard, tensors, nbytes, converted)))

    def start(self, name: str, stage: Callable[[], None]) -> None:
        def body() -> None:
            try:
                stage()
            except _Stopped:
                pass
            except BaseException as err:  # noqa: BLE001 - handed to the calling thread, which raises it
                self._stop.set()
                traceback.clear_frames(err.__traceback__)  # drop the frames' buffers; keep file and line
                self._events.put(("error", err))
            finally:
                self._events.put(("exit", name))

        thread = threading.Thread(target=body, name=f"transformd-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def wait(self, on_tick: Callable[[str, int, int, int], None]) -> None:
        """Apply ticks until every stage has exited; on an error (or an exception here) stop all, join, raise."""
        running = len(self._threads)
        try:
            while running:
                try:
                    kind, payload = self._events.get(timeout=1.0)
                except queue.Empty:
                    continue
                if kind == "tick":
                    on_tick(*payload)
                elif kind == "error":
                    raise payload
                else:
                    running -= 1
        finally:
            self._stop.set()
            for thread in self._threads:
                thread.join()


class _Channel:
    """A bounded FIFO from one stage to the next; waiting ends with :class:`_Stopped` when the stages stop."""

    def __init__(self, stages: _Stages, maxsize: int):
        self._stages = stages
        self._queue: queue.Queue[Any] = queue.Queue(maxsize)

    def put(self, item: Any) -> None:
        while True:
            self._stages.check()
            try:
                return self._queue.put(item, timeout=POLL_S)
            except queue.Full:
                pass

    def get(self) -> Any:
        while True:
            self._stages.check()
            try:
                return self._queue.get(timeout=POLL_S)
            except queue.Empty:
                pass

    def drain(self) -> list[Any]:
        """Take out whatever is left (once the stages have been joined)."""
        items = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items


# -- one lane: the four stages of one device ----------------------------------------------------------------------


class _Lane:
    """The reader, converter, writer and syncer of one device, its shards, and the slots between them."""

    def __init__(self, run: _Run, stages: _Stages, device: torch.device, shards: list[ShardPlan], memory: int):
        if device.type == "cuda" and device.index is None:  # the caller's current GPU (stage threads start on 0)
            device = torch.device("cuda", torch.cuda.current_device())
        self.run, self.stages, self.device, self.shards = run, stages, device, shards
        self.pairs = {p.weight.name: p for s in shards for p in s.pairs}
        pinned = device.type == "cuda"
        work = CPU_WORK_FACTOR if device.type == "cpu" else 0
        self.sizes = _size_buffers(self.pairs.values(), memory, run.chunk_bytes, pinned=pinned, work_factor=work)
        self.inputs = _SlotPool(self.sizes, pinned=pinned, stages=stages, tally=run.tally)
        self.outputs = _SlotPool(self.sizes, pinned=pinned, stages=stages, tally=run.tally)
        self.to_converter = stages.channel()
        self.to_writer = stages.channel()
        self.to_syncer = stages.channel(SYNC_BACKLOG)

    def start(self) -> None:
        stages = (("read", self.read), ("convert", self.convert), ("write", self.write), ("sync", self.sync))
        for name, stage in stages:
            self.stages.start(f"{name}-{self.device}", stage)

    def close(self) -> None:
        """Drop every buffer and close files left open by a stop (after the stages have been joined)."""
        self.to_converter.drain()
        self.to_writer.drain()
        for item in self.to_syncer.drain():
            if item is not _END and not isinstance(item, Path):
                item.abort()  # a SafetensorsWriter the syncer did not get to
        self.inputs.close()
        self.outputs.close()

    # -- reader

    def read(self) -> None:
        files = _OpenFiles(self.run.plan.src)
        pending = list(self.shards)
        try:
            while pending:
                shard = self._next_shard(pending)
                pending.remove(shard)
                if not shard.rewrite:
                    self.to_converter.put(_CopyShard(shard))
                    continue
                self.to_converter.put(_OpenShard(shard))
                for t in shard.header.tensors.values():
                    if t.name in shard.dropped:
                        self.to_converter.put(_DropTensor(shard.name, t))
                    elif t.name in self.pairs:
                        self._read_pair(self.pairs[t.name], files)
                    else:
                        self.to_converter.put(_CopyTensor(shard.name, t))
                self.to_converter.put(_CloseShard(shard))
        finally:
            files.close()
        self.to_converter.put(_END)

    def _next_shard(self, pending: list[ShardPlan]) -> ShardPlan:
        """The caller's choice through ``shard_order`` (a name it does not know: index order)."""
        if self.run.shard_order is None:
            return pending[0]
        name = self.run.shard_order.next([s.name for s in pending])
        return next((s for s in pending if s.name == name), pending[0])

    def _read_pair(self, pair: MxPair, files: _OpenFiles) -> None:
        units = _units(pair.weight.shape, self.sizes.piece_bytes)
        for i, unit in enumerate(units):
            slot = self.inputs.take()
            codes, scales = _slot_views(slot, unit)
            files.read_into(pair.weight_shard, pair.weight.begin + unit.code_offset, codes)
            self.run.tally.add(read=codes.numel() + _read_scales(pair, unit, files, scales))
            self.to_converter.put(_Piece(pair, unit, slot, last=i == len(units) - 1))

    # -- converter

    def convert(self) -> None:
        converter = _make_converter(self.device, self.sizes.slot_bytes, self.run.target, self.run.scale_mode)
        try:
            scales: list[torch.Tensor] = []
            while (item := self.to_converter.get()) is not _END:
                if isinstance(item, _Piece):
                    scales.append(self._convert_piece(converter, item))
                    if item.last:  # the weight's codes are all out: now its scales, in order
                        for piece in scales:
                            self.to_writer.put(_Append(item.pair.out_scale_name, piece))
                        scales = []
                        nbytes = item.pair.weight.nbytes
                        self.stages.tick(item.pair.weight_shard, 1, nbytes, converted=nbytes)
                elif isinstance(item, _DropTensor):
                    self.stages.tick(item.shard, 1, item.tensor.nbytes)
                else:
                    self.to_writer.put(item)
                    if isinstance(item, _CopyTensor):
                        self.stages.tick(item.shard, 1, item.tensor.nbytes)
                    elif isinstance(item, _CopyShard):
                        header = item.shard.header
                        self.stages.tick(item.shard.name, len(header.tensors), header.data_bytes)
            self.to_writer.put(_END)
        finally:
            converter.close()

    def _convert_piece(self, converter: _ReferenceConverter | _KernelConverter, piece: _Piece) -> torch.Tensor:
        """Convert one piece into an output slot and send it to the writer; return its output scales."""
        out = self.outputs.take()
        codes, scales = _slot_views(piece.slot, piece.unit)
        converted = out[: codes.numel()].view(codes.shape)
        try:
            scale_inv = converter(codes, scales, converted)
        except MxFormatError as err:
            problem = f"{err.problem}{piece.unit.where()}"
            file = str(self.run.plan.src / piece.pair.weight_shard)
            raise MxFormatError(problem, tensor=piece.pair.weight.name, file=file) from None
        self.inputs.give(piece.slot)
        self.to_writer.put(_Append(piece.pair.weight.name, converted, out))
        return scale_inv.to(torch.float32)

    # -- writer

    def write(self) -> None:
        writer: SafetensorsWriter | None = None
        source: BinaryIO | None = None
        try:
            while (item := self.to_writer.get()) is not _END:
                if isinstance(item, _Append):
                    assert writer is not None
                    writer.write(item.name, item.data)
                    if item.slot is not None:
                        self.outputs.give(item.slot)
                elif isinstance(item, _CopyTensor):
                    assert writer is not None and source is not None
                    writer.copy_from(item.tensor.name, source, item.tensor.begin)
                    self.run.tally.add(read=item.tensor.nbytes)
                elif isinstance(item, _OpenShard):
                    shard = item.shard
                    source = open(self.run.plan.src / shard.name, "rb")  # noqa: SIM115 - closed below
                    specs = list(_output_specs(self.run.target, shard))
                    writer = SafetensorsWriter(self.run.staging / shard.name, specs, shard.header.metadata)
                elif isinstance(item, _CloseShard):
                    assert writer is not None and source is not None
                    source.close()
                    source = None
                    self.to_syncer.put(writer)  # checked, fsynced and closed there
                    writer = None
                elif isinstance(item, _CopyShard):
                    dst = self.run.staging / item.shard.name
                    size = _copy_file(self.run.plan.src / item.shard.name, dst, check=self.stages.check, fsync=False)
                    self.run.tally.add(read=size)
                    self.to_syncer.put(dst)
            self.to_syncer.put(_END)
        finally:
            if writer is not None:
                writer.abort()
            if source is not None:
                source.close()

    # -- syncer

    def sync(self) -> None:
        """Make each file the writer has finished durable, while the writer goes on with the next."""
        while (item := self.to_syncer.get()) is not _END:
            if isinstance(item, Path):
                path = item
                self.run.tally.add(written=_fsync_file(path))
            else:
                item.close()  # SafetensorsWriter: checks every tensor is complete, fsyncs, closes
                path = item.path
                self.run.tally.add(written=item.bytes_written)
            if self.run.shard_order is not None:
                self.run.shard_order.done(path.name, path)


def _read_scales(pair: MxPair, unit: _Unit, files: _OpenFiles, out: torch.Tensor) -> int:
    """Read the E8M0 scales of ``unit`` into ``out`` (one row of scales per weight row); return the bytes read.

    Rx32 block scales (Quark ``per_block``) are read once per block row and repeated for the R rows they cover.
    """
    if pair.row_block == 1:
        files.read_into(pair.scale_shard, pair.scale.begin + unit.code_offset // MX_BLOCK, out)
        return out.numel()
    *_, rows, kb = pair.scale.shape
    first, stop = unit.r0 // pair.row_block, (unit.r1 - 1) // pair.row_block + 1
    block = torch.empty((unit.e1 - unit.e0, stop - first, kb), dtype=torch.uint8)
    for i, e in enumerate(range(unit.e0, unit.e1)):
        files.read_into(pair.scale_shard, pair.scale.begin + (e * rows + first) * kb, block[i])
    per_row = expand_row_blocks(block, stop * pair.row_block - first * pair.row_block, pair.row_block)
    skip = unit.r0 - first * pair.row_block
    out.copy_(per_row[:, skip : skip + unit.r1 - unit.r0].reshape(out.shape))
    return block.numel()


class _OpenFiles:
    """Input shards opened on first use (by name), for positional reads, until :meth:`close`."""

    def __init__(self, src: Path):
        self.src = src
        self._fds: dict[str, int] = {}

    def read_into(self, shard: str, offset: int, buf: torch.Tensor) -> None:
        """Fill the uint8 tensor ``buf`` with ``shard``'s bytes from absolute offset ``offset``."""
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(self.src / shard, os.O_RDONLY)
        view = memoryview(buf.reshape(-1).numpy()).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if not got:
                end = offset + len(view)
                problem = f"file ended {len(view) - done} bytes early while reading bytes [{offset}, {end})"
                raise CheckpointError(problem, file=self.src / shard)
            done += got

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


# -------------------------------------------------------------------------------------------------------------------
# Index, config.json, hf_quant_config.json, other files


def _write_metadata_files(run: _Run, select: str | None) -> None:
    """config.json and the index of the output. hf_quant_config.json is not carried over: it describes the MXFP8
    input (ModelOpt's legacy place for the recipe) and some loaders read it before config.json."""
    plan = run.plan
    if plan.index is not None:
        run.tally.add(written=_write_json(run.staging / INDEX_NAME, _rewrite_index(plan.index, run.output_tensors)))
    unquantized = unquantized_modules(spec for shard in plan.shards for spec in _output_specs(run.target, shard))
    qc = output_quantization_config(plan.config, plan.hf_quant_config, unquantized, _transformd_record(run, select))
    run.tally.add(written=_write_json(run.staging / CONFIG_NAME, {**plan.config, "quantization_config": qc}))


def _rewrite_index(index: dict[str, Any], output_tensors: dict[str, tuple[str, int]]) -> dict[str, Any]:
    new = dict(index)
    metadata = dict(index.get("metadata") or {})
    metadata["total_size"] = sum(nbytes for _, nbytes in output_tensors.values())
    new["metadata"] = metadata
    new["weight_map"] = {name: shard for name, (shard, _) in sorted(output_tensors.items())}
    return new


def _transformd_record(run: _Run, select: str | None) -> dict[str, Any]:
    # No package version here: the output's bytes must depend only on what the cache key
    # covers (source content, recipe, FORMAT_VERSION), so releases share cache entries.
    record: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "target": run.target.value,
        "scale_mode": run.scale_mode.value,
        "weight_dtype": run.target.safetensors_dtype,
    }
    source = source_quantization(run.plan.config, run.plan.hf_quant_config)
    if source:
        record["source_quantization"] = source
    if select is not None:
        record["select"] = select
    return record


def _copy_other_files(run: _Run) -> None:
    for rel in run.plan.other_files:
        dst = run.staging / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        size = _copy_file(run.plan.src / rel, dst)
        run.tally.add(read=size, written=size)


# -------------------------------------------------------------------------------------------------------------------
# Durable file operations


def _copy_file(src: Path, dst: Path, *, check: Callable[[], None] | None = None, fsync: bool = True) -> int:
    """Copy a file's bytes (following symlinks, as in an HF cache snapshot) and fsync the copy (unless not ``fsync``).

    Uses ``copy_file_range`` (in the kernel; a reflink where the file system shares extents) where it
    works, else positional reads and writes; ``check`` (the pipeline's stop check) runs between steps of
    ``COPY_STEP`` bytes, so a long copy can be abandoned.
    """
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        src_fd, dst_fd = fin.fileno(), fout.fileno()
        size = os.fstat(src_fd).st_size
        fast = hasattr(os, "copy_file_range")
        pos = 0
        while pos < size:
            if check is not None:
                check()
            step = min(COPY_STEP, size - pos)
            if fast:
                try:
                    done = os.copy_file_range(src_fd, dst_fd, step, pos, pos)
                except OSError:  # e.g. EXDEV/EINVAL/ENOSYS on some kernels and file systems
                    done = 0
                if done == 0:  # unsupported here (or the file shrank): the plain path decides
                    fast = False
                    continue
            else:
                done = _copy_by_reads(src_fd, dst_fd, pos, step)
                if done == 0:
                    raise CheckpointError(f"file ended at byte {pos} while copying its {size} bytes", file=src)
            pos += done
        if fsync:
            os.fsync(dst_fd)
    return size


def _fsync_file(path: Path) -> int:
    """fsync a file written earlier (through another descriptor); returns its size."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _copy_by_reads(src_fd: int, dst_fd: int, pos: int, n: int) -> int:
    data = os.pread(src_fd, n, pos)
    view = memoryview(data)
    while view:
        view = view[os.pwrite(dst_fd, view, pos + len(data) - len(view)) :]
    return len(data)


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


#: Names beside ``out`` (``.<out name>.<tag>-<token>``): the staging directory, the same before it is locked,
#: and the old ``out`` that ``overwrite`` moves aside until the new one is in place.
_STAGING_TAG, _NEW_TAG, _OLD_TAG = "transformd-staging", "transformd-new", "transformd-old"
#: An unlocked ``-new-`` directory (a kill between its mkdir and its rename) is removed once this old (seconds).
_NEW_MAX_AGE_S = 60.0


def _make_staging(out: Path) -> tuple[Path, int]:
    """Create the staging directory beside ``out``, flock-ed until the returned descriptor is closed.

    The lock tells a later conversion into ``out`` that the directory is in use (:func:`_remove_leftovers`); the
    directory is created under another name and renamed once locked, so a scan never finds it unlocked.
    """
    token = uuid.uuid4().hex[:12]
    new = out.parent / f".{out.name}.{_NEW_TAG}-{token}"
    new.mkdir()
    try:
        fd = os.open(new, os.O_RDONLY | os.O_DIRECTORY)
    except BaseException:
        new.rmdir()
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # a file system without flock: scans cannot tell it is in use either, and leave it alone
        staging = out.parent / f".{out.name}.{_STAGING_TAG}-{token}"
        os.rename(new, staging)
    except BaseException:
        os.close(fd)
        shutil.rmtree(new, ignore_errors=True)
        raise
    return staging, fd


def _lock_free(path: Path) -> bool | None:
    """True when no process holds an flock on the directory ``path``, False when one does, None when unknown."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)  # releases the probe's lock


def _remove_leftovers(out: Path) -> None:
    """Remove what killed conversions into ``out`` left beside it; undo an ``overwrite`` killed mid-publish.

    Only directories no live conversion holds (flock, see :func:`_make_staging`) are touched: staging directories,
    and the old ``out`` that ``overwrite`` moved aside, which is removed once ``out`` is in place, or renamed back
    when the kill came between the two renames of :func:`_publish`. Best effort: where locks or removal do not
    work, things are left as they are.
    """
    prefix = f".{out.name}."
    try:
        names = sorted(n for n in os.listdir(out.parent) if n.startswith(prefix))
    except OSError:
        return
    live, olds = False, []
    for name in names:
        tag, _, _token = name[len(prefix) :].rpartition("-")
        path = out.parent / name
        if tag == _OLD_TAG:
            olds.append(path)
        elif tag in (_STAGING_TAG, _NEW_TAG):
            free = _lock_free(path)
            if free and tag == _NEW_TAG:
                with contextlib.suppress(OSError):
                    free = time.time() - os.lstat(path).st_mtime > _NEW_MAX_AGE_S
            if free:
                shutil.rmtree(path, ignore_errors=True)
            else:
                live = True
    if not olds or live:
        return
    with contextlib.suppress(OSError):
        if out.exists():
            if _lock_free(out):  # a finished publish that was killed while removing the old output
                for old in olds:
                    shutil.rmtree(old, ignore_errors=True)
        elif len(olds) == 1:  # killed between moving the old output aside and renaming the new one into place
            os.rename(olds[0], out)


def _publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished staging directory to ``out``; an old non-empty ``out`` (overwrite) goes only after."""
    old: Path | None = None
    if out.exists():
        if any(out.iterdir()):
            if not overwrite:  # appeared while we were converting
                raise CheckpointError("the output directory became non-empty during the conversion", file=out)
            old = out.parent / f".{out.name}.{_OLD_TAG}-{uuid.uuid4().hex[:12]}"
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
