"""The mutation pass (tests/mutation/run_mutants.py) stays runnable: every mutant's text is still in the source it
mutates, planting it leaves a source that compiles, and the tests it runs exist. A refactor that moves or rewrites
that text must update the mutant (the pass stops at the first one it cannot plant: four had gone stale before this
check, and one left an indentation error that counted as killed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("run_mutants", REPO / "tests" / "mutation" / "run_mutants.py")
run_mutants = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("run_mutants", run_mutants)  # (its dataclass looks its module up there)
_spec.loader.exec_module(run_mutants)


@pytest.mark.parametrize("mutant", run_mutants.MUTANTS, ids=lambda x: x.id)
def test_each_mutant_can_be_planted(mutant):
    try:
        changed = run_mutants.planted(REPO, mutant)  # (what the pass writes into its copy)
    except SystemExit as gone:
        pytest.fail(str(gone))
    for f, text in changed.items():  # planted, the source still compiles: a mutant must fail tests, not the import
        compile(text, str(f), "exec")
    for arg in mutant.tests:
        if arg.startswith("tests/"):
            assert (REPO / arg.split("::")[0]).exists(), f"{mutant.id}: {arg} does not exist"


def test_mutant_ids_are_unique():
    ids = [x.id for x in run_mutants.MUTANTS]
    assert len(ids) == len(set(ids))
