"""The fault report plugin: ``TRANSFORMD_FAULT_REPORT=1`` writes outside the repository, never the committed file."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_report_goes_to_tmpdir_by_default(tmp_path: Path) -> None:
    (tmp_path / "test_one.py").write_text(
        "def test_it(fault_log):\n    fault_log.record('cat', 'a fault', 2, 'refused')\n"
    )
    committed = REPO / "tests" / "fault-report.md"
    before = hashlib.sha256(committed.read_bytes()).hexdigest() if committed.exists() else None
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TRANSFORMD_FAULT_REPORT": "1", "TMPDIR": str(tmpdir)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.support.faultlog", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), "-c", os.devnull, str(tmp_path / "test_one.py")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = tmpdir / "transformd-fault-report.md"
    assert report.is_file() and "a fault" in report.read_text(), list(tmpdir.iterdir())
    assert f"written to {report}" in run.stdout
    after = hashlib.sha256(committed.read_bytes()).hexdigest() if committed.exists() else None
    assert after == before, "the committed tests/fault-report.md must not be rewritten"


def test_rows_recorded_in_xdist_workers_reach_the_report(tmp_path: Path) -> None:
    import pytest

    pytest.importorskip("xdist")
    (tmp_path / "test_two.py").write_text(
        "def test_a(fault_log):\n    fault_log.record('cat', 'fault a', 1, 'refused')\n\n"
        "def test_b(fault_log):\n    fault_log.record('cat', 'fault b', 3, 'refused')\n"
    )
    report = tmp_path / "report.md"
    env = {**os.environ, "TRANSFORMD_FAULT_REPORT": str(report)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "tests.support.faultlog", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_two.py")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    text = report.read_text()
    assert "fault a" in text and "fault b" in text and "2 faults and attacks, 4 attempts" in text, text
