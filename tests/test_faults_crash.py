"""Crash safety of ``transformd convert``: SIGKILL at random points of real conversions, to --out and into the cache.

A sample checkpoint large enough for a conversion to last about a second (86 MB, 4 layers of 8 experts) is
converted once cleanly by the console script to measure how long the conversion runs after its staging
directory appears; then ``KILLS`` conversions are killed with SIGKILL after a delay drawn uniformly from that
span (seeded). After each kill:

* nothing partial is visible: ``--out`` is absent (or, when the kill came after the publish, complete and
  byte-identical to a clean conversion); the cache has no entry (or a complete one that verifies);
* the next run removes the stale staging directory (and, in the cache, the dead process' lock file) and
  succeeds, with output byte-identical to the clean conversion.

The clean run is the ``transformd`` console script; the killed runs execute the same entry point
(``transformd.cli.main(["convert", ...])``) in processes started ahead of time, so that their imports overlap the
previous kill's recovery. The next run is in-process (``convert_checkpoint`` / ``Cache.get_or_convert``, the
functions the CLI calls) for speed, except after the last kill, where it is the console script again. Where each kill landed is read from
what it left behind and reported. Two more tests kill a conversion deterministically inside the two-rename
publish of ``--overwrite``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from transformd.cache import Cache
from transformd.checkpoint import convert_checkpoint
from transformd.sample import write_sample_checkpoint

from .support.checkpoints import write_checkpoint
from .support.entries import entry_dir

TRANSFORMD = Path(sys.executable).with_name("transformd")
#: 86 MB; converts in ~1 s on one core of the CI machine.
SAMPLE = {"layers": 4, "experts": 8, "hidden": 1024, "moe_intermediate": 768, "shards": 5}
KILLS = 8
SEED = 20261130
CATEGORY = "crash (SIGKILL)"


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def wait_for(cond, timeout: float = 60.0, what: str = "condition", proc: subprocess.Popen | None = None) -> float:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)
    return time.monotonic()


def launch(*args: object) -> subprocess.Popen:
    """The ``transformd`` console script: ``transformd convert ARGS --device cpu``."""
    p = subprocess.Popen(
        [str(TRANSFORMD), "convert", *map(str, args), "--device", "cpu", "--target", "fnuz"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    Prestarted.started.append(p)  # ended by _no_process_left if the test fails before it ends
    return p


#: What the console script runs (``sys.exit(transformd.cli.main())``), started ahead: it imports while the
#: previous kill's recovery runs, and starts converting when its go-file appears.
_PRESTARTED = (
    "import os, sys, time\n"
    "from transformd import cli\n"
    "import transformd.cache, transformd.checkpoint\n"
    "while not os.path.exists(sys.argv[1]):\n"
    "    time.sleep(0.002)\n"
    "sys.exit(cli.main(sys.argv[2:]))\n"
)


class Prestarted:
    """``transformd convert ARGS --device cpu`` in a process started now, converting once :meth:`go` is called."""

    started: ClassVar[list[subprocess.Popen]] = []

    def __init__(self, go_file: Path, *args: object):
        self.go_file = go_file
        argv = [sys.executable, "-c", _PRESTARTED, str(go_file), "convert", *map(str, args), "--device", "cpu", "--target", "fnuz"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.started.append(self.proc)

    def go(self) -> subprocess.Popen:
        self.go_file.touch()
        return self.proc


def sleep_unless(done, t0: float, delay: float) -> float | None:
    """Sleep until ``t0 + delay``; if ``done()`` becomes true first, return how long after ``t0`` it did."""
    while time.monotonic() < t0 + delay:
        if done():
            return time.monotonic() - t0
        time.sleep(0.003)
    return None


def kill(p: subprocess.Popen) -> bool:
    """SIGKILL ``p``; False when it had already finished (successfully) by then."""
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
    _, stderr = p.communicate(timeout=30)
    assert p.returncode in (0, -signal.SIGKILL), stderr
    return p.returncode == -signal.SIGKILL


@pytest.fixture(autouse=True)
def _no_process_left() -> Iterator[None]:
    """A failing test must not leave a process behind (a pre-started one would wait for its go-file forever)."""
    yield
    while Prestarted.started:
        p = Prestarted.started.pop()
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """The source checkpoint and the files of its clean conversion."""
    root = tmp_path_factory.mktemp("crash")
    src = write_sample_checkpoint(root / "src", **SAMPLE)
    reference = convert_checkpoint(src, root / "reference", device="cpu").out
    return src, files(reference)


def _leftovers(work: Path) -> list[str]:
    return sorted(n for n in os.listdir(work) if n.startswith(".out.transformd-"))


def _out_phase(work: Path) -> str:
    """Where a kill of a conversion into ``work/out`` landed, judged by what it left."""
    if (work / "out").exists():
        return "after the publish (rename done)"
    left = _leftovers(work)
    assert len(left) == 1, left
    if "-staging-" not in left[0]:
        return "staging created"
    names = os.listdir(work / left[0])
    if "config.json" in names:
        return "finishing (metadata, carried files, fsync)"
    shards = sum(n.endswith(".safetensors") for n in names)
    return f"converting shards ({shards} of {SAMPLE['shards']} started)" if shards else "staging created"


@pytest.mark.timeout(240)
def test_sigkill_of_convert_to_out(sample, tmp_path: Path, fault_log) -> None:
    src, expected = sample
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"

    # a clean run: the conversion's span from its staging directory to its publish, and the expected bytes
    p = launch(src, "--out", out)
    t0 = wait_for(lambda: _leftovers(work), what="the staging directory", proc=p)
    span = wait_for(out.exists, what="the publish", proc=p) - t0
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    assert stdout.splitlines()[-1] == str(out) and files(out) == expected and _leftovers(work) == []
    shutil.rmtree(out)

    rng = random.Random(SEED)
    phases: Counter[str] = Counter()
    attempt = late = 0
    runs = iter(range(3 * KILLS))
    nxt = Prestarted(tmp_path / f"go{next(runs)}", src, "--out", out)
    while attempt < KILLS:
        assert late < KILLS, "most runs finished before their kill: the conversion is too short to kill mid-way"
        p = nxt.go()
        t0 = wait_for(lambda: _leftovers(work), what="the staging directory", proc=p)
        done = sleep_unless(lambda p=p: out.exists() or p.poll() is not None, t0, rng.uniform(0.0, span))
        if done is not None or not kill(p):  # published first (load varies): nothing to test; draw again
            span = min(span, done or span)  # kills are drawn from the shortest conversion seen
            p.communicate(timeout=30)
            assert p.returncode == 0 and files(out) == expected and _leftovers(work) == []
            shutil.rmtree(out)
            late += 1
            nxt = Prestarted(tmp_path / f"go{next(runs)}", src, "--out", out)
            continue
        if attempt < KILLS - 1:  # the next killed run imports while this one's recovery runs
            nxt = Prestarted(tmp_path / f"go{next(runs)}", src, "--out", out)
        phase = _out_phase(work)
        phases[phase] += 1
        if out.exists():  # the rename had happened: the output is the complete conversion
            assert files(out) == expected, attempt
        assert sorted(os.listdir(work)) == sorted(["out"] * out.exists() + _leftovers(work)), "nothing else appears"

        if attempt < KILLS - 1:  # the next run cleans up and succeeds
            convert_checkpoint(src, out, device="cpu", overwrite=True)
        else:  # after the last kill, the console script itself
            p = launch(src, "--out", out, "--overwrite")
            _, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr
        assert _leftovers(work) == [], f"stale staging left after kill {attempt} ({phase})"
        assert files(out) == expected, f"output after kill {attempt} ({phase}) differs from a clean conversion"
        shutil.rmtree(out)
        attempt += 1

    landed = ", ".join(f"{n} {phase}" for phase, n in sorted(phases.items()))
    fault_log.record(
        CATEGORY,
        f"`transformd convert SRC --out DIR` killed at uniform random points of its ~{span:.1f} s conversion "
        f"(staging to publish; {SAMPLE['shards']} shards, 86 MB)",
        KILLS,
        f"no partial output visible; stale staging removed by the next run, which succeeded byte-identical "
        f"{KILLS}/{KILLS}; kills landed: {landed} ({late} more runs published before their kill)",
    )


def _cache_phase(root: Path, key: str) -> str:
    if entry_dir(root, key).exists():
        return "after the publish (rename done)"
    statuses = [json.loads((root / "staging" / n).read_text())
                for n in os.listdir(root / "staging") if n.endswith(".json") and not n.startswith(".")]
    if not statuses:
        return "before the status file"
    st = statuses[0]
    if st.get("state") == "publishing":
        return "publishing (digest, fsync, manifest)"
    detail = st.get("detail") or {}
    if not detail.get("bytes_total"):
        return "converting (no progress reported yet)"
    quarter = min(3, 4 * detail["bytes_done"] // detail["bytes_total"])
    return f"converting ({25 * quarter}-{25 * quarter + 25}% of the bytes reported)"


@pytest.mark.timeout(240)
def test_sigkill_of_convert_into_the_cache(sample, tmp_path: Path, fault_log) -> None:
    src, expected = sample
    root = tmp_path / "cache"

    def staging_status() -> bool:
        return (root / "staging").is_dir() and any(
            n.endswith(".json") and not n.startswith(".") for n in os.listdir(root / "staging")
        )

    def entry_visible() -> bool:
        return (root / "entries").is_dir() and bool(os.listdir(root / "entries"))

    p = launch(src, "--cache-dir", root)
    t0 = wait_for(staging_status, what="the conversion's status file", proc=p)
    span = wait_for(entry_visible, what="the publish", proc=p) - t0
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    entry_path = Path(stdout.splitlines()[-1])
    key = entry_path.parent.name.split("-")[0]  # (entries/<key>-<tag>)
    assert files(entry_path) == expected, "the cache's conversion is byte-identical to --out's"
    Cache(root).rm(key)

    rng = random.Random(SEED + 1)
    phases: Counter[str] = Counter()
    attempt = late = 0
    runs = iter(range(3 * KILLS))
    nxt = Prestarted(tmp_path / f"go{next(runs)}", src, "--cache-dir", root)
    while attempt < KILLS:
        assert late < KILLS, "most runs finished before their kill: the conversion is too short to kill mid-way"
        p = nxt.go()
        t0 = wait_for(staging_status, what="the conversion's status file", proc=p)
        done = sleep_unless(lambda p=p: entry_visible() or p.poll() is not None, t0, rng.uniform(0.0, span))
        if done is not None or not kill(p):  # published first (load varies): nothing to test; draw again
            span = min(span, done or span)
            p.communicate(timeout=30)
            assert p.returncode == 0
            cache = Cache(root, cleanup=False)
            assert files(cache.get(key).path) == expected
            cache.rm(key)
            late += 1
            nxt = Prestarted(tmp_path / f"go{next(runs)}", src, "--cache-dir", root)
            continue
        if attempt < KILLS - 1:
            nxt = Prestarted(tmp_path / f"go{next(runs)}", src, "--cache-dir", root)
        phase = _cache_phase(root, key)
        phases[phase] += 1
        published = phase.startswith("after the publish")
        assert os.listdir(root / "entries") == ([entry_dir(root, key).name] if published else []), attempt
        observer = Cache(root, cleanup=False)
        if published:
            assert files(observer.get(key).path) == expected and [r.ok for r in observer.verify()] == [True]
        else:
            assert observer.lookup(src) is None and observer.get(key) is None

        if attempt < KILLS - 1:
            cache = Cache(root, device="cpu")  # start-up cleans what the dead process left
            assert os.listdir(root / "staging") == [] and os.listdir(root / "locks") == ["gc.lock"], attempt
            entry = cache.get_or_convert(src)
            assert entry.outcome == ("hit" if published else "converted")
        else:
            p = launch(src, "--cache-dir", root)
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr
            cache = Cache(root, cleanup=False)
            entry = cache.get(key)
            assert stdout.splitlines()[-1] == str(entry.path)
        assert files(entry.path) == expected, f"entry after kill {attempt} ({phase}) differs from a clean conversion"
        assert [r.ok for r in cache.verify()] == [True]
        assert os.listdir(root / "staging") == [] and os.listdir(root / "locks") == ["gc.lock"]
        assert os.listdir(root / "trash") == [] and os.listdir(root / "quarantine") == []
        cache.rm(key)
        attempt += 1

    landed = ", ".join(f"{n} {phase}" for phase, n in sorted(phases.items()))
    fault_log.record(
        CATEGORY,
        f"`transformd convert SRC` (cache) killed at uniform random points of its ~{span:.1f} s conversion and "
        "publish (status file to entry)",
        KILLS,
        f"no entry visible unless complete and verified; stale staging and lock removed at the next start; next "
        f"run succeeded byte-identical {KILLS}/{KILLS}; kills landed: {landed} ({late} more runs published first)",
    )


# ---------------------------------------------------------------------------------------------------------------------
# --overwrite publishes with two renames (old out aside, staging into place) and then removes the old output


_CHILD = textwrap.dedent(
    """
    import os, shutil, signal, sys
    import transformd.checkpoint as ck

    src, out, where = sys.argv[1:4]
    real_rename, real_rmtree = os.rename, shutil.rmtree

    def rename(a, b, *args, **kw):
        real_rename(a, b, *args, **kw)
        if where == "between the renames" and ".transformd-old-" in str(b):
            os.kill(os.getpid(), signal.SIGKILL)

    def rmtree(path, *args, **kw):
        if where == "removing the old output" and ".transformd-old-" in str(path):
            victims = sorted(p for p in os.listdir(path))
            os.unlink(os.path.join(path, victims[0]))  # part of it is gone when the kill comes
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rmtree(path, *args, **kw)

    os.rename, shutil.rmtree = rename, rmtree
    ck.convert_checkpoint(src, out, device="cpu", overwrite=True)
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["between the renames", "removing the old output"])
def test_sigkill_inside_an_overwrite_publish(tmp_path: Path, where: str, fault_log) -> None:
    src = write_checkpoint(tmp_path / "src")
    work = tmp_path / "work"
    out = work / "out"
    out.mkdir(parents=True)
    old = {"old.txt": b"the previous output", "config.json": b'{"quantization_config": {"transformd": {}}}'}
    for name, data in old.items():  # (an earlier conversion's output: --overwrite replaces nothing else)
        (out / name).write_bytes(data)
    expected = files(convert_checkpoint(src, tmp_path / "expected", device="cpu").out)

    cmd = [sys.executable, "-c", _CHILD, str(src), str(out), where]
    p = subprocess.run(cmd, capture_output=True, timeout=90, check=False)
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()
    if where == "between the renames":
        assert not out.exists(), "the kill came after the old output was moved aside"
        # a run without --overwrite puts the old output back (and refuses, as out is not empty)
        from transformd.safetensors_io import CheckpointError

        with pytest.raises(CheckpointError, match="not empty"):
            convert_checkpoint(src, out, device="cpu")
        assert files(out) == old
        assert _leftovers(work) == [], "the complete but unpublished staging directory is removed too"
        outcome = "the next run put the old output back (the overwrite never happened); --overwrite then succeeded"
    else:
        assert files(out) == expected, "the new output was in place when the kill came"
        assert [n for n in _leftovers(work) if "-old-" in n], "a partly removed old output is left"
        outcome = "the next run removed the partly deleted old output; --overwrite then succeeded"
    convert_checkpoint(src, out, device="cpu", overwrite=True)
    assert files(out) == expected and _leftovers(work) == []
    fault_log.record(CATEGORY, f"`convert --overwrite` killed {where}", 1, outcome)
