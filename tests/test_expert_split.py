"""Fused HF-v5 expert stacks written per expert for SGLang (issue 44, item 2), and the refusal of a conversion that
names no engine when some engine would load the output wrong without an error (item 1).

SGLang skips fused 3-D stacks and loads per-expert 2-D tensors; ``--engine sglang`` writes each stack's experts (and
gate/up halves) as tensors of their own. The bytes must be exactly the reference's conversion of each expert.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from transformd import cli
from transformd.cache import Recipe, cache_key
from transformd.checkpoint import CheckpointError, convert_checkpoint, plan_conversion
from transformd.checkpoint.layout import Layout, expert_splits
from transformd.checkpoint.plan import source_layout
from transformd.engines import ENGINE_ENV, engine_from_env
from transformd.reference import convert_reference
from transformd.safetensors_writer import SafetensorsWriter
from transformd.sample import write_sample_checkpoint

P = "model.layers.0.mlp.experts"


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return out


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("scale_mode", ["exact", "amax"])
def test_sglang_layout_is_the_reference_per_expert(tmp_path: Path, scale_mode: str) -> None:
    """Every per-expert tensor is, bit for bit, the reference's conversion of that expert's rows of the stack."""
    src = write_sample_checkpoint(tmp_path / "src", layers=2, experts=3, fused_experts=True, shards=3,
                                  moe_intermediate=256, hidden=384)
    result = convert_checkpoint(src, tmp_path / "out", target="ocp", scale_mode=scale_mode, device="cpu",
                                engine="sglang")
    source, out = _tensors(src), _tensors(tmp_path / "out")
    assert not any(name.endswith(("gate_up_proj", "down_proj")) for name in out), "no fused stack is left"
    for layer in (0, 1):
        p = f"model.layers.{layer}.mlp.experts"
        for stack, halves in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            q, s = convert_reference(_u8(source[f"{p}.{stack}"]), source[f"{p}.{stack}_scale"], "ocp", scale_mode)
            for e in range(3):
                rows = q.shape[1] // len(halves)
                for h, half in enumerate(halves):
                    name = f"{p}.{e}.{half}.weight"
                    assert out[name].dtype == torch.float8_e4m3fn and list(out[name].shape) == [rows, q.shape[2]]
                    assert torch.equal(_u8(out[name]), _u8(q[e, h * rows:(h + 1) * rows])), name
                    tiles = s.shape[1] // len(halves)
                    assert torch.equal(out[f"{name}_scale_inv"], s[e, h * tiles:(h + 1) * tiles]), name
    # the rest is as the as-is conversion wrote it, and the index names every per-expert tensor
    assert torch.equal(_u8(out["model.layers.0.self_attn.q_proj.weight"]),
                       _u8(convert_reference(_u8(source["model.layers.0.self_attn.q_proj.weight"]),
                                             source["model.layers.0.self_attn.q_proj.weight_scale"], "ocp",
                                             scale_mode)[0]))
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(out)
    record = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["transformd"]
    assert record["layout"] == "per-expert"
    assert result.readiness["sglang"].loads_at == [1] and not result.readiness["sglang"].misloads
    assert result.readiness["transformers"].loads_at == [1], "per-expert tensors carry their scales in transformers"


def test_as_is_and_per_expert_hold_the_same_data_bytes(tmp_path: Path) -> None:
    """The split renames byte ranges of the header only: each shard's data section is the fused conversion's."""
    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2, fused_experts=True, shards=1)
    convert_checkpoint(src, tmp_path / "fused", target="ocp", device="cpu", engine="vllm")
    convert_checkpoint(src, tmp_path / "split", target="ocp", device="cpu", engine="sglang")

    def data(path: Path) -> bytes:
        raw = path.read_bytes()
        return raw[8 + int.from_bytes(raw[:8], "little"):]

    assert data(tmp_path / "fused" / "model.safetensors") == data(tmp_path / "split" / "model.safetensors")
    assert (tmp_path / "fused" / "model.safetensors").read_bytes() != (tmp_path / "split" / "model.safetensors"
                                                                        ).read_bytes()


def test_a_stack_whose_split_would_cut_a_tile_stays_fused() -> None:
    """gate/up halves of 64 rows would share a 128-row scale tile: not split (no engine loads them anyway)."""
    pairs = [(f"{P}.gate_up_proj", (4, 128, 256)), (f"{P}.down_proj", (4, 256, 64))]
    assert expert_splits(pairs, Layout.PER_EXPERT) == {}
    ok = [(f"{P}.gate_up_proj", (4, 256, 256)), (f"{P}.down_proj", (4, 256, 128))]
    splits = expert_splits(ok, Layout.PER_EXPERT)
    assert [n for n, _ in splits[f"{P}.gate_up_proj"].weight][:3] == [
        f"{P}.0.gate_proj.weight", f"{P}.0.up_proj.weight", f"{P}.1.gate_proj.weight"]
    assert splits[f"{P}.down_proj"].scale[0] == (f"{P}.0.down_proj.weight_scale_inv", (2, 1))
    assert expert_splits(ok, Layout.AS_IS) == {}
    assert expert_splits(ok, Layout.PER_EXPERT, ["GptOssForCausalLM"]) == {}, "interleaved gate/up: never split"


def test_the_writer_fills_a_group_of_consecutive_tensors(tmp_path: Path) -> None:
    specs = [("a", "U8", [2]), ("b", "U8", [3]), ("c", "U8", [1])]
    with SafetensorsWriter(tmp_path / "x.safetensors", specs, groups={"ab": ("a", "b")}) as w:
        w.write("ab", b"\x01\x02\x03")
        w.write("ab", b"\x04\x05")
        w.write("c", b"\x06")
    got = _tensors(tmp_path)
    assert got["a"].tolist() == [1, 2] and got["b"].tolist() == [3, 4, 5] and got["c"].tolist() == [6]
    with pytest.raises(ValueError, match="not consecutive"):
        SafetensorsWriter(tmp_path / "y.safetensors", specs, groups={"ac": ("a", "c")})
    with pytest.raises(ValueError, match="more than its 2 parts hold"), \
            SafetensorsWriter(tmp_path / "z.safetensors", specs, groups={"ab": ("a", "b")}) as w:
        w.write("ab", b"\x00" * 6)


def test_the_layout_is_in_the_cache_key_only_where_it_changes_the_bytes(tmp_path: Path) -> None:
    fused = write_sample_checkpoint(tmp_path / "fused", layers=1, experts=2, fused_experts=True)
    plain = write_sample_checkpoint(tmp_path / "plain", layers=1, experts=2)
    assert source_layout(fused, "sglang") is Layout.PER_EXPERT and source_layout(fused, "vllm") is Layout.AS_IS
    assert source_layout(plain, "sglang") is Layout.AS_IS, "nothing to split: the other engines' entry"
    assert Recipe(layout="per-expert").as_dict()["layout"] == "per-expert"
    assert "layout" not in Recipe().as_dict(), "keys made before the layout existed stay what they were"
    assert Recipe.from_dict(Recipe(layout="per-expert").as_dict()) == Recipe(layout="per-expert")

    class Identity:
        writers = ()

        def canonical(self):
            return [["model.safetensors", 1, "blake3:" + "0" * 64]]

    assert cache_key(Identity(), Recipe(layout="per-expert")) != cache_key(Identity(), Recipe())  # type: ignore[arg-type]
    assert plan_conversion(fused, layout="per-expert").layout == "per-expert"


# -- no engine named --------------------------------------------------------------------------------------------------


def test_no_engine_named_refuses_what_an_engine_misloads(tmp_path: Path, capsys, monkeypatch) -> None:
    """HF-v5 stacks: SGLang skips them and transformers drops their scales, both without an error. Converting them
    without naming the engine exited 0 with a warning; now it is refused, naming who loads them and how to say so."""
    monkeypatch.delenv(ENGINE_ENV, raising=False)
    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2, fused_experts=True)
    with pytest.raises(CheckpointError, match="no engine named") as refused:
        convert_checkpoint(src, tmp_path / "out", target="ocp", device="cpu", require_engine=True)
    said = str(refused.value)
    assert "sglang: model.layers.*.mlp.experts" in said and "transformers:" in said
    assert "vllm, sglang load it" in said and "--engine vllm" in said and "--engine raw" in said and ENGINE_ENV in said
    assert not (tmp_path / "out").exists()
    for where in (["--out", str(tmp_path / "out")], ["--cache-dir", str(tmp_path / "cache"), "--no-daemon"]):
        assert cli.main(["convert", str(src), *where, "--device", "cpu"]) == 2
        assert "no engine named" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # named (flag or environment), it converts; raw: no check
    monkeypatch.setenv(ENGINE_ENV, "vllm")
    assert cli.main(["convert", str(src), "--out", str(tmp_path / "out"), "--device", "cpu"]) == 0
    assert "transformd: vllm: loads at TP 1" in capsys.readouterr().err
    monkeypatch.delenv(ENGINE_ENV)
    convert_checkpoint(src, tmp_path / "raw", target="ocp", device="cpu", engine="raw")
    # a checkpoint no engine misloads converts without one, as before
    plain = write_sample_checkpoint(tmp_path / "plain", layers=1, experts=2)
    assert cli.main(["convert", str(plain), "--out", str(tmp_path / "plain-out"), "--device", "cpu"]) == 0


def test_scale_renaming_loader_is_refused_without_an_engine(tmp_path: Path) -> None:
    """vLLM's MiniMax-M3 loader drops every block scale without an error: no layout fixes it, and it is named."""
    from .support.layouts import minimax

    src = minimax(tmp_path / "src", arch="MiniMaxM3SparseForCausalLM")
    with pytest.raises(CheckpointError, match=r"no engine named.*vllm: vllm's loader for MiniMaxM3SparseForCausalLM"):
        convert_checkpoint(src, tmp_path / "out", target="ocp", device="cpu", require_engine=True)
    with pytest.raises(CheckpointError, match="no layout of the output changes that"):
        convert_checkpoint(src, tmp_path / "out", target="ocp", device="cpu", engine="vllm")


