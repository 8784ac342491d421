"""Leases: files that protect an entry from eviction while someone uses it.

``leases/<key>/<lease id>.json`` holds the expiry time and, optionally, the identity of the
holding process. A lease protects its entry only while it has not expired and its holder is
not known to be dead; expired and dead-holder leases are ignored and removed by ``gc``.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._durable import read_json, write_json_atomic
from .errors import InvalidKeyError
from .lock import process_alive

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
