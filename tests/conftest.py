"""Test set-up: without a GPU, Triton kernels run in Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported, so this runs
before any transformd module is imported by a test.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """Register the fault report (tests/support/faultlog.py): the ``fault_log`` fixture and the table written at the end."""
    from tests.support import faultlog

    if not config.pluginmanager.is_registered(faultlog):
        config.pluginmanager.register(faultlog, "transformd-faultlog")


@pytest.fixture(autouse=True)
def _no_transformd_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start from defaults: no TRANSFORMD_* variable of the caller's shell leaks in (a test sets its own)."""
    for name in list(os.environ):
        if name.startswith("TRANSFORMD_"):
            monkeypatch.delenv(name)
