"""Polling until something a thread or another process does has happened."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> None:
    """Return once ``cond()`` is true; fail the test after ``timeout`` seconds, naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
