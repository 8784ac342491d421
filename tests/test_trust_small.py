"""Trust class 8: small holes. Real daemon on a unix socket, raw HTTP where httpx would normalise the request.

* a lone surrogate in ``source`` (``"\\ud800"`` in the JSON): 400 ``bad_source`` (before: 500);
* a chunked request body past the 64 KiB limit: 413 ``body_too_large`` as the README says (before: 400);
* a token file readable by group or others: ``transformd serve`` refuses to start and says ``chmod 600``
  (before: accepted silently).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


from .support.daemon import Daemons, raw_request

pytestmark = pytest.mark.timeout(120)

CATEGORY = "trust 8: small holes"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("trust-small")
    (base / "models").mkdir()
    with Daemons() as daemons:
        daemon = daemons.start(cache_dir=base / "cache", allow_roots=[base / "models"], prefix="tds-",
                               log_level="critical")
        yield {"sock": daemon.socket_path, "base": base}


def test_lone_surrogate_in_source_is_400(world: dict[str, Any], fault_log) -> None:
    bodies = [b'{"source": "/models/\\ud800"}', b'{"source": "\\udfff"}', b'{"source": "/x/\\ud800\\u0000"}']
    for body in bodies:
        status, payload = raw_request(world["sock"], "POST", "/v1/checkpoints",
                                      headers={"Content-Type": "application/json"}, body=body)
        assert status == 400, (body, status, payload)
        assert json.loads(payload)["error"]["status"] == 400
    fault_log.record(CATEGORY, "lone surrogate in source", len(bodies), "400 bad_source")


def _chunked(sock: Path, size: int) -> tuple[int, bytes]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(os.fspath(sock))
        s.sendall(b"POST /v1/checkpoints HTTP/1.1\r\nHost: td\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        body = b'{"source": "' + b"a" * size + b'"}'
        try:
            for i in range(0, len(body), 8192):
                part = body[i : i + 8192]
                s.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon answered and closed before the end of the body
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


def test_chunked_body_over_the_limit_is_413(world: dict[str, Any], fault_log) -> None:
    status, payload = _chunked(world["sock"], 100_000)
    assert status == 413, (status, payload[:200])
    assert json.loads(payload)["error"]["code"] == "body_too_large"
    status, _ = _chunked(world["sock"], 100)  # a small chunked body is still read as usual
    assert status in (400, 403, 404, 422), status
    fault_log.record(CATEGORY, "chunked request body of 100 kB (limit 64 KiB)", 1, "413 body_too_large")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_token_file_others_can_read_refuses_to_start(tmp_path: Path, mode: int, fault_log) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 40 + "\n")
    os.chmod(token, mode)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "transformd", "serve", "--port", "0", "--token-file", str(token),
             "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"],
            capture_output=True, text=True, timeout=30, check=False, env={**os.environ, "TRANSFORMD_SOCKET": ""},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the daemon started with a token file of mode {mode:04o}")
    assert r.returncode != 0, r.stderr
    assert "chmod 600" in r.stderr, r.stderr
    fault_log.record(CATEGORY, "token file readable by group or others", 1,
                     "the daemon refuses to start, saying chmod 600")
