"""How far a conversion is and how long it still takes, for people: the ETA, and the lines and bar that show it.

A checkpoint holds two kinds of bytes that move at very different speeds: MXFP8 weights, which are
converted (on the CPU at 0.4-1 GiB/s a core with NumPy table lookups), and everything else (BF16
embeddings, norms, other shards), which is copied at disk speed. An ETA over all bytes is far too
optimistic while the copies run ("38% ... 00:00 left" with most of the time still ahead), so
:class:`Eta` estimates from the bytes **still to convert** and the rate at which they are being
converted, over a sliding window. Only when nothing is left to convert (or the checkpoint has no
MXFP8 weight) does it fall back to all bytes.

:class:`Progress` is the record itself, the same from the pipeline to the client; a dict of it (the cache's
``ConversionStatus.detail``, an API answer) is read with :meth:`Progress.from_json`.

No torch here: the daemon and the command line use it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TextIO

__all__ = ["COUNTERS", "RATE_WINDOW_S", "ConvertProgress", "Eta", "Progress", "counters", "human_bytes",
           "human_seconds", "summary"]

#: Window of the rate estimates (seconds).
RATE_WINDOW_S = 10.0
#: The counters of a :class:`Progress` (the fields that only grow while a conversion runs).
COUNTERS = ("tensors_done", "tensors_total", "bytes_done", "bytes_total", "convert_bytes_done", "convert_bytes_total")


@dataclass(frozen=True)
class Progress:
    """How far a conversion is: the one record that flows from the pipeline (after each tensor) through the cache
    (its status files), the daemon (its jobs and answers: ``progress`` in the API) to the client and the CLI's
    display. A field nobody knows is ``None``.

    ``bytes_*`` count every input tensor byte; ``convert_bytes_*`` only the MXFP8 weights' codes, the bytes that
    are converted rather than copied (much slower on the CPU): an ETA comes from those (:class:`Eta`).
    ``phase``: validating, queued, converting, waiting (another process converts it), publishing, done, failed.
    """

    phase: str | None = None
    shard: str | None = None
    tensors_done: int | None = None
    tensors_total: int | None = None
    bytes_done: int | None = None
    bytes_total: int | None = None
    convert_bytes_done: int | None = None
    convert_bytes_total: int | None = None
    rate_bytes_per_s: float | None = None
    eta_s: float | None = None
    updated_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def replace(self, **changes: Any) -> Progress:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_json(cls, data: Any) -> Progress | None:
        """The record in ``data`` (a dict, e.g. JSON from a status file or an answer; or a Progress), keeping only
        well-formed values: counters are ints >= 0, rates and times numbers, names strings. None for no dict."""
        if isinstance(data, Progress):
            return data
        if not isinstance(data, dict):
            return None
        out: dict[str, Any] = {name: data[name] for name in COUNTERS if _count(data.get(name))}
        out.update({name: float(data[name]) for name in ("rate_bytes_per_s", "eta_s", "updated_at")
                    if isinstance(data.get(name), (int, float)) and not isinstance(data.get(name), bool)})
        out.update({name: data[name] for name in ("phase", "shard") if isinstance(data.get(name), str)})
        return cls(**out)

    @property
    def fraction(self) -> float | None:
        """Bytes done / bytes total, when both are known."""
        if self.bytes_total and self.bytes_done is not None:
            return min(1.0, self.bytes_done / self.bytes_total)
        return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def counters(update: Progress | dict[str, Any] | None) -> dict[str, int]:
    """The counters of ``update`` (a :class:`Progress` or its dict) that are known."""
    progress = Progress.from_json(update)
    return {} if progress is None else {n: getattr(progress, n) for n in COUNTERS if getattr(progress, n) is not None}


class _Rate:
    """Units per second over the last :data:`RATE_WINDOW_S` seconds of (time, count) samples."""

    def __init__(self) -> None:
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, t: float, count: int) -> float | None:
        if self._samples and (count < self._samples[-1][1] or count == self._samples[-1][1] == 0):
            self._samples.clear()  # counting started over, or has not started: the rate starts from here
        self._samples.append((t, count))
        while len(self._samples) > 2 and t - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        t0, c0 = self._samples[0]
        return (count - c0) / (t - t0) if t - t0 >= 0.2 and count > c0 else None


class Eta:
    """Seconds left, from the bytes still to convert (see the module docstring); ``None`` until it can tell."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._convert = _Rate()
        self._all = _Rate()
        self.rate: float | None = None  #: all bytes per second, for display

    def update(self, update: Any) -> float | None:
        c = counters(update)
        now = self._clock()
        done, total = c.get("bytes_done"), c.get("bytes_total")
        self.rate = None if done is None else self._all.add(now, done)
        conv_done, conv_total = c.get("convert_bytes_done"), c.get("convert_bytes_total")
        if conv_done is not None and conv_total and conv_done < conv_total:
            rate = self._convert.add(now, conv_done)
            return None if not rate else (conv_total - conv_done) / rate
        if done is None or total is None:
            return None
        if done >= total:
            return 0.0
        return None if not self.rate else (total - done) / self.rate


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"?"``."""
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def human_seconds(s: float) -> str:
    """``75`` -> ``"1m15s"``; ``4.2`` -> ``"4s"``."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def draws_a_bar(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal a bar can be drawn on: one that reports no width (a pty nobody sized) gets
    the log lines instead (a bar there showed nothing at all)."""
    if not stream.isatty():
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (OSError, ValueError, AttributeError):  # a terminal without a descriptor to ask (a wrapper)
        return True


#: Seconds between redraws of a bar that no update moves (its elapsed time goes on: the process is not stuck).
TICK_S = 0.5


class ConvertProgress:
    """Progress of ``transformd convert`` on ``stream``: a tqdm bar on a terminal, else one line every
    ``every_s`` seconds (the first ``every_s`` after the first update, so a short conversion prints none).
    The ETA is :class:`Eta`'s. Use as the ``progress`` callback; :meth:`close` at the end.

    :meth:`phase` names what the command does before and between updates (hashing, converting, publishing): on a
    terminal the bar is drawn from the start with the phase as its label, and redrawn every :data:`TICK_S` while
    no update comes (a CPU conversion showed nothing for seconds, then a bar already at 100%)."""

    def __init__(self, stream: TextIO, *, every_s: float = 5.0, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stream = stream
        self._tty = draws_a_bar(stream) if tty is None else tty
        self._every = every_s
        self._clock = clock
        self._eta = Eta(clock)
        self._bar: Any = None
        self._next_line: float | None = None
        self._phase = "converting"
        self._ticker: Any = None

    def phase(self, name: str, total_bytes: int | None = None) -> None:
        """What is being done now (``hashing``, ``converting``, ``publishing``), over ``total_bytes`` if known: the
        bar's label on a terminal, drawn at once; the word the log lines start with elsewhere."""
        self._phase = name
        if not self._tty:
            return
        if self._bar is None and total_bytes is not None:
            self._new_bar(total_bytes)
        if self._bar is not None:
            self._bar.set_description_str(name, refresh=True)

    def update(self, update: Progress | None) -> None:
        if update is None:
            return
        if update.phase and update.phase != self._phase and update.phase != "done":
            self.phase(update.phase)
        c = counters(update)
        eta = self._eta.update(update)
        if "bytes_total" not in c or "bytes_done" not in c:
            return
        if self._tty:
            self._update_bar(c, eta)
            return
        now = self._clock()
        if self._next_line is None:
            self._next_line = now + self._every
        elif now >= self._next_line:
            self._next_line = now + self._every
            print(f"transformd: {update.phase or self._phase} {self.describe(c, self._eta.rate, eta)}",
                  file=self._stream, flush=True)

    @staticmethod
    def describe(c: dict[str, int], rate: float | None, eta: float | None) -> str:
        """``120.0 MiB/694.0 MiB (17%), 40/400 tensors, 48.0 MiB/s, ~9s left``."""
        done, total = c.get("bytes_done", 0), c.get("bytes_total", 0)
        parts = [f"{human_bytes(done)}/{human_bytes(total)} ({done / total if total else 1:.0%})"]
        if c.get("tensors_total"):
            parts.append(f"{c.get('tensors_done', 0)}/{c['tensors_total']} tensors")
        if rate:
            parts.append(f"{human_bytes(rate)}/s")
        parts.append(f"~{human_seconds(eta)} left" if eta is not None else "estimating time left")
        return ", ".join(parts)

    def _new_bar(self, total: int) -> None:
        import threading

        from tqdm import tqdm

        # tqdm's own ETA counts every byte alike (fast copies too): show Eta's instead
        self._bar = bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=self._stream,
                               desc=self._phase, dynamic_ncols=True,
                               bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                          "[{elapsed}, {rate_fmt}{postfix}]")
        stop = threading.Event()

        def tick() -> None:  # (tqdm redraws only when it is moved)
            while not stop.wait(TICK_S):
                if self._bar is bar:
                    bar.refresh()

        self._ticker = stop
        threading.Thread(target=tick, name="transformd-bar", daemon=True).start()

    def _update_bar(self, c: dict[str, int], eta: float | None) -> None:
        if self._bar is None:
            self._new_bar(c["bytes_total"])
        self._bar.total = c["bytes_total"]
        self._bar.update(max(0, c["bytes_done"] - self._bar.n))
        left = f"~{human_seconds(eta)} left" if eta is not None else "estimating"
        self._bar.set_postfix_str(f"{c.get('tensors_done', 0)}/{c.get('tensors_total', 0)} tensors, {left}",
                                  refresh=False)

    def close(self, *, leave: bool = True) -> None:
        """End the bar; ``leave=False`` erases it (a phase whose bar never moved: hashing before a hit)."""
        if self._ticker is not None:
            self._ticker.set()
            self._ticker = None
        if self._bar is not None:
            self._bar.leave = leave
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ConvertProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def items_left_out(n: int) -> str:
    """What ends a list cut short after its first items (``cache.manifest.jsonable``); :func:`_listed` reads it."""
    return f"... ({n} more)"


