"""Who may use the daemon and what it may read: allowed roots (symlinks resolved), bearer tokens on TCP."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from transformd.daemon.app import create_app
from transformd.daemon.settings import Settings, SettingsError

from .support.daemon import DaemonThread, Daemons, raw_request, wait_ready
from .support.fakes import CopyConverter, write_source

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-token-0123456789abcdef"


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """models/ (allowed) with a good source, and outside/ (not allowed) with secrets and a checkpoint."""
    models, outside = tmp_path / "models", tmp_path / "outside"
    good = write_source(models / "good", seed=1)
    secret = outside / "secret.txt"
    write_source(outside, {"secret.txt": b"root:x:0:0\n"})
    elsewhere = write_source(outside / "ckpt", seed=2)
    # a checkpoint whose shard is a symlink out of the allowed root
    file_escape = write_source(models / "file-escape", seed=3)
    os.unlink(file_escape / "model-00002-of-00002.safetensors")
    os.symlink(secret, file_escape / "model-00002-of-00002.safetensors")
    # a checkpoint with a sub-directory symlinked out of the allowed root
    dir_escape = write_source(models / "dir-escape", seed=4)
    os.symlink(outside, dir_escape / "extra")
    # the source itself is a symlink to a checkpoint outside
    os.symlink(elsewhere, models / "link-out")
    # symlinks that stay inside the allowed root are fine
    inside = write_source(models / "inside-links", {"config.json": b"{}"})
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        os.symlink(good / name, inside / name)
    os.symlink(good, models / "link-in")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    os.chmod(token_file, 0o600)
    return {
        "models": models,
        "outside": outside,
        "good": good,
        "file_escape": file_escape,
        "dir_escape": dir_escape,
        "elsewhere": elsewhere,
        "inside": inside,
        "token": token_file,
        "cache": tmp_path / "cache",
    }


@pytest.fixture
def start(daemons: Daemons, layout: dict[str, Path]) -> Callable[..., DaemonThread]:
    """A daemon over ``layout`` (models/ allowed) with a copying converter; ``settings`` as ``transformd serve``'s."""
    defaults = {"cache_dir": layout["cache"], "allow_roots": [layout["models"]]}
    return lambda **settings: daemons.start(CopyConverter(), **{**defaults, **settings})


def _post(http: httpx.Client, source: Path | str) -> httpx.Response:
    return http.post("/v1/checkpoints", json={"source": str(source)})


def test_sources_outside_the_allowed_roots_are_403(start, layout: dict[str, Path]) -> None:
    daemon = start()
    with daemon.client() as http:
        for src in (
            layout["elsewhere"],
            layout["outside"],
            "/etc",
            "/",
            layout["models"] / ".." / "outside" / "ckpt",
            layout["models"] / "link-out",
            layout["file_escape"],
            layout["dir_escape"],
        ):
            r = _post(http, src)
            assert r.status_code == 403, (src, r.text)
            err = r.json()["error"]
            assert err["code"] == "source_not_allowed" and "allowed roots" in err["message"], err
        # a missing path outside is 403 too: no probing of what exists outside the roots
        assert _post(http, layout["outside"] / "nope").status_code == 403
        assert _post(http, layout["models"] / "nope").status_code == 404
        for src in (layout["good"], layout["inside"], layout["models"] / "link-in"):
            r = _post(http, src)
            assert r.status_code in (200, 202), (src, r.text)
            assert wait_ready(http, r.json()["key"])["state"] == "ready"
    cache = daemon.daemon.cache
    outside = str(layout["outside"])
    for entry in cache.entries():
        assert not entry.manifest.source_hint.startswith(outside)
        for f in (entry.path).rglob("*"):
            assert b"root:x" not in f.read_bytes()


def test_no_allowed_roots_refuses_everything(start, layout: dict[str, Path]) -> None:
    daemon = start(allow_roots=[])
    with daemon.client() as http:
        r = _post(http, layout["good"])
        assert r.status_code == 403 and "--allow-root" in r.json()["error"]["message"]


