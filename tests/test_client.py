"""The client and ``transformd resolve``/``health`` against a fake daemon that speaks the HTTP contract.

The fake (tests/support/fake_daemon.py) runs under uvicorn on a temporary unix socket and on a loopback
port with a bearer token; the end-to-end tests against the real daemon live with the daemon. The answers the
client relies on (403 source_not_allowed, 404, 401, ...) are pinned for the fake and the real daemon alike in
tests/test_client_contract.py.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.fake_daemon import FakeDaemon, ServerThread
from transformd.cli import resolve as resolve_cli
from transformd.client import (
    CheckpointStatus,
    ConflictError,
    ConversionFailedError,
    DaemonUnavailableError,
    InvalidCheckpointError,
    NotFoundError,
    Progress,
    ResolveTimeoutError,
    ServerError,
    TransformdClient,
    TransformdError,
    UnauthorizedError,
    default_socket_path,
)

TOKEN = "s3cret-token"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world():
    """One fake daemon on a unix socket and on 127.0.0.1 (with a token), a models root with sources."""
    tmp = Path(tempfile.mkdtemp(prefix="tdc"))  # short: unix socket paths are limited to ~107 bytes
    models, converted = tmp / "models", tmp / "converted"
    for name in ("good", "good2", "corrupt-ckpt", "slow", "boom", "busy", "hashing"):
        (models / name).mkdir(parents=True)
    converted.mkdir()
    (converted / "config.json").write_text("{}")
    outside = tmp / "outside"
    outside.mkdir()
    daemon = FakeDaemon(models)
    daemon.register(models / "good", converted)
    uds = ServerThread(daemon.app(), uds=str(tmp / "td.sock")).start()
    tcp = ServerThread(daemon.app(token=TOKEN)).start()
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    yield {"daemon": daemon, "socket": tmp / "td.sock", "url": tcp.url, "token_file": token_file,
           "models": models, "converted": converted.resolve(), "outside": outside, "tmp": tmp}
    uds.stop()
    tcp.stop()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def client(world):
    with TransformdClient(socket=world["socket"], timeout=10) as c:
        yield c


# ---------------------------------------------------------------------------------------------------------------------
# resolve


def test_resolve_cold_then_cached_over_unix_socket(world, client):
    daemon = world["daemon"]
    daemon.forget()
    before = daemon.conversions
    seen: list[CheckpointStatus] = []
    path = client.resolve(world["models"] / "good", target="fnuz", progress=seen.append, poll_interval=0.01)
    assert path == world["converted"]
    states = [s.state for s in seen]
    assert states[0] == "queued" and states[-1] == "ready" and "converting" in states
    converting = [s for s in seen if s.state == "converting"]
    assert isinstance(converting[0].progress, Progress) and converting[0].progress.bytes_total == 3000
    assert daemon.conversions == before + 1

    # Second time: the POST answers 200 ready at once; no poll, no new conversion.
    seen.clear()
    assert client.resolve(world["models"] / "good", target="fnuz", progress=seen.append) == world["converted"]
    assert [s.state for s in seen] == ["ready"]
    assert daemon.conversions == before + 1
    assert client.last_key == seen[0].key


def test_resolve_over_tcp_with_token_file(world):
    with TransformdClient(url=world["url"], token_file=world["token_file"]) as c:
        assert c.resolve(world["models"] / "good", poll_interval=0.01) == world["converted"]
        assert c.health()["status"] == "ok"


def test_token_file_from_environment(world, monkeypatch):
    monkeypatch.setenv("TRANSFORMD_TOKEN_FILE", str(world["token_file"]))
    with TransformdClient(url=world["url"]) as c:
        assert c.health()["status"] == "ok"


def test_tcp_without_token_is_401(world):
    with TransformdClient(url=world["url"]) as c, pytest.raises(UnauthorizedError) as info:
        c.resolve(world["models"] / "good")
    assert info.value.status == 401 and info.value.code == "unauthorized" and info.value.is_client_error


def test_relative_source_is_sent_absolute(world, client, monkeypatch):
    monkeypatch.chdir(world["models"])
    assert client.resolve("good", poll_interval=0.01) == world["converted"]
    # a quoted ~ (exec-form args, YAML) is the home directory, as in a shell; it was ./~ (an attack review)
    monkeypatch.setenv("HOME", str(world["models"].parent))
    monkeypatch.chdir(world["models"] / "good")
    assert client.resolve(f"~/{world['models'].name}/good", poll_interval=0.01) == world["converted"]


def test_a_quoted_tilde_in_convert_is_the_home_directory(tmp_path, monkeypatch):
    from transformd.hub import source_path

    monkeypatch.setenv("HOME", str(tmp_path))
    assert source_path("~/models/x") == tmp_path / "models" / "x"
    assert source_path("./~/x") == Path("./~/x")
    # and the command line's other paths (--out "~/x" made ./~/x: a review)
    from transformd.cli import build_parser

    args = build_parser().parse_args(["convert", "~/src", "--out", "~/out", "--cache-dir", "~/c"])
    assert (args.out, args.cache_dir) == (tmp_path / "out", tmp_path / "c")
    args = build_parser().parse_args(["serve", "--cache-dir", "~/c", "--token-file", "~/t"])
    assert (args.cache_dir, args.token_file) == (tmp_path / "c", tmp_path / "t")


def test_failed_conversion_carries_the_daemons_error(world, client):
    with pytest.raises(ConversionFailedError) as info:
        client.resolve(world["models"] / "corrupt-ckpt", poll_interval=0.01)
    err = info.value
    assert (err.status, err.code) == (422, "invalid_checkpoint")
    assert "tensor x.weight" in err.message and err.is_client_error


def test_server_error_is_5xx(world, client):
    with pytest.raises(ServerError) as info:
        client.resolve(world["models"] / "boom")
    assert info.value.status == 500 and not info.value.is_client_error


def test_queue_full_is_retried_until_timeout(world, client):
    daemon = world["daemon"]
    daemon.busy = 2
    posts = daemon.posts
    assert client.resolve(world["models"] / "busy", poll_interval=0.01).name == "busy"
    assert daemon.posts >= posts + 3 and daemon.busy == 0
    daemon.busy = 1000
    with pytest.raises(ServerError) as info:
        client.resolve(world["models"] / "busy", timeout=0.3)
    assert info.value.status == 503 and info.value.retry_after == 0.05
    daemon.busy = 0


def test_queue_full_is_not_retried_without_time_for_the_answer(world, client):
    """A daemon that answers 503 slowly: the client does not send a last retry that cannot be answered in the time
    left (it would time out and report "still identifying" instead of the full queue). The old rule, retry whenever
    Retry-After fits, sends one at 0.27 s with 0.03 s left for a 0.04 s answer."""
    daemon = world["daemon"]
    daemon.busy, daemon.busy_answer_s = 1000, 0.04
    try:
        with pytest.raises(ServerError) as info:
            client.resolve(world["models"] / "busy", timeout=0.3)
    finally:
        daemon.busy, daemon.busy_answer_s = 0, 0.0
    assert info.value.status == 503 and info.value.code == "queue_full"


def test_slow_post_is_not_cut_by_the_request_timeout(world):
    """Identifying a large source takes the daemon a while: the POST is waited for beyond ``timeout``."""
    with TransformdClient(socket=world["socket"], timeout=0.2) as c:
        assert c.resolve(world["models"] / "hashing", poll_interval=0.01).name == "hashing"
        with pytest.raises(ResolveTimeoutError, match="identifying"):
            c.resolve(world["models"] / "hashing", target="ocp", timeout=0.3)
        with pytest.raises(DaemonUnavailableError, match="in time"):
            c.submit(world["models"] / "hashing", scale_mode="amax", wait_s=0.2)


def test_missing_source_is_404(world, client):
    with pytest.raises(NotFoundError):
        client.submit(world["models"] / "nope")


def test_resolve_timeout(world, client):
    with pytest.raises(ResolveTimeoutError) as info:
        client.resolve(world["models"] / "slow", poll_interval=0.01, timeout=0.3)
    assert "converting" in info.value.message and info.value.status is None


def test_resolve_survives_a_daemon_that_forgot_the_key(world, client):
    daemon = world["daemon"]
    daemon.forget()
    calls = []

    def forget_once(status: CheckpointStatus) -> None:
        calls.append(status.state)
        if len(calls) == 2:
            daemon.forget()  # as if the daemon restarted while we poll: the next GET is a 404

    posts = daemon.posts
    assert client.resolve(world["models"] / "good", progress=forget_once, poll_interval=0.01) == world["converted"]
    assert daemon.posts == posts + 2


def test_resolve_says_when_the_daemon_restarted_and_it_reconnected(world, client):
    """A daemon that forgets the key mid-conversion (it restarted): the client tells ``notice`` both events, and the
    CLI's reporter prints them, so progress that starts over from 0% is explained."""
    daemon = world["daemon"]
    daemon.forget()
    notices: list[str] = []
    stream = io.StringIO()
    reporter = resolve_cli.ProgressReporter(stream, every_s=3600, tty=False)
    calls = []

    def progress(status: CheckpointStatus) -> None:
        calls.append(status.state)
        reporter.update(status)
        if len(calls) == 3:
            daemon.forget()

    def notice(message: str) -> None:
        notices.append(message)
        reporter.notice(message)

    path = client.resolve(world["models"] / "good", progress=progress, notice=notice, poll_interval=0.01)
    assert path == world["converted"]
    assert len(notices) == 2, notices
    assert "restarted" in notices[0] and "waiting up to 60s" in notices[0] and "%" in notices[0], notices
    assert notices[1].startswith(f"reconnected to transformd at {client.where} after "), notices
    assert "(was at " in notices[1] or "ready" in notices[1], notices
    lines = stream.getvalue().splitlines()
    i = lines.index(f"transformd: {notices[0]}")
    assert lines[i + 1] == f"transformd: {notices[1]}" and len(lines) > i + 2, lines  # the next status is printed


