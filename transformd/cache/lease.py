"""Leases: files that protect an entry from eviction while someone uses it.

``leases/<key>/<lease id>.json`` holds the expiry time and, optionally, the identity of the
holding process. A lease protects its entry only while it has not expired and its holder is
not known to be dead; expired and dead-holder leases are ignored and removed by ``gc``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._durable import read_json, write_json_atomic
from .errors import EntryNotFoundError, InvalidKeyError
from .keys import KEY_RE, validate_key
from .lock import process_alive, process_identity
from .manifest import MANIFEST_NAME

#: Default lease duration of :meth:`Cache.lease` (seconds); a lease of a live process.
DEFAULT_LEASE_TTL_S = 24 * 3600.0
#: Sentinel: the lease is held by the calling process.
CURRENT_PROCESS = -1

LEASE_ID_RE = re.compile(r"^[0-9a-f]{16}$")


def new_lease_id() -> str:
    return secrets.token_hex(8)


def validate_lease_id(lease_id: str) -> str:
    if not isinstance(lease_id, str) or not LEASE_ID_RE.fullmatch(lease_id):
        raise InvalidKeyError(f"not a lease id (expected 16 lowercase hex digits): {lease_id!r}")
    return lease_id


@dataclass(frozen=True)
class Lease:
    key: str
    id: str
    created_at: float
    expires_at: float
    #: free text naming the user (e.g. "vllm rank 0", a client address)
    holder: str = ""
    #: identity of the holding process (see :func:`transformd.cache.lock.process_identity`), or
    #: None for a lease that only expires (e.g. one the daemon holds for a remote client)
    owner: dict[str, Any] | None = None
    #: uid of the caller that took it (the daemon's callers), or None; only that uid or an admin may release it
    uid: int | None = None

    def holder_alive(self) -> bool | None:
        return process_alive(self.owner) if self.owner else None

    def is_live(self, now: float | None = None) -> bool:
        """Does this lease protect its entry right now?"""
        now = time.time() if now is None else now
        return now < self.expires_at and self.holder_alive() is not False

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.expires_at - time.time())

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "id": self.id,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "holder": self.holder,
            "owner": self.owner,
            "uid": self.uid,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Lease:
        return cls(
            key=str(d["key"]),
            id=str(d["id"]),
            created_at=float(d["created_at"]),
            expires_at=float(d["expires_at"]),
            holder=str(d.get("holder", "")),
            owner=d.get("owner"),
            uid=d["uid"] if isinstance(d.get("uid"), int) else None,
        )


def lease_path(leases_dir: Path, key: str, lease_id: str) -> Path:
    return leases_dir / key / f"{lease_id}.json"


def write_lease(leases_dir: Path, lease: Lease) -> None:
    d = leases_dir / lease.key
    d.mkdir(parents=True, exist_ok=True)
    write_json_atomic(lease_path(leases_dir, lease.key, lease.id), lease.as_dict())


def read_leases(leases_dir: Path, key: str) -> list[Lease]:
    """Every lease file of ``key`` (live or not); unreadable files are skipped."""
    d = leases_dir / key
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        data = read_json(d / name)
        if isinstance(data, dict):
            try:
                lease = Lease.from_dict(data)
            except (KeyError, TypeError, ValueError):
                continue
            if lease.key == key and f"{lease.id}.json" == name:
                out.append(lease)
    return out



class LeaseMixin:
    """The :class:`~transformd.cache.store.Cache` methods that take, renew, list and release leases (a part of
    ``Cache``, kept here for size)."""


    def acquire_lease(
        self, key: str, ttl_s: float, *, holder: str = "", pid: int | None = CURRENT_PROCESS, uid: int | None = None
    ) -> Lease:
        """Protect entry ``key`` from eviction for ``ttl_s`` seconds (renewable).

        ``pid``: the holding process (default: this one; the lease stops protecting when it
        dies), or None for a lease that only expires (e.g. held by the daemon for a client).
        Raises :class:`EntryNotFoundError` if there is no such entry.
        """
        validate_key(key)
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, not {ttl_s}")
        owner = None if pid is None else process_identity(None if pid == CURRENT_PROCESS else pid)
        now = time.time()
        lease = Lease(key, new_lease_id(), now, now + ttl_s, holder, owner, uid)
        self._write_lease_checked(lease)
        return lease

    def renew_lease(self, lease: Lease, ttl_s: float) -> Lease:
        """Extend ``lease`` to ``ttl_s`` seconds from now (recreating it if gc removed it as expired)."""
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, not {ttl_s}")
        renewed = Lease(
            lease.key, lease.id, lease.created_at, time.time() + ttl_s, lease.holder, lease.owner, lease.uid
        )
        self._write_lease_checked(renewed)
        return renewed

    def _write_lease_checked(self, lease: Lease) -> None:
        with self._gc_lock(shared=True):
            if not (self.entry_dir(lease.key) / MANIFEST_NAME).exists():
                raise EntryNotFoundError(lease.key, self.root)
            write_lease(self.leases_dir, lease)
        self._touch(self.entry_dir(lease.key))

    def release_lease(self, lease: Lease | str, key: str | None = None) -> bool:
        """Remove a lease (a :class:`Lease`, or its id with ``key``). False if it was already gone."""
        if isinstance(lease, Lease):
            key, lease_id = lease.key, lease.id
        else:
            if key is None:
                raise TypeError("release_lease(lease_id, key) needs the key")
            lease_id = lease
        validate_key(key)
        validate_lease_id(lease_id)
        try:
            os.unlink(lease_path(self.leases_dir, key, lease_id))
        except FileNotFoundError:
            return False
        with contextlib.suppress(OSError):
            os.rmdir(self.leases_dir / key)  # only succeeds when it was the last one
        return True

    def get_lease(self, key: str, lease_id: str) -> Lease | None:
        """The lease ``lease_id`` of ``key`` (live or not), or None."""
        validate_key(key)
        validate_lease_id(lease_id)
        return next((lease for lease in read_leases(self.leases_dir, key) if lease.id == lease_id), None)

    def leases(self, key: str | None = None) -> list[Lease]:
        """Every lease file (live or not; see :meth:`Lease.is_live`) of ``key`` or of all keys."""
        if key is not None:
            return read_leases(self.leases_dir, validate_key(key))
        out: list[Lease] = []
        with contextlib.suppress(FileNotFoundError):
            for k in sorted(os.listdir(self.leases_dir)):
                if KEY_RE.fullmatch(k):
                    out.extend(read_leases(self.leases_dir, k))
        return out

    @contextlib.contextmanager
    def lease(self, key: str, ttl_s: float = DEFAULT_LEASE_TTL_S, *, holder: str = "") -> Iterator[Lease]:
        """Hold a lease of this process on ``key`` for the duration of a ``with`` block."""
        lease = self.acquire_lease(key, ttl_s, holder=holder)
        try:
            yield lease
        finally:
            self.release_lease(lease)

