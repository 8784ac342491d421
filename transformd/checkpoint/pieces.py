"""The pipeline's pieces: what part of a weight is converted at once (whole experts or 128-row blocks),
the fixed pools of host buffers (slots) they travel in, and the converters that turn a batch of pieces into
block FP8 on one device (the kernel on a GPU, NumPy table lookups or the PyTorch reference on the CPU)."""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..convert import convert_reference_checked
from ..formats import MX_BLOCK, TILE, MxFormatError, ScaleMode, Target
from ..kernels import GroupMemberError, PackedWeight, convert_packed
from ..numpy_exact import converter, tile_bands, usable_cores
from .plan import MxPair

#: Slots of each pool (input pieces, converted pieces) that the budget must hold at the least.
MIN_SLOTS = 3
#: Slots of each pool at the most: enough read-ahead and write-behind for a disk; a slot is as large as the
#: largest piece, so more would mostly hold smaller pieces in oversized buffers.
MAX_SLOTS = 16
#: Host bytes the PyTorch reference (the CPU path's fallback) needs while it converts a piece, per code byte of the
#: piece: float32 decode, tile maxima, the quotient, the outputs (measured 12-14).
CPU_WORK_FACTOR = 16
#: Code bytes one CPU thread converts at once (a band of whole 128-row tiles of one expert) at the most. Its
#: temporaries take about 1.7x a band and 3 MiB (tracemalloc, either scale mode), so :class:`CpuConverter` makes the
#: bands smaller where its threads would need more than about half the work space.
CPU_BAND_BYTES = 8 << 20
#: Alignment of the scale bytes that follow the codes in a slot, and of each piece of a batch.
SLOT_ALIGN = 256
#: Pinned slots (a GPU's) are at least this large, budget permitting, so that many small weights share one batch:
#: one host-to-device copy, a launch per weight shape and one synchronisation for all of them.
BATCH_BYTES = 64 * 1024 * 1024


