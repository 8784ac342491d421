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
    import json, os, socket, sys
    uid = int(sys.argv[2])
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    out = []
    for method, path, body in json.loads(sys.argv[3]):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        s.connect(sys.argv[1])
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
        out.append([int(head.split()[1]), payload.decode("utf-8", "replace")])
    print(json.dumps(out))
    """
)


def as_uid(sock: Path, uid: int, requests: list[tuple[str, str, Any]]) -> list[tuple[int, Any]]:
    """Run ``requests`` (method, path, JSON body) as ``uid`` in a child process; (status, JSON) per request."""
    r = subprocess.run([sys.executable, "-c", _CLIENT, str(sock), str(uid), json.dumps(requests)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return [(status, json.loads(body) if body.strip() else None) for status, body in json.loads(r.stdout)]


def refused_for(checked: str) -> str:
    """What a 403 for a source the caller may not read says is missing: ``checked`` (the words of the daemon's
    mode-bit checks) or, where it reads with the caller's own credentials, the kernel's one answer."""
    from transformd.daemon import fscreds

    return fscreds.KERNEL_MISSING if fscreds.kernel_available() else checked
