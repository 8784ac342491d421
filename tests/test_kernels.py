"""The reference against independent oracles, and the Triton kernel against the reference, bit for bit.

On a machine without a GPU the kernel runs in Triton's interpreter (conftest.py);
on a GPU the same tests run the compiled kernel.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from transformd import MxFormatError, convert_weight, dequantize_block, dequantize_mx, kernels, validate_pair
from transformd.formats import tile_grid
from transformd.kernels import (
    GroupMemberError,
    PackedWeight,
    convert_packed,
    convert_triton,
    convert_triton_grouped,
    default_kernel,
    round_to_e4m3fn,
)
from transformd.reference import convert_reference

from .support.kernel_cases import AWKWARD, invalid_cases, random_mx
from .support.oracles import numpy_oracle, pr45726_convert

MODES = ["exact", "amax"]
TARGETS = ["fnuz", "ocp"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (E, N, K): whole tiles, partial tiles on both axes, a single row, K = 32.
SHAPES = [(1, 128, 128), (2, 200, 160), (3, 130, 96), (1, 1, 32), (2, 257, 416)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


def assert_same(got, want):
    (gq, gs), (wq, ws) = got, want
    assert same_bits(gq, wq), f"codes differ at {int((gq.cpu().view(torch.uint8) != wq.cpu().view(torch.uint8)).sum())} places"
    assert same_bits(gs, ws), "scales differ"


# --- reference vs independent oracles ---------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", ["random", *AWKWARD])
def test_reference_matches_numpy_oracle(case, target, mode):
    q, s = random_mx((2, 257, 416), seed=3) if case == "random" else AWKWARD[case]
    got_q, got_s = convert_reference(q, s, target, mode)
    for i in range(q.shape[0]):
        want_q, want_s = numpy_oracle(q[i].numpy(), s[i].numpy(), target, mode)
        np.testing.assert_array_equal(got_q[i].numpy(), want_q)
        np.testing.assert_array_equal(got_s[i].numpy().view(np.uint32), want_s.view(np.uint32))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", SHAPES)
def test_amax_mode_matches_pr45726_path(shape, target):
    q, s = random_mx(shape, lo=100, hi=150, seed=4)
    got_q, got_s = convert_reference(q, s, target, "amax")
    want_q, want_s = pr45726_convert(q.view(torch.float8_e4m3fn), s, fnuz=target == "fnuz")
    assert_same((got_q, got_s), (want_q, want_s))


def test_fnuz_normalization_of_all_256_codes():
    """FNUZ reinterpretation: every finite e4m3fn code means half its value in FNUZ, -0 becomes +0."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    fn = codes.view(torch.float8_e4m3fn).to(torch.float32)
    fnuz_codes = torch.where(codes == 0x80, torch.zeros_like(codes), codes)
    fnuz = fnuz_codes.view(torch.float8_e4m3fnuz).to(torch.float32)
    assert torch.equal(fnuz[finite] * 2, fn[finite].abs() * torch.sign(fn[finite]) + 0.0)
    # ml_dtypes agrees, and no finite code turns into FNUZ NaN (0x80).
    ml = fnuz_codes.numpy().view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)
    np.testing.assert_array_equal(ml[finite.numpy()] * 2, fn[finite].numpy() + 0.0)
    assert not np.isnan(ml[finite.numpy()]).any()
    # Through the converter: one tile holding every finite code at scale 2**0 is reproduced exactly.
    q, s = AWKWARD["every code, scale 2**0"]
    for target in TARGETS:
        out_q, out_s = convert_reference(q, s, target, "exact")
        assert torch.equal(dequantize_block(out_q, out_s, target), dequantize_mx(q, s) + 0.0)
        assert not (out_q == 0x80).any() or target == "ocp"