def test_engine_from_the_environment() -> None:
    assert engine_from_env({}) is None and engine_from_env({ENGINE_ENV: " "}) is None
    assert engine_from_env({ENGINE_ENV: "sglang"}) == "sglang"
    with pytest.raises(ValueError, match=f"{ENGINE_ENV}='vllm2' is not an engine"):
        engine_from_env({ENGINE_ENV: "vllm2"})


def test_report_compares_each_expert_of_a_split_stack(tmp_path: Path) -> None:
    """``convert --report`` / ``inspect SRC OUT`` of a per-expert output: every expert against its stack's rows."""
    from transformd.report import compare_checkpoints

    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2, fused_experts=True)
    convert_checkpoint(src, tmp_path / "out", target="ocp", device="cpu", engine="sglang")
    report = compare_checkpoints(src, tmp_path / "out")
    names = {row.name for row in report.rows}
    assert {f"{P}.{e}.{p}.weight" for e in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")} <= names
    assert report.overall.exact_fraction > 0.9 and report.overall.rel_l2 < 1e-4


def test_daemon_refuses_without_an_engine_and_splits_for_sglang(tmp_path: Path, daemons, monkeypatch,
                                                                 capsys) -> None:
    """The daemon's answer path: no engine named, a checkpoint an engine misloads is 422 ``engine_needed`` (before
    anything is converted); SGLang gets the per-expert layout, its own entry; ``resolve`` takes TRANSFORMD_ENGINE."""
    from transformd.engines import Platform

    from .support.daemon import wait_ready

    models = tmp_path / "models"
    fused = write_sample_checkpoint(models / "fused", layers=1, experts=2, fused_experts=True)
    daemon = daemons.start(cache_dir=tmp_path / "cache", allow_roots=[models], platform=Platform("amd", "gfx942"))
    try:
        with daemon.client() as http:
            refused = http.post("/v1/checkpoints", json={"source": str(fused)})
            assert refused.status_code == 422, refused.text
            error = refused.json()["error"]
            assert error["code"] == "engine_needed" and "sglang" in error["message"] and "--engine" in error["message"]
            assert http.get("/v1/cache").json()["conversions"] == [], "nothing started for a refused request"
            sglang = http.post("/v1/checkpoints", json={"source": str(fused), "engine": "sglang"})
            ready = wait_ready(http, sglang.json()["key"])
            assert ready["recipe"].get("layout") == "per-expert", ready["recipe"]
            assert ready["readiness"]["sglang"]["loads_at"] == [1] and ready["readiness"]["sglang"]["misloads"] == []
            assert (Path(ready["path"]) / "config.json").is_file()
            assert f"{P}.0.up_proj.weight" in json.loads(
                (Path(ready["path"]) / "model.safetensors.index.json").read_text())["weight_map"]
            vllm = http.post("/v1/checkpoints", json={"source": str(fused), "engine": "vllm"})
            assert vllm.json()["key"] != sglang.json()["key"], "other bytes, other entry"
            assert wait_ready(http, vllm.json()["key"])["readiness"]["vllm"]["loads_at"] == [1]
        # transformd resolve: the engine from the environment; without one, refused (exit 2)
        socket = ["--socket", str(daemon.socket_path)]
        monkeypatch.delenv(ENGINE_ENV, raising=False)
        assert cli.main(["resolve", str(fused), *socket]) == 2
        said = capsys.readouterr().err
        assert "no engine named" in said and "engine_needed" in said and "--engine vllm" in said, said
        monkeypatch.setenv(ENGINE_ENV, "sglang")
        assert cli.main(["resolve", str(fused), *socket]) == 0
        out, err = capsys.readouterr()
        assert out.strip() == ready["path"] and "transformd: sglang: loads at TP 1" in err
        monkeypatch.setenv(ENGINE_ENV, "nope")
        assert cli.main(["resolve", str(fused), *socket]) == 2
        assert "TRANSFORMD_ENGINE='nope' is not an engine" in capsys.readouterr().err
    finally:
        daemon.stop()


def test_the_head_start_worker_writes_the_per_expert_layout(tmp_path: Path) -> None:
    """The worker process (``convert --out``'s head start) writes the same split shards as the pipeline."""
    import filecmp
    import time

    from transformd.checkpoint import write_checkpoint
    from transformd.checkpoint.headstart import HeadStart
    from transformd.formats import ScaleMode, Target

    src = write_sample_checkpoint(tmp_path / "src", layers=3, experts=2, shards=4, fused_experts=True)
    convert_checkpoint(src, tmp_path / "pipeline", target="ocp", device="cpu", head_start=False, engine="sglang")
    plan = plan_conversion(src, layout="per-expert")
    out = tmp_path / "worker"
    out.mkdir()
    head = HeadStart(plan, out, Target.OCP, ScaleMode.EXACT, threads=2)
    deadline = time.monotonic() + 120
    while len(head.finished) < len(plan.shards) and time.monotonic() < deadline:
        time.sleep(0.02)
    result = write_checkpoint(plan, out, target="ocp", devices=None, head_start=head)
    assert sorted(result.head_start_shards) == sorted(s.name for s in plan.shards)
    names = sorted(p.name for p in (tmp_path / "pipeline").iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    for name in names:
        assert filecmp.cmp(tmp_path / "pipeline" / name, out / name, shallow=False), name
    assert f"{P}.1.up_proj.weight_scale_inv" in _tensors(out)