def test_tcp_requires_the_bearer_token(start, layout: dict[str, Path]) -> None:
    daemon = start(port=0, host="127.0.0.1", token_file=layout["token"])
    assert daemon.listeners.tcp_address is not None and daemon.listeners.tcp_address[0] == "127.0.0.1"
    with daemon.client(tcp=True) as http:
        for path in ("/healthz", "/metrics", "/v1/cache", f"/v1/checkpoints/{'0' * 32}", "/openapi.json"):
            r = http.get(path)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "unauthorized" and r.headers["www-authenticate"].startswith("Bearer")
        assert _post(http, layout["good"]).status_code == 401
        for header in (
            "Bearer wrong-token-0123456789abcdef",
            f"Bearer {TOKEN}x",
            f"Basic {TOKEN}",
            TOKEN,
            f"Bearer {TOKEN[:-1]}",
            "Bearer",
            "",
        ):
            r = http.get("/healthz", headers={"Authorization": header})
            assert r.status_code == 401, header
    with daemon.client(tcp=True, token=TOKEN) as http:
        assert http.get("/healthz").status_code == 200
        r = _post(http, layout["good"])
        assert r.status_code == 202
        assert wait_ready(http, r.json()["key"])["state"] == "ready"
        assert http.get("/healthz", headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200
    with daemon.client() as http:  # the unix socket of the same daemon needs no token
        assert http.get("/healthz").status_code == 200


def test_tcp_only_daemon_and_refusals_at_start(start, layout: dict[str, Path], tmp_path: Path) -> None:
    daemon = start(socket=None, port=0, token_file=layout["token"])
    assert daemon.socket_path is None
    with daemon.client(tcp=True) as http:
        assert http.get("/healthz").status_code == 401
    with daemon.client(tcp=True, token=TOKEN) as http:
        assert http.get("/healthz").status_code == 200
    with pytest.raises(SettingsError, match="token"):
        create_app(Settings(port=0, cache_dir=tmp_path / "c2"))
    weak = tmp_path / "weak"
    weak.write_text("short\n")
    with pytest.raises(SettingsError, match="at least"):
        create_app(Settings(port=0, token_file=weak, cache_dir=tmp_path / "c2"))
    with pytest.raises(SettingsError, match="cannot read"):
        create_app(Settings(port=0, token_file=tmp_path / "missing", cache_dir=tmp_path / "c2"))
    with pytest.raises(SettingsError, match="needs --port"):
        create_app(Settings(host="0.0.0.0", cache_dir=tmp_path / "c2"))


def test_a_live_socket_is_not_taken_over_and_a_stale_one_is(start, layout: dict[str, Path]) -> None:
    daemon = start()
    path = daemon.socket_path
    with pytest.raises(SettingsError, match="already listening"):
        DaemonThread(Settings(socket=path, cache_dir=layout["cache"], allow_roots=[layout["models"]]))
    daemon.stop()
    import socket

    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(os.fspath(path))  # bound, never listening: what a killed daemon leaves
    stale.close()
    second = start(socket=path)
    with second.client() as http:
        assert http.get("/healthz").status_code == 200
    not_socket = path.parent / "file"
    not_socket.write_text("x")
    with pytest.raises(SettingsError, match="not a socket"):
        DaemonThread(Settings(socket=not_socket, cache_dir=layout["cache"]))


def test_keys_and_names_cannot_reach_outside_the_cache(start, layout: dict[str, Path]) -> None:
    daemon = start()
    with daemon.client() as http:
        key = wait_ready(http, _post(http, layout["good"]).json()["key"])["key"]
    for target in (
        f"/v1/checkpoints/{key}/files/..%2F..%2F..%2F..%2Fsecret.txt",
        f"/v1/checkpoints/{key}/files/%2e%2e",
        "/v1/checkpoints/..%2f..%2foutside/files",
        "/v1/checkpoints/" + "%2e%2e%2f" * 8 + "etc%2fpasswd/files",
        f"/v1/checkpoints/{key}/leases/..%2f..%2fentries",
    ):
        for method in ("GET", "DELETE"):
            status, body = raw_request(daemon.socket_path, method, target)
            assert status in (400, 404, 405), (method, target, status, body)
            assert b"root:x" not in body
    assert daemon.daemon.cache.get(key, touch=False) is not None


def test_403_says_what_works(layout: dict[str, Path]) -> None:
    """The message names the rule (symlinks are resolved first), refuses the "link it under the root" idea and
    says which --allow-root would work, without naming or confirming the outside path (the trust model)."""
    from transformd.daemon.errors import ApiError
    from transformd.daemon.paths import SourcePolicy

    policy = SourcePolicy([layout["models"]])
    real = os.path.realpath(layout["models"] / "link-out")
    for src in (layout["models"] / "link-out", Path(real), layout["file_escape"]):
        with pytest.raises(ApiError) as info:
            policy.resolve(str(src))
        message = info.value.message
        assert info.value.status == 403 and "symlinks are resolved first" in message, message
        assert "--allow-root naming the directory where they really are" in message
        assert "move or link" not in message and str(layout["outside"]) not in message.replace(str(src), "")