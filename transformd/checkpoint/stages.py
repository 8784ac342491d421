"""The pipeline's plumbing: stage threads joined by bounded channels, the first error stopping all, the host buffer
pools between them, and how long each stage worked (see :mod:`transformd.checkpoint.pipeline`)."""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .pieces import MAX_SLOTS, BufferSizes

#: Items a channel between two stages holds by default (memory is bounded by the slots, not by this).
CHANNEL_ITEMS = 4 * MAX_SLOTS
#: How often a waiting stage checks whether the conversion was stopped (seconds).
POLL_S = 0.05

T = TypeVar("T")


class Tally:
    """Byte counts the stage threads add to: data read and written, host buffers allocated (and their peak)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.read = self.written = self.buffers = self.buffers_peak = 0

    def add(self, *, read: int = 0, written: int = 0, buffers: int = 0) -> None:
        with self._lock:
            self.read += read
            self.written += written
            self.buffers += buffers
            self.buffers_peak = max(self.buffers_peak, self.buffers)


class Stopped(Exception):
    """Unwinds a stage quietly once another stage has failed or the caller gave up."""


class Stages:
    """Threads joined by bounded channels; the first error stops them all.

    Stage threads report to the calling thread through one queue, in the order things happen: progress
    ticks, their error, their exit. :meth:`wait` (on the calling thread) applies the ticks, and re-raises
    the first error once every stage has been stopped and joined.
    """

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._local = threading.local()
        #: per stage thread: seconds alive, and seconds spent waiting on a channel or for a slot
        self.alive: dict[str, float] = {}
        self.waited: dict[str, float] = {}

    def blocking(self, attempt: Callable[[], T], miss: type[Exception]) -> T:
        """``attempt()`` (a queue operation with a timeout, raising ``miss`` when it times out) until it succeeds;
        :class:`Stopped` once the stages stop. The time counts as the calling stage's waiting (off the stages:
        not counted)."""
        since = time.monotonic()
        try:
            while True:
                self.check()
                try:
                    return attempt()
                except miss:
                    pass
        finally:
            name = getattr(self._local, "name", None)
            if name is not None:
                self.waited[name] = self.waited.get(name, 0.0) + time.monotonic() - since

    def busy(self) -> dict[str, float]:
        """Seconds each kind of stage (read, convert, write, sync) worked, the busiest lane's: the bottleneck is
        the stage whose busy time is closest to the conversion's."""
        out: dict[str, float] = {}
        for name, alive in self.alive.items():
            kind = name.split("-", 1)[0]
            out[kind] = round(max(out.get(kind, 0.0), alive - self.waited.get(name, 0.0)), 3)
        return out

    def channel(self, maxsize: int = CHANNEL_ITEMS) -> Channel:
        return Channel(self, maxsize)

    def check(self) -> None:
        """Raise :class:`Stopped` if the stages were stopped (stages call this wherever they wait)."""
        if self._stop.is_set():
            raise Stopped

    def tick(self, shard: str, tensors: int, nbytes: int, converted: int = 0) -> None:
        self._events.put(("tick", (shard, tensors, nbytes, converted)))

    def start(self, name: str, stage: Callable[[], None]) -> None:
        def body() -> None:
            self._local.name, started = name, time.monotonic()
            try:
                stage()
            except Stopped:
                pass
            except BaseException as err:  # noqa: BLE001 - handed to the calling thread, which raises it
                self._stop.set()
                traceback.clear_frames(err.__traceback__)  # drop the frames' buffers; keep file and line
                self._events.put(("error", err))
            finally:
                self.alive[name] = time.monotonic() - started
                self._events.put(("exit", name))

        thread = threading.Thread(target=body, name=f"transformd-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def wait(self, on_tick: Callable[[str, int, int, int], None], on_ticked: Callable[[], None]) -> None:
        """Apply ticks until every stage has exited, and call ``on_ticked`` once per burst of them (every event
        waiting is taken first: thousands of small tensors make one report, not thousands, on the thread the
        stages share the interpreter with); on an error (or an exception here) stop all, join, raise."""
        running = len(self._threads)
        try:
            while running:
                try:
                    events = [self._events.get(timeout=1.0)]
                except queue.Empty:
                    continue
                while not self._events.empty():
                    events.append(self._events.get_nowait())
                ticked = False
                for kind, payload in events:
                    if kind == "tick":
                        on_tick(*payload)
                        ticked = True
                    elif kind == "error":
                        if ticked:  # what was done before the failure is reported, as it would have been
                            on_ticked()
                        raise payload
                    else:
                        running -= 1
                if ticked:
                    on_ticked()
        finally:
            self._stop.set()
            for thread in self._threads:
                thread.join()


class Channel:
    """A bounded FIFO from one stage to the next; waiting ends with :class:`Stopped` when the stages stop."""

    def __init__(self, stages: Stages, maxsize: int):
        self._stages = stages
        self._queue: queue.Queue[Any] = queue.Queue(maxsize)

    def put(self, item: Any) -> None:
        self._stages.check()
        try:
            return self._queue.put_nowait(item)
        except queue.Full:
            return self._stages.blocking(lambda: self._queue.put(item, timeout=POLL_S), queue.Full)

    def get(self) -> Any:
        self._stages.check()
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return self._stages.blocking(lambda: self._queue.get(timeout=POLL_S), queue.Empty)

    def drain(self) -> list[Any]:
        """Take out whatever is left (once the stages have been joined)."""
        items = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items


class SlotPool:
    """At most ``count`` host buffers of ``slot_bytes`` each, allocated on first need and then reused.

    One stage takes slots (only that one thread), a later stage gives them back; taking waits while all
    are out, until the stages stop. Pinned (page-locked) when they feed a GPU, for full-speed copies.
    """

    def __init__(self, sizes: BufferSizes, *, pinned: bool, stages: Stages, tally: Tally):
        self.slot_bytes, self.count, self.pinned = sizes.slot_bytes, sizes.slots, pinned
        self._stages, self._tally = stages, tally
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._made = 0

    def take(self) -> torch.Tensor:
        if self._free.empty() and self._made < self.count:
            self._made += 1
            self._tally.add(buffers=self.slot_bytes)
            return torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        return self._stages.blocking(lambda: self._free.get(timeout=POLL_S), queue.Empty)

    def give(self, slot: torch.Tensor) -> None:
        self._free.put(slot)

    def close(self) -> None:
        while not self._free.empty():
            self._free.get_nowait()
        self._tally.add(buffers=-self._made * self.slot_bytes)
        self._made = 0


