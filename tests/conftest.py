"""Test set-up: without a GPU, Triton kernels run in Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported, so this runs
before any transformd module is imported by a test.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from tests.support.daemon import Daemons

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """Register the fault report (tests/support/faultlog.py): the ``fault_log`` fixture, the table at the end."""
    from tests.support import faultlog

    if not config.pluginmanager.is_registered(faultlog):
        config.pluginmanager.register(faultlog, "transformd-faultlog")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """schemathesis' items (tests/test_daemon_fuzz.py, one per API operation) share one node id under pytest 9, the
    operation being only in their names; pytest-xdist tells items apart by node id and would run one of them. Their
    operation goes into the id."""
    ids = Counter(item.nodeid for item in items)
    for item in items:
        label = getattr(item, "operation_label", None)
        if label and ids[item.nodeid] > 1:
            item._id = item._id.with_params(label)
    same = sorted(n for n, count in Counter(item.nodeid for item in items).items() if count > 1)
    if same:  # pytest-xdist would run one of each, silently
        raise pytest.UsageError(f"tests collected under the same node id: {', '.join(same)}")


@pytest.fixture(autouse=True)
def _no_transformd_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start from defaults: no TRANSFORMD_* variable of the caller's shell leaks in (a test sets its own)."""
    for name in list(os.environ):
        if name.startswith("TRANSFORMD_"):
            monkeypatch.delenv(name)


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    """Start real daemons in this test (``daemons.start(cache_dir=..., allow_roots=[...], **settings)``); all are
    stopped and their socket directories removed at its end (tests/support/daemon.py)."""
    from tests.support.daemon import Daemons  # here: transformd is imported only after TRITON_INTERPRET is set

    with Daemons() as started:
        yield started


@pytest.fixture
def mount_tmpfs() -> Iterator[Callable[..., bool]]:
    """``mount_tmpfs(path, size, *options)``: a small real file system on ``path`` until the test ends; returns whether
    it is real (False where mounting is refused: a plain directory). See tests/support/tmpfs.py."""
    from tests.support.tmpfs import tmpfs

    with contextlib.ExitStack() as stack:
        yield lambda path, size, *options: stack.enter_context(tmpfs(path, size, *options))
