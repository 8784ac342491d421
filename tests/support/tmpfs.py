"""A small real file system for fault tests: a tmpfs mounted on a directory, so that "disk full" is the kernel's
ENOSPC and "read-only" its EROFS (``chmod`` does not stop root, which these tests run as).

Mounting needs root with mount rights; where it is refused the directory stays a plain one and the tests fall back
to injected faults (or skip), saying so in the fault report.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def tmpfs(path: Path, size: str | int, *options: str) -> Iterator[bool]:
    """Mount a tmpfs of ``size`` (bytes, or ``"2m"``) with mount ``options`` (e.g. ``"strictatime"``) on ``path``,
    created if missing; yields whether it is real (False: mounting was refused, ``path`` is a plain directory).
    Unmounted at the end (made writable first, should a test have left it read-only)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = False
    if os.geteuid() == 0:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(path)],
                           capture_output=True, timeout=30, check=False)
        mounted = r.returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["mount", "-o", "remount,rw", str(path)], capture_output=True, timeout=30, check=False)
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30, check=False)


def remount(path: Path, mode: str) -> None:
    """Remount the tmpfs on ``path`` ``"ro"`` or ``"rw"``."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True, capture_output=True, timeout=30)
