"""Who may talk to the daemon and what it may touch: tokens in constant time, no way out of the cache or the allowed
roots by any route, socket and cache-file permissions.

Extends tests/test_api_access.py (403 for sources outside the roots, 401 without the token, a first set of encoded
traversals) with:

* the token comparison: every TCP request goes through ``hmac.compare_digest`` on two equal-length SHA-256 digests,
  whatever the length of the token sent (counted by wrapping ``hmac.compare_digest``), and wrong tokens of every
  length, raw bytes and huge headers are 401;
* key, file-name and lease-id parameters with ``..``, ``%2e%2e``, encoded and double-encoded slashes, backslashes,
  absolute paths, NUL bytes, overlong UTF-8 dots and overlong names, on every route and method: 400 or 404 with a
  short JSON error, never a file's content;
* a canary directory outside the allowed roots (its own tmpfs mounted ``strictatime`` when the test may mount, else
  a directory with atimes set in the past so that relatime updates them): after every route a client can take to
  make the daemon read it (the source itself, ``..`` in the source, a symlinked source, a symlinked shard, config or
  sub-directory, an index naming ``../../outside/...``, ``/proc/self/root/...``, traversal in URLs), no atime of the
  canary files or of the directory itself has changed (the daemon did not read a byte nor list it), no answer holds
  its content and no cache entry mentions it;
* the unix socket is 0660 and its new directory 0750 whatever the umask; cache entry files are 0444 and the
  directories inside an entry 0555 (the entry directory itself is renamed between staging/, entries/, trash/ and
  quarantine/, which needs write permission on it for a non-root daemon: it is only not group/other-writable).
"""

from __future__ import annotations

import hmac
import json
import os
import shutil
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from transformd.daemon import middleware
from transformd.daemon.settings import Settings
from transformd.sample import write_sample_checkpoint

from .support.daemon import DaemonThread, raw_request, short_tempdir, wait_ready
from .support.entries import entry_dir

pytestmark = pytest.mark.timeout(90)

CATEGORY = "access"
TOKEN = "access-token-0123456789abcdef0123456789"
CANARY = b"CANARY-root:x:0:0:do-not-read"
OLD_ATIME = 1_000_000_000  # 2001-09-09: any read updates it, under relatime as well
OLD_MTIME = 999_000_000


