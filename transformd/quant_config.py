"""The quantization configs of an MXFP8 input and of the block-FP8 output (no torch).

Input: every producer states its MXFP8 recipe its own way (see the README's compatibility table):

* NVIDIA ModelOpt: ``config.json`` ``{quant_method: modelopt, quant_algo: MXFP8, ignore: [globs]}`` and
  ``hf_quant_config.json`` ``{quantization: {quant_algo, group_size: 32, exclude_modules: [globs]}}``;
* MiniMax / HY-V4: ``{quant_method: mxfp8, weight_block_size: [1, 32], ignored_layers: [names]}``;
* compressed-tensors: ``{quant_method: compressed-tensors, config_groups, ignore: [names, "re:REGEX"]}``;
* AMD Quark: ``{quant_method: quark, global_quant_config: {weight: {...}}, exclude: [globs]}``.

Output: the one form vLLM's ``Fp8Config``, SGLang's and transformers' ``FineGrainedFP8Config`` read,
``{quant_method: fp8, activation_scheme: dynamic, weight_block_size: [128, 128], ignored_layers,
modules_to_not_convert}``, where both lists name, exactly, every module whose weight the output keeps
unquantized. They are derived from the tensors written, never copied from the input: vLLM and SGLang match
these names exactly (no globs, no ``re:``), so a copied pattern would silently put BF16 layers under FP8
parameters. The input's own lists are kept, unchanged, in the ``transformd`` provenance record.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from typing import Any

#: Output tile edge (rows and columns of the last two axes); the ``weight_block_size`` written.
TILE = 128
#: Keys under which quantization configs list unquantized modules (vLLM, transformers, ModelOpt,
#: compressed-tensors, Quark).
EXCLUDE_KEYS = ("ignored_layers", "modules_to_not_convert", "exclude_modules", "ignore", "exclude")
#: KV-cache settings of the input's quantization config, carried over as they are.
KV_CACHE_KEYS = ("kv_cache_scheme", "kv_cache_quant_algo")
#: The output's statement of an FP8 KV cache (``kv_cache_quant_algo``): SGLang's ``Fp8Config`` reads it, and with
#: ``--kv-cache-dtype auto`` keeps the KV cache in FP8 as the input asked. vLLM takes a KV-cache dtype from a config
#: only under ModelOpt's ``quant_method`` (``vllm/utils/torch_utils.py``, ``get_kv_cache_quant_algo_string``), never
#: from ``fp8``: its readiness warns to pass ``--kv-cache-dtype fp8`` (:mod:`transformd.engines`).
KV_CACHE_FP8 = "FP8"
#: safetensors dtypes of the output's FP8 weights.
FP8_DTYPES = ("F8_E4M3", "F8_E4M3FNUZ")
#: safetensors dtypes of unquantized weights.
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


def _input_places(config: Mapping[str, Any], hf_quant: Mapping[str, Any] | None) -> list[tuple[str, dict]]:
    """The parts of the input's quantization configs that state its recipe, by name: config.json's
    ``quantization_config``, its ``quantization`` part, and hf_quant_config.json's ``quantization`` part and top."""
    qc = config.get("quantization_config")
    places: list[tuple[str, Any]] = [("config.json", qc)]
    if isinstance(qc, dict):
        places.append(("config.json:quantization", qc.get("quantization")))
    if hf_quant is not None:
        places += [("hf_quant_config.json:quantization", hf_quant.get("quantization")),
                   ("hf_quant_config.json", hf_quant)]
    return [(where, place) for where, place in places if isinstance(place, dict)]


def source_exclusions(config: Mapping[str, Any], hf_quant: Mapping[str, Any] | None) -> dict[str, list[str]]:
    """Every excluded-module list of the input, by where it was found (``config.json:ignore``, ...), as given."""
    found: dict[str, list[str]] = {}
    for where, place in _input_places(config, hf_quant):
        for key in EXCLUDE_KEYS:
            value = place.get(key)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                found[f"{where}:{key}"] = list(value)
    return found


