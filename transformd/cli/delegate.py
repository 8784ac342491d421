"""``transformd convert SRC --cache-dir C``: the daemon that serves C converts, when one is running.

A daemon has torch, CUDA and its kernels loaded already. This process would first spend 4-7 s importing torch,
starting CUDA and launching its first kernel (the H200 machine: benchmarks/results/
convert_bench_h200_wholeprocess_16g_run3.txt), while the output's writes, which bound a cold conversion, wait;
and a second converter on the node would share the GPU and the disk with the daemon's. So when a daemon answers
on its socket (``$TRANSFORMD_SOCKET``, else the default places, as for ``transformd resolve``) and serves the very
cache directory this command writes to (the same directory on disk), ``convert`` asks it for the conversion,
shows its progress, and never imports torch. ``convert --no-daemon`` converts here regardless.

Nothing the daemon says is taken on trust. Once it reports the entry ready, this process keys SRC itself, through
the cache's stat cache (which the daemon filled as it read SRC: when this process stats the same files, with the
same device, inode, size and times, nothing is read again; otherwise it hashes them), and looks that key up in
its own cache. A daemon that read other files under the same path (another mount namespace) or answered falsely
leaves no entry under that key, and the conversion happens here. A daemon that refuses or fails for reasons of
its own (the source outside its allowed roots, degraded, gone, a bug) leaves the conversion here too, with one
line saying why; an invalid checkpoint and a cache too small for it are final, as they would be here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..cache import Cache, Entry, Recipe
from ..client import default_socket_path
from ..errors import CacheFullError, InvalidCheckpointError, SourceError, TransformdError

__all__ = ["convert_through_daemon"]

#: The daemon's answers that a conversion here would end with too (the checkpoint's content, the cache's room):
#: raised as they are. A conversion that failed in the daemon comes as a ConversionFailedError with such a status.
FINAL_ERRORS = (SourceError, InvalidCheckpointError, CacheFullError)
FINAL_STATUSES = (InvalidCheckpointError.http_status, SourceError.http_status, CacheFullError.http_status)
#: Seconds a request to the daemon may take before it counts as not answering (the wait for the conversion
#: itself has no limit, as in ``transformd resolve``).
REQUEST_TIMEOUT_S = 30.0
#: Seconds between two polls of the daemon's progress at most (the first come sooner): at most this late at the end.
POLL_INTERVAL_S = 0.2


def convert_through_daemon(cache: Cache, src: str | os.PathLike[str], recipe: Recipe, *, engine: str | None,
                           progress_every: float) -> Entry | None:
    """The entry of ``src`` with ``recipe`` in ``cache``, converted by the daemon that serves ``cache``; None when
    there is no such daemon or it did not convert it (then the caller converts; a line on standard error says
    why, unless no daemon serves this cache). ``entry.outcome`` is ``daemon`` (``hit`` when the daemon had it)."""
    sock = default_socket_path()
    if not sock.exists():  # no daemon: not even httpx is imported
        return None
    from ..client import TransformdClient
    from .resolve import ProgressReporter, resolve_with_progress

    client = TransformdClient(socket=sock, timeout=REQUEST_TIMEOUT_S)
    try:
        with client:
            health = client.health(degraded_ok=True)
            if not _same_directory(health.get("cache_root"), cache.root):
                return None  # another cache (the system's, while this one is a user's): nothing to say
            if health.get("status") != "ok":
                problems = "; ".join(str(p) for p in health.get("problems") or []) or "no reason given"
                return _converting_here(f"the daemon at {client.where} is degraded ({problems})")
            reporter = ProgressReporter(sys.stderr, every_s=progress_every)
            _, seen = resolve_with_progress(client, os.fspath(src), reporter, target=recipe.target,
                                            scale_mode=recipe.scale_mode, select=recipe.select, engine=engine,
                                            poll_interval=POLL_INTERVAL_S)
    except TransformdError as err:
        if isinstance(err, FINAL_ERRORS) or getattr(err, "status", None) in FINAL_STATUSES:
            raise
        return _converting_here(f"the daemon at {client.where} did not convert it: {err}")
    except KeyboardInterrupt:
        print(f"transformd: the conversion goes on in the daemon at {client.where}", file=sys.stderr)
        raise
    entry = cache.lookup(src, recipe)  # this process's key of SRC, in this process's cache
    if entry is None:
        return _converting_here(f"the daemon at {client.where} converted files that are not {src} as this "
                                "process reads them (another mount namespace?)")
    entry.outcome = "hit" if seen and seen[0].ready else "daemon"
    return entry


def _same_directory(theirs: object, ours: Path) -> bool:
    """Whether the path the daemon reports names the directory ``ours`` here (a path of another mount namespace
    may name nothing, or something else)."""
    try:
        return isinstance(theirs, str) and os.path.samefile(theirs, ours)
    except OSError:
        return False


def _converting_here(why: str) -> None:
    print(f"transformd: {why}; converting in this process", file=sys.stderr, flush=True)
    return None
