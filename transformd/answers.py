"""The daemon's answers as the client returns them (:mod:`transformd.client`): an entry's status, a shard's files
and tensor table, a lease. Each ``from_json`` takes the daemon's JSON as untrusted: a malformed key is a
:class:`~transformd.errors.ServerError`. No torch, no httpx here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConversionFailedError, ServerError, TransformdError
from .progress import Progress

__all__ = ["CheckpointStatus", "LeaseInfo", "ShardFile", "TensorEntry"]

_HEX_DIGITS = "0123456789abcdef"


def _absolute(path: Any) -> Path | None:
    """A path of the daemon's answer: absolute, or None; a relative one would name another directory in the caller's
    working directory, silently (a ValueError, which the client turns into its ServerError)."""
    if not path:
        return None
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"the path {str(path)[:80]!r} is not absolute")
    return Path(path)


@dataclass(frozen=True)
class CheckpointStatus:
    """One entry as the daemon reports it (``POST /v1/checkpoints`` or ``GET /v1/checkpoints/{key}``)."""

    key: str
    state: str  # queued | converting | ready | failed
    progress: Progress | None = None
    error: TransformdError | None = None
    path: Path | None = None
    source: str | None = None
    recipe: dict[str, Any] | None = None
    size_bytes: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def failed(self) -> bool:
        return self.state == "failed"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckpointStatus:
        err = data.get("error")
        error = None
        if isinstance(err, Mapping):
            status = err.get("status")
            error = ConversionFailedError.from_answer(
                str(err.get("message") or "conversion failed"),
                status=status if isinstance(status, int) else None,
                code=err.get("code"),
            )
        path = data.get("path")
        key = data.get("key")
        if not (key == "passthrough" or (isinstance(key, str) and len(key) == 32 and set(key) <= set(_HEX_DIGITS))):
            # a key goes into URLs and onto the terminal: a malformed one is the daemon's fault, said in one line
            raise ServerError(f"transformd answered with a malformed key {str(key)[:40]!r}")
        return cls(
            key=key,
            state=str(data.get("state", "")),
            progress=Progress.from_json(data.get("progress")),
            error=error,
            path=_absolute(path),
            source=data.get("source"),
            recipe=data.get("recipe"),
            size_bytes=data.get("size_bytes"),
            raw=dict(data),
        )


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard: safetensors dtype name, shape, and absolute byte range in the file."""

    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorEntry:
        """A tensor of the daemon's table: a ValueError (the client's ServerError) for a shape or offsets that are
        not whole numbers a tensor can have (a shape whose element count overflows 64 bits escaped as torch's
        RuntimeError from the loader, an attack review)."""
        begin, end = data["offsets"]
        shape = tuple(_whole(d, "a dimension") for d in data["shape"])
        if math.prod(d for d in shape if d) >= _LIMIT >> 3:  # (8 bytes an element at the most; zeros aside)
            raise ValueError(f"the shape {list(shape)[:8]} has more elements than a tensor can")
        begin, end = _whole(begin, "an offset"), _whole(end, "an offset")
        if begin > end:
            raise ValueError(f"the offsets [{begin}, {end}) are reversed")
        return cls(str(data["dtype"]), shape, (begin, end))


#: Sizes and offsets of a table are below this (torch's and the file system's int64).
_LIMIT = 1 << 63


def _whole(value: Any, what: str) -> int:
    """``value`` if it is a whole number in [0, 2**63); a ValueError naming ``what`` otherwise (a float, a bool or a
    string is not one: ``int()`` would have taken them)."""
    if type(value) is not int or not 0 <= value < _LIMIT:
        raise ValueError(f"{what} {str(value)[:40]!r} is not a whole number in [0, 2**63)")
    return value


@dataclass(frozen=True)
class ShardFile:
    """One file of ``GET /v1/checkpoints/{key}/files``: map ``path`` read-only and cut ``tensors`` out of it.

    ``path`` is ``None`` while the file is not written yet; while the entry is converting it may
    point into the staging directory (the file is renamed to ``final_path`` keeping its inode, so a
    mapping made from ``path`` stays valid).
    """

    name: str
    path: Path | None
    size: int | None
    digest: str | None
    ready: bool
    tensors: dict[str, TensorEntry]
    final_path: Path | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ShardFile:
        final, path = data.get("final_path"), data.get("path")
        return cls(
            name=str(data["name"]),
            path=_absolute(path),
            size=data.get("size"),
            digest=data.get("digest"),
            ready=bool(data.get("ready", True)),
            tensors={str(k): TensorEntry.from_json(v) for k, v in (data.get("tensors") or {}).items()},
            final_path=_absolute(final),
        )


@dataclass(frozen=True)
class LeaseInfo:
    """A lease the daemon granted: ``expires_at`` is what it sent (epoch seconds or ISO 8601)."""

    id: str
    key: str
    expires_at: Any
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LeaseInfo:
        return cls(str(data["id"]), str(data["key"]), data.get("expires_at"), dict(data))