# -- pieces and buffers -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """The part of an [N, K] or [E, N, K] weight converted at once: experts [e0, e1), rows [r0, r1) of each.

    Either whole experts (r0 = 0, r1 = N) or rows of one expert with r0 a multiple of 128, so its codes and
    its output scales are each one contiguous range, and it converts to the same bytes as the whole weight.
    """

    shape: tuple[int, ...]
    e0: int
    e1: int
    r0: int
    r1: int

    @property
    def piece_shape(self) -> tuple[int, ...]:
        k = self.shape[-1]
        return (self.e1 - self.e0, self.r1 - self.r0, k) if len(self.shape) == 3 else (self.r1 - self.r0, k)

    @property
    def code_bytes(self) -> int:
        return math.prod(self.piece_shape)

    @property
    def code_offset(self) -> int:
        n, k = self.shape[-2:]
        return (self.e0 * n + self.r0) * k

    @property
    def slot_bytes(self) -> int:
        """Input slot bytes: the codes, then (aligned) the E8M0 scales."""
        return align(self.code_bytes) + self.code_bytes // MX_BLOCK

    def where(self) -> str:
        """What error indices inside this piece are relative to ("" when they are the weight's own)."""
        n = self.shape[-2]
        if len(self.shape) == 2:
            return f" (indices relative to row {self.r0} of {n})" if self.r0 else ""
        experts = self.shape[0]
        if self.r1 - self.r0 < n and (self.e0 or self.r0):
            return f" (indices relative to row {self.r0} of expert {self.e0} of {experts})"
        return f" (indices relative to expert {self.e0} of {experts})" if self.e0 else ""


def units(shape: tuple[int, ...], piece_bytes: int) -> list[Unit]:
    """Cut a weight into pieces of at most ``piece_bytes`` code bytes: whole experts, else blocks of 128 rows.

    A piece is never smaller than one expert of at most 128 rows, or 128 rows of a larger one.
    """
    *lead, n, k = shape
    experts = lead[0] if lead else 1
    matrix = n * k
    if matrix <= piece_bytes or n <= TILE:
        step = max(1, piece_bytes // max(1, matrix))
        units = [Unit(shape, e0, min(experts, e0 + step), 0, n) for e0 in range(0, experts, step)]
        return units or [Unit(shape, 0, 0, 0, n)]  # no experts: one empty piece
    rows = max(TILE, piece_bytes // k // TILE * TILE)
    return [Unit(shape, e, e + 1, r0, min(n, r0 + rows)) for e in range(experts) for r0 in range(0, n, rows)]


def packed(unit: Unit, offset: int, out_scale_offset: int = 0) -> PackedWeight:
    """Where ``unit``'s piece lies in a slot from ``offset``: its codes, then (aligned) its E8M0 scales."""
    return PackedWeight(unit.piece_shape, offset, offset + align(unit.code_bytes), out_scale_offset)


@dataclass(frozen=True)
class BufferSizes:
    """How one lane cuts its share of ``host_memory_bytes`` (see :func:`size_buffers`)."""

    piece_bytes: int  # most code bytes of one weight read and converted at once
    slot_bytes: int  # one host buffer: a piece's codes and scales (input), or its converted codes (output)
    slots: int  # buffers in each of the two pools
    work_bytes: int  # the CPU reference's temporaries while it converts one piece

    @property
    def bound_bytes(self) -> int:
        return 2 * self.slots * self.slot_bytes + self.work_bytes


def size_buffers(
    pairs: Iterable[MxPair], memory_bytes: int, chunk_bytes: int, *, pinned: bool, work_factor: int
) -> BufferSizes:
    """Cut ``memory_bytes`` into two pools of at least ``MIN_SLOTS`` slots each, plus the CPU's work space.

    Pieces are at most ``chunk_bytes`` of codes and small enough for that; a slot is as large as the largest
    piece of ``pairs`` needs, and no larger, except that pinned slots hold at least ``BATCH_BYTES`` where the
    budget allows (batches of small pieces). Pinned slots are powers of two (the pinned allocator rounds every
    size up to one). A budget too small for one 128-row piece is exceeded by the pieces' size, not refused.
    """
    cap = memory_bytes // (2 * MIN_SLOTS + work_factor)
    if pinned:
        cap = 1 << max(0, cap.bit_length() - 1)
    piece = max(1, min(chunk_bytes, cap * MX_BLOCK // (MX_BLOCK + 1) - SLOT_ALIGN))
    need = max((u.slot_bytes for p in pairs for u in units(p.weight.shape, piece)), default=0)
    slot = max(SLOT_ALIGN, 1 << (need - 1).bit_length() if pinned else align(need))
    if pinned:  # room for a batch of small weights (a launch per shape for all), within the budget's share of a slot
        slot = max(slot, min(cap, BATCH_BYTES))
    slots = max(MIN_SLOTS, min(MAX_SLOTS, (memory_bytes - work_factor * slot) // (2 * slot)))
    return BufferSizes(piece, slot, slots, work_factor * slot)


def align(n: int) -> int:
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


# -- converters: one piece, on one device -------------------------------------------------------------------------


class CpuConverter:
    """CPU: NumPy table lookups (:func:`transformd.numpy_exact.convert_exact` and ``convert_amax``, bit for bit the
    reference) on a pool of threads, one band of whole 128-row tiles of one expert each; an empty weight and any
    weight the lookups refuse (an invalid value, or amax tables that would outnumber its codes) through the PyTorch
    reference (:func:`transformd.convert.convert_reference_checked`), whose error names the value, once every band of
    the batch is done (the two never hold memory at once). In the exact mode 0.5 GiB took 1.43-1.54 s on the 2-core
    development machine against 2.93-3.73 s with the reference
    (``benchmarks/results/convert_bench_cpu_numpy_exact.txt``).

    ``work_bytes``: the lane's work space (:attr:`BufferSizes.work_bytes`, reserved for the reference); the bands
    are at most :data:`CPU_BAND_BYTES` and a quarter of it over the threads, so that the lookups' temporaries take
    about half of it (and 3 MiB a thread) on a node of many cores too."""

    def __init__(self, target: Target, scale_mode: ScaleMode, work_bytes: int, threads: int | None = None):
        self.target, self.scale_mode = target, scale_mode
        self._convert = converter(scale_mode)
        threads = threads or usable_cores()
        self.band_bytes = max(1, min(CPU_BAND_BYTES, work_bytes // (4 * threads)))
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="transformd-cpu-convert")

    def __call__(self, slot: torch.Tensor, out: torch.Tensor, pieces: list[PackedWeight]) -> list[torch.Tensor]:
        fnuz = self.target is Target.FNUZ
        source, dest = slot.numpy(), out.numpy()
        bands: list[list[concurrent.futures.Future]] = []
        try:
            for piece in pieces:
                bands.append([self._pool.submit(self._convert, codes, scales, fnuz=fnuz, out=converted)
                              for codes, scales, converted in _bands(piece, source, dest, self.band_bytes)])
            concurrent.futures.wait([future for futures in bands for future in futures])  # (before any reference)
            scale_invs = []
            for i, (piece, futures) in enumerate(zip(pieces, bands)):
                done = [future.result() for future in futures]
                if not done or any(result is None for result in done):
                    scale_invs.append(self._reference(slot, out, piece, i))
                else:
                    grid = piece.scale_inv_shape
                    scale_inv = np.concatenate([scale for _, scale in done]).reshape(grid)
                    scale_invs.append(torch.from_numpy(scale_inv))
            return scale_invs
        finally:  # (on an error too: no band may still write into ``out`` once this returns)
            concurrent.futures.wait([future for futures in bands for future in futures])

    def _reference(self, slot: torch.Tensor, out: torch.Tensor, piece: PackedWeight, index: int) -> torch.Tensor:
        codes, e8m0 = piece.views(slot)
        try:
            q, scale_inv = convert_reference_checked(codes, e8m0, self.target, self.scale_mode)
        except MxFormatError as err:
            raise GroupMemberError(err.problem, index) from None
        out[piece.code_offset : piece.code_offset + codes.numel()].copy_(q.view(torch.uint8).reshape(-1))
        return scale_inv

    def close(self) -> None:
        self._pool.shutdown()


def _bands(piece: PackedWeight, source: np.ndarray, dest: np.ndarray, band_bytes: int
           ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(codes, E8M0 scales, converted codes) of each band of ``piece``: at most ``band_bytes`` of whole 128-row tiles
    of one expert (one tile row at the least), in order (so their scale_inv rows follow one another); none for an
    empty piece."""
    *lead, n, k = piece.shape
    experts = math.prod(lead)
    if not (experts and n and k):
        return
    size = experts * n * k
    codes = source[piece.code_offset : piece.code_offset + size].reshape(experts, n, k)
    scales = source[piece.scale_offset : piece.scale_offset + size // MX_BLOCK].reshape(experts, n, k // MX_BLOCK)
    converted = dest[piece.code_offset : piece.code_offset + size].reshape(experts, n, k)
    for e, r0, r1 in tile_bands(piece.shape, band_bytes):
        yield codes[e, r0:r1], scales[e, r0:r1], converted[e, r0:r1]


class KernelConverter:
    """GPU: the fused Triton kernel, between two device buffers of one slot each, reused for every batch.

    Host slot -> device (one asynchronous copy from pinned memory) -> one grouped launch over every piece of the
    batch -> host slot; one synchronisation per batch (the kernel's status check). Also runs on the CPU under
    ``TRITON_INTERPRET=1`` (tests).
    """

    #: Each converter's first launch (which may JIT-compile and load the kernel) runs alone: lanes on several
    #: GPUs would otherwise fill Triton's caches from several threads at once.
    _first_launch = threading.Lock()

    def __init__(self, device: torch.device, slot_bytes: int, target: Target, scale_mode: ScaleMode):
        if device.type == "cuda":
            torch.cuda.set_device(device)  # Triton launches on the thread's current device
        self.device, self.target, self.scale_mode = device, target, scale_mode
        self._in: torch.Tensor | None = torch.empty(slot_bytes, dtype=torch.uint8, device=device)
        self._out: torch.Tensor | None = torch.empty(slot_bytes, dtype=torch.uint8, device=device)
        self._launched = False

    def __call__(self, slot: torch.Tensor, out: torch.Tensor, pieces: list[PackedWeight]) -> list[torch.Tensor]:
        assert self._in is not None and self._out is not None
        last = pieces[-1]
        used = last.scale_offset + math.prod(last.shape) // MX_BLOCK
        self._in[:used].copy_(slot[:used], non_blocking=True)
        d_scales = torch.empty(sum(p.tiles for p in pieces), dtype=torch.float32, device=self.device)
        if self._launched:
            convert_packed(self._in, self._out, d_scales, pieces, self.target, self.scale_mode)
        else:
            with self._first_launch:
                convert_packed(self._in, self._out, d_scales, pieces, self.target, self.scale_mode)
            self._launched = True
        out[:used].copy_(self._out[:used], non_blocking=True)  # the codes (and the gaps between them)
        scales = d_scales.cpu()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the slots may be reused once this returns
        return [scales[p.out_scale_offset : p.out_scale_offset + p.tiles].view(p.scale_inv_shape) for p in pieces]

    def close(self) -> None:
        self._in = self._out = None


def warm_up(devices: Iterable[torch.device], target: Target, scale_mode: ScaleMode) -> None:
    """Launch the kernel a :class:`KernelConverter` will launch, once per GPU of ``devices``, on one 128x128 weight.

    A process's first launch finds the kernel in Triton's cache on disk (or compiles it) and loads it: 0.6 s on the
    H200 machine, 1.3 s with the page cache dropped, 1.9 s without Triton's cache, which the first batch would
    otherwise wait for. The warm-up's launch is specialised as the conversion's are (16-byte aligned buffers and
    offsets, K a multiple of 16, the same kernel, warps and register cap), so they find it loaded. Best effort: an
    error here is met, and reported, by the conversion itself."""
    for device in devices:
        if device.type != "cuda":
            continue
        try:
            with KernelConverter._first_launch, torch.cuda.device(device):
                unit = Unit((TILE, TILE), 0, 1, 0, TILE)
                buffer = torch.zeros(unit.slot_bytes, dtype=torch.uint8, device=device)  # +0 codes, 2^-127 scales
                out = torch.empty(unit.code_bytes, dtype=torch.uint8, device=device)
                scales = torch.empty(1, dtype=torch.float32, device=device)
                convert_packed(buffer, out, scales, [packed(unit, 0)], target, scale_mode)
        except Exception:  # noqa: BLE001, S110 - see above
            pass


def start_warm_up(devices: Iterable[torch.device], target: Target, scale_mode: ScaleMode) -> threading.Thread | None:
    """:func:`warm_up` on a thread (returned; None without a GPU), while the caller plans the conversion and its
    first batch is read."""
    gpus = [d for d in devices if d.type == "cuda"]
    if not gpus:
        return None
    thread = threading.Thread(target=warm_up, args=(gpus, target, scale_mode), name="transformd-kernel-warm-up",
                              daemon=True)
    thread.start()
    return thread


def make_converter(
    device: torch.device, slot_bytes: int, target: Target, scale_mode: ScaleMode
) -> CpuConverter | KernelConverter:
    if device.type == "cpu":
        return CpuConverter(target, scale_mode, CPU_WORK_FACTOR * slot_bytes)
    return KernelConverter(device, slot_bytes, target, scale_mode)
