"""Where things are in the bucket, and the checks on every name that comes from it.

Under ``s3://BUCKET/PREFIX`` (or ``file:///PATH``)::

    entries/<key>/checkpoint/<name>     the files of an entry, as in entries/<key>/checkpoint/ of a local cache
    entries/<key>/manifest.json         written last: its presence is the commit of the entry
    aliases/<id>.json                   {"repo_id", "commit", "recipe", "key"}: an entry found by repo id and commit

A key is a cache key (:func:`~transformd.cache.keys.validate_key`); a file name comes from a manifest, which is
untrusted: :func:`check_file_names` accepts only what a local entry may hold (relative ``/``-separated names, no
``.``/``..``/empty component, no NUL, backslash or control character, no name that is both a file and a directory,
bounded lengths and count), so nothing fetched is ever written outside the staging directory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import blake3

from ..cache.keys import FileRecord, Recipe, validate_key
from ..cache.manifest import CHECKPOINT_DIR, MANIFEST_NAME
from .errors import RemoteConfigError, RemoteCorruptError

#: Most files an entry fetched from the tier may have (a checkpoint has tens to a few thousand).
MAX_FILES = 100_000
MAX_NAME_BYTES = 1024
MAX_COMPONENT_BYTES = 255
_DIGEST_RE = re.compile(r"^blake3:[0-9a-f]{64}$")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_BAD_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")


def entry_prefix(key: str) -> str:
    return f"entries/{validate_key(key)}/"


def manifest_name(key: str) -> str:
    return entry_prefix(key) + MANIFEST_NAME


def file_name(key: str, name: str) -> str:
    """The object of file ``name`` (checked by :func:`check_file_names`) of entry ``key``."""
    return f"{entry_prefix(key)}{CHECKPOINT_DIR}/{name}"


def check_file_names(records: Iterable[FileRecord], where: str) -> None:
    """Raise :class:`RemoteCorruptError` unless every record names a file a local entry may hold, with a size and
    a ``blake3:`` digest of the right form (see the module); ``where`` names the manifest in the message."""
    seen: set[str] = set()
    dirs: set[str] = set()
    for n, rec in enumerate(records):
        if n >= MAX_FILES:
            raise RemoteCorruptError(f"{where}: more than {MAX_FILES} files")
        name = rec.name
        why = _name_problem(name)
        if why is None and name in seen:
            why = "listed twice"
        if why is None and not (isinstance(rec.size, int) and rec.size >= 0):
            why = f"bad size {rec.size!r}"
        if why is None and not _DIGEST_RE.fullmatch(rec.digest):
            why = f"bad digest {rec.digest[:80]!r}"
        if why is not None:
            raise RemoteCorruptError(f"{where}: file name {name[:200]!r}: {why}; nothing was fetched")
        seen.add(name)
        parts = name.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    clash = sorted(seen & dirs)
    if clash:
        raise RemoteCorruptError(f"{where}: {clash[0]!r} is both a file and a directory; nothing was fetched")
    if not seen:
        raise RemoteCorruptError(f"{where}: lists no files")


def _name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not name:
        return "empty or not a string"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return "too long"
    if name.startswith("/"):
        return "absolute"
    if _BAD_CHARS.search(name):
        return "a control character or backslash"
    for part in name.split("/"):
        if part in ("", ".", ".."):
            return "an empty, '.' or '..' component"
        if len(part.encode("utf-8", "surrogatepass")) > MAX_COMPONENT_BYTES:
            return "a component too long"
    return None


def check_repo_commit(repo_id: str, commit: str) -> None:
    """A hub repo id (``owner/name``) and a full commit hash, or :class:`RemoteConfigError`."""
    if not isinstance(repo_id, str) or not _REPO_RE.fullmatch(repo_id) or ".." in repo_id:
        raise RemoteConfigError(f"not a repo id (owner/name): {str(repo_id)[:200]!r}")
    if not isinstance(commit, str) or not _COMMIT_RE.fullmatch(commit):
        raise RemoteConfigError(f"not a full commit hash (40 lowercase hex digits): {str(commit)[:80]!r}")


def alias_record(repo_id: str, commit: str, recipe: Recipe) -> dict[str, object]:
    check_repo_commit(repo_id, commit)
    return {"schema": 1, "repo_id": repo_id, "commit": commit, "recipe": recipe.as_dict()}


def alias_name(repo_id: str, commit: str, recipe: Recipe) -> str:
    """``aliases/<id>.json``: ``<id>`` hashes the repo id, the commit and the recipe (a name of fixed form)."""
    text = json.dumps(alias_record(repo_id, commit, recipe), sort_keys=True, separators=(",", ":"))
    return f"aliases/{blake3.blake3(text.encode()).hexdigest()[:32]}.json"
