"""``transformd convert --cache-dir C`` hands the conversion to a daemon that serves C (transformd/cli/delegate.py),
trusting it for nothing but the work: the entry is looked up by this process's own key of the source."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from transformd import cli
from transformd.client import CheckpointStatus, TransformdClient

from .support.checkpoints import O, SHARD_B, assert_converted, default_shards, poke, set_tensor, write_checkpoint
from .support.daemon import metric_value

pytestmark = pytest.mark.timeout(180)

#: What a test's ``convert`` process had imported when it ended (an atexit handler prints it last).
_PROBE = ("import atexit, sys, runpy\nsys.argv = ['transformd', *sys.argv[1:]]\natexit.register(lambda: print("
          "sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'triton', 'numpy', 'safetensors', 'httpx'}), "
          "file=sys.stderr))\nrunpy.run_module('transformd', run_name='__main__')")


def _source(path: Path, shards=None) -> Path:
    """A checkpoint whose files are older than the stat cache's racy window (so what one process hashed, another
    finds by the files' stat signatures)."""
    src = write_checkpoint(path, shards)
    for f in src.rglob("*"):
        st = f.stat()
        os.utime(f, (st.st_atime - 60, st.st_mtime - 60))
    return src


def _conversions(daemon) -> float:
    with daemon.client() as http:
        return metric_value(http.get("/metrics").text, "transformd_conversions_total", {"outcome": "converted"})


def _requests(daemon) -> float:
    """Requests the daemon answered, but those for /metrics (this count's own)."""
    from prometheus_client.parser import text_string_to_metric_families

    with daemon.client() as http:
        text = http.get("/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "transformd_http_requests_total" and s.labels.get("route") != "/metrics")


def _convert(capsys, *argv: str | Path) -> tuple[int, list[str], list[str]]:
    code = cli.main(["convert", *(str(a) for a in argv), "--target", "ocp", "--device", "cpu"])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()


def _here(stderr: list[str]) -> list[str]:
    """The lines saying why this process converts, not the daemon."""
    return [line for line in stderr if line.endswith("; converting in this process")]


def test_the_daemon_serving_the_cache_converts_and_the_process_never_imports_torch(tmp_path: Path, daemons) -> None:
    """The cache named through a symbolic link is still the daemon's; a warm hit asks the daemon nothing; without
    a daemon's socket nothing of the client is even imported."""
    src, root = _source(tmp_path / "src"), tmp_path / "cache"
    daemon = daemons.start(cache_dir=root, allow_roots=[tmp_path])
    (tmp_path / "link").symlink_to(root)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "TRANSFORMD_SOCKET": str(daemon.socket_path)}
    runs = []
    for cache_dir, sock in ((tmp_path / "link", daemon.socket_path), (tmp_path / "link", daemon.socket_path),
                            (tmp_path / "own", tmp_path / "no.sock")):
        cmd = [sys.executable, "-c", _PROBE, "convert", str(src), "--cache-dir", str(cache_dir), "--target", "ocp"]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**env, "TRANSFORMD_SOCKET": str(sock)},
                              timeout=120)
        assert done.returncode == 0, done.stderr
        runs.append(done)
        if len(runs) == 1:
            asked = _requests(daemon)
    first, again, alone = runs
    out = Path(first.stdout.splitlines()[-1])
    assert out.resolve().parent.parent == root.resolve() / "entries" and out.name == "checkpoint", first.stdout
    assert "transformd: the daemon converted " in first.stderr and not _here(first.stderr.splitlines())
    assert first.stderr.splitlines()[-1] == "['httpx']", first.stderr  # no torch, triton, numpy nor safetensors
    assert _conversions(daemon) == 1
    assert again.stdout == first.stdout and "found in the cache" in again.stderr
    assert again.stderr.splitlines()[-1] == "[]" and _requests(daemon) == asked, again.stderr  # nothing asked
    assert "transformd: converted " in alone.stderr and "httpx" not in alone.stderr.splitlines()[-1], alone.stderr
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