_LEFT_OUT = re.compile(r"\.\.\. \((\d+) more\)")


def _listed(names: list[Any]) -> int:
    """Items of a list, counting the :func:`items_left_out` a manifest ends a long list with."""
    more = _LEFT_OUT.fullmatch(str(names[-1])) if names else None
    return len(names) - 1 + int(more.group(1)) if more else len(names)


def summary(result: Any, where: str, *, how: str = "converted", timings: dict[str, float] | None = None) -> str:
    """The one line ``transformd convert`` ends with (standard error): bytes, tensors, time, rate, target,
    mode, device and where the result is. ``result`` is a :class:`transformd.checkpoint.ConversionResult`
    or its JSON form (a cache entry's ``manifest.result``)."""
    get = result.get if isinstance(result, dict) else (lambda name, default=None: getattr(result, name, default))
    data = get("data_bytes", 0) or get("bytes_read", 0) or 0
    seconds = float(get("seconds", 0.0) or 0.0)
    tensors, converted = get("tensors", 0) or 0, _listed(get("converted", None) or [])
    rate = f", {human_bytes(data / seconds)}/s" if seconds > 0 else ""
    steps = ""
    if timings:
        labels = {"identify": "identify", "hash_alongside": "hashed alongside", "convert": "convert",
                  "publish": "publish"}
        named = [(label, timings[k]) for k, label in labels.items() if k in timings]
        steps = " (" + ", ".join(f"{k} {v:.1f} s" for k, v in named) + ")" if named else ""
        seconds = float(timings.get("total", seconds))
    counted = f"{tensors} tensors, " if tensors else ""
    busy = get("stage_busy", None) or {}
    if busy:
        steps += " [busy: " + ", ".join(f"{k} {v:.1f} s" for k, v in busy.items()) + "]"
    early = _listed(get("head_start_shards", None) or [])
    device = str(get("device", "?"))
    if early:
        device += f" ({early} of {_listed(get('shards', None) or [])} shards on the CPU while torch was imported)"
    return (
        f"transformd: {how} {human_bytes(data)} ({counted}{converted} MXFP8 weights converted) in {seconds:.1f} s"
        f"{steps}{rate}; target {get('target', '?')}, scale mode {get('scale_mode', '?')}, on {device}; {where}"
    )
