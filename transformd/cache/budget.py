"""The cache's room: its budget (sizes as operators write them: ``500G``, ``1.5TiB``, ``80%``), LRU eviction
that skips leased entries, usage, ``rm``, ``gc``, and the cleanup of what dead processes left behind."""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._durable import (
    free_bytes,
    fs_size_bytes,
    read_json,
    rmtree_force,
    temporary_target,
)
from ..progress import human_bytes
from .entry import Entry
from .errors import (
    CacheFullError,
    EntryLeasedError,
    EntryNotFoundError,
)
from .keys import (
    KEY_HEX_LEN,
    KEY_RE,
    validate_key,
)
from .lease import read_leases
from .lock import FileLock, process_alive, process_identity
from .status import FAILURE_TTL_S, _StatusWriter

#: Environment variable with the byte budget ("500G", "1.5TiB", "80%" of the file system, bytes).
ENV_BUDGET = "TRANSFORMD_CACHE_BUDGET"
#: Leftover temporary files older than this (seconds) are removed by cleanup.
TMP_MAX_AGE_S = 600.0





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
    if not math.isfinite(value) or value < 0:  # (1e999 was an OverflowError's traceback, nan a ValueError's)
        raise ValueError(f"size must be a finite number of bytes, not negative: {text}")
    return int(value)



@dataclass
class CleanupReport:
    staging_removed: list[str] = field(default_factory=list)
    locks_removed: list[str] = field(default_factory=list)
    trash_removed: int = 0
    tmp_removed: int = 0


@dataclass
class GcReport:
    evicted: list[tuple[str, int]] = field(default_factory=list)
    freed_bytes: int = 0
    used_bytes: int = 0
    budget_bytes: int = 0
    leases_removed: int = 0
    quarantine_removed: int = 0
    cleanup: CleanupReport = field(default_factory=CleanupReport)


@dataclass
class CacheUsage:
    root: Path
    budget_bytes: int
    used_bytes: int
    entries: int
    leased_bytes: int
    free_bytes: int
    quarantined: int
    in_flight: int


@dataclass
class _EntryInfo:
    key: str
    root: Path
    last_used: float
    size: int



