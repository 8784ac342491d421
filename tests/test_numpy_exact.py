"""The NumPy exact-mode conversion (transformd.numpy_exact, what the head start converts with) against torch's own
cast and the reference, bit for bit: random data, the awkward cases, slices of a matrix, and invalid values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transformd import MxFormatError, convert_weight, numpy_exact
from transformd import convert as convert_module
from transformd.numpy_exact import D_MAX, D_MIN, convert_exact, e4m3fn_code, e4m3fn_value, table
from transformd.reference import convert_reference

from .support.kernel_cases import AWKWARD, every_scale_mx, invalid_cases, random_mx, spread_row_mx

TARGETS = ["fnuz", "ocp"]
ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
FINITE = (ALL_CODES & 0x7F) != 0x7F


def test_values_and_codes_round_trip_through_torch():
    values = ALL_CODES.view(torch.float8_e4m3fn).to(torch.float64)
    for code in range(256):
        if code & 0x7F != 0x7F:
            assert e4m3fn_value(code) == values[code].item() and np.signbit(e4m3fn_value(code)) == bool(code & 0x80)
            assert e4m3fn_code(e4m3fn_value(code)) == code


@pytest.mark.parametrize("target", TARGETS)
def test_table_is_torchs_cast_of_every_code_at_every_shift(target):
    """Every entry an input can reach (|value| * 2**d <= 448) is what torch's float32 -> e4m3fn cast gives."""
    rows = table(target == "fnuz")
    for i, d in enumerate(range(D_MIN, D_MAX + 1)):
        scaled = ALL_CODES.view(torch.float8_e4m3fn).to(torch.float32) * 2.0**d
        want = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        if target == "fnuz":
            want = torch.where(want == 0x80, torch.zeros_like(want), want)
        reachable = FINITE & (scaled.abs() <= 448)
        got = torch.from_numpy(rows[i].copy())
        assert torch.equal(got[reachable], want[reachable]), f"d = {d}"
    assert not rows.flags.writeable


def test_shifts_beyond_the_table_give_what_its_last_rows_give():
    """Below D_MIN every value rounds to a signed zero (as the first row says); D_MAX bounds a nonzero block."""
    assert {int(c) for c in table(False)[0]} <= {0x00, 0x80, 0x7E, 0xFE}  # (0x7E/0xFE: the NaN codes' slots)
    smallest_nonzero = 2.0**-9 * 2.0**D_MAX
    assert smallest_nonzero <= 448 < smallest_nonzero * 2


def assert_like_reference(q: torch.Tensor, s: torch.Tensor, target: str, mode: str = "exact") -> None:
    want_q, want_s = convert_reference(q, s, target, mode)
    q3, s3 = (q, s) if q.dim() == 3 else (q[None], s[None])
    want_q, want_s = (want_q, want_s) if q.dim() == 3 else (want_q[None], want_s[None])
    convert = numpy_exact.converter(mode)
    for i in range(q3.shape[0]):
        got = convert(q3[i].numpy(), s3[i].numpy(), fnuz=target == "fnuz")
        assert got is not None
        got_q, got_s = got
        np.testing.assert_array_equal(got_q, want_q[i].numpy())
        np.testing.assert_array_equal(got_s.view(np.uint32), want_s[i].numpy().view(np.uint32))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", ["random", "random, every scale", *AWKWARD])
def test_matches_reference(case, target):
    if case == "random":
        q, s = random_mx((2, 257, 416), seed=3)
    elif case == "random, every scale":
        q, s = every_scale_mx((2, 300, 512))
    else:
        q, s = AWKWARD[case]
    assert_like_reference(q, s, target)


def test_amax_rounding_is_torchs_cast():
    """round_to_e4m3fn against torch's float32 -> e4m3fn cast: every code, every midpoint, one ulp either side of
    each, random values over [0, 448], random subnormal-range and tiny float32s."""
    codes = torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    exact = torch.cat([codes, (codes[:-1] + codes[1:]) / 2]).to(torch.float32)
    bits = exact.view(torch.int32)
    around = torch.cat([exact, (bits - 1).clamp(min=0).view(torch.float32), (bits + 1).view(torch.float32)])
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([around, torch.rand(200_000, generator=gen) * 448, torch.rand(50_000, generator=gen) * 2.0**-5,
                   torch.randint(0, 1 << 23, (20_000,), generator=gen, dtype=torch.int32).view(torch.float32)])
    x = x[x <= 448]
    want = x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(numpy_exact.round_to_e4m3fn(x.numpy()), want)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", ["random", *AWKWARD])
def test_amax_matches_reference(case, target):
    q, s = random_mx((2, 257, 416), seed=3) if case == "random" else AWKWARD[case]
    assert_like_reference(q, s, target, "amax")


