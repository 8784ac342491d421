"""The GPU suite: every kernel variant on a real GPU, bit for bit, and a record of what it ran.

CI has no GPU: there the portable kernel runs in Triton's CPU interpreter and the ``ptx`` kernel does not run at
all. This script is what runs them. On an NVIDIA GPU (compute capability 8.9+ for ``ptx``)::

    python tests/gpu/run_gpu_suite.py --out tests/gpu/last_run.json

and commit the file. It checks, on the device:

* ``convert_triton`` with each kernel variant (``portable``, ``ptx``), both targets, both scale modes, on random
  inputs (partial tiles, a single row, K = 32, a large 3-D stack) and on every awkward case of tests/test_kernels.py
  (-0, subnormal codes, extreme scales, every code, every amax significand): bit-identical to
  ``transformd.reference.convert_reference`` (on the CPU) and to the NumPy oracle (tests/support/oracles.py);
* a buffer not aligned to 16 bytes (``ptx`` falls back to ``portable``) and 2-D inputs;
* invalid values (NaN codes, E8M0 0xFF, overflow) refused by each variant with ``MxFormatError``;
* ``convert_weight`` on host tensors, chunked a few experts at a time, and on device tensors;
* ``convert_checkpoint`` of the sample checkpoint with ``device="cuda"`` (every visible GPU), byte-identical to the
  same conversion on the CPU, for both targets;
* the torch-free platform probe (:mod:`transformd.platform`) against torch's own device 0.

The result file records the device, the versions, pass/fail counts, the first failures, and the sha256 of the
device code it ran (:data:`GPU_SOURCES`). tests/test_gpu_record.py fails when those sources change after the
recorded run (or the record shows failures, a dry run, or a missing variant), so GPU code cannot change unseen.
``transformd/checkpoint/``'s device paths (per-GPU worker threads, pinned buffers) are exercised here through
``convert_checkpoint`` but are not part of the digest: that module changes often for host-only reasons, and the
byte-for-byte comparison with the CPU conversion in CI's own tests covers its output.

``--dry-run`` runs a small subset on the CPU in Triton's interpreter (``portable`` only), to test this script
without a GPU; its record says ``"dry_run": true`` and is never accepted as a GPU run. Exit status: 0 when every
check passed, 1 otherwise (the record is written either way).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The device code the record vouches for, relative to the repository: the kernels, their host wrapper and
#: launch grid, the chunked tensor entry point, the format facts they use, and the reference they are held to.
GPU_SOURCES = (
    "transformd/kernels.py", "transformd/convert.py", "transformd/formats.py", "transformd/mx.py", "transformd/reference.py",
)
#: Where the record is committed.
RECORD = REPO / "tests" / "gpu" / "last_run.json"
RERUN = "python tests/gpu/run_gpu_suite.py --out tests/gpu/last_run.json"


def source_digests(repo: Path = REPO) -> dict[str, str]:
    """sha256 of each file of :data:`GPU_SOURCES` (hex), by relative path."""
    return {rel: hashlib.sha256((repo / rel).read_bytes()).hexdigest() for rel in GPU_SOURCES}


def combined_digest(files: dict[str, str]) -> str:
    """One sha256 over the per-file digests (path and digest of each, sorted by path)."""
    text = "".join(f"{rel}\0{digest}\n" for rel, digest in sorted(files.items()))
    return hashlib.sha256(text.encode()).hexdigest()


class Tally:
    def __init__(self) -> None:
        self.passed = 0
        self.failed: list[str] = []

    def check(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - every failure is recorded, the suite goes on
            self.failed.append(f"{name}: {traceback.format_exc(limit=3).strip().splitlines()[-1]}")
            print(f"FAIL {name}\n{traceback.format_exc(limit=5)}", file=sys.stderr)
        else:
            self.passed += 1


def run(dry_run: bool) -> dict:
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    sys.path.insert(0, str(REPO))
    import numpy as np
    import pytest
    import torch

    import transformd
    from transformd import MxFormatError, convert_weight
    from transformd.checkpoint import convert_checkpoint
    from transformd.kernels import KERNELS, convert_triton, convert_triton_grouped, default_kernel
    from transformd.reference import convert_reference
    from transformd.sample import write_sample_checkpoint

    from tests.support.kernel_cases import AWKWARD, invalid_cases, random_mx
    from tests.support.layouts import LAYOUTS
    from tests.support.oracles import numpy_oracle
    from tests.test_kernels import (
        test_grouped_launch_in_small_chunks_over_three_grid_axes,
        test_grouped_launch_names_the_invalid_weight,
        test_packed_launch_matches_reference,
    )

    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run this on a GPU machine, or pass --dry-run to test the script on the CPU")
    device = torch.device("cpu" if dry_run else "cuda")
    variants = [k for k in KERNELS if k == "portable" or (not dry_run and default_kernel(device) == k)]
    missing = sorted(set(KERNELS) - set(variants))
    if missing:
        print(f"not run on this machine: {', '.join(missing)}", file=sys.stderr)
    tally = Tally()

    def same(got, want) -> None:
        for g, w, what in zip(got, want, ("codes", "scales")):
            g = g.detach().cpu().contiguous().view(torch.uint8)
            w = w.detach().cpu().contiguous().view(torch.uint8)
            assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)} != {tuple(w.shape)}"
            bad = int((g != w).sum())
            assert bad == 0, f"{what} differ in {bad} bytes"

    def against_oracle(q, s, got, target, mode) -> None:
        gq, gs = (t.detach().cpu() for t in got)
        if q.dim() == 2:
            q, s, gq, gs = q[None], s[None], gq[None], gs[None]
        for i in range(q.shape[0]):
            wq, ws = numpy_oracle(q[i].numpy(), s[i].numpy(), target, mode)
            np.testing.assert_array_equal(gq[i].view(torch.uint8).numpy(), wq)
            np.testing.assert_array_equal(gs[i].numpy().view(np.uint32), ws.view(np.uint32))

    if dry_run:
        cases = {"random (2, 200, 160)": random_mx((2, 200, 160), seed=1),
                 "negative zeros": AWKWARD["negative zeros"], "every amax significand": AWKWARD["every amax significand"]}
    else:
        cases = {f"random {shape}": random_mx(shape, seed=sum(shape))
                 for shape in [(1, 128, 128), (2, 200, 160), (3, 130, 96), (1, 1, 32), (2, 257, 416), (8, 1024, 2048)]}
        cases.update(AWKWARD)
    for kernel in variants:
        for target in ("fnuz", "ocp"):
            for mode in ("exact", "amax"):
                for name, (q, s) in cases.items():
                    label = f"{kernel}/{target}/{mode}/{name}"

                    def one(q=q, s=s, kernel=kernel, target=target, mode=mode) -> None:
                        got = convert_triton(q.to(device), s.to(device), target, mode, kernel=kernel)
                        same(got, convert_reference(q, s, target, mode))
                        against_oracle(q, s, got, target, mode)

                    tally.check(label, one)

                def two_d(kernel=kernel, target=target, mode=mode) -> None:
                    q, s = random_mx((1, 300, 544), seed=11)
                    same(convert_triton(q[0].to(device), s[0].to(device), target, mode, kernel=kernel),
                         convert_reference(q[0], s[0], target, mode))

                tally.check(f"{kernel}/{target}/{mode}/2-D input", two_d)

                def grouped(kernel=kernel, target=target, mode=mode) -> None:  # 3-D and 2-D, every case, one launch
                    items = [*cases.values(), *((q[0], s[0]) for q, s in cases.values())]
                    got = convert_triton_grouped([(q.to(device), s.to(device)) for q, s in items], target, mode, kernel=kernel)
                    for (q, s), g in zip(items, got):
                        same(g, convert_reference(q, s, target, mode))

                tally.check(f"{kernel}/{target}/{mode}/grouped launch, mixed shapes", grouped)

        def small_chunks(kernel=kernel) -> None:
            with pytest.MonkeyPatch.context() as patch:
                test_grouped_launch_in_small_chunks_over_three_grid_axes(kernel, patch)

        # tests/test_kernels.py's own on the device; in a dry run they would repeat what CI runs on the same portable
        # kernel in the same interpreter (70 of the dry run's 90 s), so only the GPU run calls them.
        if not dry_run:
            for mode in ("exact", "amax"):
                tally.check(f"{kernel}/{mode}/packed launch",
                            lambda mode=mode, kernel=kernel: test_packed_launch_matches_reference(mode, kernel))
            tally.check(f"{kernel}/grouped launch in small chunks over three grid axes", small_chunks)

        def unaligned(kernel=kernel) -> None:  # codes 8 bytes into a buffer: ptx must fall back to portable
            q, s = random_mx((1, 129, 64), seed=12)
            buf = torch.zeros(q.numel() + 8, dtype=torch.uint8, device=device)
            qv = buf[8:].view(q.shape)
            qv.copy_(q.to(device))
            assert qv.data_ptr() % 16
            same(convert_triton(qv, s.to(device), kernel=kernel), convert_reference(q, s))

        tally.check(f"{kernel}/unaligned buffer", unaligned)
        for case, (q, s, words) in invalid_cases().items():

            def refused(q=q, s=s, words=words, kernel=kernel) -> None:
                try:
                    convert_triton(q.to(device), s.to(device), kernel=kernel)
                except MxFormatError as e:
                    assert words in str(e), str(e)
                else:
                    raise AssertionError("not refused")

            tally.check(f"{kernel}/invalid/{case}", refused)
            if case != "NaN code 0xFF":
                tally.check(f"{kernel}/invalid/{case}/grouped",
                            lambda case=case, kernel=kernel: test_grouped_launch_names_the_invalid_weight(case, kernel))

    def chunked() -> None:
        q, s = random_mx((5, 130, 160), seed=6)
        for target, mode in (("fnuz", "exact"), ("ocp", "amax")):
            want = convert_reference(q, s, target, mode)
            got = convert_weight(q, s, target, mode, device=device, chunk_bytes=2 * 130 * 160)
            assert got[0].device.type == "cpu"  # host in, host out
            same(got, want)
            same(convert_weight(q.to(device), s.to(device), target, mode, device=device), want)

    tally.check("convert_weight chunked and on-device", chunked)

    def checkpoint(make: Callable[[Path], Path]) -> None:
        with tempfile.TemporaryDirectory(prefix="td-gpu-") as tmp:
            src = make(Path(tmp) / "src")
            for target in ("fnuz", "ocp"):
                on_gpu = convert_checkpoint(src, Path(tmp) / f"gpu-{target}", target=target, device=str(device))
                convert_checkpoint(src, Path(tmp) / f"cpu-{target}", target=target, device="cpu")
                assert dry_run or "cuda" in on_gpu.device, on_gpu.device
                names = sorted(p.name for p in (Path(tmp) / f"cpu-{target}").iterdir())
                assert names == sorted(p.name for p in (Path(tmp) / f"gpu-{target}").iterdir())
                for n in names:
                    a = (Path(tmp) / f"gpu-{target}" / n).read_bytes()
                    b = (Path(tmp) / f"cpu-{target}" / n).read_bytes()
                    assert a == b, f"{n} differs between the GPU and the CPU conversion ({target})"

    def sample(path: Path) -> Path:
        return write_sample_checkpoint(path, layers=1 if dry_run else 2, experts=2 if dry_run else 8)

    tally.check("convert_checkpoint on the device == on the CPU", lambda: checkpoint(sample))
    for name, make in LAYOUTS.items():  # fused HF-v5 stacks, Quark per_block scales, F8_E8M0 scales, ...
        tally.check(f"convert_checkpoint of the {name} layout on the device == on the CPU", lambda m=make: checkpoint(m))

    def warm_up_loads_what_converts() -> None:  # in a fresh process: after the warm-up a conversion adds no variant
        if dry_run:
            return  # (the interpreter compiles nothing)
        code = """if True:
            import tempfile
            from pathlib import Path
            import torch
            from transformd.checkpoint import convert_checkpoint
            from transformd.checkpoint.pieces import warm_up
            from transformd.formats import ScaleMode, Target
            from transformd.kernels import _mx_to_block_fp8_grouped_kernel as kernel
            from transformd.sample import write_sample_checkpoint

            def variants():
                return sorted(str(key) for caches in kernel.device_caches.values() for key in caches[0])

            with tempfile.TemporaryDirectory(prefix="td-gpu-") as tmp:
                src = write_sample_checkpoint(Path(tmp) / "src", layers=2, experts=8)
                for target, mode in (("fnuz", "exact"), ("ocp", "amax")):
                    before = variants()
                    warm_up([torch.device("cuda", 0)], Target(target), ScaleMode(mode))
                    warmed = variants()
                    assert len(warmed) == len(before) + 1, (target, mode, before, warmed)
                    convert_checkpoint(src, Path(tmp) / f"{target}-{mode}", target=target, scale_mode=mode,
                                       device="cuda:0")
                    assert variants() == warmed, (target, mode, warmed, variants())
                    assert torch.cuda.memory_reserved(0) == 0, torch.cuda.memory_reserved(0)
        """
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]

    tally.check("kernel warm-up: a conversion after it compiles and loads nothing new", warm_up_loads_what_converts)

    def platform_probe() -> None:  # the torch-free probe --target auto uses says what torch says
        from transformd.platform import detect_platform

        got = detect_platform()
        if dry_run:
            return
        major, minor = torch.cuda.get_device_capability(0)
        assert (got.vendor, got.arch) == ("nvidia", f"sm_{major}{minor}"), got

    tally.check("platform probe (CUDA driver, no torch) == torch's device 0", platform_probe)

    files = source_digests()
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    return {
        "schema": 1,
        "dry_run": dry_run,
        "device": None if dry_run else torch.cuda.get_device_name(device),
        "device_count": 0 if dry_run else torch.cuda.device_count(),
        "capability": None if dry_run else list(torch.cuda.get_device_capability(device)),
        "variants_run": variants,
        "variants_not_run": missing,
        "passed": tally.passed,
        "failed": len(tally.failed),
        "failures": tally.failed[:50],
        "kernel_sources": {"digest": combined_digest(files), "files": files},
        "git_commit": commit,
        "versions": {"transformd": transformd.__version__, "torch": torch.__version__,
                     "triton": __import__("triton").__version__, "python": platform.python_version()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"write the record here (e.g. {RECORD.relative_to(REPO)})")
    parser.add_argument("--dry-run", action="store_true", help="a small subset on the CPU (Triton interpreter)")
    args = parser.parse_args(argv)
    record = run(args.dry_run)
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text, end="")
    print(f"{record['passed']} passed, {record['failed']} failed on {record['device'] or 'the CPU (dry run)'}; "
          f"variants run: {', '.join(record['variants_run'])}", file=sys.stderr)
    return 0 if record["failed"] == 0 and record["passed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