def test_exact_mode_is_lossless_above_e4m3_normal_range():
    q, s = random_mx((2, 257, 416), lo=120, hi=135, seed=5)
    v = dequantize_mx(q, s)
    out_q, out_s = convert_reference(q, s, "fnuz", "exact")
    back = dequantize_block(out_q, out_s, "fnuz")
    scale = out_s.repeat_interleave(128, -2)[..., :257, :].repeat_interleave(128, -1)[..., :416] / 2
    normal = v.abs() >= scale * 2.0**-6  # values that stay in e4m3fn's normal range after scaling
    assert normal.float().mean() > 0.5
    assert torch.equal(back[normal], v[normal])


# --- Triton kernel vs reference ---------------------------------------------------------------


PTX_MISSING = (
    "ptx kernel not run: it needs an NVIDIA GPU of compute capability 8.9+ (this machine: "
    f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}); "
    "tests/gpu/run_gpu_suite.py runs it on one and test_gpu_record.py checks that run is current"
)


def kernel_variants():
    """Every kernel; the ones this machine cannot run are skipped with the reason, so the output says so."""
    has_ptx = default_kernel(torch.device(DEVICE)) == "ptx"
    return ["portable", pytest.param("ptx", marks=pytest.mark.skipif(not has_ptx, reason=PTX_MISSING))]


@pytest.mark.parametrize("kernel", kernel_variants())
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference_random(shape, target, mode, kernel):
    q, s = random_mx(shape, seed=sum(shape))
    want = convert_reference(q, s, target, mode)
    got = convert_triton(q.to(DEVICE), s.to(DEVICE), target, mode, kernel=kernel)
    assert_same(got, want)


@pytest.mark.parametrize("kernel", kernel_variants())
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(AWKWARD))
def test_kernel_matches_reference_awkward(case, target, mode, kernel):
    q, s = AWKWARD[case]
    want = convert_reference(q, s, target, mode)
    got = convert_triton(q.to(DEVICE), s.to(DEVICE), target, mode, kernel=kernel)
    assert_same(got, want)


# --- grouped launches: many weights of mixed shapes in one launch ---------------------------------------------


#: The exhaustive amax-code cases repeat one stack (126 one-row tiles) with three scale bytes: the tile program's
#: arithmetic, which the grouped and packed launches share with convert_triton (test_kernel_matches_reference_awkward
#: runs all three). A group holds one of them: two thirds of its tiles, and of the interpreter's time, otherwise.
_ARITHMETIC_ONLY = ("every amax code, one-row tiles, scale byte 0", "every amax code, one-row tiles, scale byte 127")


def _mixed_group():
    """2-D per-expert weights and 3-D stacks of every SHAPES entry, and every awkward case (of the exhaustive
    amax-code ones, one: :data:`_ARITHMETIC_ONLY`)."""
    items = []
    for shape in SHAPES:
        q, s = random_mx(shape, seed=sum(shape) + 1)
        items.append((q[0], s[0]))  # 2-D
        items.append((q, s))  # 3-D
    items.extend(case for name, case in AWKWARD.items() if name not in _ARITHMETIC_ONLY)
    return items


@pytest.mark.parametrize("kernel", kernel_variants())
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", TARGETS)
def test_grouped_launch_matches_reference_on_mixed_shapes(target, mode, kernel):
    items = _mixed_group()
    empty = (torch.zeros((0, 64), dtype=torch.uint8), torch.zeros((0, 2), dtype=torch.uint8))
    group = [(q.to(DEVICE), s.to(DEVICE)) for q, s in [*items[:3], empty, *items[3:]]]
    got = convert_triton_grouped(group, target, mode, kernel=kernel)
    assert len(got) == len(items) + 1
    assert got.pop(3)[0].shape == (0, 64)
    for (q, s), out in zip(items, got):
        assert_same(out, convert_reference(q, s, target, mode))


@pytest.mark.parametrize("kernel", kernel_variants())
def test_grouped_launch_in_small_chunks_over_three_grid_axes(kernel, monkeypatch):
    """More experts of one shape than one launch's third grid axis holds (GRID_Z 2 here: several launches per
    shape, the table sliced): the bytes of converting each weight alone."""
    monkeypatch.setattr(kernels, "GRID_Z", 2)
    items = _mixed_group()
    assert any(math.prod(q.shape[:-2]) > 2 for q, _ in items)
    got = convert_triton_grouped([(q.to(DEVICE), s.to(DEVICE)) for q, s in items], "fnuz", "amax", kernel=kernel)
    for (q, s), out in zip(items, got):
        assert_same(out, convert_reference(q, s, "fnuz", "amax"))


