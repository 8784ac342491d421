"""The remote tier of one node: :class:`Remote`, made from ``--remote`` / ``$TRANSFORMD_REMOTE``.

See the package docstring (:mod:`transformd.remote`) for what the tier is and why obstore.
"""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from ..cache.keys import Recipe
from ..cache.manifest import Manifest
from . import fetch as _fetch
from . import names
from . import publish as _publish
from .errors import RemoteConfigError
from .fetch import FetchProgress
from .stores import (
    CONNECT_TIMEOUT_S,
    READ_TIMEOUT_S,
    WRITE_TIMEOUT_S,
    FileObjectStore,
    ObjectStore,
    S3ObjectStore,
)

#: Environment variable naming the remote (as ``--remote``).
ENV_REMOTE = "TRANSFORMD_REMOTE"


class Remote:
    """A bucket (or shared directory) of converted entries, keyed like the local cache.

    ``fetch`` downloads an entry into a staging directory, checked against its manifest; ``publish`` uploads a
    local entry (files, then the manifest); ``lookup_alias`` finds a key by repo id and commit. A ``read_only``
    remote never writes: ``publish`` and ``publish_alias`` return False without a request. Safe to share between
    threads.
    """

    def __init__(self, store: ObjectStore, *, read_only: bool = False):
        self.store = store
        self.url = store.url
        self.read_only = read_only
        self._ranges = True  # until the server answers a ranged read with the whole object
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, *, read_only: bool = False, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 read_timeout_s: float = READ_TIMEOUT_S, write_timeout_s: float = WRITE_TIMEOUT_S) -> Remote:
        """``s3://BUCKET[/PREFIX]`` (credentials and endpoint from the standard AWS chain) or ``file:///PATH``.
        A request waits at most ``connect_timeout_s`` to connect and ``read_timeout_s`` without progress; a write
        request (a part of a large file, or a small object) takes at most ``write_timeout_s`` (:mod:`.stores`)."""
        if not isinstance(url, str) or not url:
            raise RemoteConfigError("--remote: empty; expected s3://BUCKET[/PREFIX] or file:///PATH")
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme == "s3":
            prefix = parsed.path.strip("/")
            if not parsed.netloc or parsed.query or parsed.fragment or "@" in parsed.netloc or any(
                    p in ("", ".", "..") for p in prefix.split("/") if prefix):
                raise RemoteConfigError(f"--remote {url!r}: expected s3://BUCKET[/PREFIX]")
            clean = f"s3://{parsed.netloc}" + (f"/{prefix}" if prefix else "")
            store = S3ObjectStore(clean, parsed.netloc, prefix, connect_timeout_s=connect_timeout_s,
                                  read_timeout_s=read_timeout_s, write_timeout_s=write_timeout_s)
            return cls(store, read_only=read_only)
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
                raise RemoteConfigError(f"--remote {url!r}: expected file:///ABSOLUTE/PATH")
            return cls(FileObjectStore(url, Path(urllib.parse.unquote(parsed.path))), read_only=read_only)
        raise RemoteConfigError(f"--remote {url!r}: expected s3://BUCKET[/PREFIX] or file:///PATH")

    def has(self, key: str) -> bool:
        """Whether the tier holds a committed entry ``key`` (its manifest is there)."""
        return self.store.size(names.manifest_name(key)) is not None

    def manifest(self, key: str) -> Manifest | None:
        """The tier's manifest of entry ``key`` (checked: its key, its file names), or None when it has none."""
        return _fetch.read_manifest(self.store, key)

    def fetch(self, key: str, staging_dir: Path, progress: Callable[[FetchProgress], None] | None = None, *,
              before: Callable[[Manifest], None] | None = None) -> bool:
        """Download entry ``key`` into ``staging_dir``, every file checked against the manifest; False on a miss.
        ``before(manifest)`` runs before the first byte is downloaded (e.g. the cache making room for
        ``manifest.total_bytes``; what it raises propagates). The caller publishes ``staging_dir``
        (``checkpoint/`` and ``manifest.json``, sealed) with the cache's rename. Raises
        :class:`~.errors.RemoteError` (nothing fetched kept)."""
        found, ranges = _fetch.fetch_entry(self.store, key, Path(staging_dir), progress, ranges=self._ranges,
                                           before=before)
        with self._lock:
            self._ranges = self._ranges and ranges
        return found

    def publish(self, key: str, entry_dir: Path, alias: tuple[str, str, Recipe] | None = None) -> bool:
        """Upload the local entry ``entry_dir`` as ``key`` (files first, manifest last), then the alias record
        ``(repo_id, commit, recipe)`` if given; True when this call committed the entry."""
        if self.read_only:
            return False
        committed = _publish.publish_entry(self.store, key, Path(entry_dir))
        if alias is not None:
            self.publish_alias(*alias, key)
        return committed

    def publish_alias(self, repo_id: str, commit: str, recipe: Recipe, key: str) -> bool:
        if self.read_only:
            return False
        return _publish.publish_alias(self.store, repo_id, commit, recipe, key)

    def lookup_alias(self, repo_id: str, commit: str, recipe: Recipe | None = None) -> str | None:
        """The key of ``repo_id`` at full ``commit`` converted with ``recipe``, if a node recorded it; else None."""
        return _publish.read_alias(self.store, repo_id, commit, recipe or Recipe())

    def __repr__(self) -> str:
        return f"Remote({self.url!r}{', read_only=True' if self.read_only else ''})"
