"""Reading a caller's source with the caller's own file-system credentials, where the daemon may.

A daemon that reads sources with its own rights and then decides from owner, group and mode bits whether the caller
could have read them answers from what the caller could not see: a link in the caller's source into another user's
0700 directory was a 403 when its target existed and a 422 "broken symlink" when not, a 507 stated the size of a file
the caller could not read, and a directory swapped for a link between the check and the open leaked what lay behind
it (two attack reviews). Where the daemon has ``CAP_SETUID`` and ``CAP_SETGID`` (it runs as root), the thread that
opens a caller's source takes the caller's file-system uid, gid and supplementary groups first (``setfsuid``,
``setfsgid``, ``setgroups``: per thread in Linux; ``setgroups`` through the raw system call, since glibc's wrapper
changes every thread of the process), and gives them back after the last open. The kernel then checks every open
and every component of every path exactly as for the caller itself (modes, groups, POSIX ACLs, at open time, so
nothing is checked and then reopened): whatever the daemon sees, the caller could see; whatever the kernel refuses
is one answer (:func:`.peers.unreadable`). Changing the fs uid away from 0 also drops the file-system capabilities
of the thread (``CAP_DAC_OVERRIDE``, ``CAP_DAC_READ_SEARCH``, ...): a probe at start-up checks that the kernel
really refuses a 0700 directory under a borrowed uid before this mode is used.

Elsewhere (no ``CAP_SETUID``, another kernel or architecture) the daemon reads with its own rights and checks the
facts it collected (:func:`.peers.denied`, :func:`.peers.path_denied`): ``/healthz`` says which (``caller_reads``).

:class:`Reader` is what a request hands to :func:`transformd.cache.securefs.reading_as` for the opens done for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from .errors import ApiError
from .peers import Caller, denied, hides, unreadable

log = logging.getLogger("transformd.daemon")

#: ``setgroups`` system call numbers (the raw call: glibc's ``setgroups`` changes every thread).
_NR_SETGROUPS = {"x86_64": 116, "aarch64": 159, "riscv64": 159, "loongarch64": 159}
#: ``caller_reads`` in ``/healthz``.
KERNEL = "kernel: the caller's own file-system uid, gid and groups (per thread)"
CHECKS = "checks: the daemon's own rights, owner, group and mode bits compared (no CAP_SETUID; POSIX ACLs not read)"
#: What the one refusal of a source read with the caller's credentials says is missing (never where).
KERNEL_MISSING = ("permission to search the directories on the way to it, or to read it or what it holds (the kernel "
                  "checked, with the caller's own credentials)")
_CAP_SETGID, _CAP_SETUID = 6, 7
_lock = threading.Lock()
_state: dict[str, Any] = {}


def _libc() -> Any:
    if "libc" not in _state:
        name = ctypes.util.find_library("c") or "libc.so.6"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            lib.setfsuid.argtypes = lib.setfsgid.argtypes = [ctypes.c_uint32]
            lib.setfsuid.restype = lib.setfsgid.restype = ctypes.c_int
            lib.syscall.restype = ctypes.c_long
        except (OSError, AttributeError):
            lib = None
        _state["libc"] = lib
    return _state["libc"]


def _has_caps() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    eff = int(line.split()[1], 16)
                    return bool(eff >> _CAP_SETUID & 1 and eff >> _CAP_SETGID & 1)
    except (OSError, ValueError):
        pass
    return False


def _set_groups(gids: list[int]) -> None:
    """This thread's supplementary groups (the raw system call: this thread only)."""
    arr = (ctypes.c_uint32 * max(1, len(gids)))(*gids)
    if _libc().syscall(_NR_SETGROUPS[platform.machine()], ctypes.c_long(len(gids)), arr) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _current() -> tuple[int, int]:
    lib = _libc()
    return lib.setfsuid(0xFFFFFFFF), lib.setfsgid(0xFFFFFFFF)  # (an invalid id changes nothing, returns the current)


def _thread_groups() -> list[int]:
    """This thread's supplementary groups (``os.getgroups`` asks the kernel for the calling thread's)."""
    return os.getgroups()


