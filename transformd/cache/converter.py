"""What fills a cache entry: the :class:`Converter` protocol and the default, transformd's own conversion."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from .keys import Recipe


class Converter(Protocol):
    """Writes the converted checkpoint of ``src`` into ``out``.

    ``out`` does not exist yet; the converter creates it as a directory and writes every file of
    the converted checkpoint into it, each fsynced (the cache fsyncs the directories and renames
    the staging directory that holds ``out``: a converter neither stages nor renames). It calls
    ``progress(update)`` as it goes (any JSON-able object, a dataclass or a dict). Its return
    value (e.g. a ConversionResult) is summarised into the manifest's ``result``. It raises on
    invalid input; the cache removes everything it wrote.
    """

    def __call__(self, src: Path, out: Path, recipe: Recipe, progress: Callable[[Any], None]) -> Any: ...


class TransformdConverter:
    """The default converter: :func:`transformd.checkpoint.write_checkpoint` into ``out``."""

    def __init__(self, device: str = "auto"):
        self.device = device

    def __call__(
        self, src: Path, out: Path, recipe: Recipe, progress: Callable[[Any], None], *, shard_order: Any = None,
        plan: Any = None,
    ) -> Any:
        """``shard_order``: a :class:`transformd.checkpoint.ShardOrder` (the daemon's just-in-time shards).
        ``plan``: the :class:`~transformd.checkpoint.ConversionPlan` of the same content (the daemon planned it
        when the request came; the cache checked the content still has the key asked for), read from ``src``."""
        # imported late: the cache does not need torch code
        from ..checkpoint import conversion_devices, plan_conversion, write_checkpoint

        if plan is None or plan.select != recipe.select:
            plan = plan_conversion(src, select=recipe.select)
        return write_checkpoint(
            dataclasses.replace(plan, src=Path(src)),
            out,
            target=recipe.target,
            scale_mode=recipe.scale_mode,
            devices=conversion_devices(self.device),
            progress=progress,
            shard_order=shard_order,
        )

    def __repr__(self) -> str:
        return f"TransformdConverter(device={self.device!r})"
