"""Shard-level just-in-time: the order in which a conversion writes its shards, changed while it runs.

The daemon hands every conversion a :class:`ShardPriority`. An engine that asks for a shard that is not
written yet (``GET /v1/checkpoints/{key}/files/{name}`` -> 202) calls :meth:`ShardPriority.request`;
the converter asks :meth:`ShardPriority.next` before it starts each shard and reports each finished
shard with :meth:`ShardPriority.done`, so the daemon can serve it from the staging directory before the
whole checkpoint is published.

The hook this needs in :func:`transformd.checkpoint.convert_checkpoint` (the
:class:`transformd.checkpoint.ShardOrder` protocol)::

    convert_checkpoint(src, out, *, ..., shard_order: ShardOrder | None = None) -> ConversionResult

* ``shard_order.next(pending)`` is called (from any thread) right before the conversion starts
  reading a shard; ``pending`` lists the shards not started yet, in index order; it returns one of
  them, which is the shard started next. Without ``shard_order``: index order, as today.
* ``shard_order.done(name, path)`` is called once the output shard ``path`` (in the conversion's
  staging directory) is completely written and fsynced and will not change again. The file keeps its
  inode through the renames into ``entries/<key>/checkpoint/``, so a reader that opened or mapped
  ``path`` keeps valid bytes.

:class:`TransformdShardConverter` passes it to :func:`transformd.checkpoint.convert_checkpoint`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..cache import Recipe, TransformdConverter
from ..request import bind

if TYPE_CHECKING:  # the protocol lives beside convert_checkpoint; importing it at run time would load torch
    from ..checkpoint import ShardOrder


class ShardPriority:
    """A thread-safe :class:`ShardOrder`: requested shards first (first requested, first served), then index order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requested: list[str] = []
        self._started: list[str] = []
        self._finished: dict[str, Path] = {}

    def request(self, name: str) -> None:
        """Ask for shard ``name`` to be converted before the shards nobody asked for (idempotent)."""
        with self._lock:
            if name not in self._requested and name not in self._started:
                self._requested.append(name)

    def next(self, pending: Sequence[str]) -> str:
        if not pending:
            raise ValueError("ShardPriority.next() called with no pending shards")
        with self._lock:
            waiting = set(pending)
            choice = next((n for n in self._requested if n in waiting), pending[0])
            if choice in self._requested:
                self._requested.remove(choice)
            self._started.append(choice)
            return choice

    def done(self, name: str, path: Path) -> None:
        with self._lock:
            self._finished[name] = Path(path)

    def finished(self) -> dict[str, Path]:
        """Shards written completely so far, with their path in the staging directory."""
        with self._lock:
            return dict(self._finished)

    def started(self) -> list[str]:
        with self._lock:
            return list(self._started)

    def requested(self) -> list[str]:
        with self._lock:
            return list(self._requested)


@dataclass(frozen=True)
class ConversionOutline:
    """What the daemon knows of a conversion before it starts: output shard names and totals."""

    shards: tuple[str, ...]
    tensors_total: int | None = None
    bytes_total: int | None = None
    #: the converter's own plan, handed back to it for the conversion (checked once per request, not twice)
    plan: Any = None


class ServiceConverter(Protocol):
    """A cache :class:`~transformd.cache.Converter` that also takes ``shard_order``; ``plan`` is optional.

    ``plan(src, recipe)`` checks the checkpoint without converting it (raises ``CheckpointError`` /
    ``MxFormatError``, which the API reports as 422) and returns its :class:`ConversionOutline`.
    """

    def __call__(
        self, src: Path, out: Path, recipe: Recipe, progress: Callable[[Any], None], *, shard_order: ShardOrder | None
    ) -> Any: ...


class TransformdShardConverter(TransformdConverter):
    """The cache's :class:`~transformd.cache.TransformdConverter` (which takes ``shard_order``) plus ``plan``."""

    def plan(self, src: Path, recipe: Recipe) -> ConversionOutline:
        from ..checkpoint import plan_conversion

        return self.outline(plan_conversion(src, select=recipe.select, layout=recipe.layout))

    @staticmethod
    def outline(plan: Any) -> ConversionOutline:
        """The outline of a :class:`~transformd.checkpoint.ConversionPlan` (:func:`transformd.request.plan`)."""
        return ConversionOutline(tuple(s.name for s in plan.shards), plan.tensor_count, plan.data_bytes, plan)

    def __repr__(self) -> str:
        return f"TransformdShardConverter(device={self.device!r})"


def bind_shard_order(converter: Any, shard_order: ShardOrder, plan: Any = None) -> Callable[..., Any]:
    """``converter`` as a plain cache converter that passes ``shard_order`` (and ``plan``, its own plan from
    :func:`plan_of`, when given) if it takes them (:func:`transformd.request.bind`)."""
    return bind(converter, shard_order=shard_order, plan=plan)


def plan_of(converter: Any, src: Path, recipe: Recipe) -> ConversionOutline | None:
    """``converter.plan(src, recipe)`` when the converter has one; None otherwise."""
    plan = getattr(converter, "plan", None)
    return None if plan is None else plan(src, recipe)


def is_shard_file(name: str) -> bool:
    return name.endswith(".safetensors") and os.sep not in name and "/" not in name