@pytest.mark.parametrize("kernel", kernel_variants())
@pytest.mark.parametrize("mode", MODES)
def test_packed_launch_matches_reference(mode, kernel):
    """convert_packed: weights at unaligned and aligned offsets of one buffer, outputs at the same offsets."""
    items = _mixed_group()
    buf, weights, at, scale_at = [], [], 0, 0
    for i, (q, s) in enumerate(items):
        pad = 16 if i % 2 else 3  # odd offsets too: ptx falls back to the portable program for the whole launch
        code_off = at + pad
        scale_off = code_off + q.numel()
        weights.append(PackedWeight(tuple(q.shape), code_off, scale_off, scale_at))
        at = scale_off + s.numel()
        scale_at += weights[-1].tiles
        buf.append((code_off, q, scale_off, s))
    data = torch.full((at,), 0x7F, dtype=torch.uint8)  # NaN codes between the weights: never read
    for code_off, q, scale_off, s in buf:
        data[code_off : code_off + q.numel()] = q.reshape(-1)
        data[scale_off : scale_off + s.numel()] = s.reshape(-1)
    data = data.to(DEVICE)
    out = torch.zeros_like(data)
    out_scales = torch.zeros(scale_at, dtype=torch.float32, device=DEVICE)
    convert_packed(data, out, out_scales, weights, "ocp", mode, kernel=kernel)
    for w, (q, s) in zip(weights, items):
        want_q, want_s = convert_reference(q, s, "ocp", mode)
        got_q = out[w.code_offset : w.code_offset + q.numel()].view(q.shape)
        got_s = out_scales[w.out_scale_offset : w.out_scale_offset + w.tiles].view(want_s.shape)
        assert_same((got_q, got_s), (want_q, want_s))


@pytest.mark.parametrize("kernel", kernel_variants())
@pytest.mark.parametrize("case", ["NaN code 0x7F", "E8M0 0xFF", "overflow"])
def test_grouped_launch_names_the_invalid_weight(case, kernel):
    bad_q, bad_s, words = invalid_cases()[case]
    good = [random_mx((130, 96), seed=i) for i in range(3)]
    items = [good[0], good[1], (bad_q, bad_s), good[2], (bad_q, bad_s)]
    with pytest.raises(GroupMemberError, match=words) as err:
        convert_triton_grouped([(q.to(DEVICE), s.to(DEVICE)) for q, s in items], kernel=kernel)
    assert err.value.index == 2
    assert isinstance(err.value, MxFormatError)


#: (N, K) -> (tiles along N, tiles along K), counted by hand: the kernel and the reference share
#: formats.tile_grid, so comparing them cannot catch a wrong grid. Exact multiples of 128 and one past.
TILE_COUNTS = {(1, 32): (1, 1), (127, 96): (1, 1), (128, 128): (1, 1), (129, 128): (2, 1), (128, 160): (1, 2),
               (256, 256): (2, 2), (257, 416): (3, 4)}


@pytest.mark.parametrize("n, k", list(TILE_COUNTS))
def test_tile_grid_and_output_shapes_match_counts_made_by_hand(n, k):
    tiles = TILE_COUNTS[(n, k)]
    assert tile_grid(n, k) == tiles
    q, s = random_mx((1, n, k), seed=n + k)
    outputs = {
        "reference": convert_reference(q, s),
        "kernel": convert_triton(q.to(DEVICE), s.to(DEVICE)),
        "kernel 2-D": convert_triton(q[0].to(DEVICE), s[0].to(DEVICE)),
        "convert_weight": convert_weight(q, s, device="cpu"),
    }
    for name, (codes, scale) in outputs.items():
        assert tuple(codes.shape[-2:]) == (n, k), name
        assert tuple(scale.shape[-2:]) == tiles, (name, tuple(scale.shape))
    # Every tile holds data here, so no tile's scale is the 1.0 of an all-zero (padding-only) tile.
    want_q, want_s = numpy_oracle(q[0].numpy(), s[0].numpy(), "fnuz", "exact")
    assert want_s.shape == tiles
    np.testing.assert_array_equal(outputs["kernel"][1][0].cpu().numpy().view(np.uint32), want_s.view(np.uint32))


