"""An entry of the cache: ``entries/<key>/`` with its manifest and converted checkpoint."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .lease import Lease
from .manifest import CHECKPOINT_DIR, MANIFEST_NAME, Manifest


class Entry:
    """A published cache entry.

    ``path`` is the converted checkpoint directory (give it to the engine); ``root`` the entry
    directory holding it and ``manifest.json``. ``outcome`` says how this call got it: ``hit``,
    ``converted`` (this process converted it), ``waited`` (another process did) or ``daemon`` (a daemon
    did, asked by ``convert``: :mod:`transformd.cli.delegate`). ``lease`` is set when the entry was
    obtained with ``lease_ttl``.
    """

    def __init__(self, key: str, root: Path, last_used: float, *, outcome: str = "hit", lease: Lease | None = None):
        self.key = key
        self.root = root
        self.path = root / CHECKPOINT_DIR
        self.last_used = last_used
        self.outcome = outcome
        self.lease = lease

    @functools.cached_property
    def manifest(self) -> Manifest:
        return Manifest.read(self.root / MANIFEST_NAME)

    @property
    def size_bytes(self) -> int:
        """Bytes of the entry on disk: the converted files plus the manifest."""
        try:
            extra = os.stat(self.root / MANIFEST_NAME).st_size
        except OSError:
            extra = 0
        return self.manifest.total_bytes + extra

    def __repr__(self) -> str:
        return f"Entry(key={self.key!r}, path={str(self.path)!r}, outcome={self.outcome!r})"
