"""The output's config.json and index, and the files carried over as they are."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import _durable
from ..formats import FORMAT_VERSION
from ..quant_config import output_quantization_config, source_quantization, unquantized_modules
from .plan import CONFIG_NAME, INDEX_NAME, output_specs

if TYPE_CHECKING:
    from .pipeline import Run


def write_metadata_files(run: Run) -> None:
    """config.json and the index of the output. hf_quant_config.json is not carried over: it describes the MXFP8
    input (ModelOpt's legacy place for the recipe) and some loaders read it before config.json."""
    plan = run.plan
    if plan.index is not None:
        index = _rewrite_index(plan.index, run.output_tensors)
        run.tally.add(written=_durable.create_json(run.out / INDEX_NAME, index))
    unquantized = unquantized_modules(spec for shard in plan.shards for spec in output_specs(run.target, shard))
    qc = output_quantization_config(plan.config, plan.hf_quant_config, unquantized, _transformd_record(run))
    run.tally.add(written=_durable.create_json(run.out / CONFIG_NAME, {**plan.config, "quantization_config": qc}))


def _rewrite_index(index: dict[str, Any], output_tensors: dict[str, tuple[str, int]]) -> dict[str, Any]:
    new = dict(index)
    metadata = dict(index.get("metadata") or {})
    metadata["total_size"] = sum(nbytes for _, nbytes in output_tensors.values())
    new["metadata"] = metadata
    new["weight_map"] = {name: shard for name, (shard, _) in sorted(output_tensors.items())}
    return new


def _transformd_record(run: Run) -> dict[str, Any]:
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
    if any(shard.splits for shard in run.plan.shards):  # (only when a stack was split: else the bytes are as-is's)
        record["layout"] = run.plan.layout
    if run.plan.select is not None:
        record["select"] = run.plan.select
    return record


def copy_other_files(run: Run) -> None:
    for rel in run.plan.other_files:
        dst = run.out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        size = _durable.copy_file(run.plan.src / rel, dst)
        run.tally.add(read=size, written=size)