def excluded_by(module: str, patterns: Iterable[str]) -> bool:
    """Whether an input exclusion list names ``module``, in any producer's syntax.

    ``re:REGEX`` (compressed-tensors: full match), globs with ``*``/``?``/``[`` (ModelOpt, Quark: fnmatch on the
    module name, so ``model.layers.*.self_attn*`` covers ``...self_attn.q_proj``), else a module name or one of
    its dotted prefixes or suffixes (``lm_head``, ``model.layers.0.mlp.gate``).
    """
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], module):
                return True
        elif any(c in pattern for c in "*?["):
            if fnmatch.fnmatchcase(module, pattern):
                return True
        elif module == pattern or module.startswith(pattern + ".") or module.endswith("." + pattern):
            return True
    return False


def kv_cache_fp8(config: Mapping[str, Any], hf_quant: Mapping[str, Any] | None = None) -> bool:
    """Whether the quantization configs ask for an FP8 KV cache, in any producer's words: ``kv_cache_quant_algo``
    ``FP8`` (ModelOpt's ``hf_quant_config.json``, SGLang), or a ``kv_cache_scheme`` of 8-bit floats that is not
    dynamic (ModelOpt's ``config.json``, compressed-tensors; vLLM's and SGLang's reading of it), in ``config.json``'s
    ``quantization_config``, its ``quantization`` part, or ``hf_quant_config.json``'s."""
    for _, place in _input_places(config, hf_quant):
        algo, scheme = place.get("kv_cache_quant_algo"), place.get("kv_cache_scheme")
        if isinstance(algo, str) and algo.upper() == KV_CACHE_FP8:
            return True
        if isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8 \
                and scheme.get("dynamic") is not True:
            return True
    return False


def quark_row_block(config: Mapping[str, Any]) -> int | None:
    """Rows that share one E8M0 scale in an AMD Quark ``per_block`` MX checkpoint (``block_size [R, 32]``), if
    stated."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "quark":
        return None
    glob = qc.get("global_quant_config")
    weight = glob.get("weight") if isinstance(glob, dict) else None
    if isinstance(weight, list):  # Quark allows a list of weight specs (double quantization); MX has one
        weight = weight[0] if weight else None
    block = weight.get("block_size") if isinstance(weight, dict) else None
    if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        return block[0]
    return None


def unquantized_modules(tensors: Iterable[tuple[str, str, tuple[int, ...]]]) -> list[str]:
    """Exact names of the modules whose weights stay unquantized, from the output's (name, dtype, shape) rows.

    ``X.weight`` of 2 or more dimensions in a float dtype names module ``X`` (linear layers, router gates,
    embeddings, lm_head; 1-D norms are no linear layers and are not listed). A 3-D float tensor of a fused
    experts module (``X.experts.gate_up_proj``) names the experts module ``X.experts``, the prefix that vLLM's
    and SGLang's FusedMoE layers are matched by.
    """
    found: set[str] = set()
    for name, dtype, shape in tensors:
        if dtype not in FLOAT_DTYPES or len(shape) < 2 or name.endswith(("_scale", "_scale_inv")):
            continue  # block scales (F32) are not weights
        if name.endswith(".weight"):
            found.add(name.removesuffix(".weight"))
        elif len(shape) == 3 and name.rpartition(".")[0].endswith("experts"):
            found.add(name.rpartition(".")[0])
    return sorted(found)


def output_quantization_config(
    config: Mapping[str, Any],
    hf_quant: Mapping[str, Any] | None,
    unquantized: list[str],
    record: dict[str, Any],
) -> dict[str, Any]:
    """``quantization_config`` of the output: block FP8, the exact exclusions, the input's KV-cache settings (and
    ``kv_cache_quant_algo: FP8`` when the input asks for an FP8 KV cache in any of its configs:
    :func:`kv_cache_fp8`)."""
    old = config.get("quantization_config")
    old = old if isinstance(old, dict) else {}
    qc: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [TILE, TILE],
        "ignored_layers": list(unquantized),
        "modules_to_not_convert": list(unquantized),
    }
    for key in KV_CACHE_KEYS:
        if key in old:
            qc[key] = old[key]
    if kv_cache_fp8(config, hf_quant):  # (the engines that read a KV-cache dtype from an fp8 config read this)
        qc["kv_cache_quant_algo"] = KV_CACHE_FP8
    exclusions = source_exclusions(config, hf_quant)
    if exclusions:
        record = {**record, "source_exclusions": exclusions}
    qc["transformd"] = record
    return qc


def source_quantization(config: Mapping[str, Any], hf_quant: Mapping[str, Any] | None) -> dict[str, str]:
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
