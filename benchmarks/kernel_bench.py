"""Kernel benchmark and on-device validation (run on a GPU machine).

One run prints, for each layer shape:
  * bit-exactness of every Triton variant against the PyTorch reference on the whole tensor,
  * elements/s and GB/s of the Triton kernel (bytes read + written), the device's own
    copy bandwidth for the same bytes, the PyTorch reference, and vLLM PR #45726's
    per-expert PyTorch path, all measured side by side in this one process;
then, for per-expert 2-D weights as real checkpoints store them (DeepSeek-V3, Qwen3-30B-A3B, a dense
matrix, shapes not multiple of 128), one launch per tensor against one grouped launch over all of
them (``convert_triton_grouped`` on the list, and ``convert_packed`` on one buffer as the pipeline
packs a batch), each checked bit for bit against the reference on the device;
for packed launches also the kernel's own device time (torch.profiler), which leaves out the Python call that
bounds batches of small weights; and then the block-scaled FP8 matmul check of the converted weights (target ocp).

    python benchmarks/kernel_bench.py [--quick] [--grouped-only] [--json results.json]

``--smoke`` runs tiny shapes on the CPU (Triton interpreter) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # must precede the first import of triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.oracles import pr45726_convert  # noqa: E402
from transformd.formats import tile_grid  # noqa: E402
from transformd.kernels import PackedWeight, convert_packed, convert_triton, convert_triton_grouped  # noqa: E402
from transformd.reference import convert_reference, dequantize_block, dequantize_mx  # noqa: E402

SHAPES = {"E128 4096x7168": (128, 4096, 7168), "E128 7168x2048": (128, 7168, 2048), "E16 3072x3072": (16, 3072, 3072)}
QUICK_SHAPES = {"E8 4096x7168": (8, 4096, 7168), "E16 3072x3072": (16, 3072, 3072)}
SMOKE_SHAPES = {"E2 256x320": (2, 256, 320)}
#: Per-expert 2-D weights (E tensors of N x K each): one launch per tensor vs one grouped launch.
GROUPED_SHAPES = {
    "DeepSeek-V3 256x 2048x7168": (256, 2048, 7168),
    "DeepSeek-V3 256x 7168x2048": (256, 7168, 2048),
    "Qwen3-30B 128x 768x2048": (128, 768, 2048),
    "Qwen3-30B 128x 2048x768": (128, 2048, 768),
    "dense 1x 8192x28672": (1, 8192, 28672),
    "E64 1408x2048": (64, 1408, 2048),
    "E16 3072x3072": (16, 3072, 3072),
    "E32 2880x2880 (partial)": (32, 2880, 2880),
    "E128 200x416 (partial)": (128, 200, 416),
}
SMOKE_GROUPED = {"E3 200x416": (3, 200, 416), "E1 128x128": (1, 128, 128)}
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def random_mx(e, n, k, device, seed=0):
    """Valid MXFP8 data with realistic E8M0 bytes, made on the device."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randint(0, 256, (e, n, k), dtype=torch.uint8, device=device, generator=g)
    q[(q & 0x7F) == 0x7F] -= 1
    s = torch.randint(112, 136, (e, n, k // 32), dtype=torch.uint8, device=device, generator=g)
    return q, s


def bench_ms(fn) -> float:
    if DEV.type != "cuda":
        return wall_ms(fn, reps=1)
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def wall_ms(fn, reps=2) -> float:
    """Whole-call wall time for the slow PyTorch paths (they launch many kernels)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best


def kernel_alone_ms(fn, kernel: str, reps: int = 20) -> float | None:
    """Device time per call of ``fn`` in the kernels named ``kernel`` (CUPTI, through torch.profiler), the L2 cache
    flushed before each call as do_bench does: the GPU's own time, without the Python call that launches it.
    None off CUDA."""
    if DEV.type != "cuda":
        return None
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    fn()
    sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        sync()
    total_us = sum(row.device_time_total for row in prof.key_averages() if kernel in row.key)
    return total_us / reps / 1e3 if total_us else None


def same(a, b) -> bool:
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(
        a[1].view(torch.int32), b[1].view(torch.int32)
    )


def run_shape(name, e, n, k, args, rows, checks, results):
    dev = DEV
    q, s = random_mx(e, n, k, dev)
    numel = q.numel()
    nt, kt = tile_grid(n, k)
    moved = numel + s.numel() + numel + e * nt * kt * 8  # read codes+scales, write codes+scale+status
    src = torch.empty(numel, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    copy_gbs = 2 * numel / copy_ms / 1e6
    src = dst = None  # (not del: the timed lambdas name them)
    rows.append((name, "device copy (same bytes)", copy_ms, numel / copy_ms / 1e6, copy_gbs, 1.0, None))
    pr_ms = wall_ms(lambda: pr45726_convert(q.view(torch.float8_e4m3fn), s, fnuz=True), reps=1)

    for mode in ("exact", "amax"):
        ref = convert_reference(q, s, "fnuz", mode)
        ref_ms = wall_ms(lambda: convert_reference(q, s, "fnuz", mode), reps=1)
        if mode == "amax":
            # The PR divides by the Python scalar 448.0; on CUDA PyTorch turns that into a
            # multiply by the rounded reciprocal, so a few tiles' scales differ from IEEE.
            pr = pr45726_convert(q.view(torch.float8_e4m3fn), s, fnuz=True)
            tiles_off = float((pr[1].view(torch.int32) != ref[1].view(torch.int32)).float().mean())
            codes_off = float((pr[0].view(torch.uint8) != ref[0]).float().mean())
            results.setdefault("pr45726_vs_ieee", {})[name] = {"tiles_scale_differs": tiles_off, "codes_differ": codes_off}
            del pr
        kernels = ("portable", "ptx") if DEV.type == "cuda" else ("portable",)
        variants = [(kern, w) for kern in kernels for w in (4, 8)]
        out = (torch.empty_like(q), torch.empty((e, nt, kt), dtype=torch.float32, device=dev))
        for kern, warps in variants:
            got = convert_triton(q, s, "fnuz", mode, kernel=kern, num_warps=warps)
            checks.append((name, mode, f"triton {kern} w{warps} == reference", same(got, ref)))
            del got
            ms = bench_ms(lambda: convert_triton(q, s, "fnuz", mode, kernel=kern, num_warps=warps, out=out, check=False))
            label = f"triton {mode} {kern} warps={warps}"
            rows.append((name, label, ms, numel / ms / 1e6, moved / ms / 1e6, moved / ms / 1e6 / copy_gbs, pr_ms / ms))
        for target in ("ocp",):
            got = convert_triton(q, s, target, mode)
            checks.append((name, mode, f"triton default, target {target} == reference", same(got, convert_reference(q, s, target, mode))))
            del got
        rows.append((name, f"pytorch reference {mode}", ref_ms, numel / ref_ms / 1e6, None, None, pr_ms / ref_ms))
        del ref
    rows.append((name, "PR #45726 per-expert path (amax)", pr_ms, numel / pr_ms / 1e6, None, None, 1.0))
    q = s = out = None
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def run_grouped(name, e, n, k, rows, checks):
    """E separate [N, K] weights packed in one buffer (codes, then scales): per-tensor vs grouped launches."""
    dev = DEV
    q3, s3 = random_mx(e, n, k, dev, seed=5)
    codes = e * n * k
    buf = torch.empty(codes + s3.numel(), dtype=torch.uint8, device=dev)
    buf[:codes].copy_(q3.view(-1))
    buf[codes:].copy_(s3.view(-1))
    del q3, s3
    q3, s3 = buf[:codes].view(e, n, k), buf[codes:].view(e, n, k // 32)
    items = [(q3[i], s3[i]) for i in range(e)]
    nt, kt = tile_grid(n, k)
    moved = 2 * codes + s3.numel() + e * nt * kt * 8
    src = torch.empty(codes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    copy_gbs = 2 * codes / copy_ms / 1e6
    src = dst = None
    rows.append((name, "device copy (same bytes)", copy_ms, codes / copy_ms / 1e6, copy_gbs, 1.0, None))
    pr_ms = wall_ms(lambda: pr45726_convert(q3.view(torch.float8_e4m3fn), s3, fnuz=True), reps=1)
    out_buf = torch.empty_like(buf)
    out_scales = torch.empty(e * nt * kt, dtype=torch.float32, device=dev)
    outs = [(out_buf[i * n * k : (i + 1) * n * k].view(n, k), out_scales[i * nt * kt : (i + 1) * nt * kt].view(nt, kt))
            for i in range(e)]
    packed = [PackedWeight((n, k), i * n * k, codes + i * n * k // 32, i * nt * kt) for i in range(e)]
    got3 = (out_buf[:codes].view(e, n, k), out_scales.view(e, nt, kt))

    def row(label, ms):
        rows.append((name, label, ms, codes / ms / 1e6, moved / ms / 1e6, moved / ms / 1e6 / copy_gbs, pr_ms / ms))

    kernels = ("portable", "ptx") if DEV.type == "cuda" else ("portable",)
    for mode in ("exact", "amax"):
        ref = convert_reference(q3, s3, "fnuz", mode)
        for kern in kernels:
            for fn, what in ((lambda: convert_triton_grouped(items, "fnuz", mode, kernel=kern, out=outs), "grouped list"),
                             (lambda: convert_packed(buf, out_buf, out_scales, packed, "fnuz", mode, kernel=kern), "packed")):
                out_buf.zero_()
                out_scales.zero_()
                fn()
                checks.append((name, mode, f"{what} {kern} == reference", same(got3, ref)))
            if e <= 512:
                out_buf.zero_()
                for (qi, si), oi in zip(items, outs):
                    convert_triton(qi, si, "fnuz", mode, kernel=kern, out=oi)
                checks.append((name, mode, f"per-tensor {kern} == reference", same(got3, ref)))
        del ref
        for kern in kernels[-1:]:  # the device's default kernel (portable is checked above, not timed)
            for warps in (4, 8):
                def per_tensor():
                    for (qi, si), oi in zip(items, outs):
                        convert_triton(qi, si, "fnuz", mode, kernel=kern, num_warps=warps, out=oi, check=False)

                row(f"{mode} {kern} w{warps}: one launch per tensor", bench_ms(per_tensor))
                row(f"{mode} {kern} w{warps}: grouped, list of tensors", bench_ms(
                    lambda: convert_triton_grouped(items, "fnuz", mode, kernel=kern, num_warps=warps, out=outs, check=False)))
                row(f"{mode} {kern} w{warps}: grouped, packed buffer", bench_ms(
                    lambda: convert_packed(buf, out_buf, out_scales, packed, "fnuz", mode, kernel=kern, num_warps=warps,
                                           check=False)))
                alone = None if warps != 8 else kernel_alone_ms(  # (the default warps)
                    lambda: convert_packed(buf, out_buf, out_scales, packed, "fnuz", mode, kernel=kern, num_warps=warps,
                                           check=False), "_mx_to_block_fp8_grouped_kernel")
                if alone is not None:  # the same launches, their GPU time only: what the Python call leaves out
                    row(f"{mode} {kern} w{warps}: packed, the kernel alone", alone)
        if e > 1:
            row(f"{mode} default: one launch on the 3-D stack", bench_ms(
                lambda: convert_triton(q3, s3, "fnuz", mode, out=got3, check=False)))
    rows.append((name, "PR #45726 per-expert path (amax)", pr_ms, codes / pr_ms / 1e6, None, None, 1.0))
    buf = out_buf = out_scales = items = outs = None
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def large_matrix_check(checks):
    """A 2-D weight with more than 2**31 elements: 64-bit offsets where they are needed."""
    n, k = 2**31 // 7168 + 200, 7168
    q, s = random_mx(1, n, k, DEV, seed=2)
    q, s = q[0], s[0]
    for mode in ("exact", "amax"):
        ref = convert_reference(q, s, "fnuz", mode)
        for kern in ("portable", "ptx"):
            checks.append((f"2-D {n}x{k}", mode, f"triton {kern} == reference", same(convert_triton(q, s, "fnuz", mode, kernel=kern), ref)))
        del ref


def quantize_activations_1x128(x: torch.Tensor):
    """Dynamic per-token, per-128-column FP8 quantization (what block-FP8 engines do)."""
    m, k = x.shape
    g = x.float().view(m, k // 128, 128)
    amax = g.abs().amax(-1).clamp(min=1e-12)
    scale = amax / 448.0
    xq = (g / scale[..., None]).to(torch.float8_e4m3fn).view(m, k)
    return xq, scale


def emulated_blockscaled_matmul(xq, sx, wq, sw):
    """The block-scaled product in float32: dequantize both FP8 operands, then matmul."""
    m, k = xq.shape
    xd = (xq.float().view(m, k // 128, 128) * sx[..., None]).view(m, k)
    return xd @ dequantize_block(wq.view(torch.uint8), sw, "ocp").t()


def blockscaled_matmul(xq, sx, wq, sw):
    """Y = X W^T on the tensor cores with 1x128 activation groups and 128x128 weight tiles.

    PyTorch's block-scaled ``_scaled_mm`` (cuBLAS, Hopper) infers the recipe from the scale
    shapes; its scale layouts have changed between releases, so each candidate layout is
    tried and accepted only if it agrees with the float32 emulation of the same product.
    Falls back to that emulation, saying so.
    """
    emulated = emulated_blockscaled_matmul(xq, sx, wq, sw)
    candidates = {
        "scale_b (K/128, N/128) col-major": sw.t(),
        "scale_b (N/128, K/128)": sw,
        "scale_b (K/128, N/128) row-major": sw.t().contiguous(),
    }
    errors = []
    for label, scale_b in candidates.items():
        try:
            y = torch._scaled_mm(xq, wq.t(), scale_a=sx.t().contiguous().t(), scale_b=scale_b, out_dtype=torch.bfloat16)
        except Exception as err:  # noqa: BLE001 - report which layouts were refused
            errors.append(f"{label}: {str(err).splitlines()[0][:160]}")
            continue
        y = y.float()
        if float((y - emulated).norm() / emulated.norm()) < 1e-2:
            return y, f"torch._scaled_mm blockwise 1x128 x 128x128, {label}"
        errors.append(f"{label}: ran, but disagrees with the emulation")
    return emulated, "fp32 emulation; _scaled_mm: " + " | ".join(errors)


def matmul_check(results, n=4096, k=7168, m=512):
    dev = DEV
    # Realistic weights: MX-quantize a Gaussian matrix (shared exponent per 32 from the block amax).
    w = torch.randn(n, k, device=dev) * 0.02
    blocks = w.view(n, k // 32, 32)
    exp = torch.floor(torch.log2(blocks.abs().amax(-1))) - 8
    q2 = (blocks / torch.exp2(exp)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, k)
    q, s = q2.view(torch.uint8), (exp + 127).to(torch.uint8)
    w_dec = dequantize_mx(q, s)
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    y_ref = (x @ w_dec.to(torch.bfloat16).t()).float()
    xq, sx = quantize_activations_1x128(x)
    xd = (xq.float().view(m, k // 128, 128) * sx[..., None]).view(m, k)
    y_act = xd @ w_dec.t()  # activation quantization alone, exact weights

    def rel(y):
        return float((y - y_ref).norm() / y_ref.norm())

    results["matmul"] = {"shape": [m, n, k], "activation_quant_only_rel_err": rel(y_act)}
    for mode in ("exact", "amax"):
        wq, sw = convert_triton(q, s, "ocp", mode)
        y, path = blockscaled_matmul(xq, sx, wq.view(torch.float8_e4m3fn), sw)
        y_emul = emulated_blockscaled_matmul(xq, sx, wq, sw)
        results["matmul"][mode] = {"path": path, "rel_err": rel(y), "rel_err_fp32_emulation": rel(y_emul)}
        w_err = float((dequantize_block(wq, sw, "ocp") - w_dec).norm() / w_dec.norm())
        results["matmul"][mode]["weight_rel_l2"] = w_err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to test this script")
    ap.add_argument("--grouped-only", action="store_true", help="only the per-tensor vs grouped table")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if DEV.type != "cuda" and not args.smoke:
        print("no GPU: this benchmark needs one (--smoke checks the script on the CPU)", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU (Triton interpreter)"
    print(f"# {gpu} | torch {torch.__version__} | triton {triton.__version__}")
    rows, checks, results = [], [], {}
    shapes = SMOKE_SHAPES if args.smoke else QUICK_SHAPES if args.quick else SHAPES
    for name, (e, n, k) in (SMOKE_GROUPED if args.smoke else GROUPED_SHAPES).items():
        run_grouped(name, e, n, k, rows, checks)
        print(f"# {name} done", flush=True)
    if not args.grouped_only:
        for name, (e, n, k) in shapes.items():
            run_shape(name, e, n, k, args, rows, checks, results)
        matmul_check(results, *((256, 512, 64) if args.smoke else ()))
        if not args.smoke:
            large_matrix_check(checks)

    print(f"\n{'shape':<28} {'variant':<48} {'ms':>9} {'G elem/s':>9} {'GB/s':>7} {'of copy':>8} {'x PR path':>9}")
    for name, label, ms, ges, gbs, frac, speed in rows:
        f = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{name:<28} {label:<48} {ms:9.3f} {ges:9.1f} {f(gbs, '7.0f'):>7} {f(frac and frac * 100, '7.1f') + '%' if frac else '-':>8} {f(speed, '9.1f'):>9}")
    print("\nbit-exactness on the whole tensors:")
    for name, mode, what, ok in checks:
        print(f"  {'OK  ' if ok else 'FAIL'} {name:<28} {mode:<6} {what}")
    if "matmul" in results:
        print("\nblock-scaled FP8 matmul with converted weights (target ocp), rel. Frobenius error vs BF16 matmul:")
        print(json.dumps(results["matmul"], indent=2))
        print("\nvLLM PR #45726 path as run on this device vs the IEEE contract (fraction of tiles / codes that differ):")
        print(json.dumps(results.get("pr45726_vs_ieee"), indent=2))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "checks": checks, **results}, indent=2))
    return 0 if all(ok for *_, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
