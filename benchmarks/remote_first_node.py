"""The first node's answer with the remote tier against without: issue 43's "the first node's answer <= 1.05x its
conversion without the tier".

A checkpoint no node has converted yet is resolved as an engine's start-up hook does it (``transformd resolve SRC
--engine vllm`` in its own process, against a running daemon with an empty cache), once by a daemon started with
``--remote`` (it looks the key up in the bucket, misses, converts, answers, then uploads in the background) and
once by a daemon without it, interleaved, ``--rounds`` times each with fresh caches and a fresh bucket prefix (so
the tier always misses). The daemons start before the clock; the upload's own time is shown apart (from the
answer until the entry's manifest is in the bucket). The server is ``rclone serve s3`` on loopback
(:mod:`tests.support.s3server`); the daemon converts on the CPU.

    python benchmarks/remote_first_node.py --layers 4 --experts 16 --hidden 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.daemon import DaemonProcess  # noqa: E402
from tests.support.s3server import S3Server  # noqa: E402
from transformd.remote import Remote  # noqa: E402
from transformd.sample import write_sample_checkpoint  # noqa: E402


def _resolve(daemon: DaemonProcess, src: Path, env: dict[str, str]) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "transformd", "resolve", str(src), "--engine", "vllm", "--socket",
           str(daemon.socket_path), "--timeout", "3600"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.strip()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoint, the caches and the bucket go")
    args = ap.parse_args()
    times: dict[str, list[float]] = {"without the tier": [], "with the tier (miss, convert, answer)": []}
    uploads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="transformd-first-node-", dir=args.dir) as tmp_s:
        tmp = Path(tmp_s)
        src = tmp / "models" / "src"
        write_sample_checkpoint(src, layers=args.layers, experts=args.experts, hidden=args.hidden,
                                moe_intermediate=args.hidden // 2)
        size = sum(f.stat().st_size for f in src.iterdir())
        with S3Server(tmp / "s3") as server:
            env = server.env()
            os.environ.update(env)  # (this process asks the bucket too: the server's credentials, no other source)
            client_env = dict(os.environ)
            for r in range(args.rounds):
                for mode in times:
                    tier = mode != "without the tier"
                    url = server.url(f"round{r}")
                    cache = tmp / f"cache-{r}-{int(tier)}"
                    daemon = DaemonProcess(tmp / f"td-{r}-{int(tier)}.sock", cache, [tmp / "models"],
                                           args=["--remote", url] if tier else [], env=env).start()
                    try:
                        took, path = _resolve(daemon, src, client_env)
                        times[mode].append(took)
                        if tier:  # the upload goes on after the answer: until its manifest (the commit) is there
                            t0, key = time.perf_counter(), Path(path).parent.name.partition("-")[0]
                            remote = Remote.from_url(url)
                            while not remote.has(key):
                                time.sleep(0.05)
                            uploads.append(time.perf_counter() - t0)
                    finally:
                        daemon.stop()
                        shutil.rmtree(cache, ignore_errors=True)
    base = statistics.median(times["without the tier"])
    print(f"{size / 2**20:.0f} MiB checkpoint, daemon on the CPU, rclone serve s3 on loopback; "
          f"median of {args.rounds} whole `transformd resolve` processes, interleaved\n")
    print("| first resolve                           | seconds (each round)        | median | vs without |")
    print("|-----------------------------------------|-----------------------------|-------:|-----------:|")
    for mode, ts in times.items():
        each = " / ".join(f"{t:.2f}" for t in ts)
        print(f"| {mode:<39} | {each:<27} | {statistics.median(ts):6.2f} | {statistics.median(ts) / base:9.2f}x |")
    print(f"\nupload after the answer, until the manifest is in the bucket: "
          f"{' / '.join(f'{t:.2f}' for t in uploads)} s")


if __name__ == "__main__":
    main()
