"""Reconstruction error of a conversion: how far the block-FP8 output is from the MXFP8 input.

Both sides are decoded exactly (:func:`~transformd.reference.dequantize_mx` for
the input; :func:`~transformd.reference.dequantize_block` for the output, with
the scale in float64 so that ``fp8(q) * scale_inv`` is not rounded) and
compared in float64:

* ``rel_l2 = ||out - in||_2 / ||in||_2``;
* ``exact_fraction``: elements whose output value equals the input value (``-0``
  and ``+0`` count as equal: FNUZ has no ``-0``, and the conversion maps it to ``+0``);
* ``max_abs_err``: ``max |out - in|``.

:func:`compare_checkpoints` pairs a converted checkpoint with its source, one
tensor in memory at a time (3-D expert tensors one expert at a time);
:func:`compare_modes` and :func:`compare_modes_checkpoint` convert with the
PyTorch reference in both scale modes, for an ``exact`` vs ``amax`` comparison.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .formats import ScaleMode, Target, infer_row_block
from .mx import as_codes, expand_row_blocks
from .reference import convert_reference, dequantize_block, dequantize_mx
from .safetensors_io import TensorInfo, read_header, read_tensor

__all__ = [
    "LEGEND",
    "Report",
    "TensorError",
    "TensorRow",
    "compare_checkpoints",
    "compare_modes",
    "compare_modes_checkpoint",
    "tensor_error",
    "transformd_record",
]

#: What the columns of :meth:`Report.format_table` mean (both sides decoded exactly, compared in float64).
LEGEND = (
    "rel L2 = ||converted - MXFP8||_2 / ||MXFP8||_2 over the decoded values; exact % = share of elements whose "
    "converted value equals the MXFP8 value bit for bit; max abs err = largest |converted - MXFP8|"
)

#: safetensors dtype of a converted weight -> its target.
_OUT_DTYPES = {Target.FNUZ.safetensors_dtype: Target.FNUZ, Target.OCP.safetensors_dtype: Target.OCP}
#: safetensors dtypes of an E8M0 scale.
_E8M0_DTYPES = ("U8", "F8_E8M0")
#: Name endings of an MXFP8 input scale next to its weight W (``X.weight_scale``, ``X.weight_scale_inv``,
#: ``X_scale_inv``).
_SCALE_SUFFIXES = ("_scale", "_scale_inv")


@dataclass(frozen=True)
class TensorError:
    """Reconstruction error of one tensor (or of several, merged with :meth:`combine`)."""

    numel: int
    rel_l2: float
    exact_fraction: float
    max_abs_err: float
    #: Raw sums kept so that errors can be merged exactly.
    exact: int = field(repr=False)
    sq_err: float = field(repr=False)
    sq_ref: float = field(repr=False)

    @classmethod
    def from_sums(cls, numel: int, exact: int, sq_err: float, sq_ref: float, max_abs_err: float) -> TensorError:
        if sq_ref > 0:
            rel = math.sqrt(sq_err) / math.sqrt(sq_ref)
        else:
            rel = 0.0 if sq_err == 0 else math.inf
        return cls(numel, rel, exact / numel if numel else 1.0, max_abs_err, exact, sq_err, sq_ref)

    @classmethod
    def combine(cls, errors: Iterable[TensorError]) -> TensorError:
        """Element-weighted merge: exact counts and squared sums add up, maxima take the max."""
        errors = list(errors)
        return cls.from_sums(
            sum(e.numel for e in errors),
            sum(e.exact for e in errors),
            math.fsum(e.sq_err for e in errors),
            math.fsum(e.sq_ref for e in errors),
            max((e.max_abs_err for e in errors), default=0.0),
        )


def tensor_error(
    codes: torch.Tensor,
    scales: torch.Tensor,
    out_codes: torch.Tensor,
    scale_inv: torch.Tensor,
    target: Target | str,
) -> TensorError:
    """Error of a converted weight against its MXFP8 source.

    ``codes``/``scales``: the MXFP8 input (e4m3fn codes, E8M0 scales; uint8 or
    float8 views). ``out_codes``/``scale_inv``: the block-FP8 output (codes of
    ``target``'s dtype, or uint8; float32 ``[..., Nt, Kt]``). 2-D or 3-D; 3-D
    is measured one expert at a time.
    """
    codes, out_codes = as_codes(codes), as_codes(out_codes)
    if codes.shape != out_codes.shape:
        raise ValueError(f"output shape {list(out_codes.shape)} differs from input shape {list(codes.shape)}")
    if codes.dim() == 3:
        return TensorError.combine(
            tensor_error(codes[i], scales[i], out_codes[i], scale_inv[i], target) for i in range(codes.shape[0])
        )
    ref = dequantize_mx(codes, scales).to(torch.float64)
    # float64 scale: fp8 value * scale_inv is computed without rounding (4 + 24 significant bits).
    out = dequantize_block(out_codes, scale_inv.to(torch.float64), target)
    diff = out - ref
    return TensorError.from_sums(
        numel=ref.numel(),
        exact=int((out == ref).sum()),
        sq_err=float(diff.square().sum()),
        sq_ref=float(ref.square().sum()),
        max_abs_err=float(diff.abs().max()) if diff.numel() else 0.0,
    )


def compare_modes(
    codes: torch.Tensor, scales: torch.Tensor, target: Target | str = Target.FNUZ
) -> dict[str, TensorError]:
    """Convert an MXFP8 weight with the reference in every scale mode; ``{"exact": ..., "amax": ...}``."""
    result = {}
    for mode in ScaleMode:
        q, s = convert_reference(codes, scales, target, mode)
        result[mode.value] = tensor_error(codes, scales, q, s, target)
    return result


@dataclass(frozen=True)
class TensorRow:
    """One line of a :class:`Report`."""

    name: str
    shape: tuple[int, ...]
    error: TensorError


@dataclass
class Report:
    """Per-tensor and overall reconstruction error of one conversion."""

    target: str
    scale_mode: str | None
    rows: list[TensorRow]

    @property
    def overall(self) -> TensorError:
        """Element-weighted exact fraction; rel L2 from the summed squares of all tensors."""
        return TensorError.combine(row.error for row in self.rows)

    def format_table(self, *, legend: bool = False) -> str:
        """A fixed-width table: tensor, shape, rel L2, exact %, max abs err; then the overall line
        (and, with ``legend``, :data:`LEGEND`: what the columns mean)."""
        header = ("tensor", "shape", "rel L2", "exact %", "max abs err")
        lines = [(r.name, _shape(r.shape), *_cells(r.error)) for r in self.rows]
        overall = self.overall
        total = (f"overall ({len(self.rows)} tensors)", f"{overall.numel} el", *_cells(overall))
        widths = [max(len(line[i]) for line in [header, *lines, total]) for i in range(len(header))]

        def fmt(cells: tuple[str, ...]) -> str:
            return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

        mode = self.scale_mode or "unknown"
        rule = "-" * len(fmt(header))
        return "\n".join(
            [f"target {self.target}, scale mode {mode}", fmt(header), rule, *map(fmt, lines), rule, fmt(total)]
            + ([LEGEND] if legend else [])
        )

    def as_dict(self) -> dict:
        """JSON-ready form: target, scale mode, overall and per-tensor errors."""

        def err(e: TensorError) -> dict:
            return {k: v for k, v in asdict(e).items() if k in ("numel", "rel_l2", "exact_fraction", "max_abs_err")}

        return {
            "target": self.target,
            "scale_mode": self.scale_mode,
            "overall": err(self.overall),
            "tensors": [{"name": r.name, "shape": list(r.shape), **err(r.error)} for r in self.rows],
        }


def compare_checkpoints(
    src_dir: str | Path, out_dir: str | Path, target: Target | str | None = None
) -> Report:
    """Compare every converted weight of ``out_dir`` with its MXFP8 source in ``src_dir``.

    A converted weight is ``X.weight`` (F8_E4M3FNUZ or F8_E4M3) with a float32
    ``X.weight_scale_inv`` in the output whose source has ``X.weight`` and an
    E8M0 ``X.weight_scale`` or ``X.weight_scale_inv``. The target is read from
    the tensors' dtype; ``target`` (or the output config's
    ``quantization_config.transformd.target``), when given, must agree with it.
    Raises ``ValueError`` when no converted weight is found.
    """
    src, out = _Checkpoint(Path(src_dir)), _Checkpoint(Path(out_dir))
    record = transformd_record(Path(out_dir))
    expected = Target(target) if target is not None else (Target(record["target"]) if "target" in record else None)
    rows: list[TensorRow] = []
    seen_target: Target | None = None
    parts = src.expert_parts() if record.get("layout") == "per-expert" else {}
    for name in out.names():
        if not name.endswith("_scale_inv") or out.dtype[name] != "F32":
            continue
        weight = name.removesuffix("_scale_inv")
        tgt = _OUT_DTYPES.get(out.dtype.get(weight, ""))
        src_scale = src.mx_scale(weight)
        if tgt is None or (src_scale is None and weight not in parts):
            continue
        if expected is not None and tgt is not expected:
            raise ValueError(
                f"{weight} in {out.file[weight].name} is {tgt.safetensors_dtype}, not target {expected.value}")
        seen_target = tgt
        if src_scale is not None:
            codes, scales = src.load_mx(weight, src_scale)
        else:  # one expert (gate or up rows) of a fused stack the output holds per expert
            stack, e, r0, r1 = parts[weight]
            codes, scales = src.load_stack(stack)
            codes, scales = codes[e, r0:r1], scales[e, r0:r1]
        error = tensor_error(codes, scales, out.load(weight), out.load(name), tgt)
        rows.append(TensorRow(weight, out.shape[weight], error))
    if not rows or seen_target is None:
        raise ValueError(f"no converted MXFP8 weight found in {out_dir} (compared with {src_dir})")
    return Report(seen_target.value, record.get("scale_mode"), rows)


def compare_modes_checkpoint(src_dir: str | Path, target: Target | str = Target.FNUZ) -> dict[str, Report]:
    """Convert every MXFP8 weight of ``src_dir`` with the reference in both modes, in memory.

    Returns ``{"exact": Report, "amax": Report}``; nothing is written.
    Raises ``ValueError`` when the checkpoint has no MXFP8 weight.
    """
    src = _Checkpoint(Path(src_dir))
    target = Target(target)
    rows: dict[str, list[TensorRow]] = {mode.value: [] for mode in ScaleMode}
    for weight, scale in src.mx_pairs():
        for mode, error in compare_modes(*src.load_mx(weight, scale), target).items():
            rows[mode].append(TensorRow(weight, src.shape[weight], error))
    if not rows[ScaleMode.EXACT.value]:
        raise ValueError(f"no MXFP8 weight (X.weight with an E8M0 X.weight_scale[_inv]) in {src_dir}")
    return {mode: Report(target.value, mode, r) for mode, r in rows.items()}


# --- reading checkpoints, one tensor at a time -----------------------------------------------


class _Checkpoint:
    """Tensor names, dtypes and shapes of a checkpoint (from the safetensors headers); tensors load on demand, by
    reads (a memory map would kill the process with SIGBUS if a file were shortened meanwhile)."""

    def __init__(self, ckpt: Path):
        index = ckpt / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (ckpt / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"{ckpt} has neither model.safetensors.index.json nor model.safetensors")
        self.file: dict[str, Path] = {}
        self.info: dict[str, TensorInfo] = {}
        self.dtype: dict[str, str] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        for fname in files:
            path = ckpt / fname
            for name, info in read_header(path).tensors.items():
                self.file[name], self.dtype[name], self.shape[name] = path, info.dtype, tuple(info.shape)
                self.info[name] = info

    def __contains__(self, name: str) -> bool:
        return name in self.file

    def names(self) -> list[str]:
        return sorted(self.file, key=_natural_key)

    def load(self, name: str) -> torch.Tensor:
        with open(self.file[name], "rb") as f:
            return read_tensor(f, self.info[name], path=self.file[name])

    def mx_scale(self, weight: str) -> str | None:
        """The E8M0 scale of ``weight`` (float8_e4m3fn or uint8 codes), if it has one."""
        if self.dtype.get(weight) not in ("F8_E4M3", "U8"):
            return None
        for suffix in _SCALE_SUFFIXES:
            if self.dtype.get(weight + suffix) in _E8M0_DTYPES:
                return weight + suffix
        return None

    def expert_parts(self) -> dict[str, tuple[str, int, int, int]]:
        """For an output in the per-expert layout (:mod:`transformd.checkpoint.layout`): each per-expert weight ->
        (its fused stack here, expert, first row, end row)."""
        from .checkpoint.layout import Layout, expert_splits

        splits = expert_splits(((w, self.shape[w]) for w, _ in self.mx_pairs()), Layout.PER_EXPERT)
        parts: dict[str, tuple[str, int, int, int]] = {}
        for stack, split in splits.items():
            halves = 2 if stack.removesuffix(".weight").endswith("gate_up_proj") else 1
            for i, (name, (rows, _)) in enumerate(split.weight):
                parts[name] = (stack, i // halves, (i % halves) * rows, (i % halves + 1) * rows)
        return parts

    def load_stack(self, stack: str) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`load_mx` of a fused stack, the last one kept (its experts are compared one after the other)."""
        if getattr(self, "_stack", (None,))[0] != stack:
            self._stack = (stack, self.load_mx(stack, self.mx_scale(stack) or ""))
        return self._stack[1]

    def mx_pairs(self) -> Iterator[tuple[str, str]]:
        """(weight, scale) names of every MXFP8 pair, in natural order."""
        for name in self.names():
            scale = self.mx_scale(name) if not name.endswith(_SCALE_SUFFIXES) else None
            if scale is not None:
                yield name, scale

    def load_mx(self, weight: str, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and per-row E8M0 scales (Quark's Rx32 block scales repeated over their R rows)."""
        codes, scales = self.load(weight), self.load(scale)
        n, rows = codes.shape[-2], scales.shape[-2]
        return codes, expand_row_blocks(scales, n, infer_row_block(n, rows) or 1)


def transformd_record(ckpt: Path) -> dict:
    """What a converted checkpoint's config.json records of its conversion (``quantization_config.transformd``:
    target, scale mode, ...); {} when there is none."""
    config = ckpt / "config.json"
    if not config.is_file():
        return {}
    record = (json.loads(config.read_text()).get("quantization_config") or {}).get("transformd") or {}
    return record if isinstance(record, dict) else {}


def _natural_key(name: str) -> list:
    """Sort ``layers.2`` before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _cells(e: TensorError) -> tuple[str, str, str]:
    return f"{e.rel_l2:.3e}", f"{100 * e.exact_fraction:.3f}", f"{e.max_abs_err:.3e}"
