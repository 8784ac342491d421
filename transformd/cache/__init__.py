"""Content-addressed cache of converted checkpoints on local disk.

One conversion per checkpoint per node: an entry is keyed by the *content* of the source
checkpoint and the recipe (target, scale mode, tensor selection, transformd's format version),
produced once under a cross-process single-flight lock, published by an atomic rename, kept
within a byte budget by LRU eviction that never removes a leased entry, and checked against
its manifest by ``verify``.

Quick use::

    from transformd.cache import Cache, Recipe
    cache = Cache()                                   # root from $TRANSFORMD_CACHE_DIR or ~/.cache/transformd
    entry = cache.get_or_convert("/models/X", Recipe(target="fnuz"))
    print(entry.path)                                 # the converted checkpoint directory
    with cache.lease(entry.key):                      # protects it from eviction while in use
        ...

Root directory
--------------
``Cache(root)`` > ``$TRANSFORMD_CACHE_DIR`` > ``$XDG_CACHE_HOME/transformd`` > ``~/.cache/transformd``.
Put it on local NVMe; the files are served memory-mapped.

On-disk layout (everything a person needs can be read with ``ls`` and ``cat``)
------------------------------------------------------------------------------
::

    <root>/
      CACHEDIR.TAG                     marks the directory as a cache (backup tools skip it)
      config.json                      {"budget_bytes": ...}; written once when the root is created
      entry-names.key                  0400: the secret the entries' names are keyed with (:mod:`.names`)
      entries/<key>-<tag>/             one published entry; <key> = 32 hex digits, <tag> = 32 hex digits of
                                       the key's keyed blake3 under the secret (:meth:`Cache.entry_dir`)
        manifest.json                  read-only: recipe, source files (name, size, content id) and
                                       source path (a hint only), every output file's size and blake3
                                       digest, timings, the converter's result (error report), created_at
        checkpoint/                    read-only: the converted checkpoint (config.json, *.safetensors,
                                       index, tokenizer, ...): give this path to the engine
      staging/<key>-<tag>.<pid>.<rand>/      a conversion in progress (becomes entries/<key>-<tag>)
      staging/<key>-<tag>.<pid>.<rand>.json  its owner (pid, host, boot id, start time), reserved bytes and
                                       progress (state, converter's latest update), rewritten <= 4x/s
      locks/<key>.lock                 flock held by the converting process (JSON owner inside);
                                       exists only while a conversion runs
      locks/gc.lock                    flock serialising eviction/removal/quarantine against new leases
      leases/<key>/<lease id>.json     {expires_at, owner process or null, holder}: protects <key>
      quarantine/<key>.<utc>.<rand>/   entries that failed verify, with QUARANTINED.txt (never served)
      trash/                           entries being deleted (renamed here first, then removed)
      failures/<key>.json              the last failed conversion of <key> (error type, message, time)
      stat-cache/<hash of src path>.json
                                       (dev, inode, size, mtime_ns, ctime_ns) -> content id per file of
                                       one source directory, so unchanged sources are not re-read

Rules
-----
- Modes: ``entries/`` and ``staging/`` 0711 (others pass through to the paths the daemon gave them, and list
  nothing), every other directory 0700: the stat cache names every source, the rest names keys. A key does not
  open its entry (anyone may compute a key from what the Hub shows): the tag does, and only the cache's owner
  (and root) can make it (:mod:`.names`); entries named otherwise (a bare key: the layout before) are moved under
  their names when their owner opens the cache.
- Keys (:mod:`.keys`): blake3 over the recipe, the sorted list of (relative name, size, content
  id) of every non-hidden file under the source directory (recursively, following symlinks), and who
  could rewrite those files in place (:func:`.keys.source_writers`). Content ids are ``blake3:`` of the
  bytes, or for Hugging Face hub snapshots (symlinks into ``blobs/``) the blob name, ``hf-sha256:`` (LFS)
  or ``hf-git-sha1:`` (small files), once the bytes were hashed and matched it; the same for
  ``hf download --local-dir`` directories, from the etags huggingface_hub records there.
- Publishing: the converter writes ``staging/<name>/checkpoint``; every file is digested,
  fsynced and made read-only (0444; directories 0555), ``manifest.json`` is written and fsynced,
  the staging directory is fsynced and renamed to ``entries/<key>-<tag>``, and ``entries/`` is fsynced.
  Only ``entries/`` is ever served, so a half-written entry is never visible. A second finisher
  finds the entry present and discards its own staging.
- Single flight: one process per key holds ``locks/<key>.lock``; the others poll, report its
  progress, and return the same entry. A lock held by a dead process is released by the kernel,
  so the next caller takes over. Staging and locks left by dead processes are removed when a
  :class:`Cache` is created and before every conversion.
- Last use: the modification time of ``entries/<key>-<tag>/`` (set on every lookup; ``ls -lt entries``
  lists entries most recently used first).
- Budget: ``Cache(budget_bytes=)`` > ``$TRANSFORMD_CACHE_BUDGET`` > ``config.json`` (written at
  creation as 90% of the file system's free space then). Sizes accept ``500G``, ``1.5TiB``,
  ``80%`` (of the file system). Before a conversion, room for about the source's size is made by
  evicting least-recently-used entries without a live lease; if even that cannot make room,
  :class:`CacheFullError` is raised and nothing is evicted. Conversions in progress reserve their
  estimate. A live lease has not expired and its holder process is not known to be dead.
- Disk full during a conversion or its publish: :class:`DiskFullError` naming the cache and the
  bytes needed; the staging directory is removed; entries are untouched.
- Integrity: ``verify`` re-hashes entries against their manifests and moves corrupt ones to
  ``quarantine/``.
"""

from ..progress import human_bytes
from .alongside import PendingIdentity
from .budget import ENV_BUDGET, CacheUsage, CleanupReport, GcReport, parse_size
from .converter import Converter, TransformdConverter
from .entry import Entry
from .errors import (
    CacheError,
    CacheFullError,
    CacheTimeoutError,
    ConversionFailedError,
    DiskFullError,
    EntryLeasedError,
    EntryNotFoundError,
    InvalidKeyError,
    NotACacheError,
    SourceError,
)
from .keys import FileRecord, Recipe, SourceIdentity, cache_key, source_identity, validate_key
from .lease import CURRENT_PROCESS, Lease
from .manifest import CHECKPOINT_DIR, MANIFEST_NAME, Manifest
from .status import ConversionStatus
from .store import ENV_CACHE_DIR, Cache, default_root, existing_root
from .verify import VerifyResult

__all__ = [
    "CHECKPOINT_DIR",
    "CURRENT_PROCESS",
    "ENV_BUDGET",
    "ENV_CACHE_DIR",
    "MANIFEST_NAME",
    "Cache",
    "CacheError",
    "CacheFullError",
    "CacheTimeoutError",
    "CacheUsage",
    "CleanupReport",
    "ConversionFailedError",
    "ConversionStatus",
    "Converter",
    "DiskFullError",
    "Entry",
    "EntryLeasedError",
    "EntryNotFoundError",
    "FileRecord",
    "GcReport",
    "InvalidKeyError",
    "Lease",
    "Manifest",
    "NotACacheError",
    "PendingIdentity",
    "Recipe",
    "SourceError",
    "SourceIdentity",
    "TransformdConverter",
    "VerifyResult",
    "cache_key",
    "default_root",
    "existing_root",
    "human_bytes",
    "parse_size",
    "source_identity",
    "validate_key",
]
