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
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.faultlog", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), "-c", os.devnull, str(tmp_path / "test_one.py")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = tmpdir / "transformd-fault-report.md"
    assert report.is_file() and "a fault" in report.read_text(), list(tmpdir.iterdir())
    assert f"written to {report}" in run.stdout
    after = hashlib.sha256(committed.read_bytes()).hexdigest() if committed.exists() else None
    assert after == before, "the committed tests/fault-report.md must not be rewritten"
