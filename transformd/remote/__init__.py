"""The remote tier: converted entries shared by many nodes through one S3 bucket (or a shared directory).

The first node that converts a checkpoint publishes the entry (:meth:`Remote.publish`: its files, then its
manifest, the commit); every other node downloads it into its local cache instead of converting
(:meth:`Remote.fetch`: every file in parallel, each checked against the manifest's size and BLAKE3 digest, into a
staging directory that the cache publishes with its one rename). The key is the cache key: the same source bytes
and recipe give the same key and bit-identical files on every node. A node with only a repo id and a commit
finds the key through an alias record (:meth:`Remote.lookup_alias`).

Trust: the bucket is as trusted as the model store. The digests protect against corruption, truncation and
half-written objects, not against the bucket's owner; names from the bucket are checked (:mod:`.names`) before
anything is written, so a hostile manifest cannot write outside the staging directory. A failure of the tier
raises :class:`RemoteError`; the caller then converts locally, as without a tier.

Why obstore (the Rust object_store's binding) and not boto3, measured with ``benchmarks/remote_client_bench.py``
(the same 256 MiB object, the same ``rclone serve s3`` on loopback, whole processes, a 2-core development VM,
``benchmarks/results/remote_client_bench_cpu.txt``): obstore uploaded it in 7.0 s against boto3's 12.1 s (both
multipart, 16 MiB parts, 8 at once) and downloaded it in 4.0 s as one stream against 8.4 s for boto3's parallel
ranged download (s3transfer); an earlier run the same hour gave 4.3 against 7.4 s and 3.5 against 17.3 s. Its
requests are bounded (connect and per-read timeouts, a retry budget), its errors typed, and it reads the standard
AWS variables itself; boto3 is used only to read an AWS profile when one is named. rclone 1.75 answers ranged GETs
with ``200`` instead of ``206``, which obstore rightly refuses (boto3 takes it): against such a server the tier
reads each file as one stream (:mod:`.stores`).
"""

from __future__ import annotations

from .errors import RemoteConfigError, RemoteCorruptError, RemoteDeniedError, RemoteError, RemoteUnavailableError
from .fetch import FetchProgress
from .tier import ENV_REMOTE, Remote

__all__ = [
    "ENV_REMOTE",
    "FetchProgress",
    "Remote",
    "RemoteConfigError",
    "RemoteCorruptError",
    "RemoteDeniedError",
    "RemoteError",
    "RemoteUnavailableError",
]
