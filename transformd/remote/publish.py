"""Uploading a local entry to the tier: its files first, the manifest last (its presence is the commit).

A reader never sees half an entry: without ``manifest.json`` there is no entry (a miss), and the manifest is
written only once every file is. The manifest is written with ``If-None-Match: *`` (obstore's ``create`` mode)
so that of two nodes publishing one key at once one wins and the other is told; a store that ignores the
condition (``rclone serve s3`` 1.75 does) lets the second replace the first's objects with the same bytes (the
conversion is deterministic: the same key gives the same files), which is harmless. An entry whose manifest is
already in the tier is not uploaded again.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..cache.keys import Recipe, validate_key
from ..cache.manifest import CHECKPOINT_DIR, MANIFEST_NAME, Manifest
from . import names
from .errors import RemoteConfigError, RemoteCorruptError
from .stores import ObjectStore

#: Files uploaded at once (each large one in parts, :data:`.stores.UPLOAD_CONCURRENCY` at a time).
FILES_AT_ONCE = 4


def publish_entry(store: ObjectStore, key: str, entry_dir: Path) -> bool:
    """Upload the local entry at ``entry_dir`` (``manifest.json`` and ``checkpoint/``) as ``key``; True when this
    call committed it, False when the tier had it already or another upload committed it first."""
    validate_key(key)
    entry_dir = Path(entry_dir)
    try:
        manifest = Manifest.read(entry_dir / MANIFEST_NAME)
        raw = (entry_dir / MANIFEST_NAME).read_bytes()
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RemoteConfigError(f"{entry_dir}: not a cache entry: {e}") from None
    if manifest.key != key:
        raise RemoteConfigError(f"{entry_dir}: its manifest is for key {manifest.key}, not {key}")
    names.check_file_names(manifest.files, str(entry_dir / MANIFEST_NAME))
    for rec in manifest.files:
        size = (entry_dir / CHECKPOINT_DIR / rec.name).stat().st_size
        if size != rec.size:
            raise RemoteCorruptError(f"{entry_dir}: {rec.name} is {size} bytes, its manifest says {rec.size}; "
                                     "not published (transformd cache verify)")
    if store.size(names.manifest_name(key)) is not None:
        return False
    largest_first = sorted(manifest.files, key=lambda r: -r.size)
    with ThreadPoolExecutor(min(FILES_AT_ONCE, len(largest_first)), thread_name_prefix="transformd-remote-put") as p:
        list(p.map(lambda r: store.write_file(names.file_name(key, r.name), entry_dir / CHECKPOINT_DIR / r.name),
                   largest_first))
    return store.write_bytes(names.manifest_name(key), raw, create=True)


def publish_alias(store: ObjectStore, repo_id: str, commit: str, recipe: Recipe, key: str) -> bool:
    """Record that ``repo_id`` at ``commit`` converted with ``recipe`` is entry ``key``; False when a record was
    there already (the same one: the key is a function of these)."""
    validate_key(key)
    record = {**names.alias_record(repo_id, commit, recipe), "key": key}
    data = (json.dumps(record, sort_keys=True, indent=1) + "\n").encode()
    return store.write_bytes(names.alias_name(repo_id, commit, recipe), data, create=True)


def read_alias(store: ObjectStore, repo_id: str, commit: str, recipe: Recipe) -> str | None:
    """The key recorded for ``repo_id`` at ``commit`` with ``recipe``, or None; a record that does not say what was
    asked, or names no valid key, is :class:`RemoteCorruptError`."""
    name = names.alias_name(repo_id, commit, recipe)
    raw = store.read_bytes(name, 64 << 10)
    if raw is None:
        return None
    want = names.alias_record(repo_id, commit, recipe)
    try:
        record = json.loads(raw)
        key = validate_key(record["key"])
        same = all(record.get(k) == v for k, v in want.items())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RemoteCorruptError(f"remote {store.url}: {name}: not an alias record: {str(e)[:200]}") from None
    if not same:
        raise RemoteCorruptError(f"remote {store.url}: {name}: the record is not that of {repo_id}@{commit}")
    return key
