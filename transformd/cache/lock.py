"""Who holds what: process identities, liveness checks and advisory file locks.

A lock only avoids duplicate work. ``flock`` locks are released by the kernel when their holder
dies, so a lock can never be stale on a local file system; on file systems where ``flock`` is
unreliable the cache stays correct because entries are published by an atomic rename.

Process identities record pid, host, boot id, PID namespace and the process' start time, so
that a recycled pid, a reboot or another container's pid is never mistaken for a live holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=1)
def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _host() -> str:
    return socket.gethostname()


def _pid_namespace(pid: int | str = "self") -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of ``pid`` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])


def process_identity(pid: int | None = None) -> dict[str, Any]:
    """Identity of this process (or of ``pid`` on this host), as stored in lock, lease and staging files."""
    pid = os.getpid() if pid is None else pid
    st = _proc_stat(pid)
    return {
        "pid": pid,
        "host": _host(),
        "boot_id": _boot_id(),
        "pid_ns": _pid_namespace(pid if pid != os.getpid() else "self"),
        "start": st[1] if st else None,
    }


def process_alive(ident: dict[str, Any] | None) -> bool | None:
    """Is the process described by ``ident`` still running?

    True or False when this process can tell; None when it cannot (another host, another PID
    namespace, no pid recorded), in which case the caller falls back to expiry times or locks.
    """
    if not ident or not isinstance(ident.get("pid"), int):
        return None
    if ident.get("host") != _host():
        return None
    boot = ident.get("boot_id")
    if boot is not None and _boot_id() is not None and boot != _boot_id():
        return False  # the machine rebooted since: every process of that boot is gone
    ns = ident.get("pid_ns")
    if ns is not None and _pid_namespace() is not None and ns != _pid_namespace():
        return None  # a pid of another container means nothing here
    pid = ident["pid"]
    st = _proc_stat(pid)
    if st is None:
        if os.path.isdir("/proc/self"):
            return False
        try:  # no procfs: best effort
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    state, start = st
    if state in ("Z", "X"):
        return False
    # a different start time means the pid was reused by another process
    return ident.get("start") is None or start == ident["start"]


class FileLock:
    """An exclusive, non-blocking ``flock`` on a lock file that is removed when released.

    Removing the file on release keeps the lock directory clean; the inode check in
    :meth:`try_acquire` makes this safe (a process that locked the unlinked file notices and retries).
    Separate :class:`FileLock` objects conflict with each other even inside one process.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self, owner: dict[str, Any] | None = None) -> bool:
        """Take the lock if nobody holds it; write ``owner`` (JSON) into the file for humans."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this object")
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder before us unlinked the file after we opened it
                os.close(fd)
                continue
            self._fd = fd
            if owner is not None:
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, json.dumps(owner).encode(), 0)
                except OSError:
                    pass  # the content is informational only
            return True
        return False  # pragma: no cover - only under pathological churn

    def release(self, *, unlink: bool = True) -> None:
        if self._fd is None:
            return
        try:
            if unlink:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FileLock:
        if not self.try_acquire():
            raise BlockingIOError(f"lock {self.path} is held by another process")
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass


class SharedExclusiveLock:
    """A blocking reader/writer ``flock`` on a file that is never removed (the cache's ``gc`` lock).

    Eviction, removal and quarantine take it exclusively; creating a lease takes it shared, so a
    lease is either seen by an evictor or created after the entry is gone (and then refused).
    """

    def __init__(self, path: Path):
        self.path = Path(path)

    @contextlib.contextmanager
    def _locked(self, op: int) -> Iterator[None]:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, op)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        return self._locked(fcntl.LOCK_EX)

    def shared(self) -> contextlib.AbstractContextManager[None]:
        return self._locked(fcntl.LOCK_SH)