def zero_blocks_scaled_zero(shape, seed=5):
    """Random data in which every third block is all zeros (signed) with E8M0 byte 0, as some quantizers write
    them, and every fifth holds only tiny values (E8M0 bytes 0..20) that round to signed zeros in the amax mode."""
    q, s = random_mx(shape, seed=seed)
    blocks = q.view(*shape[:-1], shape[-1] // 32, 32)
    blocks[..., ::3, :] &= 0x80
    s[..., ::3] = 0
    s[..., 1::5] = torch.randint(0, 21, s[..., 1::5].shape, generator=torch.Generator().manual_seed(seed),
                                 dtype=torch.uint8)
    return q, s


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", ["every scale", "zero blocks scaled 0"])
def test_amax_lookups_take_spread_scales(case, target):
    """E8M0 bytes over their whole range in every tile, or all-zero blocks with byte 0 beside ordinary ones: the
    blocks far below their tile share the table of signed zeros, the others need at most 38 tables a tile, so the
    lookups convert these too, as the reference does."""
    q, s = every_scale_mx((2, 300, 512)) if case == "every scale" else zero_blocks_scaled_zero((2, 300, 512))
    assert_like_reference(q, s, target, "amax")


@pytest.mark.parametrize("case", ["every scale", "zero blocks scaled 0", "random"])
def test_amax_lookups_memory_is_a_few_times_the_codes(case):
    """The tables are computed a bounded number of entries at a time: the peak of what the lookups allocate (output,
    indices, tables and temporaries) stays within 4x the codes, whatever the scales (it was 47x for bytes spanning
    130 values in every tile)."""
    import tracemalloc

    make = {"every scale": every_scale_mx, "zero blocks scaled 0": zero_blocks_scaled_zero, "random": random_mx}
    q, s = make[case]((1, 1024, 2048))
    q, s = q[0].numpy(), s[0].numpy()
    tracemalloc.start()
    try:
        assert numpy_exact.convert_amax(q, s, fnuz=False) is not None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 4 * q.nbytes, f"peak {peak / q.nbytes:.1f}x the codes"


def test_amax_leaves_spread_scales_in_a_few_rows_to_the_reference(monkeypatch):
    """One row of 128-wide tiles whose blocks' bytes span 11 values (:func:`spread_row_mx`). Refused (None): the
    caller converts with the reference. Allowed that many tables, the lookups give the reference's bytes there
    too."""
    q, s = spread_row_mx()
    assert numpy_exact.convert_amax(q.numpy(), s.numpy(), fnuz=False) is None
    monkeypatch.setattr(numpy_exact, "_AMAX_TABLE_BYTES", 1 << 30)
    for target in TARGETS:
        assert_like_reference(q, s, target, "amax")


@pytest.mark.parametrize("entries", [1, 3000])
def test_amax_tables_in_pieces_of_tiles(entries, monkeypatch):
    """Tables computed one tile at a time, or a few tiles (the last piece partial), give the same bytes; and with
    uint64 indices, as a matrix of over 1 GiB gets, too."""
    monkeypatch.setattr(numpy_exact, "_AMAX_ENTRIES", entries)
    monkeypatch.setattr(numpy_exact, "_UINT32_ENTRIES", 1 if entries == 1 else 1 << 32)
    q, s = every_scale_mx((1, 300, 640), seed=4)
    for target in TARGETS:
        assert_like_reference(q, s, target, "amax")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(1, 32), (5, 96), (128, 128), (129, 4096), (1000, 160)])
def test_shapes_not_multiples_of_128_and_the_index_chunks(shape, target, monkeypatch):
    monkeypatch.setattr(numpy_exact, "_INDEX_BYTES", 3000)  # several lookups per matrix, the last one partial
    q, s = random_mx(shape, lo=100, hi=150, seed=sum(shape))
    assert_like_reference(q, s, target)


@pytest.mark.parametrize("piece", [32, 96, 1 << 18])
def test_block_maxima_are_the_largest_magnitude_of_each_block(piece, monkeypatch):
    """In pieces of one block, of three (the last one partial) and the default; the largest code at every position
    of a block, and the sign bit ignored."""
    monkeypatch.setattr(numpy_exact, "_MAX_BYTES", piece)
    rng = np.random.default_rng(piece)
    signs = rng.integers(0, 2, size=(37, 160), dtype=np.uint8) << 7
    codes = rng.integers(0, 64, size=(37, 160), dtype=np.uint8) | signs
    rows, biggest = np.arange(37), (64 + np.arange(37)).astype(np.uint8)
    codes.reshape(37, 5, 32)[rows, rows % 5, rows % 32] = 0x80 | biggest  # (row i: block i % 5, position i % 32)
    want = (codes & 0x7F).reshape(37, 5, 32).max(axis=2)
    assert (want[rows, rows % 5] == biggest).all()
    np.testing.assert_array_equal(numpy_exact.block_maxima(codes), want)