@contextlib.contextmanager
def _as_ids(uid: int, gid: int, groups: list[int]) -> Iterator[None]:
    """Within: this thread opens files as ``uid``/``gid``/``groups``; its own are back after (or the process ends:
    a worker thread left with another's rights would do the daemon's next work with them)."""
    lib = _libc()
    saved_uid, saved_gid = _current()
    saved_groups = _thread_groups()
    try:
        _set_groups(groups)
        lib.setfsgid(gid)
        lib.setfsuid(uid)
        if _current() != (uid, gid):
            raise OSError(f"setfsuid/setfsgid to {uid}/{gid} did not take")
        yield
    finally:
        try:
            lib.setfsuid(saved_uid)
            lib.setfsgid(saved_gid)
            _set_groups(saved_groups)
            restored = _current() == (saved_uid, saved_gid) and sorted(_thread_groups()) == sorted(saved_groups)
        except Exception:  # noqa: BLE001 - see below
            restored = False
        if not restored:
            log.critical("could not give a worker thread its own file-system credentials back; exiting")
            sys.stderr.flush()
            os._exit(70)


def _probe() -> str | None:
    """None when a borrowed fs uid really is refused a 0700 directory of the daemon's (and the thread gets its own
    back); else why not."""
    if sys.platform != "linux" or platform.machine() not in _NR_SETGROUPS:
        return f"not Linux on {' or '.join(_NR_SETGROUPS)}"
    if _libc() is None:
        return "no C library"
    if not _has_caps():
        return "no CAP_SETUID and CAP_SETGID"
    box = tempfile.mkdtemp(prefix="transformd-probe-")
    other = 65534 if os.geteuid() != 65534 else 65533
    result: list[str | None] = []

    def probe() -> None:
        try:
            with _as_ids(other, other, []):
                try:
                    os.close(os.open(box, os.O_RDONLY | os.O_DIRECTORY))
                    result.append("the kernel let a borrowed uid open a 0700 directory (capabilities kept?)")
                    return
                except PermissionError:
                    pass
            os.close(os.open(box, os.O_RDONLY | os.O_DIRECTORY))
            result.append(None)
        except Exception as e:  # noqa: BLE001 - the mode is simply not used
            result.append(f"{type(e).__name__}: {e}")

    try:
        t = threading.Thread(target=probe, name="transformd-fscreds-probe")
        t.start()
        t.join()
    finally:
        shutil.rmtree(box, ignore_errors=True)
    return result[0] if result else "the probe did not finish"


def kernel_available() -> bool:
    """Whether callers' reads are done with their own credentials (probed once per process)."""
    with _lock:
        if "kernel" not in _state:
            why = _probe()
            _state["kernel"] = why is None
            if why is not None:
                log.info("callers' sources are read with the daemon's rights and checked by mode bits: %s", why)
        return bool(_state["kernel"])


def caller_reads() -> str:
    """Which mechanism checks callers' reads (for ``/healthz``)."""
    return KERNEL if kernel_available() else CHECKS


class Reader:
    """The opens of a source done for one caller (:func:`transformd.cache.securefs.reading_as`): with the caller's
    credentials where :func:`kernel_available`, else with the daemon's and the caller's check on what was opened."""

    def __init__(self, caller: Caller, kernel: bool | None = None):
        self.caller = caller
        self.kernel = kernel_available() if kernel is None else kernel

    @property
    def ident(self) -> tuple[Any, ...]:
        """Equal for two readers that see the same files."""
        if self.caller.uid == 0:
            return (0,)
        return (self.caller.uid, tuple(sorted(self.caller.gids)), self.kernel)

    def opening(self) -> contextlib.AbstractContextManager[None]:
        """Held around the opens: the caller's file-system credentials in this thread (kernel mode, not root)."""
        if not self.kernel or self.caller.uid == 0:
            return contextlib.nullcontext()
        if self.caller.uid < 0:
            raise self.refusal("")
        gids = sorted(self.caller.gids) or [65534]
        return _as_ids(self.caller.uid, gids[0], gids)

    def refusal(self, source: str, missing: str | None = None) -> ApiError:
        """The one answer for a source the caller may not read."""
        return unreadable(self.caller, source, missing or KERNEL_MISSING)

    def check(self, tree: Any) -> None:
        """Raise :meth:`refusal` unless the caller may read every file of ``tree`` (checks mode: the facts; kernel
        mode: the opens themselves said so)."""
        if self.kernel:
            return
        missing = denied(self.caller, tree.facts())
        if missing is not None:
            raise self.refusal(tree.src, missing)

    def denied(self, facts: Any) -> str | None:
        """:func:`.peers.denied` in checks mode; None in kernel mode (what was opened, the caller could open)."""
        return None if self.kernel else denied(self.caller, facts)

    def hides(self, real: str) -> str | None:
        """Checks mode: the right the caller lacks to search the way to ``real`` (:func:`.peers.hides`)."""
        return None if self.kernel else hides(self.caller, real)