def rounding_probe() -> torch.Tensor:
    """float32 values where e4m3fn rounding can go wrong: every code, every midpoint, one ulp either side."""
    values = torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    mids = (values[:-1] + values[1:]) / 2
    below_min = torch.tensor([2.0**-10, 3 * 2.0**-11, 2.0**-11, 2.0**-12, 1e-30, 1e-40, 0.0], dtype=torch.float64)
    top = torch.tensor([448.0, 448.00003, 455.9, 456.0], dtype=torch.float64)
    exact = torch.cat([values, mids, below_min, top]).to(torch.float32)
    bits = exact.view(torch.int32)
    neighbours = torch.cat([(bits - 1).clamp(min=0), bits + 1]).view(torch.float32)
    rand = torch.rand(20000, generator=torch.Generator().manual_seed(9)) * 448
    tiny = torch.rand(5000, generator=torch.Generator().manual_seed(10)) * 2.0**-5
    return torch.cat([exact, neighbours, rand, tiny])


def test_kernel_rounding_matches_torch_cast_on_midpoints():
    x = rounding_probe()
    x = x[x < 448.0 * (1 + 2**-20)]
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    got = round_to_e4m3fn(x.to(DEVICE)).cpu()
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} values round differently, e.g. {x[bad[:5]].tolist()}"
    # ml_dtypes (an independent RNE implementation) agrees with torch on these values.
    np.testing.assert_array_equal(x.numpy().astype(ml_dtypes.float8_e4m3fn).view(np.uint8), want.numpy())


def test_kernel_two_dimensional_and_chunked_paths_agree():
    q, s = random_mx((5, 130, 160), seed=6)
    want = convert_reference(q, s, "fnuz", "exact")
    got2d = [convert_triton(q[i].to(DEVICE), s[i].to(DEVICE)) for i in range(5)]
    assert_same((torch.stack([g[0] for g in got2d]), torch.stack([g[1] for g in got2d])), want)
    if DEVICE == "cuda":  # host tensors go to the GPU two experts at a time
        got = convert_weight(q, s, device="cuda", chunk_bytes=2 * 130 * 160)
        assert_same(got, want)


# --- invalid input -----------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", kernel_variants())
@pytest.mark.parametrize("case", list(invalid_cases()))
def test_invalid_values_are_refused_by_every_path(case, kernel):
    q, s, words = invalid_cases()[case]
    with pytest.raises(MxFormatError, match=words):
        validate_pair(q, s)
    with pytest.raises(MxFormatError, match=words):
        convert_weight(q, s, device="cpu")
    with pytest.raises(MxFormatError, match=words):
        convert_triton(q.to(DEVICE), s.to(DEVICE), kernel=kernel)


@pytest.mark.parametrize(
    "codes_shape, scales_shape, words",
    [((128, 100), (128, 3), "not a multiple of 32"), ((128, 128), (128, 8), "does not match"), ((4,), (1,), "dimensions")],
)
def test_bad_shapes_are_refused(codes_shape, scales_shape, words):
    with pytest.raises(MxFormatError, match=words):
        convert_weight(torch.zeros(codes_shape, dtype=torch.uint8), torch.zeros(scales_shape, dtype=torch.uint8))


def test_e8m0_and_fp8_dtypes_are_accepted():
    q, s = random_mx((1, 64, 64), seed=8)
    want = convert_reference(q, s)
    got = convert_weight(q.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), device="cpu")
    assert got[0].dtype == torch.float8_e4m3fnuz
    assert_same(got, want)
