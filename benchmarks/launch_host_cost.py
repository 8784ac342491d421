"""Where a packed launch's host time goes: ``convert_packed`` timed with its Python call (``do_bench``, L2 flushed,
as ``kernel_bench.py`` times it), its host time alone, the launch from a table made beforehand, two other ways of
making the table (B: a Python list through pinned memory; C: ``torch.tensor(..., device=)``, a synchronous copy), and
each step of ``kernels._launch_group`` on its own: a lone dense 8192x28672 weight, 128 experts of 200x416 (host-bound)
and 16 of 3072x3072. Needs a GPU. Run from the repository's root: ``python3 benchmarks/launch_host_cost.py``.
"""

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformd import kernels as K  # noqa: E402
from transformd.formats import ScaleMode, Target  # noqa: E402

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _table_rows(weights, n, k, nt, kt):
    rows = []
    for q, s, o, sc, st, experts in weights:
        for i in range(experts):
            rows.append((q + i * n * k, s + i * (n * k // K.MX_BLOCK), o + i * n * k, sc + i * nt * kt,
                         st + i * nt * kt, 0, 0, 0))
    return rows


def _launch_group_variant(rows, bases, target, scale_mode, kernel, num_warps, aligned, direct):
    """kernels._launch_group with its table made another way (the same grouping, kernels._group_rows)."""
    shapes, firsts, tiles = K._group_rows(rows)
    if not tiles:
        return None
    device = bases[0].device
    kernel = kernel or K.default_kernel(device)
    ptx = kernel == "ptx" and aligned
    status = torch.empty(tiles, dtype=torch.int32, device=device)
    for (n, k), weights in shapes.items():
        nt, kt = -(-n // K.TILE), -(-k // K.TILE)
        table = _table_rows(weights, n, k, nt, kt)
        if direct:
            device_table = torch.tensor(table, dtype=torch.int64, device=device)
        else:
            device_table = torch.tensor(table, dtype=torch.int64, pin_memory=device.type == "cuda").to(
                device, non_blocking=True)
        for at in range(0, len(table), K.GRID_Z):
            K._mx_to_block_fp8_grouped_kernel[(kt, nt, min(K.GRID_Z, len(table) - at))](
                device_table[at:], n, k, *bases, status,
                EXACT=scale_mode is ScaleMode.EXACT, FNUZ=target is Target.FNUZ, PTX=ptx, TILE_=K.TILE,
                BLOCK_=K.MX_BLOCK, num_warps=num_warps or 8, maxnreg=K._maxnreg(ptx, num_warps or 8, scale_mode),
                enable_fp_fusion=False)
    return status, firsts


def launch_group_list(*a):
    return _launch_group_variant(*a, direct=False)


def launch_group_list_direct(*a):
    return _launch_group_variant(*a, direct=True)


REPS = 300


def host_us(fn, reps=REPS):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def bench_ms(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def main():
    if dev.type != "cuda":
        sys.exit("launch_host_cost.py needs a GPU")
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for name, (e, n, k) in {"dense 1x 8192x28672": (1, 8192, 28672), "E128 200x416": (128, 200, 416),
                            "E16 3072x3072": (16, 3072, 3072)}.items():
        nt, kt = K.tile_grid(n, k)
        codes = e * n * k
        buf = torch.zeros(codes + codes // 32, dtype=torch.uint8, device=dev)
        buf[codes:] = 127
        out = torch.empty(codes, dtype=torch.uint8, device=dev)
        osc = torch.empty(e * nt * kt, dtype=torch.float32, device=dev)
        packed = [K.PackedWeight((n, k), i * n * k, codes + i * n * k // 32, i * nt * kt) for i in range(e)]
        for mode in (ScaleMode.EXACT, ScaleMode.AMAX):
            print(f"== {name} {mode.value}")

            def call():
                K.convert_packed(buf, out, osc, packed, "fnuz", mode, check=False)

            def call_checked():
                K.convert_packed(buf, out, osc, packed, "fnuz", mode)

            print(f"  do_bench convert_packed check=False      {bench_ms(call) * 1e3:8.1f} us")
            print(f"  host time convert_packed check=False     {host_us(call):8.1f} us")
            print(f"  host time convert_packed check=True      {host_us(call_checked):8.1f} us (incl. sync)")
            if e == 1:
                q, s = buf[:codes].view(n, k), buf[codes:].view(n, k // 32)
                o = (out.view(n, k), osc.view(nt, kt))
                print(f"  do_bench convert_triton                  "
                      f"{bench_ms(lambda: K.convert_triton(q, s, 'fnuz', mode, out=o, check=False)) * 1e3:8.1f} us")
                print(f"  host time convert_triton                 "
                      f"{host_us(lambda: K.convert_triton(q, s, 'fnuz', mode, out=o, check=False)):8.1f} us")
            # the steps of _launch_group, one by one
            rows = [(w.shape, w.code_offset, w.scale_offset, w.code_offset, w.out_scale_offset) for w in packed]
            w = np.array([(q, s_, o_, sc, 0, 1) for _, q, s_, o_, sc in rows], dtype=np.int64)
            status = torch.empty(e * nt * kt, dtype=torch.int32, device=dev)
            steps = {
                "rows list (convert_packed)": lambda: [(p.shape, p.code_offset, p.scale_offset, p.code_offset,
                                                         p.out_scale_offset) for p in packed],
                "aligned check": lambda: all(p.code_offset % 16 == 0 for p in packed) and buf.data_ptr() % 16 == 0,
                "status empty": lambda: torch.empty(e * nt * kt, dtype=torch.int32, device=dev),
                "np.array of weights": lambda: np.array([(q, s_, o_, sc, 0, 1) for _, q, s_, o_, sc in rows],
                                                        dtype=np.int64),
                "pinned empty": lambda: torch.empty((len(rows), 8), dtype=torch.int64, pin_memory=True),
                "default_kernel": lambda: K.default_kernel(dev),
            }
            host = torch.empty((len(rows), 8), dtype=torch.int64, pin_memory=True)
            table = host.numpy()

            def fill():
                ee = np.zeros(len(w), dtype=np.int64)
                table[:, 0] = w[:, 0] + ee * (n * k)
                table[:, 1] = w[:, 1] + ee * (n * k // 32)
                table[:, 2] = w[:, 2] + ee * (n * k)
                table[:, 3] = w[:, 3] + ee * (nt * kt)
                table[:, 4] = w[:, 4] + ee * (nt * kt)

            steps["table fill (numpy)"] = fill
            steps["H2D non_blocking (pinned)"] = lambda: host.to(dev, non_blocking=True)
            flat = [[q, s_, o_, sc, 0, 0, 0, 0] for _, q, s_, o_, sc in rows]
            steps["alt: torch.tensor(list) pinned + H2D"] = lambda: torch.tensor(
                flat, dtype=torch.int64, pin_memory=dev.type == "cuda").to(dev, non_blocking=True)
            steps["alt: torch.tensor(list, device=cuda)"] = lambda: torch.tensor(flat, dtype=torch.int64, device=dev)
            device_table = host.to(dev)
            ptx = True

            def launch():
                K._mx_to_block_fp8_grouped_kernel[(kt, nt, len(rows))](
                    device_table, n, k, buf, buf, out, osc, status,
                    EXACT=mode is ScaleMode.EXACT, FNUZ=True, PTX=ptx, TILE_=K.TILE, BLOCK_=K.MX_BLOCK,
                    num_warps=8, maxnreg=K._maxnreg(ptx, 8, mode), enable_fp_fusion=False)

            def launch_positional_only():  # without the compile-option kwargs (different key, so compiled again)
                K._mx_to_block_fp8_grouped_kernel[(kt, nt, len(rows))](
                    device_table, n, k, buf, buf, out, osc, status,
                    EXACT=mode is ScaleMode.EXACT, FNUZ=True, PTX=ptx, TILE_=K.TILE, BLOCK_=K.MX_BLOCK, num_warps=8)

            steps["triton launch (grouped kernel)"] = launch
            print(f"  do_bench launch alone (table prebuilt)   {bench_ms(launch) * 1e3:8.1f} us")
            for label, variant in (("B list table", launch_group_list), ("C list table, torch.tensor(device=)",
                                                                            launch_group_list_direct)):
                saved = K._launch_group
                K._launch_group = variant
                try:
                    out.zero_()
                    osc.zero_()
                    call()
                    got = (out.clone(), osc.clone())
                    K._launch_group = saved
                    out.zero_()
                    osc.zero_()
                    call()
                    same = torch.equal(got[0], out) and torch.equal(got[1].view(torch.int32), osc.view(torch.int32))
                    K._launch_group = variant
                    print(f"  do_bench convert_packed, {label:26s} {bench_ms(call) * 1e3:8.1f} us  (A again: ", end="")
                    K._launch_group = saved
                    print(f"{bench_ms(call) * 1e3:.1f} us); host {host_us(call):.1f} us; bytes same as A: {same}")
                finally:
                    K._launch_group = saved
            steps["triton launch, no maxnreg/fp_fusion kwargs"] = launch_positional_only
            steps["status.any() + bool (sync)"] = lambda: bool(status.any())
            steps["torch.nonzero(status) (sync)"] = lambda: torch.nonzero(status)
            for label, fn in steps.items():
                print(f"  step {label:40s} {host_us(fn):8.1f} us")


if __name__ == "__main__":
    main()
