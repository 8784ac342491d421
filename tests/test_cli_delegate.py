"""``transformd convert --cache-dir C`` hands the conversion to a daemon that serves C (transformd/cli/delegate.py),
trusting it for nothing but the work: the entry is looked up by this process's own key of the source."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from transformd import cli
from transformd.client import TransformdClient

from .support.checkpoints import O, SHARD_B, assert_converted, default_shards, poke, set_tensor, write_checkpoint
from .support.daemon import metric_value

pytestmark = pytest.mark.timeout(180)

#: What a test's ``convert`` process had imported when it ended (an atexit handler prints it last).
_PROBE = ("import atexit, sys, runpy\nsys.argv = ['transformd', *sys.argv[1:]]\natexit.register(lambda: print("
          "sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'triton', 'numpy', 'safetensors'}), "
          "file=sys.stderr))\nrunpy.run_module('transformd', run_name='__main__')")


def _source(path: Path, shards=None) -> Path:
    """A checkpoint whose files are older than the stat cache's racy window (so what one process hashed, another
    finds by the files' stat signatures)."""
    src = write_checkpoint(path, shards)
    for f in src.iterdir():
        st = f.stat()
        os.utime(f, (st.st_atime - 60, st.st_mtime - 60))
    return src


def _conversions(daemon) -> float:
    with daemon.client() as http:
        return metric_value(http.get("/metrics").text, "transformd_conversions_total", {"outcome": "converted"})


def _convert(capsys, *argv: str | Path) -> tuple[int, list[str], list[str]]:
    code = cli.main(["convert", *(str(a) for a in argv), "--target", "ocp", "--device", "cpu"])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()


def test_the_daemon_serving_the_cache_converts_and_the_process_never_imports_torch(tmp_path: Path, daemons) -> None:
    src, root = _source(tmp_path / "src"), tmp_path / "cache"
    daemon = daemons.start(cache_dir=root, allow_roots=[tmp_path])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "TRANSFORMD_SOCKET": str(daemon.socket_path)}
    runs = []
    for _ in range(2):
        cmd = [sys.executable, "-c", _PROBE, "convert", str(src), "--cache-dir", str(root), "--target", "ocp"]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        runs.append(done)
    first, again = runs
    out = Path(first.stdout.splitlines()[-1])
    assert out.parent.parent == root / "entries" and out.name == "checkpoint", first.stdout
    assert "transformd: the daemon converted " in first.stderr and "converting in this process" not in first.stderr
    assert first.stderr.splitlines()[-1] == "[]", first.stderr  # no torch, triton, numpy nor safetensors here
    assert _conversions(daemon) == 1
    assert again.stdout == first.stdout and "found in the cache" in again.stderr
    assert_converted(src, out, "ocp", "exact")


def test_no_daemon_flag_or_a_daemon_of_another_cache_leaves_the_work_here(
    tmp_path: Path, daemons, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    src, root = _source(tmp_path / "src"), tmp_path / "cache"
    ours = daemons.start(cache_dir=root, allow_roots=[tmp_path])
    other = daemons.start(cache_dir=tmp_path / "other-cache", allow_roots=[tmp_path])
    monkeypatch.setenv("TRANSFORMD_SOCKET", str(ours.socket_path))
    code, stdout, stderr = _convert(capsys, src, "--cache-dir", root, "--no-daemon")
    assert code == 0 and stderr[-1].startswith("transformd: converted "), stderr
    assert _conversions(ours) == 0
    assert_converted(src, Path(stdout[-1]), "ocp", "exact")

    monkeypatch.setenv("TRANSFORMD_SOCKET", str(other.socket_path))
    code, stdout, stderr = _convert(capsys, src, "--cache-dir", tmp_path / "cache2")
    assert code == 0 and stderr[-1].startswith("transformd: converted "), stderr
    assert not any("the daemon" in line for line in stderr), stderr  # another cache: nothing to say
    assert _conversions(other) == 0 and Path(stdout[-1]).is_relative_to(tmp_path / "cache2")


def test_a_daemon_that_refuses_leaves_the_work_here_and_says_why(
    tmp_path: Path, daemons, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    src, root = _source(tmp_path / "src"), tmp_path / "cache"
    (tmp_path / "elsewhere").mkdir()
    daemon = daemons.start(cache_dir=root, allow_roots=[tmp_path / "elsewhere"])
    monkeypatch.setenv("TRANSFORMD_SOCKET", str(daemon.socket_path))
    code, stdout, stderr = _convert(capsys, src, "--cache-dir", root)
    assert code == 0 and stderr[-1].startswith("transformd: converted "), stderr
    said = [line for line in stderr if "converting in this process" in line]
    assert len(said) == 1 and "did not convert it: " in said[0] and "allowed" in said[0], stderr
    assert _conversions(daemon) == 0
    assert_converted(src, Path(stdout[-1]), "ocp", "exact")


def test_a_daemon_that_converted_other_files_under_the_path_is_not_believed(
    tmp_path: Path, daemons, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A daemon in another mount namespace reads other files at the same path: stood for here by a daemon asked
    for another checkpoint. Its entry is not this source's, so this process converts; its answer's path is not
    what gets printed."""
    shards = default_shards()
    set_tensor(f"{O}.weight", poke((0, 0), 0x11))(shards)
    src, decoy, root = _source(tmp_path / "src"), _source(tmp_path / "decoy", shards), tmp_path / "cache"
    daemon = daemons.start(cache_dir=root, allow_roots=[tmp_path])
    monkeypatch.setenv("TRANSFORMD_SOCKET", str(daemon.socket_path))
    asked = []
    resolve = TransformdClient.resolve

    def elsewhere(self, source, **kw):
        asked.append(source)
        return resolve(self, decoy, **kw)

    monkeypatch.setattr(TransformdClient, "resolve", elsewhere)
    code, stdout, stderr = _convert(capsys, src, "--cache-dir", root)
    assert code == 0 and asked == [str(src)] and _conversions(daemon) == 1
    said = [line for line in stderr if "converting in this process" in line]
    assert len(said) == 1 and "converted files that are not " in said[0], stderr
    assert stderr[-1].startswith("transformd: converted "), stderr
    entries = sorted(p.name for p in (root / "entries").iterdir())
    assert len(entries) == 2 and Path(stdout[-1]).parent.name in entries
    assert_converted(src, Path(stdout[-1]), "ocp", "exact")


def test_an_invalid_checkpoint_fails_once_in_the_daemon_with_its_tensor_named(
    tmp_path: Path, daemons, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    shards = default_shards()
    set_tensor(f"{O}.weight_scale", poke((1, 1), 0xFF))(shards)
    src, root = _source(tmp_path / "src", shards), tmp_path / "cache"
    daemon = daemons.start(cache_dir=root, allow_roots=[tmp_path])
    monkeypatch.setenv("TRANSFORMD_SOCKET", str(daemon.socket_path))
    code, stdout, stderr = _convert(capsys, src, "--cache-dir", root)
    assert code == 2 and stdout == [], stderr
    assert not any("converting in this process" in line for line in stderr), stderr
    assert SHARD_B in stderr[-1] and f"{O}.weight" in stderr[-1] and "E8M0 scale byte 0xFF" in stderr[-1], stderr
    assert not any((root / "entries").iterdir())
