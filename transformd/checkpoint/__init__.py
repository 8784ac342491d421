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

:func:`plan_readiness` computes from shapes and config at which
tensor-parallel sizes vLLM, SGLang and transformers load the output
(:mod:`transformd.engines`), beside the writing; with ``engine`` it is computed
before anything is written, and a checkpoint that engine could not load at all
is refused.

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

Modules: :mod:`.plan` (phase 1), :mod:`.pipeline` (the threads that write the shards), :mod:`.hf_config`
(config.json, the index, other files), :mod:`.convert` (:func:`write_checkpoint` writes into a directory, each
file fsynced once; :func:`convert_checkpoint` adds the staging directory and the publish of
:mod:`transformd._durable`; the cache publishes :func:`write_checkpoint`'s output its own way), :mod:`.headstart`
(a worker process that converts the last shards while a lone ``convert --out`` imports torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names
from ..errors import CheckpointError
from .plan import (
    ConversionPlan,
    MxPair,
    ShardPlan,
    check_engine,
    output_bytes,
    plan_conversion,
    plan_readiness,
    readiness_of_dir,
)

#: name -> module that defines it, imported on first access: planning and engine readiness import no torch (a
#: warm cache hit never converts), the conversion does.
_LAZY = {
    "ConversionResult": ".convert",
    "OutputError": ".convert",
    "convert_checkpoint": ".convert",
    "write_checkpoint": ".convert",
    "Progress": ".pipeline",
    "ShardOrder": ".pipeline",
    "conversion_devices": ".pipeline",
}

__all__ = [
    "CheckpointError",
    "ConversionPlan",
    "MxPair",
    "ShardPlan",
    "check_engine",
    "output_bytes",
    "plan_conversion",
    "plan_readiness",
    "readiness_of_dir",
    *sorted(_LAZY),
]


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


if TYPE_CHECKING:  # the lazy names (in __all__ through _LAZY), for type checkers
    from .convert import ConversionResult, OutputError, convert_checkpoint, write_checkpoint  # noqa: F401
    from .pipeline import Progress, ShardOrder, conversion_devices  # noqa: F401
