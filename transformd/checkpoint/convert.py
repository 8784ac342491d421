"""Convert a checkpoint directory: plan, write every file into one directory, publish it.

:func:`write_checkpoint` writes the converted checkpoint into a directory it creates and fsyncs each file once;
it neither stages nor renames. Its callers publish: :func:`convert_checkpoint` through a staging directory
beside ``--out`` (:mod:`transformd._durable`), the cache through its own ``staging/`` (:mod:`transformd.cache`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import _durable
from ..engines import Engine, EngineReadiness
from ..errors import CheckpointError, OutputError
from ..formats import ScaleMode, Target
from ..progress import Progress, human_bytes
from ..readahead import last_shard_in_page_cache
from .hf_config import copy_other_files, write_metadata_files
from .layout import Layout, layout_for
from .plan import (CONFIG_NAME, ConversionPlan, check_engine, load_json, output_bytes, plan_conversion, plan_readiness,
                   records_a_conversion)

if TYPE_CHECKING:  # (torch is imported by the conversion itself: a head start converts while that import runs)
    import torch

    from .headstart import HeadStart
    from .pipeline import ShardOrder

__all__ = ["ConversionResult", "OutputError", "convert_checkpoint", "write_checkpoint"]


@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` (or :func:`write_checkpoint`) did."""

    out: Path
    converted: list[str]
    shards: list[str]
    left_out: list[str]
    bytes_read: int
    bytes_written: int
    seconds: float
    target: str
    scale_mode: str
    device: str
    #: Peak bytes of the host buffers between the pipeline's stages (see ``host_memory_bytes``).
    host_buffer_bytes: int = 0
    #: Per engine, the TP sizes at which it loads the output right, and why not at others (:func:`plan_readiness`).
    readiness: dict[str, EngineReadiness] = field(default_factory=dict)
    #: Tensors in the input shards, and their bytes (what progress counts up to).
    tensors: int = 0
    data_bytes: int = 0
    #: Seconds each stage of the pipeline worked (read, convert, write, sync; the busiest lane's): where the time
    #: went. The stage closest to ``seconds`` is the bottleneck (sync: the disk; read: the source or the page cache).
    stage_busy: dict[str, float] = field(default_factory=dict)
    #: Shards the head start wrote (converted on the CPU while torch was imported; see :mod:`.headstart`).
    head_start_shards: list[str] = field(default_factory=list)


