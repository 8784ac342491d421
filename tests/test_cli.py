"""The ``transformd`` command line: exit codes, the last line of standard output, one-line errors."""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from transformd import cli
from transformd.errors import CheckpointError
from transformd.sample import write_sample_checkpoint

from .support.checkpoints import (
    O,
    SHARD_B,
    assert_converted,
    default_shards,
    mx_pair,
    poke,
    set_tensor,
    write_checkpoint,
)


def _run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, list[str], list[str]]:
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()


def test_convert_prints_out_dir_last(tmp_path: Path, capsys) -> None:
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    code, stdout, stderr = _run(capsys, "convert", src, "--out", out, "--target", "ocp", "--scale-mode", "amax",
                                "--device", "cpu")
    assert code == 0
    assert stdout[-1] == str(out)
    # no bar when standard error is not a terminal, no line within the first 5 s: the warnings that engines could
    # not load the partial tiles of this checkpoint, then the summary
    *warnings, summary = stderr
    assert warnings and all(line.startswith("transformd: warning: ") for line in warnings), stderr
    assert summary.startswith("transformd: converted "), stderr
    for part in (" KiB (22 tensors, ", " MXFP8 weights converted) in ", " s, ",
                 "/s; target ocp, scale mode amax, on cpu; ", f"into {out}"):
        assert part in summary, (part, summary)
    assert_converted(src, out, "ocp", "amax")


def test_convert_prints_progress_lines_in_logs(tmp_path: Path, capsys) -> None:
    """Standard error not a terminal: a line every --progress-every seconds (5 by default), each with bytes,
    percentage, tensors, rate and the time left, then the summary; into the cache too."""
    src = write_checkpoint(tmp_path / "src")
    code, stdout, stderr = _run(capsys, "convert", src, "--out", tmp_path / "out", "--device", "cpu",
                                "--progress-every", "0")
    assert code == 0 and stdout[-1] == str(tmp_path / "out")
    lines = [line for line in stderr[:-1] if not line.startswith("transformd: warning: ")]  # partial tiles
    last = stderr[-1]
    assert lines and all(line.startswith("transformd: converting ") for line in lines), stderr
    assert "/22 tensors" in lines[-1] and "%)" in lines[-1] and ("left" in lines[-1]), lines
    assert last.startswith("transformd: converted ") and f"into {tmp_path / 'out'}" in last
    root = tmp_path / "cache"
    code, stdout, stderr = _run(capsys, "convert", src, "--cache-dir", root, "--device", "cpu", "--progress-every", "0")
    assert code == 0 and stderr[-1].startswith("transformd: converted ") and "(identify " in stderr[-1], stderr
    assert f"cache entry {stdout[-1]}" in stderr[-1] and "target ocp, scale mode exact, on cpu" in stderr[-1]
    assert any(line.startswith("transformd: converting ") for line in stderr[:-1]), stderr
    code, again, stderr = _run(capsys, "convert", src, "--cache-dir", root, "--device", "cpu")
    assert again == stdout and stderr[-1:] == [
        f"transformd: found in the cache (converted earlier, nothing converted now): target ocp, scale mode exact; "
        f"cache entry {stdout[-1]}"
    ]


