"""``transformd convert SRC --cache-dir C``: the daemon that serves C converts, when one is running.

A daemon has torch, CUDA and its kernels loaded already. This process would first spend 4-7 s importing torch,
starting CUDA and launching its first kernel (the H200 machine: benchmarks/results/
convert_bench_h200_wholeprocess_16g_run3.txt), while the output's writes, which bound a cold conversion, wait;
and a second converter on the node would share the GPU and the disk with the daemon's. So when a daemon of this
version answers on its socket (``$TRANSFORMD_SOCKET``, else the default places, as for ``transformd resolve``) and
serves the very cache directory this command writes to (the same directory on disk), ``convert`` asks it for the
conversion, shows its progress, and never imports torch. ``convert --no-daemon`` converts here regardless.

The daemon is trusted for the work only. Once it reports the entry ready, this process looks up its own key of SRC
in its own cache: the key it computed before asking, or else (a large source new to the cache, which this process
did not read) the key from the cache's stat cache, which the daemon filled as it read SRC (when this process stats
the same files, with the same device, inode, size and times, nothing is read again; otherwise it hashes them). A
daemon that read other files under the same path (another mount namespace) or answered falsely leaves no entry
under that key, and the conversion happens here. So does any refusal or failure of the daemon (SRC outside its
allowed roots, a full queue, degraded, gone, an error of its own or a malformed answer), with one line saying why:
the conversion here then ends as it would have without a daemon, an invalid checkpoint included.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .._version import __version__
from .. import request
from ..cache import Cache, CacheError, Entry, Recipe, SourceIdentity
from ..client import default_socket_path
from .common import shown

__all__ = ["convert_through_daemon"]

#: Seconds a request to the daemon may take to connect (the wait for the conversion has no limit, as in
#: ``transformd resolve``).
REQUEST_TIMEOUT_S = 30.0
#: Seconds between two polls of the daemon's progress at most (the first come sooner): at most this late at the end.
POLL_INTERVAL_S = 0.2


class _NotHere(Exception):
    """This daemon serves the cache but is not to be asked (another version, degraded): one line says why."""


def convert_through_daemon(cache: Cache, src: str | os.PathLike[str], recipe: Recipe, *,
                           known: SourceIdentity | None, progress_every: float, here: bool = True) -> Entry | None:
    """The entry of ``src`` with ``recipe`` in ``cache``, converted by the daemon that serves ``cache``; None when
    there is no such daemon or it did not convert it (then the caller converts; a line on standard error says
    why, unless no daemon serves this cache). ``known``: this process's identity of ``src``, if it has one.
    ``entry.outcome`` is ``daemon`` (``hit`` when the daemon had it already). Not ``here`` (this process does not
    write ``cache``: :meth:`~transformd.cache.Cache.written_here`), the entry is the one at the path the daemon
    answered with, of the key it answered with, and a daemon that did not convert it is a :class:`CacheError`
    saying why."""
    sock = default_socket_path()
    if not sock.exists():  # no daemon: not even httpx is imported
        return None
    from ..client import TransformdClient, TransformdError
    from .resolve import ProgressReporter, resolve_with_progress

    client = TransformdClient(socket=sock, timeout=REQUEST_TIMEOUT_S)
    asked, done = 0.0, False
    try:
        with client:
            health = client.health(degraded_ok=True)
            if not _same_directory(health.get("cache_root"), cache.root):
                return None  # another cache (the system's, while this one is a user's): nothing to say
            if health.get("version") != __version__:
                raise _NotHere(f"is transformd {health.get('version')}, this is {__version__}")
            if health.get("status") != "ok":
                raise _NotHere(f"is degraded ({'; '.join(map(str, health.get('problems') or [])) or 'no reason'})")
            reporter = ProgressReporter(sys.stderr, every_s=progress_every)
            asked = time.time()
            path, _ = resolve_with_progress(client, os.fspath(src), reporter, target=recipe.target,
                                            scale_mode=recipe.scale_mode, select=recipe.select,
                                            poll_interval=POLL_INTERVAL_S)
            done = True
        if known is not None or here:  # the entry of this process's own key of src (step 3 of transformd.request)
            entry = request.find(cache, known or request.identify(cache, src), recipe)
        else:  # another user's cache, whose entry names this user cannot make (cache.names): the entry of the key
            entry = cache.entry_at(client.last_key, path) if client.last_key else None  # and path it was answered
        # converted since it was asked (for this request, or for another at the same time), or cached before
        outcome = None if entry is None else "daemon" if entry.manifest.created_at >= asked else "hit"
    except KeyboardInterrupt:
        if asked and not done:
            print(f"transformd: the conversion goes on in the daemon at {client.where}", file=sys.stderr)
        raise
    except _NotHere as why:
        return _converting_here(f"the daemon at {client.where} {why}", here)
    except (TransformdError, OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # its answers too
        return _converting_here(f"the daemon at {client.where} did not convert it: {err}", here)
    if entry is None:
        return _converting_here(f"the daemon at {client.where} converted files that are not {src} as this "
                                "process reads them (another mount namespace?)", here)
    entry.outcome = outcome
    return entry


def _same_directory(theirs: object, ours: Path) -> bool:
    """Whether the path the daemon reports names the directory ``ours`` here (a path of another mount namespace
    may name nothing, or something else)."""
    try:
        return isinstance(theirs, str) and os.path.samefile(theirs, ours)
    except OSError:
        return False


def _converting_here(why: str, here: bool = True) -> None:
    if not here:
        raise CacheError(f"{why}; this user may not write the cache to convert it itself")
    print(shown(f"transformd: {why}; converting in this process"), file=sys.stderr, flush=True)  # its words too
    return None
