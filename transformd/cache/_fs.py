"""File-system helpers: durable writes, forced removal, read-only marking, size parsing."""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any

#: errno values that mean "the file system is full".
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def fsync_path(path: Path | str) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any, *, durable: bool = False, mode: int = 0o644) -> None:
    """Write JSON to ``path`` by writing a temporary file beside it and renaming it over ``path``.

    Readers see the old or the new content, never a torn file. ``durable`` also fsyncs the file
    (not the directory) before the rename.
    """
    tmp = path.with_name(f".tmp.{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
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
    st = os.statvfs(_nearest_existing(path))
    return st.f_bavail * st.f_frsize


def fs_size_bytes(path: Path) -> int:
    st = os.statvfs(_nearest_existing(path))
    return st.f_blocks * st.f_frsize


def _nearest_existing(path: Path | str) -> Path:
    """``path``, or its closest existing parent (a cache directory removed under a running process is recreated
    there, so that is the file system to ask)."""
    p = Path(path)
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "p": 10**15,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}


def parse_size(text: str | int, *, total: int | None = None) -> int:
    """Parse ``"500G"``, ``"1.5TiB"``, ``"123456"`` or ``"80%"`` (of ``total``) into bytes."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    s = text.strip().lower().replace(" ", "")
    if s.endswith("%"):
        if total is None:
            raise ValueError(f"a percentage ({text}) needs a total to refer to")
        pct = float(s[:-1])
        if not 0 <= pct <= 100:
            raise ValueError(f"percentage out of range: {text}")
        return int(total * pct / 100)
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot parse size {text!r}; use bytes or a suffix like 500G, 1.5TiB, or 80%")
    value = float(num) * _UNITS[unit]
    if value < 0:
        raise ValueError(f"size must not be negative: {text}")
    return int(value)


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover
