"""What a newcomer meets on the command line (issue 45): a typo is "no such directory" before any advice about the
daemon's roots or downloads, a refusal says its real reason the first time, flags and usage as one would guess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from transformd import cli


def _run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, list[str], list[str]]:
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()


def test_a_typo_is_no_such_directory_before_any_advice(tmp_path: Path, daemons, capsys, monkeypatch) -> None:
    """``resolve /models/modls/X`` was told to restart the daemon with --allow-root, ``resolve modls/X`` to start it
    with --allow-hub-cache, ``convert modls/X`` to run ``hf download``: the caller's own view comes first. A name
    that is there (a directory outside the roots, a repo in the hub cache) keeps the daemon's answer as it was."""
    models = tmp_path / "models"
    models.mkdir()
    daemon = daemons.start(cache_dir=tmp_path / "cache", allow_roots=[models])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    sock = ["--socket", str(daemon.socket_path)]

    code, out, err = _run(capsys, "resolve", *sock, tmp_path / "modls" / "X")
    assert code == 2 and out == [] and len(err) == 1, err
    assert err[0].startswith(f"transformd: error: no such directory: {tmp_path / 'modls' / 'X'} "), err
    assert err[0].index("no such directory") < err[0].index("--allow-root"), "the advice comes after, if at all"

    code, out, err = _run(capsys, "resolve", *sock, "modls/X")  # relative: read as a repo id
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"transformd: error: modls/X is neither a directory here (no {tmp_path / 'modls/X'}) "
                             f"nor a repo in the Hugging Face hub cache {tmp_path / 'hub'}: check the name"), err
    assert err[0].index("check the name") < err[0].index("--allow-hub-cache")

    code, out, err = _run(capsys, "convert", "modls/X", "--out", tmp_path / "o", "--device", "cpu")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"transformd: error: no such directory: {tmp_path / 'modls/X'}; as a repo id, "), err
    assert err[0].index("no such directory") < err[0].index("hf download")

    (tmp_path / "elsewhere").mkdir()  # there, but outside the roots: the daemon's own answer
    code, _, err = _run(capsys, "resolve", *sock, tmp_path / "elsewhere")
    assert code == 2 and "outside the allowed roots" in err[0] and "no such directory" not in err[0], err
    (tmp_path / "hub" / "models--org--M").mkdir(parents=True)  # a repo here: the daemon's answer is the news
    code, _, err = _run(capsys, "resolve", *sock, "org/M")
    assert code == 2 and err[0].startswith("transformd: error: repo id org/M is refused: "), err
    assert not (tmp_path / "o").exists() and not any((tmp_path / "cache" / "entries").iterdir())


