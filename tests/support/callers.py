"""Another caller of the daemon's unix socket: a child process that ``setuid``s to an unprivileged uid and speaks
HTTP/1.1 by hand (the peer credentials the daemon sees are that uid's). Needs root.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

#: The unprivileged uid the tests act as.
NOBODY = 65534

_CLIENT = textwrap.dedent(
    """
    import json, os, socket, sys, threading  # (imported before setuid: the stdlib may be unreadable to uid)
    uid, _, gid = sys.argv[2].partition(":")
    os.setgroups([])
    os.setgid(int(gid or uid))
    os.setuid(int(uid))
    requests = json.loads(sys.argv[3])
    parallel = len(sys.argv) > 4 and sys.argv[4] == "parallel"

    def one(method, path, body, s):
        data = b"" if body is None else json.dumps(body).encode()
        s.sendall(f"{method} {path} HTTP/1.1\\r\\nHost: td\\r\\nContent-Type: application/json\\r\\n"
                  f"Content-Length: {len(data)}\\r\\nConnection: close\\r\\n\\r\\n".encode() + data)
        raw = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
        s.close()
        head, _, payload = raw.partition(b"\\r\\n\\r\\n")
        return [int(head.split()[1]), payload.decode("utf-8", "replace")]

    def connected():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        s.connect(sys.argv[1])
        return s

    if parallel:  # every request on its own connection, all sent at once (connected first, then a barrier)
        socks = [connected() for _ in requests]
        out = [None] * len(requests)
        barrier = threading.Barrier(len(requests))

        def run(i):
            barrier.wait()
            out[i] = one(*requests[i], socks[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        out = [one(method, path, body, connected()) for method, path, body in requests]
    print(json.dumps(out))
    """
)


def as_uid(sock: Path, uid: int, requests: list[tuple[str, str, Any]], *, parallel: bool = False,
           timeout: float = 120, gid: int | None = None) -> list[tuple[int, Any]]:
    """Run ``requests`` (method, path, JSON body) as ``uid`` (group ``gid``, default the uid's number, and no other)
    in a child process; (status, JSON) per request, in order. ``parallel``: each on its own connection, connected
    first and then all sent at once (one thread each)."""
    who = f"{uid}:{gid}" if gid is not None else str(uid)
    argv = [sys.executable, "-c", _CLIENT, str(sock), who, json.dumps(requests), *(["parallel"] if parallel else [])]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, r.stderr
    return [(status, json.loads(body) if body.strip() else None) for status, body in json.loads(r.stdout)]


_HOLD = textwrap.dedent(
    """
    import os, socket, sys, time
    uid, n = int(sys.argv[2]), int(sys.argv[3])
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    held = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sys.argv[1])
        held.append(s)
    print("held", flush=True)
    time.sleep(600)
    """
)


def hold_connections(sock: Path, uid: int, n: int) -> subprocess.Popen[str]:
    """A child process of ``uid`` that opens ``n`` connections to ``sock`` and sends nothing on them (idle) until it
    is killed; returns once they are connected."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(sock), str(uid), str(n)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def refused_for(checked: str) -> str:
    """What a 403 for a source the caller may not read says is missing: ``checked`` (the words of the daemon's
    mode-bit checks) or, where it reads with the caller's own credentials, the kernel's one answer."""
    from transformd.daemon import fscreds

    return fscreds.KERNEL_MISSING if fscreds.kernel_available() else checked