def convert_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    target: Target | str = Target.FNUZ,
    scale_mode: ScaleMode | str = ScaleMode.EXACT,
    select: str | None = None,
    device: str | torch.device | None = "auto",
    overwrite: bool = False,
    progress: Callable[[Progress], None] | None = None,
    chunk_bytes: int | None = None,
    host_memory_bytes: int | None = None,
    shard_order: ShardOrder | None = None,
    engine: Engine | str | None = None,
    head_start: bool | None = None,
    layout: Layout | str | None = None,
    require_engine: bool = False,
) -> ConversionResult:
    """Convert the MXFP8 checkpoint directory ``src`` into a block-FP8 checkpoint directory ``out``.

    ``engine`` (vllm, sglang, transformers): refuse, before anything is written, a checkpoint that engine
    could not load at any tensor-parallel size (see :mod:`transformd.engines`); None with ``require_engine`` (as
    ``transformd convert`` calls it): refuse one that any engine would load wrong without an error (name ``raw`` for
    transformd.loader or your own kernels: no check); the result's ``readiness`` reports every engine either way.
    ``layout`` (:mod:`.layout`; None: the one ``engine`` loads, per-expert expert tensors for SGLang, else the
    source's).

    Refuses a non-empty ``out`` unless ``overwrite``. Everything is written to a
    staging directory next to ``out`` and renamed into place at the end; on any
    error the staging directory is removed and ``out`` is left as it was.

    Reading, converting, writing and fsyncing overlap (a thread each); ``device``
    ``auto`` or ``cuda`` with several GPUs visible spreads the shards over all of them.
    ``host_memory_bytes`` bounds the host buffers between the stages (input
    pieces, converted pieces, and on the CPU the reference's temporaries), split
    evenly between the GPUs; ``chunk_bytes`` bounds the slice of one weight (whole
    experts, or blocks of 128 rows) read and converted at once. The bound holds
    whatever the checkpoint's size; only a budget smaller than a few 128-row blocks
    of the widest weight is exceeded (by that much). Cached GPU memory and pinned
    host memory are given back when the conversion ends.

    ``progress`` is called on the calling thread with a :class:`Progress` as each
    tensor leaves the converter (the writer trails it by at most the buffers).

    ``shard_order`` (see :class:`ShardOrder`) lets a caller change the order of the
    shards while the conversion runs and learn when each output shard is final, so
    that a shard can be served before the whole checkpoint is done.

    ``head_start``: while torch is imported and the kernel loads, a worker process converts shards from the end of
    the checkpoint on the CPU with NumPy (:mod:`.headstart`: either scale mode, shards in the page cache, the same
    output bytes). None (the default): when this call is the one that imports torch, as in a process that
    converts by itself (``transformd convert --out``), and the checkpoint's last shard is in the page cache (else the
    plan waits for torch's import, as it did, so that a cold source is read in order from the start).
    """
    target, scale_mode = Target(target), ScaleMode(scale_mode)
    src, out = Path(src), Path(out)
    early = ("torch" not in sys.modules and last_shard_in_page_cache(src)) if head_start is None else head_start
    # Without a head start, the order it always had: torch imported and the devices found first (a bad device is
    # refused before anything else), then the plan while the kernel loads.
    devices = None if early else _devices(device)
    _durable.remove_leftovers(out)
    _check_out(src, out, overwrite)  # (a refused output waits for no kernel)
    with contextlib.ExitStack() as kernel:
        if devices is not None:  # the kernel loads while the plan is made
            kernel.enter_context(_kernel_warm_up(devices, target, scale_mode))
        plan = plan_conversion(src, select=select, layout=layout_for(engine) if layout is None else layout)
        # refused before anything is written: what the named engine cannot load, or, with none named, what an
        # engine would load wrong without an error (0.14-0.28 s for 20,589 tensors on the H200 machine)
        checked = engine is not None and Engine(engine) is not Engine.RAW
        report = plan_readiness(plan, target) if checked or (engine is None and require_engine) else None
        if report is not None:
            check_engine(report, engine, src, plan, target)
        needed = output_bytes(plan, target)
        _check_free_space(out, needed)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            staging, staging_lock = _durable.make_staging(out)
        except OSError as err:
            wrapped = _output_error(err, src, out, needed, None)
            if wrapped is None:
                raise
            raise wrapped from err
        head = None
        try:
            _refuse_a_second_writer(staging, out)
            if early:
                from .headstart import HeadStart

                head = HeadStart.start(plan, staging, target, scale_mode)
            if devices is None:  # torch is imported here, while the head start converts
                devices = _devices(device)
                kernel.enter_context(_kernel_warm_up(devices, target, scale_mode))
            result = write_checkpoint(
                plan, staging, target=target, scale_mode=scale_mode, devices=devices, progress=progress,
                chunk_bytes=chunk_bytes, host_memory_bytes=host_memory_bytes, shard_order=shard_order, readiness=report,
                head_start=head,
            )
            _durable.fsync_dirs(staging)
            _durable.publish(staging, out, overwrite)
        except BaseException as exc:
            if head is not None:
                head.cancel()  # (it writes into the staging directory)
            shutil.rmtree(staging, ignore_errors=True)
            wrapped = _output_error(exc, src, out, needed, staging) if isinstance(exc, OSError) else None
            if wrapped is not None:
                raise wrapped from exc
            raise
        finally:
            os.close(staging_lock)
        result.out = out
        return result


