"""Trust, second round (issue 42, item 8): the client trusts no more than it must.

* a socket another uid planted in a world-writable sticky ``XDG_RUNTIME_DIR`` (the planter, uid 65534, binds it
  in a child process) is not used: the system-wide socket is taken instead, and where there is none the client
  refuses with one line (before: the client spoke to the planter, who could answer with paths of his choosing);
  the caller's own socket there, root's, and any socket in a directory only its owner may write are used;
* what answers on the socket is untrusted too: a 20,000-deep JSON answer and a tensor table whose shape overflows
  64 bits (or is not whole numbers) are the client's one :class:`ServerError` (before: a ``RecursionError``, and a
  torch ``RuntimeError`` out of ``load_from_daemon``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from transformd import client as client_module
from transformd.client import TransformdClient, default_socket_path
from transformd.errors import NotAllowedError, NotFoundError, ServerError

from .support.callers import NOBODY
from .support.daemon import short_tempdir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")

KEY = "0123456789abcdef0123456789abcdef"

_PLANT = textwrap.dedent(
    """
    import os, socket, sys, time
    os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sys.argv[1]); s.listen(8)
    print("planted", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def sticky() -> Iterator[Path]:
    """A world-writable sticky directory (like /tmp) of this process's uid, as its XDG_RUNTIME_DIR."""
    d = short_tempdir("tdxdg-")
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _plant(path: Path, uid: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _PLANT, str(path), str(uid)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "planted"
    assert path.lstat().st_uid == uid
    return proc


def test_a_socket_another_uid_planted_in_a_sticky_runtime_dir_is_not_used(sticky: Path, monkeypatch,
                                                                         tmp_path: Path) -> None:
    planted = sticky / "transformd.sock"
    system = tmp_path / "system" / "transformd.sock"
    monkeypatch.setattr(client_module, "DEFAULT_SOCKET", str(system))
    monkeypatch.delenv("TRANSFORMD_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(sticky))
    env = {"XDG_RUNTIME_DIR": str(sticky)}
    proc = _plant(planted, NOBODY)
    try:
        with pytest.raises(NotAllowedError, match=f"belongs to uid {NOBODY}"):
            default_socket_path(env)
        with pytest.raises(NotAllowedError):
            TransformdClient()  # what an engine's start-up hook calls
        system.parent.mkdir()
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(system))
            assert default_socket_path(env) == system  # the system-wide one instead
            assert default_socket_path(env, listening=True) == planted  # (a daemon's rule is its own: --socket)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("owner", ["caller", "another uid, in a directory only the caller may write"])
def test_a_socket_no_one_else_could_plant_is_used(sticky: Path, monkeypatch, tmp_path: Path, owner: str) -> None:
    monkeypatch.setattr(client_module, "DEFAULT_SOCKET", str(tmp_path / "none" / "transformd.sock"))
    runtime = sticky
    if owner != "caller":
        runtime = sticky / "private"
        runtime.mkdir(mode=0o700)  # only its owner (this uid) may write: whatever socket is there, it put there
    path = runtime / "transformd.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        if owner != "caller":
            os.chown(path, NOBODY, NOBODY)
        assert default_socket_path({"XDG_RUNTIME_DIR": str(runtime)}) == path


def _client(answer: Callable[[httpx.Request], httpx.Response]) -> TransformdClient:
    return TransformdClient(socket="/nonexistent.sock", transport=httpx.MockTransport(answer))


def _deep(n: int = 20_000) -> bytes:
    return b'{"key": ' + b"[" * n + b"]" * n + b"}"


def test_a_deeply_nested_answer_is_a_server_error() -> None:
    for status, error in ((200, ServerError), (500, ServerError), (404, NotFoundError)):
        c = _client(lambda request, status=status: httpx.Response(status, content=_deep()))
        with pytest.raises(error):
            c.status(KEY)
    c = _client(lambda request: httpx.Response(200, content=b'{"files": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"))
    with pytest.raises(ServerError):
        c.files(KEY)


def _table(shape: object, offsets: object = (100, 100)) -> bytes:
    tensor = {"dtype": "U8", "shape": shape, "offsets": list(offsets)}  # type: ignore[call-overload]
    shard = {"name": "model.safetensors", "path": "/tmp/model.safetensors", "final_path": "/tmp/model.safetensors",
             "size": 200, "digest": None, "ready": True, "tensors": {"t": tensor}}
    return json.dumps({"key": KEY, "state": "ready", "files": [shard]}).encode()


@pytest.mark.parametrize("shape, offsets", [
    ([2**40, 2**40, 0], (100, 100)),      # zero elements, but torch sizes the storage from the rest: it overflowed
    ([2**31, 2**31, 4, 0], (100, 100)),
    ([2**64], (100, 100)),
    ([-1], (100, 100)),
    ([1.5], (100, 100)),
    ([True], (100, 101)),
    (["3"], (100, 103)),
    ([3], (100.0, 103)),
    ([3], (103, 100)),
])
def test_a_table_with_a_shape_no_tensor_can_have_is_a_server_error(shape: object, offsets: object) -> None:
    c = _client(lambda request: httpx.Response(200, content=_table(shape, offsets)))
    with pytest.raises(ServerError, match="malformed answer"):
        c.files(KEY)


def test_load_from_daemon_raises_the_server_error_not_torchs() -> None:
    from transformd.loader import load_from_daemon

    c = _client(lambda request: httpx.Response(200, content=_table([2**40, 2**40, 0])))
    with pytest.raises(ServerError):
        load_from_daemon(c, KEY)