def test_serve_without_a_usable_allowed_root_refuses_to_start(tmp_path: Path) -> None:
    """A daemon with no --allow-root (or only roots that are not there) started, ``health`` said ok, and compose's
    service_healthy and the Kubernetes probes passed: the failure showed only at an engine's first resolve. Now it
    says so in one line and does not start (exit 2, no socket)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMD_")}
    base = [sys.executable, "-m", "transformd", "serve", "--socket", str(tmp_path / "td.sock"), "--cache-dir",
            str(tmp_path / "cache"), "--device", "cpu"]
    (tmp_path / "file").write_text("x")
    for extra, said in (([], "no allowed root: this daemon would refuse every source; name the directories that "
                             "hold the checkpoints with --allow-root DIR"),
                        (["--allow-root", str(tmp_path / "nope"), "--allow-root", str(tmp_path / "file")],
                         f"no allowed root can be used, so this daemon would refuse every source: {tmp_path / 'nope'} "
                         f"does not exist; {tmp_path / 'file'} is not a directory")):
        r = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
        assert r.stderr.startswith(f"transformd: error: {said}"), r.stderr
        assert not (tmp_path / "td.sock").exists()


def test_out_onto_other_files_says_the_real_reason_the_first_time(tmp_path: Path, capsys) -> None:
    """``--out`` onto a directory of other files was refused twice: "pass --overwrite", then, with it, "holds files
    that are not a transformd output". The first refusal says the second's reason; an earlier conversion's output
    still asks for --overwrite, which then replaces it."""
    from transformd.sample import write_sample_checkpoint

    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, stdout, stderr = _run(capsys, "convert", src, "--out", out, "--device", "cpu")
    assert code == 2 and stdout == [] and len(stderr) == 1, stderr
    assert "not a transformd output" in stderr[0] and "choose another --out" in stderr[0], stderr
    assert "pass --overwrite" not in stderr[0]
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (out / "notes.txt").unlink()
    assert _run(capsys, "convert", src, "--out", out, "--device", "cpu")[0] == 0
    code, _, stderr = _run(capsys, "convert", src, "--out", out, "--device", "cpu")
    assert code == 2 and "holds an earlier conversion's output; pass --overwrite" in stderr[0], stderr
    assert _run(capsys, "convert", src, "--out", out, "--device", "cpu", "--overwrite")[0] == 0


def test_flags_and_usage_as_a_newcomer_guesses_them(capsys) -> None:
    """``--allow-roots`` (the environment variable is plural) is taken as ``--allow-root``; an unknown flag prints the
    usage of the command it was given to (it printed the top-level usage, which names none of its flags)."""
    args = cli.build_parser().parse_args(["serve", "--allow-roots", "/a", "--allow-root", "/b"])
    assert args.allow_root == [Path("/a"), Path("/b")]
    for argv, usage, unknown in ((["resolve", "--foo", "/models/X"], "transformd resolve", "--foo"),
                                 (["cache", "ls", "--bar"], "transformd cache ls", "--bar"),
                                 (["serve", "--allow-rot", "/a"], "transformd serve", "--allow-rot /a")):
        code, out, err = _run(capsys, *argv)
        assert code == 2 and out == [], err
        assert err[0].startswith(f"usage: {usage} "), err
        assert err[-1] == f"{usage}: error: unrecognized arguments: {unknown}", err


def test_a_cold_resolve_says_why_this_target_as_a_warm_one_does(tmp_path: Path, daemons, capsys) -> None:
    """The warm ``resolve`` printed "target ...: reason"; the cold one, which polls for the entry, did not."""
    from transformd.sample import write_sample_checkpoint

    models = tmp_path / "models"
    src = write_sample_checkpoint(models / "S", layers=1, experts=2)
    daemon = daemons.start(cache_dir=tmp_path / "cache", allow_roots=[models])
    said = []
    for _ in ("cold", "warm"):
        code, out, err = _run(capsys, "resolve", "--socket", daemon.socket_path, src, "--engine", "vllm")
        assert code == 0 and len(out) == 1, err
        said.append([line for line in err if line.startswith("transformd: target ")])
    assert said[0] == said[1] and len(said[0]) == 1 and said[0][0].startswith("transformd: target ocp: vllm"), said


def test_a_refused_request_is_one_line_of_the_daemons_log(tmp_path: Path, daemons, caplog) -> None:
    """Only "converted" lines appeared at the default level (info): an operator could not see why an engine failed.
    Each refused or failed request is one line: status, code, caller uid, source as given."""
    import logging
    import os

    models = tmp_path / "models"
    models.mkdir()
    daemon = daemons.start(cache_dir=tmp_path / "cache", allow_roots=[models])
    caplog.set_level(logging.INFO, logger="transformd.daemon")
    with daemon.client() as http:
        assert http.post("/v1/checkpoints", json={"source": str(tmp_path / "elsewhere")}).status_code == 403
        assert http.post("/v1/checkpoints", json={"source": str(models / "nope")}).status_code == 404
        assert http.post("/v1/checkpoints", json={"source": str(models), "target": "x"}).status_code == 400
        assert http.get("/v1/checkpoints/" + "0" * 32).status_code == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "transformd.daemon" and r.levelno == logging.INFO
             and r.getMessage().startswith("refused ")]
    uid = os.geteuid()
    assert lines[0].startswith(f"refused POST /v1/checkpoints: 403 source_not_allowed, uid {uid}, source "
                               f"{str(tmp_path / 'elsewhere')!r}: source "), lines
    assert lines[1].startswith(f"refused POST /v1/checkpoints: 404 source_not_found, uid {uid}, source "
                               f"{str(models / 'nope')!r}: "), lines
    assert lines[2].startswith(f"refused POST /v1/checkpoints: 400 bad_request, uid {uid}, source {str(models)!r}: "), \
        lines
    assert lines[3].startswith(f"refused GET /v1/checkpoints/{'0' * 32}: 404 "), lines
    assert len(lines) == 4, lines


def test_cache_ls_lists_the_cache_of_the_daemon_resolve_asks(tmp_path: Path, daemons, capsys, monkeypatch) -> None:
    """Right after a resolve, ``cache ls`` said "no entries": it read ~/.cache/transformd, not the daemon's cache.
    With no cache named and a daemon answering, it lists the daemon's (what this user may see) and says so; with no
    daemon, the default cache, saying that no daemon answered."""
    from transformd.cache import Cache
    from transformd.sample import write_sample_checkpoint

    models = tmp_path / "models"
    src = write_sample_checkpoint(models / "S", layers=1, experts=2)
    daemon = daemons.start(cache_dir=tmp_path / "daemon-cache", allow_roots=[models])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    Cache(tmp_path / "xdg" / "transformd")  # the caller's own default cache, empty
    monkeypatch.setenv("TRANSFORMD_SOCKET", str(daemon.socket_path))
    code, out, _ = _run(capsys, "resolve", src)
    assert code == 0
    key = Path(out[-1]).parent.name.partition("-")[0]  # (entries/<key>-<tag>: cache.names)
    code, out, err = _run(capsys, "cache", "ls")
    assert code == 0, err
    assert out[0] == (f"cache {tmp_path / 'daemon-cache'} (of the daemon at unix socket {daemon.socket_path}, the "
                      "entries this user may see; --cache-dir DIR lists another)"), out
    assert out[2].split()[0] == key and out[2].rstrip().endswith(str(src)) and "ocp/exact" in out[2], out
    assert out[3].startswith("1 entries, "), out
    code, out, _ = _run(capsys, "cache", "ls", "--json")
    assert [e["key"] for e in json.loads("\n".join(out))["entries"]] == [key]
    code, out, _ = _run(capsys, "cache", "ls", "--cache-dir", tmp_path / "xdg" / "transformd")
    assert out[:2] == [f"cache {tmp_path / 'xdg' / 'transformd'}", "no entries"], out
    monkeypatch.setenv("TRANSFORMD_SOCKET", str(tmp_path / "no.sock"))
    code, out, _ = _run(capsys, "cache", "ls")
    assert out[:2] == [f"cache {tmp_path / 'xdg' / 'transformd'} (no daemon answers here)", "no entries"], out


def test_the_bar_shows_each_phase_from_the_start(tmp_path: Path, capsys, monkeypatch) -> None:
    """A CPU ``convert --cache-dir`` on a terminal showed nothing for seconds (hashing, torch's import, the head
    start), then a bar already at 100%. The bar is drawn from the start at 0%, labelled by its phase (hashing,
    converting, publishing), and redrawn while nothing moves it."""
    import io
    import time

    from transformd import progress
    from transformd.progress import ConvertProgress, Progress
    from transformd.sample import write_sample_checkpoint

    stream = io.StringIO()
    bar = ConvertProgress(stream, tty=True)
    bar.phase("hashing", 1000)
    assert "hashing:   0%" in stream.getvalue(), stream.getvalue()
    drawn = len(stream.getvalue())
    time.sleep(3 * progress.TICK_S)
    assert len(stream.getvalue()) > drawn, "redrawn while no update came (its elapsed time goes on)"
    bar.update(Progress(phase="publishing", bytes_done=1000, bytes_total=1000, tensors_done=1, tensors_total=1))
    assert "publishing: 100%" in stream.getvalue()
    bar.close()

    monkeypatch.setattr(progress, "draws_a_bar", lambda stream: True)
    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2)
    code, out, err = _run(capsys, "convert", src, "--cache-dir", tmp_path / "cache", "--no-daemon", "--device", "cpu")
    assert code == 0, err
    text = "\n".join(err).replace("\r", "\n")
    first = {phase: text.find(f"{phase}:") for phase in ("hashing", "converting", "publishing")}
    assert 0 <= first["hashing"] < first["converting"] < first["publishing"], text
    assert text[first["converting"]:].startswith("converting:   0%"), text


@pytest.mark.skipif(__import__("os").geteuid() != 0 or __import__("shutil").which("setpriv") is None,
                    reason="needs root and setpriv (runs the daemon as another uid)")
def test_a_cache_the_daemon_may_not_write_names_the_uid_and_the_fix() -> None:
    """A Kubernetes hostPath ``DirectoryOrCreate`` makes a root-owned 0755 directory; the daemon (another uid) exited
    with "Permission denied: .../entries", naming neither the uid nor the fix."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from tests.support.callers import NOBODY

    run = Path(tempfile.mkdtemp(prefix="td-cache-"))
    try:
        os.chmod(run, 0o755)
        (run / "cache").mkdir(mode=0o755)  # root's, as DirectoryOrCreate makes it
        (run / "models").mkdir(mode=0o755)
        argv = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", sys.executable, "-m",
                "transformd", "serve", "--socket", str(run / "td.sock"), "--cache-dir", str(run / "cache"),
                "--allow-root", str(run / "models"), "--device", "cpu"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMD_")}
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=run)
        assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
        assert r.stderr.startswith(f"transformd: error: the daemon (uid {NOBODY}, gid {NOBODY}) may not write its "
                                   f"cache directory {run / 'cache'} "), r.stderr
        assert f"`install -d -o {NOBODY} -g {NOBODY} {run / 'cache'}`" in r.stderr, r.stderr
        assert os.listdir(run / "cache") == [] and not (run / "td.sock").exists()
    finally:
        shutil.rmtree(run, ignore_errors=True)


def test_the_readme_progress_callback_prints_one_line_per_answer(capsys) -> None:
    """The README's Python snippet passed ``progress=print``, which dumped whole status objects; its callback prints
    one short line per answer, for an answer with progress and one without."""
    import re
    import textwrap

    from transformd.answers import CheckpointStatus

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "progress=show" in b)
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("def show("))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = next(i for i in range(start + 1, len(lines)) if len(lines[i]) - len(lines[i].lstrip()) <= indent)
    namespace: dict = {}
    exec(textwrap.dedent("\n".join(lines[start:end])), namespace)  # the README's own function, as written
    key = "ab" * 16
    namespace["show"](CheckpointStatus.from_json({"key": key, "state": "converting",
                                                  "progress": {"bytes_done": 1, "bytes_total": 4}}))
    namespace["show"](CheckpointStatus.from_json({"key": key, "state": "queued"}))
    assert capsys.readouterr().out.splitlines() == [f"{key[:12]} converting 25%", f"{key[:12]} queued "]