def test_resolve_says_when_it_reconnected_after_the_daemon_went_away(tmp_path):
    """The daemon's socket stops answering mid-conversion and a new daemon comes up on it: one line each."""
    import threading

    models = tmp_path / "m"
    (models / "good").mkdir(parents=True)
    daemon = FakeDaemon(models)
    sock = Path(tempfile.mkdtemp(prefix="tdr")) / "td.sock"
    servers = [ServerThread(daemon.app(), uds=str(sock)).start()]
    restarted = threading.Event()

    def restart() -> None:
        servers[0].stop()
        daemon.forget()
        threading.Timer(0.5, lambda: (servers.append(ServerThread(daemon.app(), uds=str(sock)).start()),
                                      restarted.set())).start()

    notices: list[str] = []
    calls = []

    def progress(status: CheckpointStatus) -> None:
        calls.append(status)
        if len(calls) == 2:
            restart()

    try:
        with TransformdClient(socket=sock, timeout=5) as c:
            path = c.resolve(models / "good", progress=progress, notice=notices.append, poll_interval=0.05,
                             reconnect_s=30, timeout=60)
        assert path == (models / "good").resolve() and restarted.is_set()
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(sock.parent, ignore_errors=True)
    assert len(notices) == 2, notices
    assert "went away while entry" in notices[0] and "waiting up to 30s" in notices[0], notices
    assert notices[1].startswith("reconnected to transformd at") and " after " in notices[1], notices


