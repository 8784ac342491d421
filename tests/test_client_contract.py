"""The HTTP contract the client relies on, held by the fake daemon (tests/support/fake_daemon.py) and the real one
alike.

test_client.py drives the client's retry, timeout and progress paths with the fake, which can script them. That is
only worth something if the fake answers like the daemon: every test here runs against both (``daemon`` is
parametrised), so a code or status the fake invents (it once sent ``path_not_allowed``, which the daemon never
does) fails here. The real daemon runs in a thread with a copying converter (the contract, not the conversion).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.fake_daemon import FakeDaemon, ServerThread
from transformd.client import NotAllowedError, NotFoundError, TransformdClient, UnauthorizedError
from transformd.daemon.settings import Settings

from .support.daemon import DaemonThread
from .support.fakes import OrderedCopyConverter, write_source

TOKEN = "contract-token-0123456789abcdef0123"


@dataclass
class World:
    kind: str
    socket: Path
    url: str
    token_file: Path
    models: Path
    outside: Path
    sibling: Path  # <models>-evil: shares the root's name as a string prefix


def _layout(tmp: Path) -> tuple[Path, Path, Path]:
    models, outside, sibling = tmp / "models", tmp / "outside", tmp / "models-evil"
    for d in (models / "good", outside / "ckpt", sibling / "ckpt"):
        write_source(d, {"config.json": b"{}", "model.safetensors": b"\0" * 64})
    (models / "escape").symlink_to(outside / "ckpt")
    (tmp / "token").write_text(TOKEN + "\n")
    (tmp / "token").chmod(0o600)
    return models, outside, sibling


@pytest.fixture(scope="module", params=["fake", "real"])
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    tmp = Path(tempfile.mkdtemp(prefix="tdk"))  # short: unix socket paths are limited to ~107 bytes
    models, outside, sibling = _layout(tmp)
    stops = []
    try:
        if request.param == "fake":
            fake = FakeDaemon(models)
            uds = ServerThread(fake.app(), uds=str(tmp / "td.sock")).start()
            tcp = ServerThread(fake.app(token=TOKEN)).start()
            stops += [uds.stop, tcp.stop]
            url = tcp.url
        else:
            settings = Settings(socket=tmp / "td.sock", port=0, token_file=tmp / "token", cache_dir=tmp / "cache",
                                allow_roots=[models], device="cpu", log_level="critical")
            daemon = DaemonThread(settings, converter=OrderedCopyConverter()).start()
            stops.append(daemon.stop)
            url = daemon.base_url
        yield World(request.param, tmp / "td.sock", url, tmp / "token", models, outside, sibling)
    finally:
        for stop in stops:
            stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def client(world: World) -> Iterator[TransformdClient]:
    with TransformdClient(socket=world.socket, timeout=10) as c:
        yield c


def test_resolve_returns_the_converted_directory_then_answers_from_the_cache(world, client) -> None:
    path = client.resolve(world.models / "good", target="ocp", poll_interval=0.01, timeout=60)
    assert path.is_dir() and (path / "config.json").is_file()
    key = client.last_key
    assert client.resolve(world.models / "good", target="ocp", timeout=5) == path
    status = client.status(key)
    assert status.ready and status.path == path and status.recipe["target"] == "ocp"


def test_resolve_over_tcp_with_the_token(world) -> None:
    with TransformdClient(url=world.url, token_file=world.token_file) as c:
        assert c.resolve(world.models / "good", poll_interval=0.01, timeout=60).is_dir()


def test_tcp_without_the_token_is_401_unauthorized(world) -> None:
    with TransformdClient(url=world.url) as c, pytest.raises(UnauthorizedError) as info:
        c.resolve(world.models / "good")
    assert (info.value.status, info.value.code) == (401, "unauthorized")


@pytest.mark.parametrize(
    "where",
    [
        pytest.param(lambda w: w.outside / "ckpt", id="outside"),
        pytest.param(lambda w: w.models / "escape", id="symlink out of the root"),
        pytest.param(lambda w: w.sibling / "ckpt", id="sibling sharing the root's name as prefix"),
        pytest.param(lambda w: w.models / ".." / "outside" / "ckpt", id="'..' out of the root"),
    ],
)
def test_sources_outside_the_allowed_roots_are_403_source_not_allowed(world, client, where) -> None:
    with pytest.raises(NotAllowedError) as info:
        client.resolve(where(world), timeout=5)
    err = info.value
    assert (err.status, err.code) == (403, "source_not_allowed"), err.message
    assert "outside the allowed roots" in err.message and err.is_client_error


def test_a_missing_source_inside_the_root_is_404_source_not_found(world, client) -> None:
    with pytest.raises(NotFoundError) as info:
        client.submit(world.models / "nope")
    assert (info.value.status, info.value.code) == (404, "source_not_found")


def test_an_unknown_key_is_404_unknown_key(world, client) -> None:
    with pytest.raises(NotFoundError) as info:
        client.status("0" * 32)
    assert (info.value.status, info.value.code) == (404, "unknown_key")


def test_leases_are_taken_and_released(world, client) -> None:
    client.resolve(world.models / "good", poll_interval=0.01, timeout=60)
    with client.lease(client.last_key, ttl_s=60, holder="contract") as lease:
        assert lease.key == client.last_key and len(lease.id) >= 16
