"""transformd.progress: the ETA comes from the bytes still to convert, not from fast copies; lines for logs."""

from __future__ import annotations

import io
import os

from transformd.checkpoint import Progress
from transformd.progress import ConvertProgress, Eta, summary

MB = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _run(eta: Eta, clock: Clock, steps: list[tuple[float, int, int]], totals: tuple[int, int]) -> list[float | None]:
    """steps: (time, bytes_done, convert_bytes_done); returns the ETA after each."""
    out = []
    for i, (t, done, conv) in enumerate(steps):
        clock.t = t
        out.append(eta.update(Progress(shard="s", tensors_done=i, tensors_total=len(steps), bytes_done=done, bytes_total=totals[0],
                                       convert_bytes_done=conv, convert_bytes_total=totals[1])))
    return out


def test_eta_ignores_fast_copies_and_follows_the_conversion() -> None:
    """600 MB of BF16 copied in 1 s, then 100 MB of MXFP8 converted at 10 MB/s (10 s): an ETA over all bytes would
    say ~0 s left at 86% done; this one waits for the conversion to start and then says ~the real time left."""
    clock = Clock()
    copies = [(0.1 * i, 60 * MB * i, 0) for i in range(1, 11)]
    converting = [(1.0 + i, 600 * MB + 10 * MB * i, 10 * MB * i) for i in range(1, 10)]
    etas = _run(Eta(clock), clock, copies + converting, (700 * MB, 100 * MB))
    assert all(e is None for e in etas[:10]), etas[:10]  # nothing converted yet: no estimate rather than a wrong one
    for (t, _, _), e in zip(converting[1:], etas[11:], strict=True):
        real = 11.0 - t
        assert e is not None and abs(e - real) <= 0.15 * real + 0.01, (t, e, real)


def test_eta_without_mxfp8_weights_uses_all_bytes() -> None:
    clock = Clock()
    etas = _run(Eta(clock), clock, [(1.0, 10 * MB, 0), (2.0, 20 * MB, 0), (3.0, 30 * MB, 0)], (40 * MB, 0))
    assert etas[0] is None and abs(etas[2] - 1.0) < 1e-6


def test_lines_for_logs_every_period_with_the_eta() -> None:
    clock = Clock()
    stream = io.StringIO()
    progress = ConvertProgress(stream, every_s=5.0, tty=False, clock=clock)
    for i in range(0, 21):
        clock.t = float(i)
        progress.update(Progress(shard="s", tensors_done=i, tensors_total=20, bytes_done=5 * MB * i, bytes_total=100 * MB,
                                 convert_bytes_done=5 * MB * i, convert_bytes_total=100 * MB))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4, lines  # at 5, 10, 15 and 20 s after the first update
    assert lines[0].startswith("transformd: converting 23.8 MiB/95.4 MiB (25%), 5/20 tensors, 4.8 MiB/s, ~15s left")
    assert lines[-1].endswith("~0s left")


def test_summary_line() -> None:
    result = {"data_bytes": 700 * MB, "seconds": 14.0, "tensors": 412, "converted": ["a"] * 96, "target": "fnuz",
              "scale_mode": "exact", "device": "cpu"}
    assert summary(result, "into /x") == (
        "transformd: converted 667.6 MiB (412 tensors, 96 MXFP8 weights converted) in 14.0 s, 47.7 MiB/s; "
        "target fnuz, scale mode exact, on cpu; into /x"
    )
    timed = summary(result, "cache entry /c", timings={"identify": 2.0, "convert": 14.0, "publish": 0.5, "total": 16.5})
    assert "in 16.5 s (identify 2.0 s, convert 14.0 s, publish 0.5 s), 47.7 MiB/s" in timed
    # a cache entry's manifest keeps the first 1000 names of a long list and says how many more
    from transformd.cache.manifest import jsonable

    many = {**result, "converted": [f"w{i}" for i in range(9964)], "stage_busy": {"read": 2.5, "write": 9.0}}
    line = summary(jsonable(many), "cache entry /c", timings={"hash_alongside": 3.0, "convert": 14.0, "total": 14.5})
    assert "(412 tensors, 9964 MXFP8 weights converted) in 14.5 s (hashed alongside 3.0 s, convert 14.0 s) " \
           "[busy: read 2.5 s, write 9.0 s]" in line, line


def test_one_progress_record_from_the_pipeline_to_the_client() -> None:
    """The pipeline, the cache's status, the daemon's schema and the client share one record type."""
    import dataclasses

    from transformd import checkpoint, client, progress
    from transformd.cache import ConversionStatus
    from transformd.daemon.schemas import ProgressModel

    assert checkpoint.Progress is client.Progress is progress.Progress
    names = [f.name for f in dataclasses.fields(progress.Progress)]
    assert list(ProgressModel.model_fields) == names
    sent = progress.Progress(phase="converting", shard="a", tensors_done=1, tensors_total=2, bytes_done=3,
                             bytes_total=4, convert_bytes_done=1, convert_bytes_total=2)
    status = ConversionStatus(key="k" * 32, state="converting", detail=dataclasses.asdict(sent), waiting=True)
    assert status.progress == sent.replace(phase="waiting")
    answer = ProgressModel.model_validate(sent.as_dict()).model_dump()
    assert client.CheckpointStatus.from_json({"key": "0" * 32, "state": "converting", "progress": answer}).progress == sent


def test_a_terminal_that_reports_no_width_gets_the_log_lines() -> None:
    """A pty nobody sized (``pty.fork`` without a window size) reports 0 columns: tqdm drew nothing there, so a
    conversion showed no progress at all. Such a terminal gets the lines; a sized one the bar."""
    import fcntl
    import pty
    import struct
    import termios

    from transformd.progress import draws_a_bar

    leader, follower = pty.openpty()
    try:
        with open(follower, "w", closefd=False) as stream:
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
            assert stream.isatty() and not draws_a_bar(stream)
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
            assert draws_a_bar(stream)
    finally:
        os.close(leader)
        os.close(follower)
    assert not draws_a_bar(io.StringIO())