@pytest.fixture
def world(tmp_path: Path, mount_tmpfs: Callable[..., bool]) -> Iterator[dict[str, Any]]:
    """models/ (the allowed root) with a good checkpoint and hostile ones; outside/ (the canary) beside it."""
    outside = tmp_path / "outside"
    mounted = mount_tmpfs(outside, "16m", "strictatime", "mode=0755")
    models = tmp_path / "models"
    good = write_sample_checkpoint(models / "good", layers=1, experts=2)
    shard = max(good.glob("*.safetensors"))
    (outside / "passwd").write_bytes(CANARY + b"\n" * 64)
    (outside / "secret.safetensors").write_bytes(shard.read_bytes() + CANARY)  # a readable shard, if it were read
    elsewhere = outside / "ckpt"
    shutil.copytree(good, elsewhere)

    def variant(name: str) -> Path:
        return Path(shutil.copytree(good, models / name))

    link_shard = variant("link-shard")
    os.unlink(link_shard / shard.name)
    os.symlink(outside / "secret.safetensors", link_shard / shard.name)
    link_config = variant("link-config")
    os.unlink(link_config / "config.json")
    os.symlink(outside / "passwd", link_config / "config.json")
    link_dir = variant("link-dir")
    os.symlink(outside, link_dir / "extra")
    relative_link = variant("relative-link")
    os.symlink("../../outside/passwd", relative_link / "notes.txt")
    index_escape = variant("index-escape")
    index = json.loads((index_escape / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../../outside/secret.safetensors"
    (index_escape / "model.safetensors.index.json").write_text(json.dumps(index))
    index_abs = variant("index-absolute")
    index["weight_map"][first] = str(outside / "secret.safetensors")
    (index_abs / "model.safetensors.index.json").write_text(json.dumps(index))
    os.symlink(elsewhere, models / "link-source")
    os.symlink(outside, models / "link-root")

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    os.chmod(token_file, 0o600)  # the daemon refuses a token file others can read
    canaries = [outside, *sorted(p for p in outside.rglob("*"))]
    for p in reversed(canaries):  # children first: setting a file's times does not touch its directory's atime
        os.utime(p, (OLD_ATIME, OLD_MTIME), follow_symlinks=False)
    run = short_tempdir("tda-")
    try:
        yield {
            "models": models,
            "outside": outside,
            "good": good,
            "shard": shard.name,
            "canaries": canaries,
            "mounted": mounted,
            "sources": {
                "the source itself outside": elsewhere,
                "the canary directory": outside,
                "'..' out of an allowed root": models / ".." / "outside" / "ckpt",
                "/proc/self/root/... to outside": Path("/proc/self/root") / str(elsewhere).lstrip("/"),
                "symlinked source": models / "link-source",
                "symlink to the canary directory": models / "link-root",
                "shard symlinked outside": link_shard,
                "config.json symlinked to a file outside": link_config,
                "sub-directory symlinked outside": link_dir,
                "relative symlink ../../outside/passwd": relative_link,
                "index naming ../../outside/secret.safetensors": index_escape,
                "index naming an absolute path outside": index_abs,
                "missing path outside (no probing)": outside / "nope",
            },
            "token_file": token_file,
            "run": run,
            "cache": tmp_path / "cache",
        }
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _atimes(paths: list[Path]) -> dict[str, int]:
    return {str(p): os.lstat(p).st_atime_ns for p in paths}


def _start(world: dict[str, Any], **kw: Any) -> DaemonThread:
    settings = Settings(
        socket=world["run"] / "td.sock",
        port=0,
        token_file=world["token_file"],
        cache_dir=world["cache"],
        allow_roots=[world["models"]],
        device="cpu",
        log_level="critical",
        **kw,
    )
    return DaemonThread(settings).start()


def _raw_tcp(address: tuple[str, int], request: bytes) -> int:
    """Send raw bytes to the TCP listener; the status of the answer (0 if the connection was closed without one)."""
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(request)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                return 0
            data += chunk
    return int(data.split(b" ", 2)[1])


def test_wrong_tokens_of_every_length_are_401_compared_in_constant_time(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch, fault_log
) -> None:
    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", counting)
    daemon = _start(world)
    wrong = [
        None,
        "",
        "Bearer",
        f"Bearer {TOKEN[:-1]}X",  # same length, last character wrong
        f"Bearer X{TOKEN[1:]}",  # same length, first character wrong
        f"Bearer {TOKEN[:8]}",  # a prefix
        f"Bearer {TOKEN}{TOKEN}",  # longer
        f"Bearer {TOKEN} extra",
        f"Bearer {'A' * 4000}",  # long
        f"Basic {TOKEN}",
        f"Token {TOKEN}",
        TOKEN,
        f"bearer{TOKEN}",
    ]
    try:
        with daemon.client(tcp=True) as http:
            for header in wrong:
                calls.clear()
                headers = {} if header is None else {"Authorization": header}
                for url in ("/healthz", "/v1/cache"):
                    r = http.get(url, headers=headers)
                    assert r.status_code == 401, (header, url, r.text)
                    assert r.json()["error"]["code"] == "unauthorized"
                assert http.post("/v1/checkpoints", headers=headers, json={"source": str(world["good"])}).status_code \
                    == 401
                assert len(calls) == 3 and all(c == (32, 32) for c in calls), (header, calls)
            calls.clear()
            assert http.get("/healthz", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
            assert calls == [(32, 32)]
        address = daemon.listeners.tcp_address
        assert address is not None
        for raw in (
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\x00\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\xc3\xa9\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b"x" * 60000 + b"\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nAuthorization: Bearer "
            + TOKEN.encode() + b"\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer\t" + TOKEN.encode() + b"x\r\n\r\n",
        ):
            status = _raw_tcp(address, raw)
            assert status in (0, 400, 401, 431), (raw[:80], status)
        with daemon.client() as http:  # the unix socket needs no token
            assert http.get("/healthz").status_code == 200
    finally:
        daemon.stop()
    source = (Path(middleware.__file__)).read_text()
    assert "hmac.compare_digest(_digest(" in source and "== self._token" not in source
    fault_log.record(CATEGORY, "TCP without a token, wrong tokens of equal/shorter/longer length, other schemes",
                     len(wrong) * 3, "401 unauthorized; each compared with hmac.compare_digest on 32-byte digests")
    fault_log.record(CATEGORY, "raw Authorization headers: non-ASCII, NUL, 60 kB, empty, tab, a second header "
                     "with the token", 6, "refused (401/400/431 or connection closed), never served")


TRAVERSALS = [
    "..",
    "%2e%2e",
    "%2E%2E",
    ".%2e",
    "..%2f..%2f..%2foutside%2fpasswd",
    "..%252f..%252foutside%252fpasswd",
    "%2e%2e%2f%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "..%5c..%5coutside%5cpasswd",
    "..\\..\\outside\\passwd",
    "%c0%ae%c0%ae%2f%c0%ae%c0%aepasswd",
    "%2fetc%2fpasswd",
    "%00",
    "model-00001-of-00002.safetensors%00.txt",
    "a" * 300,
    "%2e" * 2000,
    "x" * 7000,
]


def test_key_and_name_parameters_cannot_leave_the_cache(world: dict[str, Any], fault_log) -> None:
    daemon = _start(world)
    try:
        with daemon.client() as http:
            key = wait_ready(http, http.post("/v1/checkpoints", json={"source": str(world["good"])}).json()["key"])[
                "key"
            ]
        before = _atimes(world["canaries"])
        targets = []
        for bad in TRAVERSALS:
            targets += [
                ("GET", f"/v1/checkpoints/{bad}"),
                ("DELETE", f"/v1/checkpoints/{bad}"),
                ("GET", f"/v1/checkpoints/{bad}/files"),
                ("GET", f"/v1/checkpoints/{key}/files/{bad}"),
                ("GET", f"/v1/checkpoints/{bad}/files/{world['shard']}"),
                ("POST", f"/v1/checkpoints/{bad}/leases"),
                ("DELETE", f"/v1/checkpoints/{key}/leases/{bad}"),
            ]
        targets += [
            ("GET", f"/v1/checkpoints/{key}/files/../../../../outside/passwd"),
            ("GET", f"/v1/checkpoints/{key}/files//etc/passwd"),
            ("GET", f"/v1/checkpoints/{key}/files/%2f%2fetc%2fpasswd"),
            ("GET", f"//v1/checkpoints/{key}/files/manifest.json"),
            ("GET", f"/v1/checkpoints/{key}/files/manifest.json"),
            ("GET", f"/v1/checkpoints/{key}/files/config.json"),
            ("GET", f"/v1/checkpoints/{key}%2f..%2f..%2fquarantine/files"),
            ("GET", "http://evil/../../etc/passwd"),
        ]
        statuses: dict[int, int] = {}
        for method, target in targets:
            status, body = raw_request(daemon.socket_path, method, target)
            statuses[status] = statuses.get(status, 0) + 1
            assert status in (400, 404), (method, target[:120], status, body[:200])
            assert CANARY not in body and b"root:" not in body
            if body:
                err = json.loads(body)["error"]
                assert err["status"] == status and len(err["message"]) < 1000
        assert _atimes(world["canaries"]) == before
        with daemon.client() as http:
            assert http.get(f"/v1/checkpoints/{key}").json()["state"] == "ready"  # nothing was deleted
    finally:
        daemon.stop()
    fault_log.record(
        CATEGORY,
        f"{len(TRAVERSALS)} traversal forms ('..', %2e%2e, double-encoded and back slashes, absolute, NUL, overlong "
        "UTF-8, 7000-char names) in key/name/lease id on every route",
        len(targets),
        f"refused ({', '.join(f'{s}: {n}' for s, n in sorted(statuses.items()))}); no file outside read",
    )


def test_no_route_makes_the_daemon_read_outside_the_allowed_roots(world: dict[str, Any], fault_log) -> None:
    daemon = _start(world)
    canaries = world["canaries"]
    before = _atimes(canaries)
    answers = {}
    try:
        with daemon.client(tcp=True, token=TOKEN) as http:
            for what, source in world["sources"].items():
                r = http.post("/v1/checkpoints", json={"source": str(source)})
                assert CANARY.decode() not in r.text
                err = r.json().get("error") or {}
                answers[what] = (r.status_code, err.get("code"))
                if r.status_code == 202:  # must not happen: wait to see what it does, then fail
                    wait_ready(http, r.json()["key"])
                assert r.status_code in (403, 422), (what, r.status_code, r.text)
                if r.status_code == 403:
                    assert err["code"] == "source_not_allowed" and "allowed roots" in err["message"], err
                else:  # the index names a path: refused by name, the file is never opened
                    assert err["code"] == "invalid_checkpoint" and "not a file name in the directory" in err[
                        "message"], err
            cache = http.get("/v1/cache").json()
        after = _atimes(canaries)
    finally:
        daemon.stop()
    assert after == before, {p: (before[p], after[p]) for p in before if before[p] != after[p]}
    assert cache["entries"] == []
    for entry in (world["cache"] / "entries").iterdir():
        assert str(world["outside"]) not in (entry / "manifest.json").read_text()
    for p in (world["cache"]).rglob("*"):
        if p.is_file():
            assert CANARY not in p.read_bytes(), p
    # the detector works on this file system: reading a canary does change its atime
    with open(world["outside"] / "passwd", "rb") as f:
        assert f.read(8)
    assert os.lstat(world["outside"] / "passwd").st_atime_ns != before[str(world["outside"] / "passwd")]
    how = "tmpfs strictatime" if world["mounted"] else "old atimes under relatime"
    for what, (status, code) in answers.items():
        fault_log.record(
            CATEGORY,
            f"make the daemon read outside the allowed roots: {what}",
            1,
            f"{status} {code}; canary files and directory not read or listed (atime, {how})",
        )


def test_socket_permissions_do_not_depend_on_the_umask(tmp_path: Path, fault_log) -> None:
    tried = 0
    for umask in (0o000, 0o077, 0o022):
        run = short_tempdir("tdu-")
        old = os.umask(umask)
        try:
            sock = run / "new-dir" / "td.sock"
            daemon = DaemonThread(Settings(socket=sock, cache_dir=tmp_path / "cache", device="cpu",
                                           log_level="critical")).start()
        finally:
            os.umask(old)
        try:
            assert stat.S_ISSOCK(os.lstat(sock).st_mode)
            assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o660, (oct(umask), oct(os.lstat(sock).st_mode))
            assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o750, oct(umask)
            with daemon.client() as http:
                assert http.get("/healthz").status_code == 200
        finally:
            daemon.stop()
            shutil.rmtree(run, ignore_errors=True)
        assert not sock.exists()
        tried += 1
    # an existing directory is left as it is (the operator chose it), the socket is still 0660
    run = short_tempdir("tdu-")
    os.chmod(run, 0o711)
    try:
        with DaemonThread(Settings(socket=run / "td.sock", cache_dir=tmp_path / "cache", device="cpu",
                                   log_level="critical")):
            assert stat.S_IMODE(os.stat(run).st_mode) == 0o711
            assert stat.S_IMODE(os.lstat(run / "td.sock").st_mode) == 0o660
    finally:
        shutil.rmtree(run, ignore_errors=True)
    fault_log.record(CATEGORY, "unix socket created under umask 000, 077, 022 and in an existing directory",
                     tried + 1, "socket 0660, a new directory 0750, an existing one untouched")


def test_cache_entries_are_read_only(world: dict[str, Any], fault_log) -> None:
    daemon = _start(world)
    try:
        with daemon.client() as http:
            key = wait_ready(http, http.post("/v1/checkpoints", json={"source": str(world["good"])}).json()["key"])[
                "key"
            ]
            files = http.get(f"/v1/checkpoints/{key}/files").json()["files"]
    finally:
        daemon.stop()
    entry = entry_dir(world["cache"], key)
    # entries/<key>/ itself stays writable by the daemon's user: it is renamed from staging/ into entries/ and on
    # into trash/ or quarantine/, and moving a directory to another parent needs write permission on it (for a
    # non-root daemon). Everything in it is read-only.
    assert stat.S_IMODE(os.lstat(entry).st_mode) & 0o022 == 0, oct(os.lstat(entry).st_mode)
    checked = 1
    for p in entry.rglob("*"):
        mode = stat.S_IMODE(os.lstat(p).st_mode)
        if p.is_dir():
            assert mode == 0o555, (p, oct(mode))
        else:
            assert stat.S_ISREG(os.lstat(p).st_mode) and mode == 0o444, (p, oct(mode))
        checked += 1
    for f in files:
        assert Path(f["path"]).is_relative_to(entry) and stat.S_IMODE(os.stat(f["path"]).st_mode) == 0o444
    fault_log.record(CATEGORY, "modes of a published entry (every file and directory)", checked,
                     "files 0444 (manifest included), directories 0555; the entry directory not group/other-writable "
                     "(renamed between staging/entries/trash/quarantine); /files paths point into it")


def test_the_cache_is_never_writable_by_others(tmp_path: Path, fault_log) -> None:
    """The cache's directories took the daemon's umask: under 000 or 002 another user could copy an entry of his
    own weights under the key of someone else's checkpoint, and the daemon served it (an attack review; ``cache
    verify`` passed). ``serve`` now masks group and world write, mends its own directories that others may write
    and refuses a cache with a directory of another owner."""
    from .support.daemon import DaemonProcess

    models = tmp_path / "models"
    src = write_sample_checkpoint(models / "m", layers=1, experts=2)
    run = short_tempdir("tdu-")
    cache, mended = tmp_path / "cache", tmp_path / "mended"
    mended.mkdir()
    os.chmod(mended, 0o777)  # a volume mounted world-writable, the daemon's own
    tried = 0
    try:
        for root, umask in ((cache, 0), (mended, 0), (tmp_path / "umask077", 0o077)):
            old = os.umask(umask)
            try:
                daemon = DaemonProcess(run / "td.sock", root, [models]).start()
            finally:
                os.umask(old)
            try:
                with daemon.client(timeout=60) as http:
                    r = http.post("/v1/checkpoints", json={"source": str(src)})
                    assert r.status_code in (200, 202), r.text
                    assert wait_ready(http, r.json()["key"], timeout=120)["state"] == "ready"
            finally:
                daemon.stop()
            writable = [p for p in [root, *root.rglob("*")] if not p.is_symlink() and p.lstat().st_mode & 0o022]
            assert writable == [], [(str(p), oct(p.lstat().st_mode)) for p in writable]
            # and every entry readable by the engines of other users, whatever the umask (077 made them 0700/0600)
            closed = [p for p in [root, root / "entries", *(root / "entries").rglob("*")]
                      if not p.lstat().st_mode & (0o001 if p.is_dir() else 0o004)]
            assert closed == [], [(str(p), oct(p.lstat().st_mode)) for p in closed]
            tried += 1
        if os.geteuid() == 0:  # a sub-directory another user owns (he made it first): refused, not used
            os.chown(cache / "entries", 65534, 65534)
            with pytest.raises(RuntimeError, match="exited with 1"):
                DaemonProcess(run / "td.sock", cache, [models]).start()
            log = (run / "td.log").read_text()
            assert f"cache directory {cache / 'entries'} (mode 0711, owner uid 65534) can be written by others" in log
            theirs = tmp_path / "theirs"  # a root another user owns: he may rename what the daemon makes in it
            theirs.mkdir()
            os.chown(theirs, 65534, 65534)
            os.chmod(theirs, 0o755)
            with pytest.raises(RuntimeError, match="exited with 1"):
                DaemonProcess(run / "td.sock", theirs, [models]).start()
            assert f"cache directory {theirs} (mode 0755, owner uid 65534) can be written by others" in (
                run / "td.log").read_text()
            tried += 2
    finally:
        shutil.rmtree(run, ignore_errors=True)
    fault_log.record(CATEGORY, "the daemon started under umask 000 (a new cache, and its own cache dir mounted "
                     "0777) and 077; a cache sub-directory, or the cache root, of another owner", tried,
                     "no directory or file group/world-writable (mended), every entry readable by others; another "
                     "owner's: refused at start, exit 1")
