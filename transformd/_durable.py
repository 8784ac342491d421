"""Durable file operations, shared by every writer: ``convert --out`` and the cache publish the same way.

A checkpoint is written into one staging directory, every file fsynced once by its writer (the pipeline's
syncer, :func:`copy_file`, :func:`create_json`), then the directories are fsynced and the staging
directory renamed into place once (:func:`publish`; the cache renames ``staging/<name>`` to
``entries/<key>`` itself). Also: forced removal of read-only trees, JSON files replaced atomically,
free space.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import re
import secrets
import shutil
import stat
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import CheckpointError

#: A whole-file copy checks for a stop between steps of this many bytes.
COPY_STEP = 64 * 1024 * 1024

#: errno values that mean "the file system is full".
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def dir_with_mode(path: Path, mode: int) -> None:
    """Create the directory ``path`` with ``mode``, or give it ``mode`` when it is this user's (a directory of
    another owner is left as it is; the daemon refuses to serve such a cache)."""
    path.mkdir(mode=mode, exist_ok=True)
    st = path.stat()
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def fsync_path(path: Path | str) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (looked up once, when first needed), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        func = ctypes.CDLL(None, use_errno=True).sync_file_range  # (the process's own libc: no search)
    except (OSError, AttributeError):
        return None
    func.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return func  # type: ignore[no-any-return]


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``nbytes`` at ``offset`` of ``fd`` to the disk now, without waiting (Linux's
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; nothing elsewhere). A file written as fast as it arrives is otherwise
    written back only once a tenth of the memory is dirty, so the fsync at its end waits for almost all of it (6.8 s
    for 16 GiB on the H100 server); started as it goes, the writes overlap the arrival. Durability still comes from
    the fsync; this only moves the work earlier."""
    func = _sync_file_range()
    if func is not None:
        func(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # (an error here is the fsync's to report)


def temporary_beside(path: Path) -> Path:
    """The temporary file :func:`write_json_atomic` writes before renaming it over ``path``: ``.tmp.NAME.PID.HEX``."""
    return path.with_name(f".tmp.{path.name}.{os.getpid()}.{secrets.token_hex(4)}")


_TEMPORARY = re.compile(r"\.tmp\.(.+)\.\d+\.[0-9a-f]{8}")


def temporary_target(name: str) -> str | None:
    """The file name that a :func:`temporary_beside` file named ``name`` was to replace; None for other names."""
    match = _TEMPORARY.fullmatch(name)
    return match.group(1) if match else None


def write_json_atomic(path: Path, data: Any, *, durable: bool = False, mode: int = 0o644) -> None:
    """Write JSON to ``path`` by writing a temporary file beside it and renaming it over ``path``.

    Readers see the old or the new content, never a torn file. ``durable`` also fsyncs the file
    (not the directory) before the rename.
    """
    tmp = temporary_beside(path)
    text = json.dumps(data, indent=1, sort_keys=True)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_json(path: Path) -> Any | None:
    """Parsed JSON of ``path``, or None when it is missing or not valid JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _make_writable(path: str) -> None:
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            os.chmod(path, stat.S_IMODE(st.st_mode) | stat.S_IRWXU)
    except OSError:
        pass


def rmtree_force(path: Path | str) -> None:
    """Remove a tree even if its directories are read-only; a missing path is not an error.

    Tolerates another process removing the same tree at the same time.
    """
    path = os.fspath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    for dirpath, dirnames, _ in os.walk(path):
        _make_writable(dirpath)
        for d in dirnames:
            _make_writable(os.path.join(dirpath, d))

    def onexc(func, p, exc):
        err = exc if isinstance(exc, BaseException) else exc[1]
        if isinstance(err, FileNotFoundError):
            return
        if isinstance(err, PermissionError):
            _make_writable(os.path.dirname(p))
            try:
                func(p)
                return
            except FileNotFoundError:
                return
        raise err

    try:
        shutil.rmtree(path, onexc=onexc)  # type: ignore[call-arg]
    except TypeError:  # Python < 3.12
        shutil.rmtree(path, onerror=onexc)


def is_no_space(exc: BaseException) -> bool:
    """True when ``exc`` or an exception it was raised from/during is ENOSPC or EDQUOT."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS:
            return True
        e = e.__cause__ or e.__context__
    return False


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged user may still write on the file system holding ``path``."""
    st = os.statvfs(nearest_existing(path))
    return st.f_bavail * st.f_frsize


def fs_size_bytes(path: Path) -> int:
    st = os.statvfs(nearest_existing(path))
    return st.f_blocks * st.f_frsize


def nearest_existing(path: Path | str) -> Path:
    """``path``, or its closest existing parent (a cache directory removed under a running process is recreated
    there, so that is the file system to ask)."""
    p = Path(path)
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


# -------------------------------------------------------------------------------------------------------------------
# Checkpoint files: copy, write, stage, publish


def copy_file(src: Path, dst: Path, *, check: Callable[[], None] | None = None, fsync: bool = True) -> int:
    """Copy a file's bytes (following symlinks, as in an HF cache snapshot) and fsync the copy (unless not ``fsync``).

    Uses ``copy_file_range`` (in the kernel; a reflink where the file system shares extents) where it
    works, else positional reads and writes; ``check`` (the pipeline's stop check) runs between steps of
    ``COPY_STEP`` bytes, so a long copy can be abandoned.
    """
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        src_fd, dst_fd = fin.fileno(), fout.fileno()
        size = os.fstat(src_fd).st_size
        fast = hasattr(os, "copy_file_range")
        pos = 0
        while pos < size:
            if check is not None:
                check()
            step = min(COPY_STEP, size - pos)
            if fast:
                try:
                    done = os.copy_file_range(src_fd, dst_fd, step, pos, pos)
                except OSError:  # e.g. EXDEV/EINVAL/ENOSYS on some kernels and file systems
                    done = 0
                if done == 0:  # unsupported here (or the file shrank): the plain path decides
                    fast = False
                    continue
            else:
                done = _copy_by_reads(src_fd, dst_fd, pos, step)
                if done == 0:
                    raise CheckpointError(f"file ended at byte {pos} while copying its {size} bytes", file=src)
            pos += done
        if fsync:
            os.fsync(dst_fd)
    return size


def fsync_file(path: Path) -> int:
    """fsync a file written earlier (through another descriptor); returns its size."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _copy_by_reads(src_fd: int, dst_fd: int, pos: int, n: int) -> int:
    data = os.pread(src_fd, n, pos)
    view = memoryview(data)
    while view:
        view = view[os.pwrite(dst_fd, view, pos + len(data) - len(view)) :]
    return len(data)


def create_json(path: Path, obj: dict[str, Any]) -> int:
    data = (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data)


def fsync_dirs(path: Path) -> None:
    """fsync every directory of the staging tree, so the renamed directory's entries are durable too."""
    for root, _, _ in os.walk(path, topdown=False):
        fsync_path(Path(root))


#: Names beside ``out`` (``.<out name>.<tag>-<token>``): the staging directory, and the old ``out`` that
#: ``overwrite`` moves aside until the new one is in place.
_STAGING_TAG, _OLD_TAG = "transformd-staging", "transformd-old"


def make_staging(out: Path) -> tuple[Path, int]:
    """Create the staging directory beside ``out``, flock-ed until the returned descriptor is closed.

    The lock tells a later conversion into ``out`` that the directory is in use (:func:`remove_leftovers`); the
    creator's pid in the name covers the moment between the mkdir and the flock.
    """
    staging = out.parent / f".{out.name}.{_STAGING_TAG}-{os.getpid()}.{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    try:
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    except BaseException:
        staging.rmdir()
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass  # a file system without flock: scans cannot tell it is in use either, and leave it alone
    return staging, fd


def _lock_free(path: Path) -> bool | None:
    """True when no process holds an flock on the directory ``path``, False when one does, None when unknown."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)  # releases the probe's lock


def _creator_alive(token: str) -> bool:
    """Whether the process named in a staging token (``<pid>.<hex>``) still runs: it may be about to lock it."""
    pid = token.partition(".")[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists (EPERM: another user's)
    return True


def remove_leftovers(out: Path) -> None:
    """Remove what killed conversions into ``out`` left beside it; undo an ``overwrite`` killed mid-publish.

    Only directories no live conversion holds (flock, see :func:`make_staging`) are touched: staging directories,
    and the old ``out`` that ``overwrite`` moved aside, which is removed once ``out`` is in place, or renamed back
    when the kill came between the two renames of :func:`publish`. Best effort: where locks or removal do not
    work, things are left as they are.
    """
    prefix = f".{out.name}."
    try:
        names = sorted(n for n in os.listdir(out.parent) if n.startswith(prefix))
    except OSError:
        return
    live, olds = False, []
    for name in names:
        tag, _, _token = name[len(prefix) :].rpartition("-")
        path = out.parent / name
        if tag == _OLD_TAG:
            olds.append(path)
        elif tag == _STAGING_TAG:
            free = _lock_free(path) and not _creator_alive(_token)
            if free:
                shutil.rmtree(path, ignore_errors=True)
            else:
                live = True
    if not olds or live:
        return
    with contextlib.suppress(OSError):
        if out.exists():
            if _lock_free(out):  # a finished publish that was killed while removing the old output
                for old in olds:
                    shutil.rmtree(old, ignore_errors=True)
        elif len(olds) == 1:  # killed between moving the old output aside and renaming the new one into place
            os.rename(olds[0], out)


#: Seconds a staging directory may be without its flock while its creator runs (make_staging: mkdir, then flock).
_UNLOCKED_S = 10.0


def others_converting(staging: Path, out: Path) -> list[str]:
    """Names of the staging directories beside ``out``, other than ``staging``, that another conversion writes now:
    it holds the flock, or made the directory moments ago (between its mkdir and its flock). Never one that a killed
    process left, even where its pid runs again (a container's pid 1 restarted: :func:`remove_leftovers` keeps
    that one, a refusal for it would never end), nor one on a file system without flock once it is a few seconds
    old."""
    prefix = f".{out.name}.{_STAGING_TAG}-"
    try:
        names = sorted(n for n in os.listdir(out.parent) if n.startswith(prefix) and n != staging.name)
    except OSError:
        return []
    writing = []
    for name in names:
        path = out.parent / name
        if _lock_free(path) is False:
            writing.append(name)
            continue
        token = name.rpartition("-")[2]
        try:
            just_made = time.time() - os.stat(path).st_mtime < _UNLOCKED_S
        except OSError:
            continue
        if just_made and token.partition(".")[0] != str(os.getpid()) and _creator_alive(token):
            writing.append(name)
    return writing


def publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished staging directory to ``out``; an old non-empty ``out`` (overwrite) goes only after."""
    old: Path | None = None
    if out.exists():
        if any(out.iterdir()):
            if not overwrite:  # appeared while we were converting
                raise CheckpointError("the output directory became non-empty during the conversion", file=out)
            old = out.parent / f".{out.name}.{_OLD_TAG}-{uuid.uuid4().hex[:12]}"
            os.rename(out, old)
        else:
            out.rmdir()
    try:
        os.rename(staging, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
