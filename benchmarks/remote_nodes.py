"""Two nodes and one bucket, whole processes: issue 43's "Done when" numbers.

A checkpoint sits in a Hugging Face hub cache (``org/Model`` at a full commit) on the first node. Engines'
start-up hooks ask for it as they do in production: ``transformd resolve org/Model --revision COMMIT --engine
vllm`` in its own process, against a daemon already running (started before the clock, as at a node's boot).

- **First node** (``--rounds`` times, interleaved, fresh caches): the daemon without the tier against one started
  with ``--remote`` (it looks the key up in the bucket, misses, converts, answers, then uploads the entry and its
  alias record in the background; each round a fresh bucket prefix, so it always misses). The answer must not
  wait for the upload: the upload's own time is shown apart (from the answer until the manifest is in the bucket).
- **Second node** (``--rounds`` times, interleaved): a daemon with an empty cache and an empty hub cache (no
  source at all) and ``--remote`` on round 1's prefix resolves the same repo id and commit: alias record, manifest,
  every file downloaded and checked (BLAKE3), published in its cache. Against it, a plain download of the same
  objects from the same server by the same client library (obstore, the files in parallel, with and without an
  fsync of each file) and by ``rclone copy``, each its own process.

The server is ``rclone serve s3`` on loopback (:mod:`tests.support.s3server`), keeping its objects under
``--bucket-dir`` (a tmpfs such as /dev/shm keeps a 16 GiB run within a 64 GiB disk). Every process shares the
machine's cores with the server: the numbers compare the tier with a download, not with a network. The second
node's entry is checked to be the first node's (same key, same bytes).

    python benchmarks/remote_nodes.py --layers 4 --experts 16 --hidden 1024 --rounds 3          # ~110 MiB, CPU
    python benchmarks/remote_nodes.py --gib 16 --device cuda --rounds 3 --dir /tmp/rn --bucket-dir /dev/shm/rn
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

from convert_bench import HEAD_DIM, HIDDEN, KV_HEADS, MOE_INTERMEDIATE, sample_shape  # noqa: E402
from remote_bench import PLAIN_CLIENT, rclone_env, timed  # noqa: E402

from tests.support.daemon import DaemonProcess  # noqa: E402
from tests.support.s3server import S3Server  # noqa: E402
from tests.test_hub import add_snapshot  # noqa: E402
from transformd.remote import Remote  # noqa: E402
from transformd.sample import write_sample_checkpoint  # noqa: E402

REPO_ID, COMMIT = "bench/Model", "5eed" * 10


def _resolve(daemon: DaemonProcess, env: dict[str, str], source: list[str]) -> tuple[float, Path]:
    took, out = timed([sys.executable, "-m", "transformd", "resolve", *source, "--engine", "vllm", "--socket",
                        str(daemon.socket_path), "--timeout", "3600"], env)
    return took, Path(out)


def _sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def _rm(path: Path) -> None:
    subprocess.run(["chmod", "-R", "u+w", str(path)], check=False, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


def _table(title: str, times: dict[str, list[float]], base: str, nbytes: int) -> None:
    print(f"\n{title}\n")
    print(f"| {'operation':<46} | {'seconds (each round)':<26} | median |  GiB/s | vs {base.split(':')[0][:6]:<6} |")
    print(f"|{'-' * 48}|{'-' * 28}|-------:|-------:|----------:|")
    ref = statistics.median(times[base])
    for name, ts in times.items():
        med = statistics.median(ts)
        each = " / ".join(f"{t:.2f}" for t in ts)
        print(f"| {name:<46} | {each:<26} | {med:6.2f} | {nbytes / 2**30 / med:6.2f} | {med / ref:9.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=None, help="checkpoint size (the knobs of convert_bench.py)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="the daemons' --device (cpu, cuda)")
    ap.add_argument("--dir", default=None, help="the hub cache, the nodes' caches and the downloads")
    ap.add_argument("--bucket-dir", default=None, help="where the S3 server keeps its objects (default: in --dir)")
    ap.add_argument("--skip-first", action="store_true", help="only round 1 of the first node (to fill the bucket)")
    ap.add_argument("--by", choices=["repo", "path"], default="repo",
                    help="name the checkpoint by repo id and commit (a hub cache; the second node has no source), "
                         "or by its directory (both nodes hold the source: the second keys it, then downloads)")
    args = ap.parse_args()
    first: dict[str, list[float]] = {"without the tier": [], "with the tier (miss, convert, answer)": []}
    second: dict[str, list[float]] = {"second node: transformd resolve (tier, checked)": [],
                                      "plain download: obstore": [], "plain download: obstore, fsync": [],
                                      "plain download: rclone copy": []}
    uploads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="transformd-nodes-", dir=args.dir) as tmp_s, \
            tempfile.TemporaryDirectory(prefix="transformd-bucket-", dir=args.bucket_dir) as bucket_s:
        tmp = Path(tmp_s)
        t0 = time.perf_counter()
        if args.gib:
            knobs = {**sample_shape(int(args.gib * 2**30)), "hidden": HIDDEN, "moe_intermediate": MOE_INTERMEDIATE,
                     "head_dim": HEAD_DIM, "kv_heads": KV_HEADS}
        else:
            knobs = {"layers": args.layers, "experts": args.experts, "hidden": args.hidden,
                     "moe_intermediate": args.hidden // 2}
        src = write_sample_checkpoint(tmp / ("work" if args.by == "repo" else "models-a") / "model", **knobs)
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        if args.by == "repo":  # (moved into a hub cache as a download of REPO_ID at COMMIT)
            add_snapshot(tmp / "models-a" / "hub", REPO_ID, COMMIT, src, ("main",))
            source, second_models = [REPO_ID, "--revision", COMMIT], "models-b"
        else:
            source, second_models = [str(src)], "models-a"
        for node in ("models-a", "models-b"):  # (the second node's: empty)
            (tmp / node / "hub").mkdir(parents=True, exist_ok=True)
        print(f"sample: {size / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        with S3Server(Path(bucket_s) / "s3") as server:
            env = {**server.env(), "HF_HUB_OFFLINE": "1"}
            os.environ.update(env)  # (this process asks the bucket too: the server's credentials, no other source)
            client_env = dict(os.environ)
            rclone = rclone_env(server, client_env)

            def daemon(name: str, models: str, remote: str | None) -> DaemonProcess:
                hub = tmp / models / "hub"
                extra = ["--device", args.device, "--hub-cache", str(hub)] + (["--remote", remote] if remote else [])
                return DaemonProcess(tmp / f"{name}.sock", tmp / f"cache-{name}", [tmp / models], args=extra,
                                     env=env).start(timeout=600)

            warm = write_sample_checkpoint(tmp / "models-a" / "warm-up", layers=1, experts=2, shards=1)
            d = daemon("warm", "models-a", None)  # (a first conversion compiles the kernels: not in the rounds)
            try:
                timed([sys.executable, "-m", "transformd", "resolve", str(warm), "--engine", "vllm", "--socket",
                        str(d.socket_path)], client_env)
            finally:
                d.stop()
                _rm(d.cache_dir)
            first_entry: Path | None = None
            for r in range(1 if args.skip_first else args.rounds):
                for mode in first:
                    tier = mode != "without the tier"
                    if args.skip_first and not tier:
                        continue
                    url = server.url(f"round{r}")
                    d = daemon(f"a{r}{int(tier)}", "models-a", url if tier else None)
                    try:
                        took, path = _resolve(d, client_env, source)
                        first[mode].append(took)
                        print(f"first node round {r + 1}, {mode}: {took:.2f} s", file=sys.stderr, flush=True)
                        if tier:  # the upload goes on after the answer: until its manifest (the commit) is there
                            t1, key = time.perf_counter(), path.parent.name.partition("-")[0]
                            remote = Remote.from_url(url)
                            while not remote.has(key):
                                time.sleep(0.05)
                            uploads.append(time.perf_counter() - t1)
                    finally:
                        d.stop()
                    if tier and r == 0:  # the second node's source of truth: kept until the end
                        first_entry = path
                    else:
                        _rm(d.cache_dir)
                    if tier and r > 0:
                        shutil.rmtree(server.object_path(f"round{r}"), ignore_errors=True)
            assert first_entry is not None
            key = first_entry.parent.name.partition("-")[0]
            entry_bytes = sum(_sizes(first_entry).values())
            objects = f"round0/entries/{key}/checkpoint"
            for r in range(args.rounds):
                down = tmp / f"down{r}"
                down.mkdir()
                b = daemon(f"b{r}", second_models, server.url("round0"))
                try:
                    took, path = _resolve(b, client_env, source)
                    with b.client() as http:
                        hits = http.get("/v1/cache").json()["remote"]["hits"]
                    assert hits == 1, f"the second node did not download the entry (remote hits: {hits})"
                finally:
                    b.stop()
                second["second node: transformd resolve (tier, checked)"].append(took)
                assert path.parent.name.partition("-")[0] == key, (path, first_entry)
                assert _sizes(path) == _sizes(first_entry), (path, first_entry)
                largest = max(_sizes(path).items(), key=lambda kv: kv[1])[0]
                assert subprocess.run(["cmp", path / largest, first_entry / largest]).returncode == 0, largest
                _rm(b.cache_dir)
                for name, cmd, env_ in (
                    ("plain download: obstore", [sys.executable, "-c", PLAIN_CLIENT, "get", server.bucket, objects,
                                                 str(down / "plain")], client_env),
                    ("plain download: obstore, fsync", [sys.executable, "-c", PLAIN_CLIENT, "get-fsync",
                                                        server.bucket, objects, str(down / "plainsync")], client_env),
                    ("plain download: rclone copy", [server.binary, "copy", f":s3:{server.bucket}/{objects}",
                                                     str(down / "rclone"), "--transfers", "8"], rclone),
                ):
                    second[name].append(timed(cmd, env_)[0])
                    _rm(down)
                    down.mkdir()
                print(f"second node round {r + 1}: " + ", ".join(f"{k.split(': ')[-1]} {v[-1]:.2f} s"
                                                                 for k, v in second.items()), file=sys.stderr,
                      flush=True)
                _rm(down)
    where = f"daemons on --device {args.device}, rclone serve s3 on loopback, named by {args.by}"
    if not args.skip_first:
        _table(f"First node: {size / 2**30:.2f} GiB checkpoint, {where}; whole `transformd resolve` processes, "
               "interleaved", first, "without the tier", size)
        print(f"\nupload after the answer, until the manifest is in the bucket: "
              f"{' / '.join(f'{t:.2f}' for t in uploads)} s")
    holds = "no source" if args.by == "repo" else "the source on its disk"
    _table(f"Second node (empty cache, {holds}): the entry's {entry_bytes / 2**30:.2f} GiB, {where}; whole "
           "processes, interleaved", second, "plain download: obstore", entry_bytes)


if __name__ == "__main__":
    main()