def test_progress_bar_only_on_a_terminal(tmp_path: Path, capsys, monkeypatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    src = write_checkpoint(tmp_path / "src")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    code = cli.main(["convert", str(src), "--out", str(tmp_path / "out"), "--device", "cpu"])
    assert code == 0 and capsys.readouterr().out.splitlines()[-1] == str(tmp_path / "out")
    bar = terminal.getvalue()
    assert "converting" in bar and "22/22 tensors" in bar and "left" in bar
    assert bar.rstrip().splitlines()[-1].startswith("transformd: converted ")


def test_convert_select_leaving_mxfp8_exit_2(tmp_path: Path, capsys) -> None:
    src = write_checkpoint(tmp_path / "src")
    code, stdout, stderr = _run(capsys, "convert", src, "--out", tmp_path / "out", "--select", r"down_proj",
                                "--device", "cpu")
    assert code == 2 and stdout == [] and not (tmp_path / "out").exists()
    assert len(stderr) == 1 and "leaves 5 of the 8 MXFP8 weights unconverted" in stderr[0]


def test_convert_non_empty_out_exit_2(tmp_path: Path, capsys) -> None:
    src = write_checkpoint(tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    code, stdout, stderr = _run(capsys, "convert", src, "--out", tmp_path / "out", "--device", "cpu")
    assert code == 2 and stdout == []
    assert len(stderr) == 1 and stderr[0].startswith("transformd: error: ") and "not empty" in stderr[0]
    code, stdout, stderr = _run(capsys, "convert", src, "--out", tmp_path / "out", "--device", "cpu", "--overwrite")
    assert code == 2 and stdout == [] and "not a transformd output" in stderr[0] and (tmp_path / "out" / "x").exists()
    (tmp_path / "out" / "x").unlink()
    for _ in range(2):  # the second replaces the first's output
        code, stdout, _ = _run(capsys, "convert", src, "--out", tmp_path / "out", "--device", "cpu", "--overwrite")
        assert code == 0 and stdout[-1] == str(tmp_path / "out")


def test_a_second_convert_into_one_out_is_refused_before_it_converts(tmp_path: Path, capsys) -> None:
    """Two `convert --out DIR` at once: the second converted everything, then failed at its rename (a newcomer
    review). It is refused while another process writes DIR, and runs once that one is gone."""
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    first = subprocess.Popen(  # another conversion's staging directory, held as a running one holds it
        [sys.executable, "-c", "import sys; from pathlib import Path; from transformd import _durable; "
         "print(_durable.make_staging(Path(sys.argv[1]))[0].name, flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = first.stdout.readline().strip()
        code, stdout, stderr = _run(capsys, "convert", src, "--out", out, "--device", "cpu")
        assert code == 2 and stdout == [] and len(stderr) == 1
        assert "another conversion into this directory is running" in stderr[0] and theirs in stderr[0]
        assert sorted(os.listdir(tmp_path)) == sorted(["src", theirs]), "ours removed, theirs left alone"
    finally:
        first.communicate("")
    code, stdout, _ = _run(capsys, "convert", src, "--out", out, "--device", "cpu")
    assert code == 0 and stdout[-1] == str(out) and sorted(os.listdir(tmp_path)) == ["out", "src"]
    # what a killed conversion left, named with a pid that runs again (ours: a container's pid 1 restarted; pid 1),
    # unlocked for a minute: no conversion writes it, so it refuses nothing
    left = [tmp_path / f".again.transformd-staging-{pid}.0123456789ab" for pid in (os.getpid(), 1)]
    for path in left:
        path.mkdir()
        os.utime(path, (time.time() - 60, time.time() - 60))
    code, stdout, stderr = _run(capsys, "convert", src, "--out", tmp_path / "again", "--device", "cpu")
    assert code == 0 and stdout[-1] == str(tmp_path / "again"), stderr


def test_convert_invalid_values_exit_2_nothing_written(tmp_path: Path, capsys) -> None:
    shards = default_shards()
    set_tensor(f"{O}.weight_scale", poke((1, 1), 0xFF))(shards)
    src = write_checkpoint(tmp_path / "src", shards)
    code, stdout, stderr = _run(capsys, "convert", src, "--out", tmp_path / "out", "--device", "cpu")
    assert code == 2 and stdout == [] and len(stderr) == 1
    assert SHARD_B in stderr[0] and f"{O}.weight" in stderr[0] and "E8M0 scale byte 0xFF" in stderr[0]
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_hostile_tensor_name_cannot_drive_the_terminal(tmp_path: Path, capsys) -> None:
    """A checkpoint's names are untrusted: control characters in the error line are escaped, not emitted."""
    name = "model.layers.0.mlp.experts.9\x1b[2J\x1b]0;owned\x07.down_proj"
    shards = default_shards()
    shards[SHARD_B].update(mx_pair(name, (64, 96), seed=3))
    set_tensor(f"{name}.weight_scale", poke((0, 0), 0xFF))(shards)
    src = write_checkpoint(tmp_path / "src", shards)
    code, stdout, stderr = _run(capsys, "convert", src, "--out", tmp_path / "out", "--device", "cpu")
    assert code == 2 and stdout == [] and len(stderr) == 1
    assert "\x1b" not in stderr[0] and "\x07" not in stderr[0]
    assert "experts.9\\x1b[2J\\x1b]0;owned\\x07.down_proj.weight" in stderr[0] and "0xFF" in stderr[0], stderr


@pytest.mark.parametrize(
    "argv",
    [["convert", "src"], ["convert", "src", "--out", "o", "--target", "e5m2"], ["bogus"], [],
     ["sample", "d", "--layers", "0"]],
)
def test_usage_errors_exit_2(capsys, argv: list[str]) -> None:
    code, stdout, stderr = _run(capsys, *argv)
    assert code == 2 and stdout == [] and stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_gpu_exit_1(tmp_path: Path, capsys) -> None:
    src = write_checkpoint(tmp_path / "src")
    code, stdout, stderr = _run(capsys, "convert", src, "--out", tmp_path / "out", "--device", "cuda")
    assert code == 1 and stdout == [] and len(stderr) == 1 and "no GPU" in stderr[0]
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_sample_then_convert_with_report_and_inspect(tmp_path: Path, capsys) -> None:
    code, stdout, _ = _run(capsys, "sample", tmp_path / "s", "--layers", "1", "--experts", "2", "--seed", "3")
    assert code == 0 and stdout[-1] == str(tmp_path / "s")
    assert (tmp_path / "s" / "config.json").is_file() and (tmp_path / "s" / "model.safetensors.index.json").is_file()

    code, stdout, _ = _run(capsys, "convert", tmp_path / "s", "--out", tmp_path / "o", "--device", "cpu", "--report")
    assert code == 0 and stdout[-1] == str(tmp_path / "o")
    table = "\n".join(stdout[:-1])
    assert "rel L2" in table and "model.layers.0.self_attn.q_proj.weight" in table and "overall" in table

    code, stdout, _ = _run(capsys, "inspect", tmp_path / "s", tmp_path / "o")
    assert code == 0 and stdout[-1] == str(tmp_path / "o") and "\n".join(stdout[:-1]) == table


def test_sample_options_reach_the_checkpoint(tmp_path: Path, capsys) -> None:
    code, stdout, _ = _run(capsys, "sample", tmp_path / "s", "--layers", "1", "--experts", "2", "--shards", "1",
                           "--scale-suffix", "weight_scale_inv", "--fused-experts")
    assert code == 0 and stdout[-1] == str(tmp_path / "s")
    tensors = load_file(str(tmp_path / "s" / "model.safetensors"))
    fused = tensors["model.layers.0.mlp.experts.down_proj"]  # HF-v5 fused naming
    assert fused.dim() == 3 and fused.shape[0] == 2
    assert "model.layers.0.mlp.experts.down_proj_scale_inv" in tensors


def test_one_parser_holds_every_command_of_every_module() -> None:
    """transformd.cli builds one parser from its command modules; each command's handler is its module's."""
    parser = cli.build_parser()
    where = {"convert": cli.convert, "sample": cli.convert, "inspect": cli.convert, "demo": cli.convert,
             "serve": cli.serve, "resolve": cli.resolve, "health": cli.resolve}
    for command, module in where.items():
        args = parser.parse_args([command, "x"] if command in ("convert", "inspect", "resolve", "sample") else
                                 [command])
        assert args.handler.__module__ == module.__name__, command
    args = parser.parse_args(["cache", "ls"])
    assert args.handler.__module__ == cli.cache.__name__
    args = parser.parse_args(["convert", "a", "--out", "b"])
    assert args.handler is cli.convert._run_convert and args.out == Path("b") and args.target == "auto"


def test_console_entry_point_in_a_process(tmp_path: Path) -> None:
    """Through a real process: exit status and stdout as a shell script sees them."""
    src = write_checkpoint(tmp_path / "src")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "transformd", "convert", str(src), "--out", out, "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(tmp_path / "out")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and done.stdout == "" and "not empty" in done.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["transformd"]["target"] == "ocp", "auto: a raw consumer without a GPU"



def test_the_script_ends_at_once_after_atexit_handlers_with_its_output_flushed(tmp_path: Path) -> None:
    """``cli.run`` (the script, ``python -m transformd``) skips the interpreter's teardown (0.6 s after torch):
    nothing after it runs (no ``finally``), but the atexit handlers do, buffered standard output reaches the
    pipe, and the exit code is the command's."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    probe = ("import atexit, sys\natexit.register(lambda: print('atexit ran'))\nsys.argv = ['transformd', "
             "*sys.argv[1:]]\nfrom transformd.cli import run\ntry:\n run()\nfinally:\n print('unwound')")
    src = write_checkpoint(tmp_path / "src")
    for argv, code in ((["convert", str(src), "--out", str(tmp_path / "out"), "--device", "cpu"], 0),
                       (["convert", str(tmp_path / "missing"), "--out", str(tmp_path / "out2")], 2)):
        done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env,
                              timeout=120)
        assert done.returncode == code, done.stderr
        assert done.stdout.splitlines()[-1] == "atexit ran" and "unwound" not in done.stdout, done.stdout
    assert done.stdout.splitlines() == ["atexit ran"] and "transformd: error:" in done.stderr
    assert (tmp_path / "out" / "config.json").is_file()


def test_the_script_leaves_a_running_thread_to_the_normal_exit(monkeypatch) -> None:
    """A non-daemon thread still running when the command returns is waited for (``SystemExit``), not killed."""
    release = threading.Event()
    worker = threading.Thread(target=release.wait)
    worker.start()
    monkeypatch.setattr(cli, "main", lambda: 3)
    monkeypatch.setattr(cli.os, "_exit", lambda code: pytest.fail("os._exit while a thread runs"))
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.run()
    finally:
        release.set()
        worker.join()
    assert exit_.value.code == 3


def test_a_warm_cache_hit_in_a_process_imports_no_torch(tmp_path: Path) -> None:
    """The second ``convert --cache-dir`` finds the entry: target auto (the platform probe), the engine check
    (the plan), the readiness report and the summary read headers only, so the process never pays for torch,
    triton or numpy (seconds), nor for httpx (0.15 s: ``convert`` talks to no daemon), while the first one
    really converts."""
    src, root = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2), tmp_path / "cache"
    for f in src.iterdir():  # older than the stat cache's racy window (a file just written is hashed again)
        os.utime(f, (f.stat().st_atime - 60, f.stat().st_mtime - 60))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    probe = ("import atexit, sys, runpy\nsys.argv = ['transformd', *sys.argv[1:]]\natexit.register(lambda: print("
             "sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'triton', 'numpy', 'safetensors', 'httpx'}), "
             "file=sys.stderr))\nrunpy.run_module('transformd', run_name='__main__')")
    runs = []
    for _ in range(2):
        cmd = [sys.executable, "-c", probe, "convert", str(src), "--cache-dir", str(root), "--engine", "vllm"]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        runs.append(done)
    cold, warm = runs
    assert "'torch'" in cold.stderr.splitlines()[-1] and "transformd: converted " in cold.stderr
    assert warm.stdout == cold.stdout and "found in the cache" in warm.stderr
    assert warm.stderr.splitlines()[-1] == "[]", warm.stderr

def test_every_option_and_argument_has_help() -> None:
    """`transformd X --help` explains every option (sample, inspect SRC OUT, ...), demo says it starts a daemon and
    where its files go, and convert's default cache names $XDG_CACHE_HOME."""
    import argparse

    from transformd.cli import build_parser

    missing, parsers = [], {}

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        parsers[path] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}".strip())
            elif not action.help:
                missing.append(f"{path}: {action.option_strings or action.dest}")

    walk(build_parser(), "")
    assert missing == []
    assert "daemon" in parsers["demo"].description and "daemon" in parsers["demo"].format_help()
    assert "$TMPDIR" in parsers["demo"].format_help()
    assert "$XDG_CACHE_HOME" in " ".join(parsers["convert"].format_help().split())


def test_convert_out_checks_free_space_first(tmp_path: Path, capsys, monkeypatch) -> None:
    """Where no small file system can be mounted: too little free space (as statvfs reports it) is refused before
    anything is written, naming --out and the sizes (tests/test_faults_storage.py has the real tmpfs)."""
    from transformd import checkpoint
    from transformd.checkpoint import convert as checkpoint_convert

    src = write_checkpoint(tmp_path / "src")
    monkeypatch.setattr(checkpoint_convert, "_free_bytes", lambda path: 4096)
    code, stdout, stderr = _run(capsys, "convert", src, "--out", tmp_path / "out", "--device", "cpu")
    assert code == 1 and stdout == [] and len(stderr) == 1, stderr
    expected = f"transformd: error: not enough free space for the output directory {tmp_path / 'out'}"
    assert stderr[0].startswith(expected)
    assert "4.0 KiB (4096 bytes) are free" in stderr[0] and ".transformd-" not in stderr[0]
    assert sorted(os.listdir(tmp_path)) == ["src"]
    plan = checkpoint.plan_conversion(src)
    needed = checkpoint.output_bytes(plan, "fnuz")
    monkeypatch.undo()
    out = checkpoint.convert_checkpoint(src, tmp_path / "out", device="cpu").out
    written = sum(f.stat().st_size for f in out.iterdir())
    assert written <= needed <= written + (2 << 20), (written, needed)  # the estimate is close, and not below


def test_a_cache_hit_reports_the_readiness_its_conversion_recorded(tmp_path: Path, capsys, monkeypatch) -> None:
    """A hit prints the same engine warnings as the conversion did, from the manifest (no shard header is read);
    an entry whose manifest has none (an older version's) gets them computed from its headers."""
    from transformd.checkpoint import plan

    src, root = write_checkpoint(tmp_path / "src"), tmp_path / "cache"
    _, first, cold = _run(capsys, "convert", src, "--cache-dir", root, "--device", "cpu", "--target", "ocp")
    warnings = [line for line in cold if line.startswith("transformd: warning: ")]
    assert warnings, cold  # this checkpoint's partial tiles: some engine cannot load it at any TP size
    read: list[str] = []
    real = plan.read_header
    monkeypatch.setattr(plan, "read_header", lambda p: read.append(str(p)) or real(p))
    _, again, warm = _run(capsys, "convert", src, "--cache-dir", root, "--device", "cpu", "--target", "ocp")
    assert again == first and [line for line in warm if line.startswith("transformd: warning: ")] == warnings
    assert "found in the cache" in warm[-1] and not [p for p in read if p.startswith(str(root))], read
    # with --engine too: the engine check of a hit is the recorded readiness, not a plan of the source's headers
    # (SGLang: vLLM may load it at TP 1, its Triton MoE refining the block of the 64-row experts)
    code, _, refused = _run(capsys, "convert", src, "--cache-dir", root, "--device", "cpu", "--engine", "sglang")
    assert read == [], "no header read on a hit, of the source or of the entry"
    with pytest.raises(CheckpointError) as planned:  # what the check from the source's headers says
        plan.check_engine(plan.plan_readiness(plan.plan_conversion(src), "ocp"), "sglang", src)
    assert code == 2 and refused == [f"transformd: error: {planned.value}"], refused
    read.clear()
    manifest = Path(first[-1]).parent / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["result"]["readiness"]
    os.chmod(manifest, 0o644)
    manifest.write_text(json.dumps(data))
    _, _, older = _run(capsys, "convert", src, "--cache-dir", root, "--device", "cpu", "--target", "ocp")
    assert [line for line in older if line.startswith("transformd: warning: ")] == warnings
    assert [p for p in read if p.startswith(str(root))], "computed from the entry's headers"


def test_the_engine_check_of_a_cache_conversion_does_not_read_the_source_twice(tmp_path: Path, capsys,
                                                                                monkeypatch) -> None:
    """``--engine`` looks the source's key up before converting; the conversion then reuses that identity, even for
    files written moments ago (which the stat cache does not remember yet): each file is hashed once. And the plan
    its check read (every shard's header): the conversion does not plan the source again (it did, a review)."""
    from transformd import checkpoint
    from transformd.cache import keys
    from transformd.checkpoint import plan

    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2)  # just written: inside the racy window
    hashed: list[str] = []
    real = keys.hash_file
    monkeypatch.setattr(keys, "hash_file",
                        lambda p, *a, **k: hashed.append(os.path.basename(os.readlink(p))) or real(p, *a, **k))
    plans: list[str] = []
    real_plan = plan.plan_conversion
    counted = functools.wraps(real_plan)(lambda p, *a, **k: plans.append(str(p)) or real_plan(p, *a, **k))
    for module in (checkpoint, plan):  # (its name in the package and in its module: both ways of importing it)
        monkeypatch.setattr(module, "plan_conversion", counted)
    code, out, err = _run(capsys, "convert", src, "--cache-dir", tmp_path / "cache", "--device", "cpu",
                          "--engine", "vllm")
    assert code == 0 and "transformd: converted " in err[-1], err
    assert sorted(hashed) == sorted(p.name for p in src.iterdir() if p.is_file()), "each file hashed once"
    assert len(plans) == 1, plans


#: ``transformd`` with its first output fsync held (said on standard error) until the file argv[1] exists. SIGINT
#: is Python's KeyboardInterrupt here even where the test runs with it ignored (a background job's).
_HELD_AT_FSYNC = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
real, release, held_once = os.fsync, sys.argv.pop(1), []
def held(fd):
    if not held_once:
        held_once.append(fd)
        print("holding", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)
    real(fd)
os.fsync = held
sys.argv = ["transformd", *sys.argv[1:]]
from transformd.cli import run
run()
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_mid_conversion_leaves_nothing_behind(tmp_path: Path, sig: str) -> None:
    """SIGTERM is what kill, systemd and Kubernetes send: it stops a conversion as Ctrl-C does, its staging
    directory removed (before, the process died at once and left it: a review saw 443 MiB stay hidden beside
    --out until a later conversion to the same place)."""
    import signal
    import time

    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2)
    out = tmp_path / "out" / "model"
    out.parent.mkdir()
    release = tmp_path / "release"
    child = subprocess.Popen([sys.executable, "-c", _HELD_AT_FSYNC, str(release), "convert", str(src), "--out",
                              str(out), "--device", "cpu", "--target", "ocp"], stderr=subprocess.PIPE, text=True,
                             cwd=Path(__file__).parents[1])
    try:
        for line in child.stderr:
            if line.startswith("holding"):
                break
        time.sleep(0.2)
        assert os.listdir(out.parent), "a staging directory beside --out while it converts"
        child.send_signal(getattr(signal, sig))
        time.sleep(0.2)
        release.touch()  # (a held fsync in another thread than the signal's goes on)
        rest = child.stderr.read()
        code = child.wait(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert code == {"SIGTERM": 143, "SIGINT": 130}[sig], rest
    assert rest.splitlines()[-1] == {"SIGTERM": "transformd: error: terminated (SIGTERM)",
                                     "SIGINT": "transformd: error: interrupted"}[sig], rest
    assert os.listdir(out.parent) == [], "nothing left beside --out"


def test_serve_says_in_one_line_what_keeps_it_from_starting(tmp_path: Path) -> None:
    """A setting that cannot be used is one line naming its environment variable (exit 2), and ``--device cuda``
    without a GPU one line before the server starts (exit 1; before: two tracebacks, exit 3)."""
    base = [sys.executable, "-m", "transformd", "serve", "--socket", str(tmp_path / "td.sock"), "--cache-dir",
            str(tmp_path / "cache")]
    env = {**os.environ, "TRANSFORMD_MAX_CONCURRENT_CONVERSIONS": "abc"}
    bad = subprocess.run(base, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1, bad.stderr
    assert "max_concurrent_conversions (TRANSFORMD_MAX_CONCURRENT_CONVERSIONS): " in bad.stderr
    if torch.cuda.is_available():
        return
    gpu = subprocess.run([*base, "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert gpu.returncode == 1, gpu.stderr
    assert gpu.stderr == "transformd: error: --device cuda was asked for, but PyTorch sees no GPU\n", gpu.stderr
    assert not (tmp_path / "td.sock").exists()


def test_a_source_that_does_not_exist_is_named_as_such(tmp_path: Path, capsys) -> None:
    """Before, ``convert /no/such --out DIR`` said it "is not a directory"."""
    code, stdout, stderr = _run(capsys, "convert", tmp_path / "nope", "--out", tmp_path / "out", "--device", "cpu")
    assert code == 2 and stdout == [] and stderr == [f"transformd: error: file {tmp_path / 'nope'}: does not exist"]
    (tmp_path / "file").write_text("x")
    code, _, stderr = _run(capsys, "convert", tmp_path / "file", "--out", tmp_path / "out", "--device", "cpu")
    assert code == 2 and stderr == [f"transformd: error: file {tmp_path / 'file'}: is not a directory"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_flags_that_cannot_apply_are_refused_not_ignored(tmp_path: Path, capsys) -> None:
    """Before, ``--out`` with ``--cache-dir`` or ``--no-daemon`` ignored them, and negative times were taken."""
    src = write_sample_checkpoint(tmp_path / "src", layers=1, experts=2)
    for extra, said in ((["--cache-dir", str(tmp_path / "c")], "--cache-dir: "), (["--no-daemon"], "--no-daemon: ")):
        code, stdout, stderr = _run(capsys, "convert", src, "--out", tmp_path / "out", "--device", "cpu", *extra)
        assert code == 2 and stdout == [] and stderr == [f"transformd: error: {said}for a conversion into the cache, "
                                                         "not with --out"], stderr
    for argv, said in ((["convert", str(src), "--progress-every", "-5"], "-5 is not a number of seconds (0 or more)"),
                       (["resolve", str(src), "--timeout", "-1"], "-1 is not a positive number of seconds"),
                       (["resolve", str(src), "--request-timeout", "0"], "0 is not a positive number of seconds")):
        assert cli.main(argv) == 2, argv
        assert said in capsys.readouterr().err, argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_resolve_ends_on_sigterm_as_on_ctrl_c_with_its_own_status(capsys, monkeypatch) -> None:
    """resolve's own handler of Ctrl-C took SIGTERM's Terminated too and said 130 'interrupted' (a review)."""
    from transformd.cli import resolve as resolve_cli
    from transformd.cli.common import Terminated

    for raised, code, said in ((Terminated, 143, "terminated (SIGTERM; "), (KeyboardInterrupt, 130, "interrupted (")):
        def stopped(*args, raised=raised, **kwargs):
            raise raised

        monkeypatch.setattr(resolve_cli, "resolve_with_progress", stopped)
        assert cli.main(["resolve", "/models/x", "--socket", "/nonexistent.sock"]) == code
        assert capsys.readouterr().err == f"transformd: error: {said}the conversion goes on in the daemon)\n"