def _refuse_a_second_writer(staging: Path, out: Path) -> None:
    """Refuse a conversion into ``out`` while another one writes it: the later one converted everything, then
    failed at the end (a newcomer review). Two that start in the same instant see each other and both stop."""
    others = _durable.others_converting(staging, out)
    if others:
        raise CheckpointError(f"another conversion into this directory is running (its staging directory "
                              f"{others[0]} beside it); wait for it to finish, or convert into another directory",
                              file=out)


def _devices(device: str | torch.device | None) -> list[torch.device]:
    """The devices of ``device`` (:func:`.pipeline.conversion_devices`; imports torch)."""
    from .pipeline import conversion_devices

    return conversion_devices(device)


@contextlib.contextmanager
def _kernel_warm_up(devices: list[torch.device], target: Target, scale_mode: ScaleMode) -> Iterator[None]:
    """The kernel loaded on a thread while the body runs (:func:`.pieces.warm_up`); joined at the end and its
    buffers given back (done long before, unless the conversion launched nothing: then they would stay cached)."""
    from .pieces import start_warm_up
    from .pipeline import release_cached_memory

    warming = start_warm_up(devices, target, scale_mode)
    try:
        yield
    finally:
        if warming is not None:
            warming.join()
            release_cached_memory(devices)


def write_checkpoint(
    plan: ConversionPlan,
    out: Path,
    *,
    target: Target | str = Target.FNUZ,
    scale_mode: ScaleMode | str = ScaleMode.EXACT,
    devices: list[torch.device] | None = None,
    progress: Callable[[Progress], None] | None = None,
    chunk_bytes: int | None = None,
    host_memory_bytes: int | None = None,
    shard_order: ShardOrder | None = None,
    readiness: dict[str, EngineReadiness] | None = None,
    head_start: HeadStart | None = None,
) -> ConversionResult:
    """Write the conversion of ``plan`` into the directory ``out`` (created when missing; must be empty).

    Every file is fsynced once, by the stage that wrote it; the directories are not, and nothing is renamed:
    the caller publishes ``out`` (and removes it on an error). See :func:`convert_checkpoint` for the
    arguments; ``devices`` defaults to ``auto``'s choice; ``readiness``: :func:`plan_readiness` of ``plan`` when the
    caller computed it already (to check an engine before writing), else made on a thread while the shards are
    written (0.14-0.28 s for 20,589 tensors on the H200 machine, which the first write would otherwise wait for);
    ``head_start``: a :class:`.headstart.HeadStart` writing shards of ``plan`` into ``out`` already (the pipeline
    takes the others, and counts its shards as its own).
    """
    from .pipeline import DEFAULT_CHUNK_BYTES, DEFAULT_HOST_MEMORY_BYTES, Run, conversion_devices, convert_shards

    started = head_start.started if head_start is not None else time.monotonic()
    target, scale_mode = Target(target), ScaleMode(scale_mode)
    devices = devices if devices is not None else conversion_devices("auto")
    chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    host_memory_bytes = DEFAULT_HOST_MEMORY_BYTES if host_memory_bytes is None else host_memory_bytes
    out.mkdir(exist_ok=True)
    run = Run(plan, out, target, scale_mode, max(1, chunk_bytes), max(1, host_memory_bytes), progress, shard_order,
              head_start)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="transformd-readiness") as pool:
        made = pool.submit(plan_readiness, plan, target) if readiness is None else None
        convert_shards(run, devices)
        write_metadata_files(run)
        copy_other_files(run)
        readiness = readiness if made is None else made.result()
    return ConversionResult(
        out=out,
        converted=[p.weight.name for p in plan.selected],
        shards=[s.name for s in plan.shards],
        left_out=[str(f) for f in plan.left_out],
        bytes_read=run.tally.read,
        bytes_written=run.tally.written,
        seconds=time.monotonic() - started,
        target=target.value,
        scale_mode=scale_mode.value,
        device=",".join(str(d) for d in devices),
        host_buffer_bytes=run.tally.buffers_peak,
        readiness=readiness,
        tensors=plan.tensor_count,
        data_bytes=plan.data_bytes,
        stage_busy=run.stage_busy,
        head_start_shards=[f.shard.name for f in head_start.finished] if head_start is not None else [],
    )


