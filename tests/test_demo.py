"""The README's main job: `transformd demo` runs the whole path through a real daemon."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from safetensors import safe_open


def test_demo_converts_maps_reports_and_hits_the_cache(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "transformd", "demo", "--dir", str(tmp_path), "--device", "cpu"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    out = Path(lines[-1])
    assert out.is_dir() and out.is_relative_to(tmp_path / "cache" / "entries")
    text = done.stdout
    # target auto, as engines ask: OCP e4m3fn on a machine without a gfx94x GPU
    assert "(converted, target ocp for this node)" in text and "mapped 81 tensors" in text
    assert "float8_e4m3fn" in text and "float8_e4m3fnuz" not in text
    assert "from the cache (cache hits: 1), same path: True" in text
    overall = next(line for line in lines if line.startswith("overall"))
    assert "99.877" in overall  # bit-exact share of the sample in exact mode (README)
    with safe_open(out / "model-00002-of-00002.safetensors", "pt") as f:
        assert any(name.endswith("weight_scale_inv") for name in f.keys())
    assert lines[0] == f"0. working directory (--dir): {tmp_path}: the sample, the daemon's socket, log and cache"
    assert text.count("target ocp, scale mode exact") == 1, text  # said once, by the table
    assert "rel L2 = " in text and "exact % = " in text  # the columns are explained
    assert f"its files stay in {tmp_path} (remove them with: rm -rf {tmp_path})" in text
    log = (tmp_path / "daemon.log").read_text()
    assert "Traceback" not in log


def test_demo_refuses_a_dir_of_someone_elses_files(tmp_path: Path) -> None:
    """``--dir`` holding files the demo did not make (a real checkpoint, a home directory) is refused before
    anything is written: before, the demo filled it, changing a checkpoint's content, and its last line suggested
    ``rm -rf`` of it."""
    (tmp_path / "notes.txt").write_text("precious")
    done = subprocess.run([sys.executable, "-m", "transformd", "demo", "--dir", str(tmp_path), "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"transformd: error: --dir {tmp_path} holds files of its own (notes.txt); give the "
                                   "demo a new or empty directory, or one an earlier demo made"), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and "rm -rf" not in done.stdout
