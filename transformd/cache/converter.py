"""What fills a cache entry: the :class:`Converter` protocol and the default, transformd's own conversion."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..readahead import last_shard_in_page_cache
from .keys import Recipe


class Converter(Protocol):
    """Writes the converted checkpoint of ``src`` into ``out``.

    ``out`` does not exist yet; the converter creates it as a directory and writes every file of
    the converted checkpoint into it, each fsynced (the cache fsyncs the directories and renames
    the staging directory that holds ``out``: a converter neither stages nor renames). It calls
    ``progress(update)`` as it goes (any JSON-able object, a dataclass or a dict). Its return
    value (e.g. a ConversionResult) is summarised into the manifest's ``result``. It raises on
    invalid input; the cache removes everything it wrote. A source new to the cache is hashed beside its conversion,
    from the conversion's first progress update on, at the pace of its ``bytes_done`` (:mod:`.alongside`): a
    converter that reports none gets its key only once it has returned.

    Each ``*.safetensors`` file is written front to back and, once it has all the bytes its header declares, not
    written again: a converter that must redo one removes it and creates a new file under the name. The cache hashes
    such a file while the conversion goes on (:mod:`.seal`) and keeps that digest only for the same file unchanged
    (inode, size, times), so a rewrite in place is caught where the file system's clock moves between the writes.

    A converter may also have a ``prepare(recipe)`` method: the cache calls it before it starts hashing a source it
    converts while hashing (:mod:`.alongside`), so that a slow start-up (imports, a GPU context, loading the
    recipe's kernel) overlaps the first reads.
    """

    def __call__(self, src: Path, out: Path, recipe: Recipe, progress: Callable[[Any], None]) -> Any: ...


#: The one thread of this process that imports the conversion's modules ahead of the first conversion, then loads
#: the kernel (:meth:`TransformdConverter.prepare`).
_warming: threading.Thread | None = None
_warming_lock = threading.Lock()
#: Set once that thread's imports are over (done or failed): a conversion waits for them, not for the kernel.
_imported = threading.Event()


def _warm_up(device: str, recipe: Recipe) -> None:
    """Import torch, triton and the pipeline, initialise CUDA and load ``recipe``'s kernel on each GPU the
    conversion will use (seconds of a cold process)."""
    try:
        try:
            from ..checkpoint import convert, conversion_devices  # noqa: F401 - torch, the pipeline, the kernels
            from ..checkpoint.pieces import warm_up
            from ..formats import ScaleMode, Target
        finally:
            _imported.set()
        warm_up(conversion_devices(device), Target(recipe.target), ScaleMode(recipe.scale_mode))
    except Exception:  # noqa: BLE001, S110 - the conversion itself meets the same error and reports it
        pass


def _start_warm_up(device: str, recipe: Recipe) -> threading.Thread:
    """This process's warm-up thread (:func:`_warm_up`), started now unless it was before."""
    global _warming
    with _warming_lock:
        if _warming is None:
            _warming = threading.Thread(target=_warm_up, args=(device, recipe), name="transformd-warm-up", daemon=True)
            _warming.start()
        return _warming


class TransformdConverter:
    """The default converter: :func:`transformd.checkpoint.write_checkpoint` into ``out``."""

    def __init__(self, device: str = "auto", *, head_start: bool = False):
        """``head_start``: a head start (:mod:`transformd.checkpoint.headstart`) converts the last shards on the CPU
        while this process imports torch, when it has yet to, the scale mode is exact and the source's last shard is
        in the page cache (``transformd convert --cache-dir`` without a daemon); never with False (the default, the
        daemon's: its torch is imported). Its worker reads the source through this process's checked descriptors
        (the view's links), not by name."""
        self.device, self.head_start = device, head_start

    def prepare(self, recipe: Recipe) -> None:
        """Start importing what the conversion needs in a background thread (once per process), and loading the
        kernel of ``recipe`` (the first recipe's: others load theirs when they first convert).

        The cache calls this before it hashes a source it converts alongside the hashing (the daemon, when a
        request comes), so that the seconds of ``import torch``, CUDA's start-up and the kernel's load pass while
        the source is checked and read ahead (:mod:`.alongside`), not after. Not while a head start may come
        (:meth:`_may_head_start`): the conversion starts them once the head start's worker is started, as
        ``transformd convert --out`` does (beside torch's import, the plan and the worker's start took 0.2 s
        instead of 0.04 s on a 2-core machine with a 0.5 GiB sample, and the worker converted that much less).
        """
        if not self._may_head_start(recipe):
            _start_warm_up(self.device, recipe)

    def _may_head_start(self, recipe: Recipe) -> bool:
        """Whether a conversion of ``recipe`` may get a head start in this process: allowed, torch not imported nor
        being imported."""
        return self.head_start and _warming is None and "torch" not in sys.modules

    def __call__(
        self, src: Path, out: Path, recipe: Recipe, progress: Callable[[Any], None], *, shard_order: Any = None,
        plan: Any = None,
    ) -> Any:
        """``shard_order``: a :class:`transformd.checkpoint.ShardOrder` (the daemon's just-in-time shards).
        ``plan``: the :class:`~transformd.checkpoint.ConversionPlan` of the same content (the daemon planned it
        when the request came; the cache checked the content still has the key asked for), read from ``src``."""
        # imported late (the cache does not need torch code), and never beside the warm-up's imports; the plan and
        # the first batch's reading overlap the kernel's load, which the first launch waits for
        deferred = self._may_head_start(recipe)  # (then the imports start here, after the head start's worker)
        head = None
        if deferred and last_shard_in_page_cache(src):  # planned first, the worker started, then torch
            from ..checkpoint.headstart import HeadStart
            from ..checkpoint.plan import plan_conversion  # (no torch)
            from ..formats import ScaleMode, Target

            plan = dataclasses.replace(plan if _plans(plan, recipe)
                                       else plan_conversion(src, select=recipe.select, layout=recipe.layout),
                                       src=Path(src))
            Path(out).mkdir()
            head = HeadStart.start(plan, Path(out), Target(recipe.target), ScaleMode(recipe.scale_mode))
        warming = _start_warm_up(self.device, recipe) if deferred else _warming
        devices = None
        try:
            while warming is not None and not _imported.wait(0.1) and warming.is_alive():
                pass
            from ..checkpoint import conversion_devices, plan_conversion, write_checkpoint

            if not _plans(plan, recipe):
                plan = plan_conversion(src, select=recipe.select, layout=recipe.layout)
            devices = conversion_devices(self.device)
            return write_checkpoint(
                dataclasses.replace(plan, src=Path(src)),
                out,
                target=recipe.target,
                scale_mode=recipe.scale_mode,
                devices=devices,
                progress=progress,
                shard_order=shard_order,
                head_start=head,
            )
        except BaseException:
            if head is not None:
                head.cancel()  # (it writes into ``out``, which the cache removes)
            raise
        finally:
            if warming is not None and warming.is_alive() and devices is not None:  # (launched nothing, or failed)
                from ..checkpoint.pipeline import release_cached_memory

                warming.join()
                with contextlib.suppress(Exception):  # (never in place of the conversion's own error)
                    release_cached_memory(devices)  # the warm-up's buffers

    def __repr__(self) -> str:
        return f"TransformdConverter(device={self.device!r}, head_start={self.head_start!r})"


def _plans(plan: Any, recipe: Recipe) -> bool:
    """Whether ``plan`` (None: none made) is the plan of ``recipe``'s conversion (its selection and layout)."""
    return plan is not None and plan.select == recipe.select and plan.layout == recipe.layout
