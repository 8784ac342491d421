"""The caller's own file-system credentials (transformd.daemon.fscreds): borrowed by one thread only, given back after,
and what the kernel then allows is exactly what the caller may (groups, POSIX ACLs), which the mode-bit checks could
not say. Runs as root (it takes uid 65534's credentials)."""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from transformd.daemon import fscreds
from transformd.daemon.peers import Caller
from transformd.daemon.settings import Settings

from .support.callers import NOBODY
from .support.daemon import DaemonThread, short_tempdir

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(os.geteuid() != 0 or not fscreds.kernel_available(),
                       reason="needs a process that may take another uid's file-system credentials"),
]

GROUP = 4242


def _opens(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY))
    except PermissionError:
        return False
    return True


def test_borrowed_credentials_are_one_threads_and_are_given_back(tmp_path: Path) -> None:
    """While a worker thread reads as uid 65534 (groups 65534 and 4242), it may not open the daemon's 0700 directory,
    and every other thread keeps the daemon's own uid and groups (glibc's ``setgroups`` would have changed every
    thread's: the raw system call is used); afterwards the worker has its own back."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    groups_before = sorted(os.getgroups())
    held, release = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def worker() -> None:
        with fscreds.Reader(Caller(NOBODY, frozenset({NOBODY, GROUP})), kernel=True).opening():
            seen["inside_opens"] = _opens(private)
            seen["inside_groups"] = sorted(os.getgroups())
            held.set()
            release.wait(10)
        seen["after_opens"] = _opens(private)
        seen["after_groups"] = sorted(os.getgroups())

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert held.wait(10)
        assert _opens(private), "another thread lost the daemon's rights"
        assert sorted(os.getgroups()) == groups_before, "another thread's groups changed"
    finally:
        release.set()
        t.join(10)
    assert seen == {"inside_opens": False, "inside_groups": sorted({NOBODY, GROUP}), "after_opens": True,
                    "after_groups": groups_before}, seen


def _acl(entries: list[tuple[int, int, int]]) -> bytes:
    """A ``system.posix_acl_access`` value: version 2, then (tag, perm, id) entries."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, ident) for tag, perm, ident in entries)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every uid may search (pytest's own root is 0700)."""
    import shutil

    base = short_tempdir("tdfc-")
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_groups_and_acls_are_the_kernels_to_decide(open_dir: Path) -> None:
    """A 0750 directory of group 4242 opens for a caller in that group and not for one outside it; a 0700 directory
    whose ACL grants uid 65534 read and search opens for it with its own credentials, which the mode-bit checks
    refused (they read no ACL)."""
    shared = open_dir / "shared"
    shared.mkdir()
    os.chown(shared, 0, GROUP)
    os.chmod(shared, 0o750)

    def opens_as(caller: Caller, path: Path) -> bool:
        out: list[bool] = []

        def run() -> None:
            with fscreds.Reader(caller, kernel=True).opening():
                out.append(_opens(path))

        t = threading.Thread(target=run)
        t.start()
        t.join(10)
        return out[0]

    assert opens_as(Caller(NOBODY, frozenset({NOBODY, GROUP})), shared)
    assert not opens_as(Caller(NOBODY, frozenset({NOBODY})), shared)
    granted = open_dir / "granted"
    granted.mkdir(mode=0o700)
    user_obj, user, group_obj, mask, other, undefined = 1, 2, 4, 0x10, 0x20, 0xFFFFFFFF
    try:
        os.setxattr(granted, "system.posix_acl_access", _acl([(user_obj, 7, undefined), (user, 5, NOBODY),
                                                              (group_obj, 0, undefined), (mask, 5, undefined),
                                                              (other, 0, undefined)]))
    except OSError as e:
        pytest.skip(f"no POSIX ACLs here: {e}")
    caller = Caller(NOBODY, frozenset({NOBODY}))
    assert opens_as(caller, granted), "the ACL's grant"
    from transformd.cache.securefs import collect_facts

    facts = collect_facts((), [(str(granted), os.stat(granted))])
    assert fscreds.Reader(caller, kernel=True).denied(facts) is None
    assert fscreds.Reader(caller, kernel=False).denied(facts) is not None, "mode bits alone refuse it"


def test_healthz_says_which_mechanism_checks_callers() -> None:
    base = short_tempdir("tdfc-")
    try:
        settings = Settings(socket=base / "td.sock", cache_dir=base / "cache", device="cpu", log_level="critical")
        with DaemonThread(settings) as daemon, daemon.client(timeout=30) as http:
            body = http.get("/healthz").json()
        assert body["caller_reads"] == fscreds.KERNEL, body
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
