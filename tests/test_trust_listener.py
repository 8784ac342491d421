"""Trust, second round (issue 42, item 9): the listener and the token file.

Real daemons on unix sockets, attacked by other uids (child processes that ``setuid``):

* idle connections of many uids, each within its per-uid share, fill the unix listener: the last eighth of it
  (64 connections at most) is kept for root, the daemon's uid and the admins, so they are still answered
  (before: 16 uids x 128 idle connections filled all 2048, and root got 503 too);
* a peer that sends requests and reads none of the answers is cut once its unsent bytes stop shrinking for
  ``write_timeout_s`` (before: its connection, and its uid's share, were held for ever);
* a 0600 token file owned by another uid: the daemon refuses to start (its owner can read the token).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .support.callers import NOBODY, hold_connections
from .support.daemon import Daemons, short_tempdir

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid"),
]

CATEGORY = "trust, round 2: listener and token"


def _start(daemons: Daemons, **settings: object):  # -> DaemonThread
    base = short_tempdir("tdls-")
    (base / "models").mkdir()
    daemon = daemons.start(cache_dir=base / "cache", allow_roots=[base / "models"], prefix="tdls-",
                           log_level="critical", **settings)
    os.chmod(daemon.socket_path.parent, 0o755)
    os.chmod(daemon.socket_path, 0o666)  # let the unprivileged processes connect (the test's choice)
    return daemon


def test_idle_connections_of_many_uids_leave_room_for_root(daemons: Daemons, fault_log) -> None:
    limit, share, uids = 40, 8, [NOBODY - i for i in range(6)]
    daemon = _start(daemons, max_unix_connections=limit, max_unix_connections_per_uid=share, header_timeout_s=60)
    holders = []
    try:
        for uid in uids:  # 6 x 8 = 48 idle connections asked for: more than the listener has
            holders.append(hold_connections(daemon.socket_path, uid, share))
        time.sleep(0.5)
        with daemon.client(timeout=10) as http:
            for _ in range(5):
                r = http.get("/healthz", headers={"Connection": "close"})
                assert r.status_code == 200, r.text
    finally:
        for proc in holders:
            proc.kill()
            proc.wait()
    fault_log.record(CATEGORY, f"{len(uids)} uids x {share} idle unix connections (listener {limit})", 5,
                     "root still answered (the admins' room of the listener)")


_SLOW_READER = textwrap.dedent(
    """
    import os, socket, sys, time
    os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))
    n = int(sys.argv[3])
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(sys.argv[1])
    s.sendall(b"GET /openapi.json HTTP/1.1\\r\\nHost: td\\r\\n\\r\\n" * n)
    time.sleep(float(sys.argv[4]))  # reads nothing meanwhile
    s.settimeout(20)
    got, t = b"", time.monotonic()
    while True:
        try:
            chunk = s.recv(1 << 20)
        except socket.timeout:
            break
        if not chunk:
            break
        got += chunk
    print(got.count(b"HTTP/1.1 200"), round(time.monotonic() - t, 1))
    """
)


def test_a_peer_that_reads_nothing_is_cut(daemons: Daemons, fault_log) -> None:
    daemon = _start(daemons, write_timeout_s=1.0)
    n = 200  # answers of ~10 kB each: far more than the socket buffers hold
    r = subprocess.run([sys.executable, "-c", _SLOW_READER, str(daemon.socket_path), str(NOBODY), str(n), "5"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    answered = int(r.stdout.split()[0])
    assert answered < n, f"all {n} answers were kept for a peer that read nothing for 5 s"
    with daemon.client(timeout=10) as http:
        assert http.get("/healthz").status_code == 200
    fault_log.record(CATEGORY, f"a peer pipelines {n} requests and reads nothing for 5 s (write timeout 1 s)", 1,
                     f"cut: {answered} answers sent before")


def test_a_token_file_of_another_uid_refuses_to_start(fault_log) -> None:
    base = short_tempdir("tdtk-")
    token = base / "token"
    token.write_text("t" * 40 + "\n")
    os.chmod(token, 0o600)
    os.chown(token, NOBODY, NOBODY)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "transformd", "serve", "--port", "0", "--token-file", str(token),
             "--cache-dir", str(base / "cache"), "--device", "cpu"],
            capture_output=True, text=True, timeout=30, check=False, env={**os.environ, "TRANSFORMD_SOCKET": ""},
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the daemon started with a token file of another uid")
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    assert r.returncode != 0, r.stderr
    assert f"owned by uid {NOBODY}" in r.stderr, r.stderr
    fault_log.record(CATEGORY, "0600 token file owned by another uid", 1, "the daemon refuses to start, saying chown")


def test_a_token_file_of_the_daemons_uid_is_read(tmp_path: Path) -> None:
    from transformd.daemon.settings import read_token_file

    token = tmp_path / "token"
    token.write_text("t" * 40 + "\n")
    os.chmod(token, 0o600)
    assert read_token_file(token) == b"t" * 40
