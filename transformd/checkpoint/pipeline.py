"""The threaded pipeline that writes the converted shards (see :mod:`transformd.checkpoint`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol, runtime_checkable

import torch

from .. import _durable
from ..convert import resolve_device
from ..formats import MX_BLOCK, MxFormatError, ScaleMode, Target
from ..kernels import GroupMemberError, PackedWeight
from ..mx import expand_row_blocks
from ..progress import Progress
from ..safetensors_header import ShardFiles
from ..safetensors_io import (
    SafetensorsWriter,
    TensorInfo,
    tensor_nbytes,
)
from .pieces import (
    CPU_WORK_FACTOR,
    CpuConverter,
    KernelConverter,
    Unit,
    align,
    make_converter,
    packed,
    size_buffers,
    units,
)
from .plan import ConversionPlan, MxPair, ShardPlan, output_groups, output_specs
from .stages import SlotPool, Stages, Tally

if TYPE_CHECKING:
    from .headstart import Finished, HeadStart

# -------------------------------------------------------------------------------------------------------------------
# Conversion
#
# One lane per device, each four threads joined by bounded channels:
#
#     reader --(pieces, in input slots)--> converter --(converted pieces, in output slots)--> writer --> syncer
#
# * reader: reads each MXFP8 weight of its shards one piece at a time (whole experts, or blocks of 128 rows of a
#   large matrix) into a reusable host buffer (a "slot"; pinned when it feeds a GPU); consecutive pieces share a
#   slot while they fit (a batch), so thousands of small per-expert weights travel in a few slots.
# * converter: converts a batch on the device into an output slot, with one copy each way and one kernel launch
#   (and hands the input slot back).
# * writer: appends converted pieces to the output shard, copies the tensors that are not converted straight
#   from the input file (copy_file_range, never through memory), and copies whole the shards that need no
#   rewrite.
# * syncer: fsyncs each file the writer has finished while the writer goes on with the next, so that flushing
#   shard i to disk overlaps reading and writing shard i+1.
#
# Host memory is therefore the slots (two pools of a fixed number of fixed-size slots, cut from
# ``host_memory_bytes``) plus, on the CPU, the PyTorch reference's temporaries for one piece: it does not grow
# with the checkpoint. The calling thread only waits: it counts the tensors the stages finish and calls ``progress``
# once per burst of them (and per shard), and when any stage fails it stops the others, joins them and raises that
# stage's exception. Each stage's busy time (not waiting on a channel or for a slot) is in the result.

#: Largest slice of one weight (input code bytes) read and converted at once.
DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024
#: Default bound on the host memory of a conversion's buffers (``host_memory_bytes``).
DEFAULT_HOST_MEMORY_BYTES = 2 << 30
#: Finished files waiting for the syncer at the most (bounds the dirty page cache the writer runs ahead by).
SYNC_BACKLOG = 2


@runtime_checkable
class ShardOrder(Protocol):
    """Chooses the next shard of a running conversion and hears of each finished one.

    ``next(pending)`` is called from a conversion thread right before a shard is
    started, with the names not started yet in index order; it returns one of them.
    ``done(name, path)`` is called once the output shard ``path`` (in the staging
    directory) is completely written and fsynced; the file keeps its inode through
    the renames that publish the checkpoint, so a reader that opened it stays valid.
    """

    def next(self, pending: Sequence[str]) -> str: ...

    def done(self, name: str, path: Path) -> None: ...


@dataclass
class Run:
    """State of one conversion, kept by the calling thread (stage threads only add to ``tally``)."""

    plan: ConversionPlan
    out: Path
    target: Target
    scale_mode: ScaleMode
    chunk_bytes: int
    host_memory_bytes: int
    progress: Callable[[Progress], None] | None
    shard_order: ShardOrder | None = None
    head_start: HeadStart | None = None  # converting shards on the CPU since before torch was imported
    tally: Tally = field(default_factory=Tally)
    tensors_done: int = 0
    bytes_done: int = 0
    convert_bytes_done: int = 0
    shard: str | None = None  # of the last tick
    unreported: bool = False  # ticks since the last report
    output_tensors: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (shard, nbytes)
    stage_busy: dict[str, float] = field(default_factory=dict)  # see Stages.busy

    def tick(self, shard: str, tensors: int, nbytes: int, converted: int = 0) -> None:
        """Count a finished tensor; :meth:`report` tells ``progress`` (once per burst, and for each shard)."""
        if self.shard not in (None, shard) and self.unreported:
            self.report()  # the last of the previous shard
        self.tensors_done += tensors
        self.bytes_done += nbytes
        self.convert_bytes_done += converted
        self.shard, self.unreported = shard, True

    def report(self) -> None:
        self.unreported = False
        if self.progress is not None:
            self.progress(
                Progress(phase="converting", shard=self.shard, tensors_done=self.tensors_done,
                         tensors_total=self.plan.tensor_count, bytes_done=self.bytes_done,
                         bytes_total=self.plan.data_bytes, convert_bytes_done=self.convert_bytes_done,
                         convert_bytes_total=self.plan.convert_bytes)
            )


def convert_shards(run: Run, devices: list[torch.device]) -> None:
    """Write every output shard into the staging directory: a lane per device, the shards spread over them (those
    the head start has taken, if any, written by it)."""
    for shard in run.plan.shards:
        if shard.rewrite:
            outputs = [(name, tensor_nbytes(dtype, shape)) for name, dtype, shape in output_specs(run.target, shard)]
        else:
            outputs = [(t.name, t.nbytes) for t in shard.header.tensors.values()]
        run.output_tensors.update((name, (shard.name, nbytes)) for name, nbytes in outputs)
    _convert(run, devices, run.plan.shards, run.head_start)
    if run.head_start is not None:
        back = run.head_start.given_back()
        if back:  # skipped by the lanes while the head start had them
            _convert(run, devices, back, None)
        run.stage_busy["head start"] = round(run.head_start.busy, 3)


def _convert(run: Run, devices: list[torch.device], shards: Sequence[ShardPlan], head: HeadStart | None) -> None:
    """Convert ``shards`` on ``devices``, beside ``head`` (the lanes skip what it has taken; its finished shards count
    as the lanes' do). Each stage's busy seconds are added to ``run.stage_busy``."""
    assigned = [(dev, group) for dev, group in zip(devices, _assign_shards(shards, len(devices))) if group]
    stages = Stages()
    lanes = [_Lane(run, stages, dev, group, run.host_memory_bytes // len(assigned)) for dev, group in assigned]
    try:
        for lane in lanes:
            lane.start()
        if head is not None:  # a stage of its own, so that the lanes' end waits for the head start's last shard
            stages.start("follow-head-start", lambda: head.follow(lambda done: _head_started(run, stages, done),
                                                                  stages.check))
        stages.wait(run.tick, run.report)
        busy = stages.busy()
        busy.pop("follow", None)  # (it waits)
        for kind, seconds in busy.items():
            run.stage_busy[kind] = round(run.stage_busy.get(kind, 0.0) + seconds, 3)
    finally:
        for lane in lanes:
            lane.close()
        release_cached_memory(devices)


def _head_started(run: Run, stages: Stages, done: Finished) -> None:
    """Count a shard the head start finished as the lanes count theirs."""
    header = done.shard.header
    stages.tick(done.shard.name, len(header.tensors), header.data_bytes, converted=done.converted)
    run.tally.add(read=done.read, written=done.written)
    if run.shard_order is not None:
        run.shard_order.done(done.shard.name, run.out / done.shard.name)


def conversion_devices(device: str | torch.device | None) -> list[torch.device]:
    """Every visible GPU for ``auto``/``cuda`` (no index) when there are several; else the one device asked for."""
    dev = resolve_device(device)
    any_gpu = dev.type == "cuda" and (device is None or str(device) in ("auto", "cuda"))
    return _spread_devices(dev, torch.cuda.device_count() if any_gpu else 1)


def _spread_devices(dev: torch.device, count: int) -> list[torch.device]:
    """``count`` > 1: one device of ``dev``'s type per index; else ``dev`` itself."""
    return [torch.device(dev.type, i) for i in range(count)] if count > 1 else [dev]


def _assign_shards(shards: Sequence[ShardPlan], lanes: int) -> list[list[ShardPlan]]:
    """Spread shards over ``lanes`` devices with about equal bytes each (largest first to the least loaded).

    Every shard goes to exactly one lane; each lane keeps the checkpoint's order (sequential reads).
    """
    load = [0] * lanes
    picked: list[list[int]] = [[] for _ in range(lanes)]
    for i in sorted(range(len(shards)), key=lambda i: -shards[i].header.file_size):
        lane = min(range(lanes), key=lambda j: (load[j], j))
        picked[lane].append(i)
        load[lane] += shards[i].header.file_size
    return [[shards[i] for i in sorted(p)] for p in picked]


def release_cached_memory(devices: list[torch.device]) -> None:
    """Give PyTorch's cached GPU memory and pinned host memory back, so that an idle process holds none."""
    if any(d.type == "cuda" for d in devices) and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()


# -- what flows between the stages ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CopyShard:
    """Copy this shard's file as it is (nothing in it changes)."""

    shard: ShardPlan


@dataclass(frozen=True)
class _OpenShard:
    """Start writing this output shard (header first)."""

    shard: ShardPlan


@dataclass(frozen=True)
class _CopyTensor:
    """Copy this tensor's bytes from the input shard into the output shard."""

    shard: str
    tensor: TensorInfo


@dataclass(frozen=True)
class _DropTensor:
    """An input scale of a converted weight: nothing to write (counted for progress only)."""

    shard: str
    tensor: TensorInfo


@dataclass(frozen=True)
class _Piece:
    """One piece of an MXFP8 weight in a batch; ``last``: the weight's last piece."""

    pair: MxPair
    unit: Unit
    where: PackedWeight
    last: bool


@dataclass
class _Batch:
    """Reader -> converter: consecutive pieces read into one input slot (at least one)."""

    slot: torch.Tensor
    pieces: list[_Piece] = field(default_factory=list)
    used: int = 0  # slot bytes taken
    tiles: int = 0  # output scales of the pieces so far


@dataclass(frozen=True)
class _Append:
    """Converter -> writer: the next bytes of tensor ``name``; ``slot`` goes back to the output pool after."""

    name: str
    data: torch.Tensor | memoryview
    slot: torch.Tensor | None = None


@dataclass(frozen=True)
class _CloseShard:
    """This output shard is complete: hand it to the syncer (which checks, fsyncs and closes it)."""

    shard: ShardPlan


_END = object()  # the last item a stage sends


# -- one lane: the four stages of one device ----------------------------------------------------------------------


class _Lane:
    """The reader, converter, writer and syncer of one device, its shards, and the slots between them."""

    def __init__(self, run: Run, stages: Stages, device: torch.device, shards: list[ShardPlan], memory: int):
        if device.type == "cuda" and device.index is None:  # the caller's current GPU (stage threads start on 0)
            device = torch.device("cuda", torch.cuda.current_device())
        self.run, self.stages, self.device, self.shards = run, stages, device, shards
        self.pairs = {p.weight.name: p for s in shards for p in s.pairs}
        pinned = device.type == "cuda"
        work = CPU_WORK_FACTOR if device.type == "cpu" else 0
        self.sizes = size_buffers(self.pairs.values(), memory, run.chunk_bytes, pinned=pinned, work_factor=work)
        self.inputs = SlotPool(self.sizes, pinned=pinned, stages=stages, tally=run.tally)
        self.outputs = SlotPool(self.sizes, pinned=pinned, stages=stages, tally=run.tally)
        self.to_converter = stages.channel()
        self.to_writer = stages.channel()
        self.to_syncer = stages.channel(SYNC_BACKLOG)
        self._batch: _Batch | None = None  # the reader's batch being filled

    def start(self) -> None:
        stages = (("read", self.read), ("convert", self.convert), ("write", self.write), ("sync", self.sync))
        for name, stage in stages:
            self.stages.start(f"{name}-{self.device}", stage)

    def close(self) -> None:
        """Drop every buffer and close files left open by a stop (after the stages have been joined)."""
        self.to_converter.drain()
        self.to_writer.drain()
        for item in self.to_syncer.drain():
            if item is not _END and not isinstance(item, Path):
                item.abort()  # a SafetensorsWriter the syncer did not get to
        self.inputs.close()
        self.outputs.close()

    # -- reader

    def read(self) -> None:
        files = ShardFiles(self.run.plan.src)
        pending = list(self.shards)
        try:
            while pending:
                shard = self._next_shard(pending)
                pending.remove(shard)
                if self.run.head_start is not None and not self.run.head_start.claim(shard.name):
                    continue  # the head start writes it
                if not shard.rewrite:
                    self.to_converter.put(_CopyShard(shard))
                    continue
                self.to_converter.put(_OpenShard(shard))
                for t in shard.header.tensors.values():
                    if t.name in shard.dropped:  # (no data to write: the batch goes on)
                        self.to_converter.put(_DropTensor(shard.name, t))
                    elif t.name in self.pairs:
                        self._read_pair(self.pairs[t.name], files)
                    else:
                        self._send_batch()  # the writer takes tensors in order
                        self.to_converter.put(_CopyTensor(shard.name, t))
                self._send_batch()
                self.to_converter.put(_CloseShard(shard))
        finally:
            files.close()
        self.to_converter.put(_END)

    def _next_shard(self, pending: list[ShardPlan]) -> ShardPlan:
        """The caller's choice through ``shard_order`` (a name it does not know: index order)."""
        if self.run.shard_order is None:
            return pending[0]
        name = self.run.shard_order.next([s.name for s in pending])
        return next((s for s in pending if s.name == name), pending[0])

    def _read_pair(self, pair: MxPair, files: ShardFiles) -> None:
        """Read the weight's pieces into the open batch, each after the last while it fits, else a new slot."""
        pieces = units(pair.weight.shape, self.sizes.piece_bytes)
        for i, unit in enumerate(pieces):
            size = align(unit.slot_bytes)
            if self._batch is not None and self._batch.used + size > self.sizes.slot_bytes:
                self._send_batch()
            if self._batch is None:
                self._batch = _Batch(self.inputs.take())
            batch = self._batch
            where = packed(unit, batch.used, batch.tiles)
            codes, scales = where.views(batch.slot)
            files.read_into(pair.weight_shard, pair.weight.begin + unit.code_offset, codes.numpy())
            self.run.tally.add(read=codes.numel() + _read_scales(pair, unit, files, scales))
            batch.pieces.append(_Piece(pair, unit, where, last=i == len(pieces) - 1))
            batch.used += size
            batch.tiles += where.tiles

    def _send_batch(self) -> None:
        if self._batch is not None:
            self.to_converter.put(self._batch)
            self._batch = None

    # -- converter

    def convert(self) -> None:
        converter = make_converter(self.device, self.sizes.slot_bytes, self.run.target, self.run.scale_mode)
        try:
            scales: list[torch.Tensor] = []  # of the weight whose pieces are under way
            while (item := self.to_converter.get()) is not _END:
                if isinstance(item, _Batch):
                    self._convert_batch(converter, item, scales)
                elif isinstance(item, _DropTensor):
                    self.stages.tick(item.shard, 1, item.tensor.nbytes)
                else:
                    self.to_writer.put(item)
                    if isinstance(item, _CopyTensor):
                        self.stages.tick(item.shard, 1, item.tensor.nbytes)
                    elif isinstance(item, _CopyShard):
                        header = item.shard.header
                        self.stages.tick(item.shard.name, len(header.tensors), header.data_bytes)
            self.to_writer.put(_END)
        finally:
            converter.close()

    def _convert_batch(
        self, converter: CpuConverter | KernelConverter, batch: _Batch, scales: list[torch.Tensor]
    ) -> None:
        """Convert a batch into an output slot and send its pieces to the writer, each weight's scales after its
        last piece's codes (``scales`` holds those of a weight whose last piece is still to come)."""
        out = self.outputs.take()
        try:
            scale_invs = converter(batch.slot, out, [p.where for p in batch.pieces])
        except GroupMemberError as err:
            piece = batch.pieces[err.index]
            problem = f"{err.problem}{piece.unit.where()}"
            file = str(self.run.plan.src / piece.pair.weight_shard)
            raise MxFormatError(problem, tensor=piece.pair.weight.name, file=file) from None
        self.inputs.give(batch.slot)
        codes = memoryview(out.numpy())  # the writer writes from the slot itself: no copies
        appends, ticks = [], []
        for piece, scale_inv in zip(batch.pieces, scale_invs):
            at = piece.where.code_offset
            appends.append(_Append(piece.pair.weight.name, codes[at : at + piece.unit.code_bytes]))
            scales.append(scale_inv)
            if piece.last:  # the weight's codes are all out: now its scales, in order
                appends.extend(_Append(piece.pair.out_scale_name, s) for s in scales)
                scales.clear()
                ticks.append((piece.pair.weight_shard, piece.pair.weight.nbytes))
        appends[-1] = _Append(appends[-1].name, appends[-1].data, out)  # the slot goes back after the last
        for append in appends:
            self.to_writer.put(append)
        for shard, nbytes in ticks:
            self.stages.tick(shard, 1, nbytes, converted=nbytes)

    # -- writer

    def write(self) -> None:
        writer: SafetensorsWriter | None = None
        source: BinaryIO | None = None
        try:
            while (item := self.to_writer.get()) is not _END:
                if isinstance(item, _Append):
                    assert writer is not None
                    writer.write(item.name, item.data)
                    if item.slot is not None:
                        self.outputs.give(item.slot)
                elif isinstance(item, _CopyTensor):
                    assert writer is not None and source is not None
                    writer.copy_from(item.tensor.name, source, item.tensor.begin)
                    self.run.tally.add(read=item.tensor.nbytes)
                elif isinstance(item, _OpenShard):
                    shard = item.shard
                    source = open(self.run.plan.src / shard.name, "rb")  # noqa: SIM115 - closed below
                    specs = list(output_specs(self.run.target, shard))
                    writer = SafetensorsWriter(self.run.out / shard.name, specs, shard.header.metadata,
                                               groups=output_groups(shard))
                elif isinstance(item, _CloseShard):
                    assert writer is not None and source is not None
                    source.close()
                    source = None
                    self.to_syncer.put(writer)  # checked, fsynced and closed there
                    writer = None
                elif isinstance(item, _CopyShard):
                    dst = self.run.out / item.shard.name
                    src = self.run.plan.src / item.shard.name
                    size = _durable.copy_file(src, dst, check=self.stages.check, fsync=False)
                    self.run.tally.add(read=size)
                    self.to_syncer.put(dst)
            self.to_syncer.put(_END)
        finally:
            if writer is not None:
                writer.abort()
            if source is not None:
                source.close()

    # -- syncer

    def sync(self) -> None:
        """Make each file the writer has finished durable, while the writer goes on with the next."""
        while (item := self.to_syncer.get()) is not _END:
            if isinstance(item, Path):
                path = item
                self.run.tally.add(written=_durable.fsync_file(path))
            else:
                item.close()  # SafetensorsWriter: checks every tensor is complete, fsyncs, closes
                path = item.path
                self.run.tally.add(written=item.bytes_written)
            if self.run.shard_order is not None:
                self.run.shard_order.done(path.name, path)


def _read_scales(pair: MxPair, unit: Unit, files: ShardFiles, out: torch.Tensor) -> int:
    """Read the E8M0 scales of ``unit`` into ``out`` (one row of scales per weight row); return the bytes read.

    Rx32 block scales (Quark ``per_block``) are read once per block row and repeated for the R rows they cover.
    """
    if pair.row_block == 1:
        files.read_into(pair.scale_shard, pair.scale.begin + unit.code_offset // MX_BLOCK, out.reshape(-1).numpy())
        return out.numel()
    *_, rows, kb = pair.scale.shape
    first, stop = unit.r0 // pair.row_block, (unit.r1 - 1) // pair.row_block + 1
    block = torch.empty((unit.e1 - unit.e0, stop - first, kb), dtype=torch.uint8)
    for i, e in enumerate(range(unit.e0, unit.e1)):
        files.read_into(pair.scale_shard, pair.scale.begin + (e * rows + first) * kb, block[i].numpy())
    per_row = expand_row_blocks(block, stop * pair.row_block - first * pair.row_block, pair.row_block)
    skip = unit.r0 - first * pair.row_block
    out.copy_(per_row[:, skip : skip + unit.r1 - unit.r0].reshape(out.shape))
    return block.numel()
