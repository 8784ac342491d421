"""The main job, end to end on the built-in sample checkpoint (``transformd demo``).

What an inference node does with transformd, in one command:

1. start the daemon (``transformd serve`` on a private unix socket and cache),
2. write the sample MXFP8 MoE checkpoint,
3. resolve it through the HTTP API (the first request converts, on the GPU when there is one),
4. map the converted tensors (zero-copy, copy-on-write) through the ``/files`` tensor tables,
5. report the reconstruction error of both scale modes,
6. resolve again: the cache answers without converting.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from .client import TransformdClient
from .loader import load_from_daemon
from .report import compare_checkpoints, compare_modes_checkpoint, transformd_record
from .sample import write_sample_checkpoint

START_TIMEOUT_S = 60.0
#: What the demo puts in its working directory: a ``--dir`` holding anything else is refused (it is not the demo's
#: to fill, and the last line suggests removing it).
DEMO_FILES = frozenset({"sample-mxfp8", "cache", "daemon.log", "transformd.sock"})


def run_demo(workdir: Path | None = None, *, device: str = "auto", echo=print) -> Path:
    """Run the demo in ``workdir`` (a new temporary directory by default); returns the converted directory."""
    temporary = workdir is None
    workdir = Path(workdir).absolute() if workdir else Path(tempfile.mkdtemp(prefix="transformd-demo-"))
    others = sorted(set(os.listdir(workdir)) - DEMO_FILES) if workdir.is_dir() else []
    if others:
        raise ValueError(f"--dir {workdir} holds files of its own ({', '.join(others[:3])}"
                         f"{', ...' if len(others) > 3 else ''}); give the demo a new or empty directory, or one an "
                         "earlier demo made")
    workdir.mkdir(parents=True, exist_ok=True)
    made = "a new temporary directory" if temporary else "--dir"
    echo(f"0. working directory ({made}): {workdir}: the sample, the daemon's socket, log and cache")
    src = workdir / "sample-mxfp8"
    if not (src / "config.json").exists():
        write_sample_checkpoint(src)
    size = sum(f.stat().st_size for f in src.iterdir())
    echo(f"1. sample MXFP8 checkpoint: {src} ({size / 2**20:.1f} MiB)")

    socket = workdir / "transformd.sock"
    daemon = _start_daemon(workdir, socket, device)
    try:
        with TransformdClient(socket=socket) as client:
            _wait_healthy(client, daemon)
            health = client.health()
            echo(f"2. daemon up on {socket} (device {health.get('device')}, cache {health.get('cache_root')})")

            t0 = time.perf_counter()
            # target auto, as an engine's start-up hook asks: FNUZ for a gfx94x GPU, else OCP e4m3fn
            path = client.resolve(str(src), scale_mode="exact", timeout=600)
            cold = time.perf_counter() - t0
            key = client.last_key
            target = transformd_record(Path(path))["target"]
            echo(f"3. resolved through the API in {cold:.2f} s (converted, target {target} for this node): {path}")

            with client.lease(key, ttl_s=600, holder="transformd demo"):
                tensors = load_from_daemon(client, key)
                dtypes = Counter(str(t.dtype).removeprefix("torch.") for t in tensors.values())
                mapped = sum(t.numel() * t.element_size() for t in tensors.values())
                echo(
                    f"4. mapped {len(tensors)} tensors ({mapped / 2**20:.1f} MiB) copy-on-write from "
                    f"{len(tensors.mappings)} files, zero-copy: " + ", ".join(f"{n} {d}" for d, n in dtypes.items())
                )

            report = compare_checkpoints(src, path)
            echo("\n5. reconstruction error of the converted checkpoint, per converted weight:")
            echo(report.format_table(legend=True))
            amax = compare_modes_checkpoint(src, target)["amax"].overall
            echo(
                f"   scale mode amax (vLLM PR #45726 parity) would give: rel L2 {amax.rel_l2:.3e}, "
                f"exact {100 * amax.exact_fraction:.3f}%"
            )

            t0 = time.perf_counter()
            again = client.resolve(str(src), scale_mode="exact")
            warm = time.perf_counter() - t0
            hits = _metric(client.metrics(), "transformd_cache_hits_total")
            echo(f"\n6. second resolve: {warm * 1e3:.1f} ms from the cache (cache hits: {hits:g}), "
                 f"same path: {again == path}")
    finally:
        _stop_daemon(daemon)
    echo(f"\nThe daemon was stopped; its files stay in {workdir} (remove them with: rm -rf {workdir})")
    return path


def _start_daemon(workdir: Path, socket: Path, device: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "transformd", "serve", "--socket", str(socket), "--cache-dir", str(workdir / "cache"),
           "--allow-root", str(workdir), "--device", device]
    log = open(workdir / "daemon.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        log.close()


def _wait_healthy(client: TransformdClient, daemon: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited with status {daemon.returncode}; see daemon.log")
        try:
            client.health()
            return
        except Exception:  # noqa: BLE001 - not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the daemon did not answer within {START_TIMEOUT_S:.0f} s; see daemon.log") from None
            time.sleep(0.1)


def _stop_daemon(daemon: subprocess.Popen) -> None:
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def _metric(text: str, name: str) -> float:
    """Sum of the samples of one Prometheus metric in ``text``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith(f"{name}_created"):
            total += float(line.rsplit(" ", 1)[1])
    return total


if __name__ == "__main__":  # pragma: no cover
    run_demo(Path(os.environ["TRANSFORMD_DEMO_DIR"]) if "TRANSFORMD_DEMO_DIR" in os.environ else None)
