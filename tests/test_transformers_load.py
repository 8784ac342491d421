"""transformers (its own loading code, on the CPU) loads every converted layout, and its weights are the MXFP8
source's values.

``AutoModelForCausalLM.from_pretrained(out, quantization_config=FineGrainedFP8Config(dequantize=True))`` reads
``quantization_config``, skips ``modules_to_not_convert``, fuses per-expert tensors into its experts'
``gate_up_proj``/``down_proj`` and dequantizes with ``weight_scale_inv``. Every parameter of the loaded model is
compared with what the source says it is: BF16/F32 tensors bit for bit, MXFP8 tensors decoded exactly, within
the ``exact`` mode's error. A misread exclusion, a scale at the wrong rows or a dropped scale fails here.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from transformd.checkpoint import CheckpointError, convert_checkpoint
from transformd.reference import dequantize_mx
from transformd.sample import write_sample_checkpoint

from .support.layouts import compressed_tensors, fused, minimax, modelopt, quark, quark_per_block


#: Names a transformers parameter can have in a checkpoint (MiniMax's own naming; per-expert projections).
_MODULE_ALIASES = {"mlp": ("mlp", "block_sparse_moe")}
_EXPERT_PROJ = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}

LAYOUTS = {
    "sample": lambda root: write_sample_checkpoint(root, layers=2, experts=4),
    "modelopt": modelopt,
    "minimax_m2": minimax,
    "fused_hf_v5": lambda root: fused(root, arch="Qwen3MoeForCausalLM"),
    "compressed_tensors": compressed_tensors,
    "quark": quark,
    "quark_per_block": quark_per_block,
}


class _Source:
    """The source checkpoint's tensors, decoded to float32 (MXFP8 exactly; Quark Rx32 scales repeated)."""

    def __init__(self, root: Path):
        index = root / "model.safetensors.index.json"
        files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
        self.handles = [safe_open(str(root / f), framework="pt") for f in sorted(files)]
        self.names = {n: h for h in self.handles for n in h.keys()}

    def get(self, name: str) -> torch.Tensor | None:
        handle = self.names.get(name)
        if handle is None:
            return None
        t = handle.get_tensor(name)
        if t.dtype != torch.float8_e4m3fn:
            return t.float()
        scale_name = next(name + s for s in ("_scale", "_scale_inv") if name + s in self.names)
        scales = self.names[scale_name].get_tensor(scale_name).view(torch.uint8)
        n, rows = t.shape[-2], scales.shape[-2]
        if rows != n:
            scales = scales.repeat_interleave(-(-n // rows), dim=-2)[..., :n, :]
        return dequantize_mx(t.view(torch.uint8), scales)

    def _first(self, names) -> torch.Tensor | None:
        return next((v for v in map(self.get, names) if v is not None), None)

    def find(self, param: str) -> torch.Tensor | None:
        """The source value of a transformers parameter, through the naming variants of the layouts."""
        layer, sep, rest = param.partition(".mlp.")
        heads = [param] if not sep else [f"{layer}.{alias}.{rest}" for alias in _MODULE_ALIASES["mlp"]]
        for candidate in heads:
            direct = self.get(candidate)
            if direct is not None:
                return direct
            if not candidate.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                continue
            base, _, proj = candidate.rpartition(".")
            parts = ("gate", "up") if proj == "gate_up_proj" else ("down",)
            stacked = []
            while True:  # per-expert tensors, fused the way transformers fuses them: [gate; up] per expert
                per = [self._first(f"{base}.{len(stacked)}.{a}.weight" for a in _EXPERT_PROJ[p]) for p in parts]
                if any(v is None for v in per):
                    break
                stacked.append(torch.cat(per, dim=0))
            if stacked:
                return torch.stack(stacked)
        return None


def _load(out: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(
            out, quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16
        )


@pytest.mark.parametrize("layout", sorted(set(LAYOUTS) - {"fused_hf_v5"}))
def test_transformers_loads_the_source_values(layout: str, tmp_path: Path) -> None:
    src = LAYOUTS[layout](tmp_path / "src")
    convert_checkpoint(src, tmp_path / "out", target="ocp", device="cpu", engine="transformers")
    model = _load(tmp_path / "out")
    source = _Source(src)
    compared = 0
    for name, param in model.state_dict().items():
        want = source.find(name)
        if want is None:
            continue  # a parameter the replica does not have (transformers initialises it)
        got = param.float()
        assert got.shape == want.shape, (layout, name)
        rel_l2 = float((got - want).norm() / want.norm().clamp(min=1e-30))
        exact = float((got == want).float().mean())
        assert rel_l2 < 1e-4 and exact > 0.9, (layout, name, rel_l2, exact)
        compared += 1
    linear = sum(1 for n, p in model.state_dict().items() if n.endswith((".weight", "_proj")) and p.dim() >= 2)
    assert compared >= linear - 3, (layout, compared, linear)
    assert compared > 0


def test_fused_expert_naming_is_refused_for_transformers_because_it_loads_them_unscaled(tmp_path: Path) -> None:
    """transformers 5 reads FP8 expert stacks named ``experts.gate_up_proj`` without their ``*_scale_inv``: the
    readiness rule that refuses them is checked against transformers itself (should it learn to, this fails)."""
    src = LAYOUTS["fused_hf_v5"](tmp_path / "src")
    with pytest.raises(CheckpointError, match="transformers could not load.*fused HF-v5 naming"):
        convert_checkpoint(src, tmp_path / "refused", target="ocp", device="cpu", engine="transformers")
    convert_checkpoint(src, tmp_path / "out", target="ocp", device="cpu", engine="vllm")
    model = _load(tmp_path / "out")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    got, want = model.state_dict()[name].float(), _Source(src).find(name)
    assert float((got - want).norm() / want.norm()) > 1.0, "transformers now applies the scales: drop the rule"