class BudgetMixin:
    """The :class:`~transformd.cache.store.Cache` methods that keep it within its budget: room for a new entry,
    LRU eviction that skips leased entries, usage, rm, gc and the cleanup of what dead processes left (a part of
    ``Cache``, kept here for size; it uses the cache's directories and locks)."""


    def _scan_entries(self) -> list[_EntryInfo]:
        out = []
        try:
            names = os.listdir(self.entries_dir)
        except FileNotFoundError:
            return []
        for name in names:
            key = self.key_of_entry(name)
            if key is None:  # (not an entry's name: see .names)
                continue
            d = self.entries_dir / name
            try:
                last_used = os.stat(d).st_mtime
            except OSError:
                continue
            try:
                size = Entry(key, d, last_used).size_bytes
            except (OSError, ValueError, KeyError, TypeError):
                size = _du(d)
            out.append(_EntryInfo(key, d, last_used, size))
        return out

    def _used_bytes(self) -> int:
        return sum(e.size for e in self._scan_entries())

    def _live_leased_keys(self) -> set[str]:
        out = set()
        now = time.time()
        try:
            keys = os.listdir(self.leases_dir)
        except FileNotFoundError:
            return out
        for key in keys:
            if KEY_RE.fullmatch(key) and any(lease.is_live(now) for lease in read_leases(self.leases_dir, key)):
                out.add(key)
        return out

    def _live_stagings(self) -> list[dict[str, Any]]:
        """Status files of conversions whose owner is not known to be dead."""
        out = []
        try:
            names = os.listdir(self.staging_dir)
        except FileNotFoundError:
            return out
        for n in names:
            if n.endswith(".json") and not n.startswith("."):
                data = read_json(self.staging_dir / n)
                if not isinstance(data, dict) or not KEY_RE.fullmatch(str(data.get("key"))):
                    continue
                alive = process_alive(data.get("owner"))
                if alive is None:  # another host or container: live while it holds the key's lock
                    alive = not self._key_lock_free(data["key"])
                if alive:
                    data["staging_dir"] = str(self.staging_dir / n.removesuffix(".json"))
                    out.append(data)
        return out

    def _reserve(self, key: str, estimate: int, source: str, writer: _StatusWriter) -> None:
        """Make room for ``estimate`` bytes (evicting LRU entries without live leases) and record the reservation.

        Raises :class:`CacheFullError` without evicting anything when it cannot be done.
        """
        victims: list[_EntryInfo] = []
        with self._gc_lock():
            entries = self._scan_entries()
            leased = self._live_leased_keys()
            reserved = sum(int(s.get("estimate_bytes") or 0) for s in self._live_stagings() if s.get("key") != key)
            used = sum(e.size for e in entries)
            budget = self.budget_bytes
            free = free_bytes(self.root)
            leased_bytes = sum(e.size for e in entries if e.key in leased)
            need = max(0, used + reserved + estimate - budget, estimate - free)
            candidates = sorted((e for e in entries if e.key not in leased), key=lambda e: (e.last_used, e.key))
            evictable = sum(e.size for e in candidates)
            if estimate > budget or evictable < need:
                why = (
                    f"the budget is only {human_bytes(budget)}"
                    if estimate > budget
                    else f"{human_bytes(used)} are used by {len(entries)} entries, {human_bytes(leased_bytes)} of "
                    f"them leased (in use, cannot be evicted), {human_bytes(reserved)} reserved by conversions in "
                    f"progress, budget {human_bytes(budget)}, {human_bytes(free)} free on disk"
                )
                raise CacheFullError(
                    f"cache {self.root} cannot hold the conversion of {source}: it needs about "
                    f"{human_bytes(estimate)} ({estimate} bytes) but {why}. Nothing was evicted. Raise the budget "
                    f"({ENV_BUDGET} or {self.config_path}), release leases, or use another --cache-dir",
                    root=self.root,
                    needed_bytes=estimate,
                    budget_bytes=budget,
                    used_bytes=used,
                    leased_bytes=leased_bytes,
                    free_bytes=free,
                )
            freed = 0
            for e in candidates:
                if freed >= need:
                    break
                victims.append(e)
                freed += e.size
            moved = [self._move_to_trash(e.key) for e in victims]
            writer.write(force=True)  # the reservation is visible to others from here on
        for m in moved:
            if m is not None:
                rmtree_force(m)

    def _move_to_trash(self, key: str) -> Path | None:
        """Rename an entry out of ``entries/`` (the atomic removal step); drop its leases."""
        dest = self.trash_dir / f"{key}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            os.rename(self.entry_dir(key), dest)
        except FileNotFoundError:
            return None
        rmtree_force(self.leases_dir / key)
        return dest

    def _enforce_budget(self, *, budget: int | None = None, protect: set[str] = frozenset()) -> list[tuple[str, int]]:
        victims: list[_EntryInfo] = []
        moved = []
        with self._gc_lock():
            budget = self.budget_bytes if budget is None else budget
            entries = self._scan_entries()
            leased = self._live_leased_keys() | set(protect)
            reserved = sum(int(s.get("estimate_bytes") or 0) for s in self._live_stagings())
            used = sum(e.size for e in entries) + reserved
            for e in sorted((e for e in entries if e.key not in leased), key=lambda e: (e.last_used, e.key)):
                if used <= budget:
                    break
                victims.append(e)
                used -= e.size
            moved = [self._move_to_trash(e.key) for e in victims]
        for m in moved:
            if m is not None:
                rmtree_force(m)
        return [(e.key, e.size) for e in victims]



    def entries(self) -> list[Entry]:
        """Every entry, most recently used first (does not mark them as used)."""
        infos = sorted(self._scan_entries(), key=lambda e: (-e.last_used, e.key))
        return [Entry(e.key, e.root, e.last_used) for e in infos]

    def usage(self) -> CacheUsage:
        entries = self._scan_entries()
        leased = self._live_leased_keys()
        try:
            quarantined = len([n for n in os.listdir(self.quarantine_dir) if not n.startswith(".")])
        except FileNotFoundError:
            quarantined = 0
        return CacheUsage(
            root=self.root,
            budget_bytes=self.budget_bytes,
            used_bytes=sum(e.size for e in entries),
            entries=len(entries),
            leased_bytes=sum(e.size for e in entries if e.key in leased),
            free_bytes=free_bytes(self.root),
            quarantined=quarantined,
            in_flight=len(self._live_stagings()),
        )

    def rm(self, key: str, *, force: bool = False) -> int:
        """Remove entry ``key``; returns the bytes freed.

        Refuses (:class:`EntryLeasedError`) while a live lease holds it, unless ``force``.
        Processes that mapped its files keep valid bytes until they unmap them.
        """
        validate_key(key)
        with self._gc_lock():
            d = self.entry_dir(key)
            if not d.exists():
                raise EntryNotFoundError(key, self.root)
            live = [lease for lease in read_leases(self.leases_dir, key) if lease.is_live()]
            if live and not force:
                holders = tuple(lease.holder or f"pid {(lease.owner or {}).get('pid', '?')}" for lease in live)
                raise EntryLeasedError(
                    f"cache entry {key} is leased by {len(live)} live holder(s) ({', '.join(holders)}); wait for "
                    f"the leases to be released or expire, or remove it anyway with force=True "
                    f"(transformd cache rm --force {key})",
                    key=key,
                    holders=holders,
                )
            info = next((e for e in self._scan_entries() if e.key == key), None)
            moved = self._move_to_trash(key)
        if moved is not None:
            rmtree_force(moved)
        return info.size if info else 0

    def gc(self, budget_bytes: int | str | None = None, *, purge_quarantine: bool = False) -> GcReport:
        """Apply the budget (evict LRU entries without live leases) and remove leftovers.

        Leftovers: stale staging and locks, trash, expired and dead-holder lease files, failure
        records older than an hour, stat-cache files of sources that no longer exist, and with
        ``purge_quarantine`` the quarantined entries.
        """
        report = GcReport(cleanup=self.cleanup())
        budget = None if budget_bytes is None else parse_size(budget_bytes, total=fs_size_bytes(self.root))
        report.evicted = self._enforce_budget(budget=budget)
        report.freed_bytes = sum(s for _, s in report.evicted)
        report.budget_bytes = self.budget_bytes if budget is None else budget
        report.used_bytes = self._used_bytes()
        now = time.time()
        for lease in self.leases():
            if not lease.is_live(now) and self.release_lease(lease):
                report.leases_removed += 1
        with contextlib.suppress(FileNotFoundError):
            for k in os.listdir(self.leases_dir):
                with contextlib.suppress(OSError):
                    os.rmdir(self.leases_dir / k)
        with contextlib.suppress(FileNotFoundError):
            for n in os.listdir(self.failures_dir):
                data = read_json(self.failures_dir / n)
                if not isinstance(data, dict) or now - float(data.get("at", 0)) > FAILURE_TTL_S:
                    with contextlib.suppress(OSError):
                        os.unlink(self.failures_dir / n)
        sc = self.root / "stat-cache"
        with contextlib.suppress(FileNotFoundError):
            for n in os.listdir(sc):
                data = read_json(sc / n)
                if not isinstance(data, dict) or not os.path.isdir(str(data.get("source"))):
                    with contextlib.suppress(OSError):
                        os.unlink(sc / n)
        if purge_quarantine:
            with contextlib.suppress(FileNotFoundError):
                for n in os.listdir(self.quarantine_dir):
                    rmtree_force(self.quarantine_dir / n)
                    report.quarantine_removed += 1
        return report

    def written_here(self) -> bool:
        """Whether this process writes the cache as its owner (its staging directory's). Another user's cache (a
        daemon's, whose directories others may not list) is read by key only, also by root (entries root made there
        its daemon could never evict) and through a read-only mount; the owner's own on a read-only disk is still
        the owner's (the cache's errors say what fails). Cleaned only when written here."""
        try:
            return self.staging_dir.stat().st_uid == os.geteuid()
        except OSError:
            return False

    def cleanup(self, *, _held_key: str | None = None) -> CleanupReport:
        """Remove what dead processes left: staging directories, lock files, trash, temporary files.

        A staging directory is stale when its owner is known to be dead, or when its owner cannot
        be checked (another host or container) and nobody holds its key's lock. Never touches
        entries. (``_held_key``: this process holds that key's lock, so any staging of that key is
        a dead process'.)
        """
        report = CleanupReport()
        try:
            names = sorted(os.listdir(self.staging_dir))
        except FileNotFoundError:
            names = []
        bases = {n.removesuffix(".json") for n in names if not n.startswith(".")}
        # a status file's temporary (_durable.write_json_atomic), left by a process killed while it replaced its
        # status, belongs to BASE even when nothing else of BASE is left
        temporaries = {n: t.removesuffix(".json") for n in names if (t := temporary_target(n)) and t.endswith(".json")}
        bases |= set(temporaries.values())
        for base in sorted(bases):
            key = base[:KEY_HEX_LEN]
            if not KEY_RE.fullmatch(key):
                continue
            status_file = self.staging_dir / f"{base}.json"
            data = read_json(status_file)
            owner = data.get("owner") if isinstance(data, dict) else None
            if owner is None:  # crashed before writing the status file: only the pid (name) is known
                parts = base.split(".")
                alive = None
                if (
                    len(parts) == 3
                    and parts[1].isdigit()
                    and process_alive(
                        {"pid": int(parts[1]), "host": process_identity()["host"], "pid_ns": None, "boot_id": None}
                    )
                    is False
                ):
                    alive = False
            else:
                alive = process_alive(owner)
            if alive is True:
                continue
            if alive is None and key != _held_key and not self._key_lock_free(key):
                continue
            rmtree_force(self.staging_dir / base)
            for leftover in [status_file.name, *(n for n, b in temporaries.items() if b == base)]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.staging_dir / leftover)
            report.staging_removed.append(base)
        with contextlib.suppress(FileNotFoundError):
            for n in sorted(os.listdir(self.locks_dir)):
                if n.endswith(".lock") and KEY_RE.fullmatch(n[: -len(".lock")]):
                    lock = FileLock(self.locks_dir / n)
                    if lock.try_acquire():
                        lock.release(unlink=True)
                        report.locks_removed.append(n[: -len(".lock")])
        with contextlib.suppress(FileNotFoundError):
            for n in os.listdir(self.trash_dir):
                rmtree_force(self.trash_dir / n)
                report.trash_removed += 1
        now = time.time()
        for d in (self.root, self.staging_dir, self.root / "stat-cache", self.failures_dir):
            with contextlib.suppress(FileNotFoundError):
                for n in os.listdir(d):
                    if n.startswith(".tmp."):
                        with contextlib.suppress(OSError):
                            if now - os.lstat(d / n).st_mtime > TMP_MAX_AGE_S:
                                os.unlink(d / n)
                                report.tmp_removed += 1
        return report

    def _key_lock_free(self, key: str) -> bool:
        lock = FileLock(self.locks_dir / f"{key}.lock")
        if lock.try_acquire():
            lock.release(unlink=True)
            return True
        return False



def _du(path: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for n in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_size
    return total