def test_unreachable_daemon(world, tmp_path):
    with TransformdClient(socket=tmp_path / "none.sock", timeout=2) as c, pytest.raises(DaemonUnavailableError) as info:
        c.health()
    assert info.value.status is None and "no socket at" in info.value.message
    stale = tmp_path / "stale.sock"  # a socket file nothing listens on (a daemon killed left it): a hint too
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    with TransformdClient(socket=stale, timeout=2) as c, pytest.raises(DaemonUnavailableError) as info:
        c.health()
    assert f"nothing listens on {stale}" in info.value.message and "transformd serve" in info.value.message


# ---------------------------------------------------------------------------------------------------------------------
# status, files, leases, cache


def test_status_files_and_file(world, client):
    client.resolve(world["models"] / "good", poll_interval=0.01)
    key = client.last_key
    status = client.status(key)
    assert status.ready and status.path == world["converted"] and status.recipe["target"] == "ocp"
    assert client.files(key) == []  # the fake's converted dir holds no shards
    with pytest.raises(NotFoundError) as info:
        client.file(key, "model.safetensors")
    assert info.value.code == "unknown_file"
    with pytest.raises(NotFoundError):
        client.status("0" * 32)


def test_lease_context_manager_acquires_and_releases(world, client):
    daemon = world["daemon"]
    client.resolve(world["models"] / "good", poll_interval=0.01)
    key = client.last_key
    with client.lease(key, ttl_s=60, holder="test") as lease:
        assert lease.key == key and lease.id in daemon.leases
        assert daemon.leases[lease.id]["holder"] == "test"
        with pytest.raises(ConflictError) as info:
            client.delete(key)  # leased: the daemon refuses
        assert info.value.status == 409
    assert lease.id not in daemon.leases

    with pytest.raises(RuntimeError), client.lease(key, ttl_s=60) as lease2:
        raise RuntimeError("engine crashed")
    assert lease2.id not in daemon.leases  # released on the way out of an exception too
    client.release_lease(key, lease2.id)  # already gone: not an error


