"""Where a cache keeps an entry: ``entries/<key>-<tag>`` under the cache's secret (:mod:`transformd.cache.names`),
for tests that know a cache directory and a key (as its owner, root, does)."""

from __future__ import annotations

import os
from pathlib import Path

from transformd.cache.names import EntryNames


def entry_dir(cache_root: str | os.PathLike[str], key: str) -> Path:
    """The directory of ``key``'s entry in the cache at ``cache_root`` (it may not exist)."""
    root = Path(cache_root)
    return root / "entries" / EntryNames(root).name(key)
