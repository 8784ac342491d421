"""tests/fault-report.md must describe the tests that land: it is regenerated whenever they change.

Each row of the report is written only after its test's assertions passed (tests/support/faultlog.py), so the rows are
a function of the recording tests' code. The report's header records the sha256 of those modules; when they have
changed since, the report may describe assertions that no longer exist (or miss new ones), and this test fails.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support import faultlog

REPORT = Path(__file__).resolve().parent / "fault-report.md"
REGENERATE = "TRANSFORMD_FAULT_REPORT=tests/fault-report.md .venv/bin/python -m pytest -q (the whole suite)"


def _rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| Category")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]


def test_the_fault_report_was_generated_by_the_current_recording_tests() -> None:
    text = REPORT.read_text(encoding="utf-8")
    found = re.search(rf"{faultlog.DIGEST_LABEL}: `([0-9a-f]{{64}})`", text)
    assert found, f"{REPORT.name} has no '{faultlog.DIGEST_LABEL}' line: it predates the check; regenerate: {REGENERATE}"
    assert found.group(1) == faultlog.recording_digest(), (
        f"{REPORT.name} is stale: the tests that write it changed since it was generated; regenerate: {REGENERATE}"
    )


def test_the_fault_report_holds_only_passing_rows_of_existing_tests() -> None:
    text = REPORT.read_text(encoding="utf-8")
    rows = _rows(text)
    assert rows and "0 failing" in text
    summary = re.search(r": (\d+) faults and attacks, (\d+) attempts", text)
    assert summary and int(summary.group(1)) == len(rows)
    assert int(summary.group(2)) == sum(int(r[2]) for r in rows)
    recording = {p.name for p in faultlog.recording_modules()}
    for category, fault, _tried, _outcome, result, tests in rows:
        assert result == "pass", (category, fault)
        assert set(tests.split(", ")) <= recording, (fault, tests)