def test_bands_of_whole_tiles_convert_like_the_whole_matrix():
    q, s = random_mx((700, 256), seed=11)
    whole_q, whole_s = convert_exact(q.numpy(), s.numpy(), fnuz=True)
    for r0 in range(0, 700, 256):
        part = convert_exact(q[r0 : r0 + 256].numpy(), s[r0 : r0 + 256].numpy(), fnuz=True)
        np.testing.assert_array_equal(part[0], whole_q[r0 : r0 + 256])
        np.testing.assert_array_equal(part[1], whole_s[r0 // 128 : r0 // 128 + 2])


@pytest.mark.parametrize("shape, most", [((700, 256), 256 * 256), ((3, 300, 96), 1), ((2, 129, 4096), 1 << 20),
                                         ((64, 32), 1 << 30)])
def test_tile_bands_cover_each_expert_in_whole_tiles(shape, most):
    *lead, n, k = shape
    bands = list(numpy_exact.tile_bands(shape, most))
    experts = lead[0] if lead else 1
    order = [e for e, _, _ in bands]
    assert order == sorted(order) and set(order) == set(range(experts))
    for e in range(experts):
        rows = [(r0, r1) for x, r0, r1 in bands if x == e]
        assert rows[0][0] == 0 and rows[-1][1] == n and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
        assert all(r0 % 128 == 0 and (r1 - r0 <= 128 or (r1 - r0) * k <= most) for r0, r1 in rows)


def test_in_place():
    q, s = random_mx((300, 256), seed=12)
    want = convert_exact(q.numpy(), s.numpy(), fnuz=False)
    codes = q.numpy().copy()
    got = convert_exact(codes, s.numpy(), fnuz=False, out=codes)
    assert got[0] is codes
    np.testing.assert_array_equal(codes, want[0])


@pytest.mark.parametrize("case", list(invalid_cases()))
@pytest.mark.parametrize("mode", ["exact", "amax"])
def test_invalid_values_are_refused(case, mode):
    q, s, _ = invalid_cases()[case]
    convert = numpy_exact.converter(mode)
    results = [convert(q[i].numpy(), s[i].numpy(), fnuz=True) for i in range(q.shape[0])]
    assert any(r is None for r in results)
    valid = [i for i, r in enumerate(results) if r is not None]
    for i in valid:  # (the other matrix of the case is valid, and converts like the reference)
        assert_like_reference(q[i], s[i], "fnuz", mode)


@pytest.mark.parametrize("mode", ["exact", "amax"])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", ["random 2-D", "Quark per_block scales", *AWKWARD])
def test_convert_weight_on_the_cpu_looks_up_the_references_bytes(case, target, mode, monkeypatch):
    """transformd.convert_weight(device="cpu") in both modes: the lookups, never the reference, same bytes."""
    if case == "random 2-D":
        q, s = random_mx((300, 416), seed=5)
        row_block, scales = None, s
    elif case == "Quark per_block scales":  # one scale per 32 rows: expanded before the lookups
        q, s = random_mx((2, 96, 160), seed=6)
        row_block, scales = 32, s[:, ::32].contiguous()
        s = scales.repeat_interleave(32, dim=1)
    else:
        q, s = AWKWARD[case]
        row_block, scales = None, s
    want_q, want_s = convert_reference(q, s, target, mode)

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference was called for valid input")

    monkeypatch.setattr(convert_module, "convert_reference", no_reference)
    got_q, got_s = convert_weight(q.view(torch.float8_e4m3fn), scales, target, mode, device="cpu", row_block=row_block)
    assert got_q.dtype == (torch.float8_e4m3fnuz if target == "fnuz" else torch.float8_e4m3fn)
    assert got_q.shape == q.shape and got_s.shape == want_s.shape and got_s.dtype == torch.float32
    np.testing.assert_array_equal(got_q.view(torch.uint8).numpy(), want_q.numpy())
    np.testing.assert_array_equal(got_s.numpy().view(np.uint32), want_s.numpy().view(np.uint32))


@pytest.mark.parametrize("mode", ["exact", "amax"])
@pytest.mark.parametrize("case", list(invalid_cases()))
def test_convert_weight_on_the_cpu_names_an_invalid_value(case, mode):
    q, s, words = invalid_cases()[case]
    with pytest.raises(MxFormatError, match=words):
        convert_weight(q, s, "ocp", mode, device="cpu")
