"""The main job, end to end on the built-in sample checkpoint (``transformd demo``).

Writes the sample MXFP8 MoE checkpoint, converts it into a cache (the GPU when
there is one), reports the reconstruction error of both scale modes, then
resolves the same checkpoint again, which the cache answers without converting.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .cache import Cache, Recipe
from .report import compare_checkpoints, compare_modes_checkpoint
from .sample import write_sample_checkpoint


def run_demo(workdir: Path | None = None, *, device: str = "auto", echo=print) -> Path:
    """Run the demo in ``workdir`` (a new temporary directory by default); returns the converted directory."""
    from .convert import resolve_device

    workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="transformd-demo-"))
    src = workdir / "sample-mxfp8"
    if not (src / "config.json").exists():
        write_sample_checkpoint(src)
    size = sum(f.stat().st_size for f in src.iterdir())
    dev = resolve_device(device)
    echo(f"sample MXFP8 checkpoint: {src} ({size / 2**20:.1f} MiB)")

    cache = Cache(workdir / "cache", device=str(dev))
    recipe = Recipe(target="fnuz", scale_mode="exact")
    t0 = time.perf_counter()
    entry = cache.get_or_convert(src, recipe)
    cold = time.perf_counter() - t0
    echo(f"converted on {dev} in {cold:.2f} s ({entry.outcome}): key {entry.key}")

    report = compare_checkpoints(src, entry.path)
    echo("\nreconstruction error of the converted checkpoint (target fnuz, scale mode exact):")
    echo(report.format_table())
    amax = compare_modes_checkpoint(src, "fnuz")["amax"].overall
    echo(
        f"\nfor comparison, scale mode amax (vLLM PR #45726 parity): rel. L2 {amax.rel_l2:.3e}, "
        f"bit-exact {100 * amax.exact_fraction:.3f}% (exact mode: rel. L2 {report.overall.rel_l2:.3e}, "
        f"bit-exact {100 * report.overall.exact_fraction:.3f}%)"
    )

    t0 = time.perf_counter()
    again = cache.get_or_convert(src, recipe)
    warm = time.perf_counter() - t0
    echo(f"\nsecond resolve: {again.outcome} in {warm * 1e3:.1f} ms, same entry: {again.path == entry.path}")
    return entry.path