def test_an_invalid_checkpoint_fails_here_as_it_failed_in_the_daemon(
    tmp_path: Path, daemons, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The daemon may have read other files at that path: its verdict is a line; this process's is final."""
    shards = default_shards()
    set_tensor(f"{O}.weight_scale", poke((1, 1), 0xFF))(shards)
    src, root = _source(tmp_path / "src", shards), tmp_path / "cache"
    daemon = daemons.start(cache_dir=root, allow_roots=[tmp_path])
    monkeypatch.setenv("TRANSFORMD_SOCKET", str(daemon.socket_path))
    code, stdout, stderr = _convert(capsys, src, "--cache-dir", root)
    assert code == 2 and stdout == [], stderr
    said = _here(stderr)
    assert len(said) == 1 and "did not convert it: " in said[0] and "(HTTP 422" in said[0], stderr
    assert SHARD_B in stderr[-1] and f"{O}.weight" in stderr[-1] and "E8M0 scale byte 0xFF" in stderr[-1], stderr
    assert stderr[-1].startswith("transformd: error: ") and "HTTP" not in stderr[-1], stderr  # this process's own
    assert not any((root / "entries").iterdir())


def test_a_daemon_that_sees_an_empty_directory_there_does_not_fail_the_conversion(
    tmp_path: Path, daemons, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Another mount namespace where SRC's path names an empty directory: the daemon refuses it (422); here it
    converts."""
    src, root, empty = _source(tmp_path / "src"), tmp_path / "cache", tmp_path / "empty"
    empty.mkdir()
    daemon = daemons.start(cache_dir=root, allow_roots=[tmp_path])
    monkeypatch.setenv("TRANSFORMD_SOCKET", str(daemon.socket_path))
    resolve = TransformdClient.resolve
    monkeypatch.setattr(TransformdClient, "resolve", lambda self, source, **kw: resolve(self, empty, **kw))
    code, stdout, stderr = _convert(capsys, src, "--cache-dir", root)
    assert code == 0 and stderr[-1].startswith("transformd: converted "), stderr
    said = _here(stderr)
    assert len(said) == 1 and "did not convert it: " in said[0] and "(HTTP 422" in said[0], stderr
    assert_converted(src, Path(stdout[-1]), "ocp", "exact")


@pytest.mark.parametrize("answer", ["degraded", "version", "malformed"])
def test_a_degraded_other_version_or_garbled_daemon_leaves_the_work_here(
    tmp_path: Path, daemons, monkeypatch: pytest.MonkeyPatch, capsys, answer: str
) -> None:
    """One line each (the daemon's words on one line, control characters replaced); then this process converts."""
    src, root = _source(tmp_path / "src"), tmp_path / "cache"
    daemon = daemons.start(cache_dir=root, allow_roots=[tmp_path])
    monkeypatch.setenv("TRANSFORMD_SOCKET", str(daemon.socket_path))
    health = TransformdClient.health
    changed = {"degraded": {"status": "degraded", "problems": ["disk\x1b[2J full\nread-only"]},
               "version": {"version": "0.0.1"}, "malformed": {}}[answer]
    monkeypatch.setattr(TransformdClient, "health", lambda self, **kw: {**health(self, **kw), **changed})
    if answer == "malformed":  # an answer that is not an object where one is due
        monkeypatch.setattr(TransformdClient, "submit", lambda self, *a, **kw: CheckpointStatus.from_json(["ready"]))
    code, stdout, stderr = _convert(capsys, src, "--cache-dir", root)
    assert code == 0 and stderr[-1].startswith("transformd: converted "), stderr
    said = _here(stderr)
    expected = {"degraded": "is degraded (disk\\x1b[2J full read-only)", "version": "is transformd 0.0.1, this is ",
                "malformed": "did not convert it: "}[answer]
    assert len(said) == 1 and expected in said[0], stderr
    assert _conversions(daemon) == 0
    assert_converted(src, Path(stdout[-1]), "ocp", "exact")


def test_a_daemon_that_had_the_content_already_is_a_hit(
    tmp_path: Path, daemons, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """This process leaves a large new source unread (its conversion would hash it): stood for by a threshold of 0
    bytes here. The daemon converted the same content at another path before; asked for this one, it has it."""
    from transformd import cache as cache_module

    src, copy, root = _source(tmp_path / "src"), _source(tmp_path / "copy"), tmp_path / "cache"
    daemon = daemons.start(cache_dir=root, allow_roots=[tmp_path])
    monkeypatch.setenv("TRANSFORMD_SOCKET", str(daemon.socket_path))
    code, stdout, stderr = _convert(capsys, copy, "--cache-dir", root)
    assert code == 0 and "transformd: the daemon converted " in stderr[-1], stderr
    monkeypatch.setattr(cache_module, "Cache", type("Cache", (cache_module.Cache,), {"hash_alongside_min_bytes": 0}))
    asked = _requests(daemon)
    code, again, stderr = _convert(capsys, src, "--cache-dir", root)
    assert code == 0 and again == stdout and _conversions(daemon) == 1 and _requests(daemon) > asked
    assert stderr[-1].startswith("transformd: found in the cache "), stderr


def test_the_engine_is_checked_here_before_the_daemon_is_asked(
    tmp_path: Path, daemons, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """``--engine`` refuses before anything is asked (SGLang cannot load this checkpoint's partial tiles; vLLM may, its
    Triton MoE refining the block of the 64-row experts); an engine
    that loads it (raw) gets the daemon's conversion, and the line on the target chosen for it."""
    src, root = _source(tmp_path / "src"), tmp_path / "cache"
    daemon = daemons.start(cache_dir=root, allow_roots=[tmp_path])
    monkeypatch.setenv("TRANSFORMD_SOCKET", str(daemon.socket_path))
    asked = _requests(daemon)
    code, stdout, stderr = _convert(capsys, src, "--cache-dir", root, "--engine", "sglang")
    assert code == 2 and stdout == [] and "sglang could not load" in stderr[-1], stderr
    assert _requests(daemon) == asked and _conversions(daemon) == 0
    code, stdout, stderr = _convert(capsys, src, "--cache-dir", root, "--engine", "raw")
    assert code == 0 and "transformd: the daemon converted " in stderr[-1] and _conversions(daemon) == 1, stderr
    assert "transformd: target ocp: target ocp asked for" in stderr, stderr
    assert_converted(src, Path(stdout[-1]), "ocp", "exact")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the cache another owner")
def test_another_user_converts_into_the_daemons_cache_through_the_daemon(tmp_path: Path, daemons, capsys,
                                                                         monkeypatch) -> None:
    """The cache's directories are not listable by other users (0711, 0700: test_cache_store.py checks them as
    uid 65534), so `convert --cache-dir` of a user who is not the daemon's reads nothing of it but an entry by
    key: the daemon keys and converts, the process prints its entry; with no daemon to ask, one line says so (it
    was a PermissionError on the cache). Here the CLI (the test's thread) sees the cache as such a user does; the
    daemon (its own threads) as its owner."""
    import threading

    src, root = _source(tmp_path / "models" / "src"), tmp_path / "cache"
    daemon = daemons.start(cache_dir=root, allow_roots=[tmp_path / "models"])
    os.chown(root / "staging", 4242, -1)  # (whose the cache is: its staging directory's owner)
    main, listdir, access = threading.main_thread(), os.listdir, os.access

    def theirs(path) -> bool:  # a directory of the cache but an entry's own, from the test's thread
        p = Path(os.fspath(path)).resolve()
        return threading.current_thread() is main and (p == root or p.parent == root)

    def listed(path="."):
        if theirs(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return listdir(path)

    monkeypatch.setattr(os, "listdir", listed)
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: not theirs(path) and access(path, mode, **kw))
    monkeypatch.setenv("TRANSFORMD_SOCKET", str(daemon.socket_path))
    code, out, err = _convert(capsys, src, "--cache-dir", root)
    assert code == 0 and any(line.startswith("transformd: the daemon converted ") for line in err), err
    assert Path(out[-1]).parent.parent == root / "entries" and not _here(err), (out, err)
    assert _convert(capsys, src, "--cache-dir", root)[:2] == (0, out)
    outside = _source(tmp_path / "elsewhere")  # the daemon refuses it: one line, not "converting in this process"
    code, _, err = _convert(capsys, outside, "--cache-dir", root)
    assert code == 1 and len(err) == 1 and "outside the allowed roots" in err[0], err
    assert err[0].endswith("; this user may not write the cache to convert it itself"), err
    monkeypatch.setenv("TRANSFORMD_SOCKET", str(tmp_path / "none.sock"))
    for flags, asked in (((), "no daemon serving it answers here"), (("--no-daemon",), "--no-daemon was given")):
        code, _, err = _convert(capsys, src, "--cache-dir", root, *flags)
        assert code == 1 and err == [f"transformd: error: cannot convert into {root}: only its owner (uid 4242, its "
                                     f"daemon) writes that cache, and {asked}; give a --cache-dir of your own "
                                     "otherwise"], err
    assert _conversions(daemon) == 1
    assert_converted(src, Path(out[-1]), "ocp", "exact")