def _check_out(src: Path, out: Path, overwrite: bool) -> None:
    s, o = src.resolve(), out.resolve()
    if s == o or s in o.parents or o in s.parents:
        raise CheckpointError(f"the output directory must be outside the input {src} (and not contain it)", file=out)
    if not out.exists():
        return
    if not out.is_dir():
        raise CheckpointError("exists and is not a directory", file=out)
    if not any(out.iterdir()):
        return
    # (the real reason first: files of another kind were told to pass --overwrite, then refused again for them)
    if not _is_transformd_output(out):
        raise CheckpointError("the output directory is not empty: it holds files that are not a transformd output "
                              "(its config.json has no quantization_config.transformd record), and --overwrite "
                              "replaces only an earlier conversion's output: choose another --out, or remove them "
                              "yourself", file=out)
    if not overwrite:
        raise CheckpointError("the output directory is not empty: it holds an earlier conversion's output; pass "
                              "--overwrite (overwrite=True in Python) to replace it", file=out)


def _is_transformd_output(out: Path) -> bool:
    """Whether ``out`` holds what a conversion wrote: its config.json's ``quantization_config.transformd`` record."""
    try:
        return records_a_conversion(load_json(out / CONFIG_NAME, required=False))
    except CheckpointError:  # (not a regular file, too large, not JSON)
        return False




def _free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (or its nearest parent)."""
    try:
        return _durable.free_bytes(path)
    except OSError:
        return None


def _check_free_space(out: Path, needed: int) -> None:
    """Refuse before writing anything when the file system of ``out`` has less free space than the output needs."""
    free = _free_bytes(out.parent)
    if free is not None and free < needed:
        raise OutputError(
            errno.ENOSPC,
            f"not enough free space for the output directory {out}: the conversion writes about {human_bytes(needed)} "
            f"({needed} bytes) and only {human_bytes(free)} ({free} bytes) are free on the file system of "
            f"{_durable.nearest_existing(out.parent)}; nothing was written. Free space there or choose another output "
            "directory (--out)",
            out=out, needed_bytes=needed, free_bytes=free,
        )


def _output_error(err: OSError, src: Path, out: Path, needed: int, staging: Path | None) -> OutputError | None:
    """``err`` restated about ``out`` (the caller's directory, not the staging path) when it is a failure to write
    the output; None when it is something else (e.g. reading the source)."""
    if isinstance(err, OutputError):
        return err
    code = err.errno
    where = _durable.nearest_existing(out.parent)
    cleaned = "the partial output was removed and nothing" if staging is not None else "nothing"
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(out.parent)
        what = "ran out of disk space" if code == errno.ENOSPC else "ran out of disk quota"
        return OutputError(
            code,
            f"{what} writing the output directory {out}: the conversion writes about {human_bytes(needed)} ({needed} "
            f"bytes), {human_bytes(free) if free is not None else '?'} are free on the file system of {where} now; "
            f"{cleaned} was left beside it. Free space there or choose another output directory (--out)",
            out=out, needed_bytes=needed, free_bytes=free,
        )
    if code == errno.EROFS:
        return OutputError(
            code,
            f"cannot write the output directory {out}: {where} is on a read-only file system; {cleaned} was "
            "written. Choose an output directory (--out) on a writable file system",
            out=out,
        )
    if code in (errno.EACCES, errno.EPERM):
        name = os.fspath(err.filename) if err.filename is not None else None
        within = (lambda d: name == str(d) or name.startswith(str(d).rstrip(os.sep) + os.sep)) if name else None
        # a path beside or inside out (the staging directory) is ours; a source file we may not read is not
        if name is None or (within(out.parent) and not within(src)):
            return OutputError(
                code,
                f"cannot write the output directory {out}: permission denied in {out.parent} (the conversion "
                f"writes a staging directory beside {out.name} and renames it into place); {cleaned} was written",
                out=out,
            )
    return None
