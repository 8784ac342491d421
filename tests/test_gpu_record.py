"""GPU code cannot change unseen: the last recorded GPU run must have run the current device code, and passed.

CI has no GPU, so tests/gpu/run_gpu_suite.py runs the kernels (``portable`` and ``ptx``), the chunked
``convert_weight`` and a real-CUDA ``convert_checkpoint`` on a GPU machine and records, in tests/gpu/last_run.json,
the sha256 of the device code it ran. Here that record is checked against the sources as they are now: a change to
the kernels (say, the FNUZ fix dropped from the PTX kernel only, which no CPU test can run) fails this test until
someone re-runs the GPU suite and commits the new record.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("run_gpu_suite", REPO / "tests" / "gpu" / "run_gpu_suite.py")
suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite)


def test_the_recorded_gpu_run_covers_the_current_kernel_sources() -> None:
    if not suite.RECORD.exists():
        pytest.skip(f"no GPU run recorded yet ({suite.RECORD.relative_to(REPO)} is missing): on an NVIDIA GPU "
                    f"(sm_89+) run `{suite.RERUN}` and commit the file")
    record = json.loads(suite.RECORD.read_text())
    assert not record["dry_run"] and record["device"], "the record is a --dry-run on the CPU, not a GPU run"
    assert record["failed"] == 0 and record["passed"] > 0, f"the recorded GPU run failed: {record['failures']}"
    from transformd.kernels import KERNELS

    assert sorted(record["variants_run"]) == sorted(KERNELS), (
        f"the recorded GPU run did not run every kernel variant ({record['variants_not_run']} missing): "
        f"re-run `{suite.RERUN}` on an NVIDIA GPU of compute capability 8.9+"
    )
    now = suite.source_digests()
    recorded = record["kernel_sources"]["files"]
    changed = sorted(rel for rel in set(now) | set(recorded) if now.get(rel) != recorded.get(rel))
    assert not changed and suite.combined_digest(now) == record["kernel_sources"]["digest"], (
        f"GPU code changed since the last recorded GPU run ({record['device']}, commit {record['git_commit']}): "
        f"{', '.join(changed)}. Re-run the GPU suite: `{suite.RERUN}` on an NVIDIA GPU (sm_89+), and commit the file"
    )


def test_the_digest_changes_with_any_byte_of_the_device_code(tmp_path: Path) -> None:
    for rel in suite.GPU_SOURCES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((REPO / rel).read_bytes())
    before = suite.combined_digest(suite.source_digests(tmp_path))
    assert before == suite.combined_digest(suite.source_digests())
    for rel in suite.GPU_SOURCES:
        data = (tmp_path / rel).read_bytes()
        (tmp_path / rel).write_bytes(data.replace(b"0x80", b"0x81", 1) if b"0x80" in data else data + b"\n")
        assert suite.combined_digest(suite.source_digests(tmp_path)) != before, rel
        (tmp_path / rel).write_bytes(data)


def test_the_gpu_suite_runs_on_the_cpu_as_a_dry_run(tmp_path: Path) -> None:
    """The script itself works (its portable-kernel subset in the interpreter); its record is never a GPU run."""
    out = tmp_path / "run.json"
    done = subprocess.run([sys.executable, str(REPO / "tests" / "gpu" / "run_gpu_suite.py"), "--dry-run",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["dry_run"] and record["device"] is None
    assert record["failed"] == 0 and record["passed"] >= 20
    assert record["variants_run"] == ["portable"] and record["variants_not_run"] == ["ptx"]
    assert record["kernel_sources"]["digest"] == suite.combined_digest(suite.source_digests())
