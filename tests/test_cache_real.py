"""The cache with the real converter (transformd.checkpoint.convert_checkpoint) on the sample checkpoint."""

from __future__ import annotations

import json
import os

import pytest
from safetensors import safe_open

from transformd.cache import Cache, ConversionStatus, Recipe
from transformd.checkpoint import convert_checkpoint
from transformd.safetensors_io import CheckpointError
from transformd.sample import write_sample_checkpoint


def _tree(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["fnuz", "ocp"])
def test_real_conversion_into_the_cache(tmp_path, target):
    src = write_sample_checkpoint(tmp_path / "sample")
    cache = Cache(tmp_path / "cache", budget_bytes="1G", device="cpu")
    updates: list[ConversionStatus] = []
    entry = cache.get_or_convert(src, Recipe(target=target), progress=updates.append)
    assert entry.outcome == "converted"
    # byte-identical to converting directly
    direct = convert_checkpoint(src, tmp_path / "direct", target=target, device="cpu")
    assert _tree(entry.path) == _tree(direct.out)
    assert entry.manifest.total_bytes == sum(len(b) for b in _tree(direct.out).values())
    # the converter's result is in the manifest, with the final path
    result = entry.manifest.result
    assert result["target"] == target and result["converted"] == direct.converted
    assert result["out"] == str(entry.path)
    # progress came from the converter (tensor counts) through the cache
    details = [u.detail for u in updates if u.state == "converting" and u.detail]
    assert details and details[-1]["tensors_done"] == details[-1]["tensors_total"]
    with safe_open(str(entry.path / "model-00002-of-00002.safetensors"), "pt") as f:
        names = list(f.keys())
        assert any(n.endswith("weight_scale_inv") for n in names)
        assert not any(n.endswith(".weight_scale") for n in names)
    cfg = json.loads((entry.path / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    # a second call is a hit; the entry verifies
    again = cache.get_or_convert(src, Recipe(target=target))
    assert again.outcome == "hit" and again.path == entry.path
    assert [r.ok for r in cache.verify()] == [True]


def test_invalid_checkpoint_leaves_the_cache_empty(tmp_path):
    src = write_sample_checkpoint(tmp_path / "sample")
    shard = src / "model-00002-of-00002.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 1000)
    cache = Cache(tmp_path / "cache", budget_bytes="1G", device="cpu")
    with pytest.raises(CheckpointError):
        cache.get_or_convert(src)
    assert os.listdir(cache.entries_dir) == [] and os.listdir(cache.staging_dir) == []
    st = cache.status(cache.key_for(src))
    assert st.state == "failed" and st.error_type == "CheckpointError"


def test_the_converter_gets_ready_while_an_unseen_source_is_hashed(tmp_path, monkeypatch):
    """A source the cache has not seen is hashed while it is converted (from ``hash_alongside_min_bytes``, 0
    here): the default converter's ``prepare`` (the background import of torch and the kernels, CUDA's
    start-up) is called once, before the hashing starts, and not at all for a hit or for a source the stat
    cache knows."""
    from transformd.cache import TransformdConverter, keys

    src = write_sample_checkpoint(tmp_path / "sample", layers=1, experts=2)
    for f in src.iterdir():  # older than the stat cache's racy window: remembered once hashed
        os.utime(f, (f.stat().st_atime - 60, f.stat().st_mtime - 60))
    events: list[str] = []
    real_hash = keys.hash_file
    monkeypatch.setattr(keys, "hash_file", lambda p, *a, **k: events.append("hash") or real_hash(p, *a, **k))
    monkeypatch.setattr(TransformdConverter, "prepare", lambda self, recipe: events.append(("prepare", recipe)))
    cache = Cache(tmp_path / "cache", budget_bytes="1G", device="cpu")
    cache.hash_alongside_min_bytes = 0
    assert cache.get_or_convert(src, Recipe(target="ocp")).outcome == "converted"
    assert events[0] == ("prepare", Recipe(target="ocp")) and events.count(events[0]) == 1, events
    assert "hash" in events[1:], events
    events.clear()
    assert cache.get_or_convert(src, Recipe(target="ocp")).outcome == "hit"
    assert cache.get_or_convert(src, Recipe(target="fnuz")).outcome == "converted"
    assert events == [], "nothing to hash: the stat cache knows every file"


def test_the_warm_up_thread_imports_the_conversion_once(monkeypatch):
    """``prepare`` starts one background thread per process, whatever the number of converters, for the first
    recipe asked; a conversion joins it before importing anything itself (no two threads import the same modules
    at once)."""
    import transformd.cache.converter as converter_module

    started = []
    monkeypatch.setattr(converter_module, "_warming", None)
    monkeypatch.setattr(converter_module, "_warm_up", lambda device, recipe: started.append((device, recipe)))
    a, b = converter_module.TransformdConverter("cpu"), converter_module.TransformdConverter("cpu")
    a.prepare(Recipe(target="ocp"))
    b.prepare(Recipe(target="fnuz"))
    converter_module._warming.join()
    assert started == [("cpu", Recipe(target="ocp"))]


@pytest.mark.timeout(120)
def test_a_conversion_waits_for_the_warm_ups_imports_not_for_its_kernel(tmp_path, monkeypatch):
    """The conversion plans and reads once the warm-up thread's imports are over (never importing beside them), while
    the kernel loads (its first launch waits for that on the converters' lock, ``pieces.warm_up``): waiting for the
    whole warm-up put the plan and the first reads after the kernel's load (0.6-2.4 s on the H200 machine). A
    warm-up still running when the conversion ends is joined before it returns; the output is right."""
    import threading
    import time

    import transformd.cache.converter as converter_module

    from .support.checkpoints import assert_converted, write_checkpoint

    imported, converted, order = threading.Event(), threading.Event(), []

    def warm_up(device, recipe):  # as _warm_up: the imports (0.3 s), then the kernel's load (until converting, 1 s)
        time.sleep(0.3)
        order.append("imports over")
        imported.set()
        order.append(f"converting while the kernel loads: {converted.wait(20)}")
        time.sleep(1)
        order.append("kernel loaded")

    real_warm_up = converter_module._warm_up
    monkeypatch.setattr(converter_module, "_warming", None)
    monkeypatch.setattr(converter_module, "_imported", imported)
    monkeypatch.setattr(converter_module, "_warm_up", warm_up)
    converter = converter_module.TransformdConverter("cpu")
    converter.prepare(Recipe(target="ocp"))
    src = write_checkpoint(tmp_path / "src")

    def progress(update) -> None:
        if not converted.is_set():
            order.append("converting")
            converted.set()

    converter(src, tmp_path / "out", Recipe(target="ocp"), progress)
    assert order == ["imports over", "converting", "converting while the kernel loads: True", "kernel loaded"]
    assert_converted(src, tmp_path / "out", "ocp", "exact")
    monkeypatch.setattr(converter_module, "_imported", threading.Event())
    real_warm_up("cpu", Recipe(target="ocp"))  # the real one says when its imports are over
    assert converter_module._imported.is_set()