def test_cache_health_metrics(world, client):
    assert "entries" in client.cache()
    assert client.health()["status"] == "ok"
    assert "transformd_conversions_total" in client.metrics()


def test_error_classes_by_status():
    from transformd.client import BadRequestError, CacheFullError, error_for_status

    assert isinstance(error_for_status(400, "x"), BadRequestError)
    assert isinstance(error_for_status(422, "x"), InvalidCheckpointError)
    assert isinstance(error_for_status(507, "x"), CacheFullError)
    assert isinstance(error_for_status(503, "x"), ServerError)
    assert all(isinstance(error_for_status(s, "x"), TransformdError) for s in (400, 401, 403, 404, 409, 422, 507))


def test_default_socket_path(tmp_path):
    assert default_socket_path({"TRANSFORMD_SOCKET": "/x/y.sock", "XDG_RUNTIME_DIR": str(tmp_path)}) == Path("/x/y.sock")
    expected = tmp_path / "transformd.sock"
    if Path("/run/transformd/transformd.sock").exists():
        pytest.skip("a system daemon's socket exists on this machine")
    assert default_socket_path({"XDG_RUNTIME_DIR": str(tmp_path)}) == expected
    assert default_socket_path({}) == Path("/run/transformd/transformd.sock")


# ---------------------------------------------------------------------------------------------------------------------
# The command line


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``transformd resolve ...`` (``resolve`` is added unless the command is ``resolve`` or ``health``)."""
    if argv[0] not in ("resolve", "health"):
        argv = ("resolve", *argv)
    return subprocess.run([sys.executable, "-m", "transformd", *argv], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, **(env or {})}, timeout=120)


def test_cli_resolve_prints_only_the_directory(world):
    world["daemon"].forget()
    run = _cli("resolve", str(world["models"] / "good"), "--socket", str(world["socket"]), "--target", "fnuz",
               "--poll-interval", "0.01", "--progress-every", "0")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [str(world["converted"])]
    # Not a terminal: progress comes as lines on standard error.
    lines = run.stderr.splitlines()
    assert any("queued" in line for line in lines) and any("converting" in line and "%" in line for line in lines)


#: Run ``transformd resolve`` (or any statement) in a fresh interpreter, then print the heavy modules it loaded.
_IMPORTED = ("import sys\n{run}\n"
             "print(sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'triton', 'numpy', 'fastapi', "
             "'uvicorn', 'safetensors', 'blake3', 'huggingface_hub', 'click', 'rich'}}), file=sys.stderr)")


def test_the_client_and_resolve_import_no_torch(world):
    """Engines call the client and ``transformd resolve`` at every start, from every rank: neither may pay for
    torch (or the daemon's own libraries). Checked on a warm resolve that really answers, in a fresh process."""
    run = _IMPORTED.format(run="import transformd.client, transformd")
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0 and done.stderr.strip() == "[]", done.stderr
    argv = ["resolve", str(world["models"] / "good"), "--socket", str(world["socket"]), "--target", "fnuz"]
    run = _IMPORTED.format(run=f"from transformd.cli import main\ncode = main({argv!r})\nassert code == 0, code")
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0 and done.stdout.splitlines() == [str(world["converted"])], done.stderr
    assert done.stderr.strip().splitlines()[-1] == "[]", done.stderr


def test_httpx_is_imported_without_its_command_line():
    """``import_httpx`` leaves out httpx's ``_main`` (click, rich: half of httpx's import time, checked above on a
    real resolve) and leaves nothing behind: ``httpx._main`` imports as usual afterwards."""
    run = ("import sys\nfrom transformd._lazy import import_httpx\nhttpx = import_httpx()\n"
           "assert httpx.Client and not {'httpx._main', 'click'} & set(sys.modules), sorted(sys.modules)\n"
           "import httpx._main\nassert httpx._main.main is not httpx.main\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr


def test_cli_resolve_over_tcp_and_env_socket(world):
    run = _cli(str(world["models"] / "good"), "--url", world["url"], "--token-file", str(world["token_file"]))
    assert (run.returncode, run.stdout.strip()) == (0, str(world["converted"])), run.stderr
    run = _cli(str(world["models"] / "good"), env={"TRANSFORMD_SOCKET": str(world["socket"])})
    assert (run.returncode, run.stdout.strip()) == (0, str(world["converted"])), run.stderr


@pytest.mark.parametrize(
    ("source", "extra", "code", "needle"),
    [
        ("outside", [], 2, "outside the allowed roots"),
        ("corrupt-ckpt", [], 2, "E8M0 byte 0xFF"),
        ("boom", [], 1, "something broke"),
        ("slow", ["--timeout", "0.3"], 1, "gave up waiting"),
    ],
)
def test_cli_resolve_errors(world, source, extra, code, needle):
    src = world["outside"] if source == "outside" else world["models"] / source
    run = _cli(str(src), "--socket", str(world["socket"]), "--poll-interval", "0.01", *extra)
    assert run.returncode == code, run.stderr
    assert run.stdout == ""
    errors = [line for line in run.stderr.splitlines() if line.startswith("transformd: error:")]
    assert len(errors) == 1 and needle in errors[0]


def test_cli_resolve_unauthorized_and_unreachable(world, tmp_path):
    run = _cli(str(world["models"] / "good"), "--url", world["url"])
    assert run.returncode == 2 and "401" in run.stderr
    run = _cli(str(world["models"] / "good"), "--socket", str(tmp_path / "none.sock"))
    assert run.returncode == 1 and "cannot reach transformd" in run.stderr and run.stdout == ""
    for url in ("http://[::1", "http://127.0.0.1:abc"):  # (httpx's InvalidURL traceback: an attack review)
        run = _cli(str(world["models"] / "good"), "--url", url)
        assert run.returncode == 2 and run.stderr.startswith(f"transformd: error: not a URL: {url!r} (Invalid port")
        assert len(run.stderr.splitlines()) == 1, run.stderr
    for seconds in ("nan", "-1", "inf"):  # (nan waited for a daemon gone away without end)
        run = _cli(str(world["models"] / "good"), "--socket", str(world["socket"]), f"--reconnect={seconds}")
        assert run.returncode == 2 and "--reconnect" in run.stderr and "seconds (0 or more)" in run.stderr, run.stderr


def test_cli_health(world, tmp_path):
    run = _cli("health", "--socket", str(world["socket"]))
    assert (run.returncode, run.stdout.strip()) == (0, "ok")
    run = _cli("health", "--url", world["url"], "--token-file", str(world["token_file"]), "-q")
    assert (run.returncode, run.stdout) == (0, "")
    run = _cli("health", "--socket", str(tmp_path / "none.sock"))
    assert run.returncode == 1 and run.stderr.startswith("transformd: error:")


@pytest.mark.parametrize("http_status", [200, 503])
def test_cli_health_degraded_exits_1_with_the_reasons_as_text(world, http_status):
    """Degraded is not healthy: exit 1, the reasons as one line of text (not the JSON body), whether the daemon
    answers 503 (as transformd does) or 200; --allow-degraded (liveness probes) exits 0 and still says why."""
    world["daemon"].health = {"status": "degraded", "version": "0.1.0",
                              "problems": ["cache directory /c is not writable by the daemon", "shutting down"]}
    world["daemon"].health_status = http_status
    try:
        run = _cli("health", "--socket", str(world["socket"]))
        quiet = _cli("health", "--socket", str(world["socket"]), "-q")
        allowed = _cli("health", "--socket", str(world["socket"]), "--allow-degraded", "-q")
    finally:
        world["daemon"].health = {"status": "ok", "version": "0.1.0", "problems": []}
        world["daemon"].health_status = 200
    for r in (run, quiet):
        assert (r.returncode, r.stdout.strip()) == (1, "degraded"), (r.returncode, r.stdout, r.stderr)
        assert r.stderr.splitlines() == [
            f"transformd: error: transformd at unix socket {world['socket']} is degraded: cache directory /c is not "
            "writable by the daemon; shutting down"
        ], r.stderr
        assert "{" not in r.stderr
    assert allowed.returncode == 0 and "warning" in allowed.stderr and "not writable" in allowed.stderr


def test_commands_register_on_the_main_parser(world, capsys):
    """``transformd resolve`` / ``health`` through transformd.cli's parser."""
    from transformd import cli

    parser = cli.build_parser()
    args = parser.parse_args(["resolve", str(world["models"] / "good"), "--socket", str(world["socket"])])
    assert args.handler(args) == 0
    assert capsys.readouterr().out.splitlines() == [str(world["converted"])]
    args = parser.parse_args(["health", "--socket", str(world["socket"])])
    assert args.handler(args) == 0


def _status(state: str, done: int, key: str = "k" * 32) -> CheckpointStatus:
    return CheckpointStatus(key=key, state=state, progress=Progress(tensors_done=done, tensors_total=10, bytes_done=done * 100,
                                                                     bytes_total=1000, rate_bytes_per_s=50.0, eta_s=3.0))


def test_progress_lines_every_few_seconds():
    now = [0.0]
    out = io.StringIO()
    rep = resolve_cli.ProgressReporter(out, every_s=5, tty=False, clock=lambda: now[0])
    rep.update(_status("queued", 0))
    for t, done in ((1, 1), (2, 2), (6, 3), (7, 4), (12, 5)):
        now[0] = t
        rep.update(_status("converting", done))
    lines = out.getvalue().splitlines()
    # queued (state change), converting at t=1 (state change), t=6 (due), t=12 (due)
    assert len(lines) == 4, lines
    assert "300 B/1000 B (30%)" in lines[2] and "3/10 tensors" in lines[2] and "~3s left" in lines[2]


def test_progress_bar_on_a_terminal():
    out = io.StringIO()
    rep = resolve_cli.ProgressReporter(out, tty=True)
    rep.update(_status("queued", 0))
    rep.update(_status("converting", 5))
    rep.update(_status("converting", 10))
    rep.close()
    assert "converting" in out.getvalue() and "10/10 tensors" in out.getvalue()


def test_cache_hit_prints_no_progress():
    out = io.StringIO()
    rep = resolve_cli.ProgressReporter(out, tty=False)
    rep.update(CheckpointStatus(key="k", state="ready", path=Path("/x")))
    assert out.getvalue() == ""


def test_a_malformed_key_in_an_answer_is_the_daemons_error_in_one_line() -> None:
    """A key goes into URLs and onto the terminal: one with control characters took the title of a review's
    terminal (through the progress bar's label) and then ended the client with httpx's traceback."""
    from transformd.client import CheckpointStatus

    for key in ("\x1b]0;PWNED\x07", "../x", "A" * 32, None, 7):
        with pytest.raises(ServerError, match="malformed key"):
            CheckpointStatus.from_json({"key": key, "state": "ready"})
    assert CheckpointStatus.from_json({"key": "passthrough", "state": "ready"}).key == "passthrough"
    assert CheckpointStatus.from_json({"key": "0" * 32, "state": "queued"}).state == "queued"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory another user's")
def test_an_inherited_runtime_dir_of_another_user_is_not_asked(tmp_path):
    """root with an XDG_RUNTIME_DIR inherited from uid 1000 (su, sudo -E) asked uid 1000's socket, whose fake daemon
    answered with a path of its choosing (an attack review). Another user's runtime directory is skipped."""
    runtime = tmp_path / "run-user-1000"
    runtime.mkdir()
    (runtime / "transformd.sock").touch()
    os.chown(runtime, 1000, 1000)
    assert default_socket_path({"XDG_RUNTIME_DIR": str(runtime)}) == Path("/run/transformd/transformd.sock")
    os.chown(runtime, os.geteuid(), os.getegid())
    assert default_socket_path({"XDG_RUNTIME_DIR": str(runtime)}) == runtime / "transformd.sock"


def test_an_answer_past_the_size_cap_is_not_read_to_its_end(monkeypatch):
    """The client read a daemon's whole answer into memory: a listener on the socket answering without end
    (1.5M files: 1.2 GB, an attack review) grew the engine's process until it died. Past MAX_ANSWER_BYTES it stops
    reading and raises; an answer under the cap, gzip-encoded included, reads as before."""
    import gzip
    import json

    import httpx

    from transformd import client as client_module

    monkeypatch.setattr(client_module, "MAX_ANSWER_BYTES", 1 << 20)
    pulled = []

    def endless():
        while True:
            pulled.append(1)
            yield b"x" * 65536

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/cache":
            return httpx.Response(200, content=endless())
        body = gzip.compress(json.dumps({"status": "ok", "pad": "y" * 100_000}).encode())
        return httpx.Response(200, content=body, headers={"content-encoding": "gzip"})

    with TransformdClient(socket="/nonexistent.sock", transport=httpx.MockTransport(handler)) as td:
        with pytest.raises(ServerError, match=r"answered GET /v1/cache with more than 1 MiB: not read"):
            td.cache()
        assert len(pulled) <= 17  # 1 MiB and one chunk, not the endless rest
        assert td.health() == {"status": "ok", "pad": "y" * 100_000}


@pytest.mark.parametrize("answer, message", [
    ([1, 2], "malformed answer (TypeError: not a JSON object but list)"),
    ({"key": "0" * 32, "state": "ready", "path": "rel/dir"}, "the path 'rel/dir' is not absolute"),
    ({"key": "0" * 32, "state": "ready", "path": None}, f"reported entry {'0' * 32} ready without its path"),
    ({"key": "0" * 32, "state": "ready", "path": 7}, "the path '7' is not absolute"),
], ids=["a-list", "a-relative-path", "no-path", "a-number"])
def test_an_answer_of_another_shape_is_the_daemons_error_in_one_line(answer, message):
    """What listens on the socket may answer anything: a list was an AttributeError's traceback, a relative path was
    printed and loaded from the engine's working directory (another directory, silently), and a ready answer
    without its path was asked again for ever (an attack review)."""
    import httpx

    posts = []

    def handler(request: httpx.Request) -> httpx.Response:
        posts.append(request.url.path)
        return httpx.Response(200, json=answer)

    with TransformdClient(socket="/nonexistent.sock", transport=httpx.MockTransport(handler)) as td:
        with pytest.raises(ServerError) as info:
            td.resolve("/models/x", timeout=5)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert len(posts) <= 2


def test_resolve_asks_to_be_answered_at_the_end_and_still_paces_an_older_daemon():
    """Each poll asks the daemon to answer when the conversion ends (``?wait=``, at most the poll interval); a
    daemon that answers at once anyway (older, without ``wait``) is not polled in a tight loop."""
    import time

    import httpx

    gets: list[httpx.URL] = []
    ready_at = time.monotonic() + 1.0

    def handler(request: httpx.Request) -> httpx.Response:
        key = "0" * 32
        if request.method == "POST":
            return httpx.Response(202, json={"key": key, "state": "queued"})
        gets.append(request.url)
        if time.monotonic() < ready_at:
            return httpx.Response(200, json={"key": key, "state": "converting"})
        return httpx.Response(200, json={"key": key, "state": "ready", "path": "/cache/entries/x/checkpoint"})

    with TransformdClient(socket="/nonexistent.sock", transport=httpx.MockTransport(handler)) as td:
        assert td.resolve("/models/x", poll_interval=0.2, timeout=30) == Path("/cache/entries/x/checkpoint")
    waits = [float(u.params["wait"]) for u in gets]
    assert all(0 < w <= 0.2 for w in waits), waits
    assert 3 <= len(gets) <= 15, len(gets)  # ~1 s at 0.05, 0.1, 0.2, 0.2, ... (a tight loop: thousands)
