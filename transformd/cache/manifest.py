"""The manifest of a cache entry: what was converted, how, and the digest of every output file.

``entries/<key>/manifest.json`` is written (and fsynced) before the entry is renamed into
place, so every visible entry has one. It is read-only and never rewritten: the last use of an
entry is the modification time of its directory.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..progress import items_left_out
from .keys import FileRecord, Recipe

MANIFEST_NAME = "manifest.json"
#: The converted checkpoint directory inside an entry.
CHECKPOINT_DIR = "checkpoint"
MANIFEST_SCHEMA = 1


@dataclass(frozen=True)
class Manifest:
    key: str
    recipe: Recipe
    #: the source checkpoint's files (its content identity)
    source_files: tuple[FileRecord, ...]
    #: where the source was when it was converted; a hint for humans, not part of the identity
    source_hint: str
    #: every file of ``checkpoint/``, with size and ``blake3:`` digest
    files: tuple[FileRecord, ...]
    created_at: float
    #: seconds: ``identify`` (hashing the source), ``hash_alongside`` (the same, beside the conversion), ``convert``,
    #: ``publish`` (the output's digests not taken during the conversion (:mod:`.seal`), read-only modes, directory
    #: fsyncs), ``total``
    timings: dict[str, float] = field(default_factory=dict)
    #: the converter's result summary (error report, tensor counts, ...), JSON
    result: Any = None
    transformd_version: str = ""
    host: str = ""
    schema: int = MANIFEST_SCHEMA

    @property
    def total_bytes(self) -> int:
        """Bytes of the converted checkpoint's files."""
        return sum(f.size for f in self.files)

    @property
    def source_bytes(self) -> int:
        return sum(f.size for f in self.source_files)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "key": self.key,
            "recipe": self.recipe.as_dict(),
            "source": {
                "path_hint": self.source_hint,
                "total_bytes": self.source_bytes,
                "files": [f.as_dict() for f in self.source_files],
            },
            "output": {
                "dir": CHECKPOINT_DIR,
                "total_bytes": self.total_bytes,
                "files": [f.as_dict() for f in self.files],
            },
            "created_at": self.created_at,
            "timings": self.timings,
            "result": self.result,
            "transformd_version": self.transformd_version,
            "host": self.host,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        if d.get("schema") != MANIFEST_SCHEMA:
            raise ValueError(f"unknown manifest schema {d.get('schema')!r}")
        return cls(
            key=str(d["key"]),
            recipe=Recipe.from_dict(d["recipe"]),
            source_files=tuple(FileRecord.from_dict(f) for f in d["source"]["files"]),
            source_hint=str(d["source"].get("path_hint", "")),
            files=tuple(FileRecord.from_dict(f) for f in d["output"]["files"]),
            created_at=float(d["created_at"]),
            timings=dict(d.get("timings") or {}),
            result=d.get("result"),
            transformd_version=str(d.get("transformd_version", "")),
            host=str(d.get("host", "")),
        )

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """Parse a manifest file; raises OSError or ValueError (bad JSON or schema)."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def write(self, path: Path) -> None:
        """Write durably (fsync) and make the file read-only."""
        data = self.to_json().encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(path, 0o444)


def jsonable(obj: Any, *, depth: int = 0, max_items: int = 1000) -> Any:
    """A JSON-compatible rendering of a converter's result or progress update.

    Dataclasses and objects with ``__dict__`` become dicts, enums their values, paths strings,
    tensors/arrays a short description; non-finite floats become strings. Deep or huge
    structures are cut short rather than failing: a list longer than ``max_items`` keeps its
    first ``max_items`` items and ends with ``"... (N more)"`` (:func:`~transformd.progress.items_left_out`).
    """
    if depth > 8:
        return repr(obj)[:200]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, enum.Enum):
        return jsonable(obj.value, depth=depth + 1)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: jsonable(getattr(obj, f.name), depth=depth + 1, max_items=max_items)
            for f in dataclasses.fields(obj)
            if not f.name.startswith("_")
        }
    if isinstance(obj, Mapping):
        items = list(obj.items())[:max_items]
        return {str(k): jsonable(v, depth=depth + 1, max_items=max_items) for k, v in items}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
        out = [jsonable(v, depth=depth + 1, max_items=max_items) for v in items[:max_items]]
        if len(items) > max_items:
            out.append(items_left_out(len(items) - max_items))
        return out
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return f"<{type(obj).__name__} {getattr(obj, 'dtype', '')} {list(getattr(obj, 'shape', []))}>"
    if hasattr(obj, "__dict__"):
        return {
            k: jsonable(v, depth=depth + 1, max_items=max_items) for k, v in vars(obj).items() if not k.startswith("_")
        }
    return repr(obj)[:1000]
