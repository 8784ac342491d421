"""The CPU's conversion, one weight at a time, in both scale modes: NumPy table lookups (``transformd.numpy_exact``)
against the PyTorch reference, on the speed benchmarks' shapes, in one process, alternated, and checked byte for byte.

Columns: ``convert_exact`` (``convert_amax``) alone on one thread; ``convert_weight(device="cpu")``, the package's
tensor-level CPU path with its validation (the reference at 8e67383 in both modes); ``convert_reference`` itself.
Best of ``--repeat`` runs each (the reference fewer: ``--reference-repeat``), input codes' GiB/s, and the
reference's time over the others'. No GPU needed. From the repository's root::

    .venv/bin/python benchmarks/cpu_lookup_bench.py            # every shape (the dense one: ~10 s of reference)
    .venv/bin/python benchmarks/cpu_lookup_bench.py --quick    # without the dense 8192x28672
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformd import convert_weight  # noqa: E402
from transformd.numpy_exact import converter  # noqa: E402
from transformd.reference import convert_reference  # noqa: E402

#: (name, shape): per-expert 2-D weights as checkpoints store them, a stack, and a dense weight.
SHAPES = [
    ("DeepSeek-V3 expert 2048x7168", (2048, 7168)),
    ("DeepSeek-V3 expert 7168x2048", (7168, 2048)),
    ("Qwen3-30B expert 768x2048", (768, 2048)),
    ("Qwen3-30B expert 2048x768", (2048, 768)),
    ("E128 200x416 (partial tiles)", (128, 200, 416)),
    ("dense 8192x28672", (8192, 28672)),
]


def sample(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random finite e4m3fn codes and E8M0 scales spread over a few binades per tile, as quantizers leave them."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    scales = rng.integers(118, 126, size=(*shape[:-1], shape[-1] // 32), dtype=np.uint8)
    return torch.from_numpy(codes), torch.from_numpy(scales)


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def lookups(q: torch.Tensor, s: torch.Tensor, mode: str) -> list[np.ndarray]:
    """The lookups' codes, expert by expert (none refused on these samples)."""
    convert = converter(mode)
    q3, s3 = q.numpy().reshape(-1, *q.shape[-2:]), s.numpy().reshape(-1, *s.shape[-2:])
    done = [convert(q3[e], s3[e], fnuz=False) for e in range(q3.shape[0])]
    assert all(d is not None for d in done)
    return [codes for codes, _ in done]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="leave out the dense 8192x28672")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--reference-repeat", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)  # (the reference on one thread, as the lookups: per-core speed)
    print(f"CPU conversion, one thread; {os.cpu_count()} CPUs here; torch {torch.__version__}, NumPy {np.__version__}")
    for mode in ("exact", "amax"):
        print(f"\n{mode + ' mode':30s} {'convert_' + mode:>15s} {'convert_weight':>15s} {'reference':>15s}  "
              "reference / lookups")
        for i, (name, shape) in enumerate(SHAPES):
            if args.quick and name.startswith("dense"):
                continue
            q, s = sample(shape, seed=i)
            gib = q.numel() / 2**30
            want_q, want_s = convert_reference(q, s, "ocp", mode)
            got_q, got_s = convert_weight(q, s, "ocp", mode, device="cpu")
            assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), name
            assert torch.equal(got_s.view(torch.int32), want_s.view(torch.int32)), name
            got = np.stack(lookups(q, s, mode))  # (the lookups' own bytes)
            assert np.array_equal(got, want_q.numpy().reshape(got.shape)), name
            t_lookup = best(lambda: lookups(q, s, mode), args.repeat)
            t_weight = best(lambda: convert_weight(q, s, "ocp", mode, device="cpu"), args.repeat)
            t_ref = best(lambda: convert_reference(q, s, "ocp", mode), args.reference_repeat)

            def cell(t: float) -> str:
                return f"{t * 1e3:7.1f} ms {gib / t:4.2f}"

            print(f"{name:30s} {cell(t_lookup):>15s} {cell(t_weight):>15s} {cell(t_ref):>15s}  "
                  f"{t_ref / t_lookup:5.1f}x / {t_ref / t_weight:5.1f}x")
    print("each cell: best time, GiB/s of input codes; every output checked byte for byte against the reference")


if __name__ == "__main__":
    main()
