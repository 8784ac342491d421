"""The arithmetic facts behind ``amax`` mode's division in the kernels, checked exactly on rationals.

The reference rounds ``v / scale`` to float32 (IEEE), then to e4m3fn. The kernels write
``v / scale = (m / sig) * 2**d`` (sig in [1, 2): the scale's significand, m: a code's value) and compute
``y0 = m * (r * 2**d)`` with ``r = 1/sig`` rounded to float32; powers of two change no rounding while every
intermediate is a normal float32 (the kernels keep them so), so the significands decide:

* a code's significand is one of 8 (1 + j/8), whatever its exponent, subnormal codes included;
* a scale ``amax / 448`` has one of 8 significands where it is a normal float32, 86 in all (a subnormal scale
  is rounded at fewer bits);
* for the 8 normal ones, y0 rounds to the same e4m3fn code as the IEEE quotient at every exponent, though it
  can be an ulp off: that is why one multiply per element is exact there;
* for the subnormal ones it does not always, and two FMAs (Markstein) give the IEEE quotient itself.

The kernels are checked on data in tests/test_kernels.py (``every amax code, one-row tiles`` reaches every
scale significand); this file shows the claims hold for every case, not only the ones data reach.
"""

from __future__ import annotations

from fractions import Fraction

import pytest


def _floor_log2(x: Fraction) -> int:
    e = x.numerator.bit_length() - x.denominator.bit_length()
    return e if Fraction(2) ** e <= x else e - 1


def _round_to_grid(x: Fraction, step: Fraction) -> Fraction:
    """x (>= 0) to the nearest multiple of step, ties to an even multiple."""
    q, rem = divmod(x / step, 1)
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and q % 2):
        q += 1
    return q * step


def f32(x: Fraction) -> Fraction:
    """Round a positive rational to float32, to nearest even, subnormals included."""
    return _round_to_grid(x, Fraction(2) ** (max(_floor_log2(x), -126) - 23))


def e4m3(y: Fraction) -> Fraction:
    """Round y >= 0 to the e4m3fn grid (3 mantissa bits, subnormal step 2**-9), to nearest even."""
    return _round_to_grid(y, Fraction(2) ** (max(_floor_log2(y), -6) - 3)) if y else y


def code_value(code: int) -> Fraction:
    exponent, mantissa = code >> 3, code & 7
    if exponent == 0:
        return Fraction(mantissa, 8) * Fraction(2) ** -6
    return (1 + Fraction(mantissa, 8)) * Fraction(2) ** (exponent - 7)


def significand(x: Fraction) -> Fraction:
    return x / Fraction(2) ** _floor_log2(x)


CODE_SIGNIFICANDS = [1 + Fraction(j, 8) for j in range(8)]


def _scale_significands() -> tuple[set[Fraction], set[Fraction]]:
    """Significands of every scale amax / 448 a valid tile can have: (normal scales, subnormal scales)."""
    normal, subnormal = set(), set()
    for code in range(1, 0x7F):
        for byte in range(255):
            amax = code_value(code) * Fraction(2) ** (byte - 127)
            if amax >= Fraction(2) ** 128:  # not finite in float32: refused
                continue
            scale = f32(amax / 448)
            (normal if scale >= Fraction(2) ** -126 else subnormal).add(significand(scale))
    return normal, subnormal


NORMAL, SUBNORMAL = _scale_significands()
#: Exponents of a quotient in [0.5, 2) that put it across e4m3fn's range, its subnormals and the rounding to 0.
SHIFTS = range(-12, 9)


def _quotients(sig: Fraction, m: Fraction) -> tuple[Fraction, Fraction, Fraction]:
    """(IEEE quotient, the kernels' y0, y0 after the FMA correction) of m / sig."""
    r = f32(1 / sig)
    y0 = f32(m * r)
    residual = m - y0 * sig  # an FMA: exact, and representable (asserted below)
    assert residual == 0 or f32(abs(residual)) == abs(residual)
    corrected = residual * r + y0
    return f32(m / sig), y0, f32(corrected)


def test_scale_significands_count():
    assert len(NORMAL) == 8
    assert len(NORMAL | SUBNORMAL) == 86


@pytest.mark.parametrize("kind", ["normal", "subnormal"])
def test_fma_correction_gives_the_ieee_quotient_for_every_pair(kind):
    for sig in NORMAL if kind == "normal" else SUBNORMAL:
        for m in CODE_SIGNIFICANDS:
            ieee, _, corrected = _quotients(sig, m)
            assert corrected == ieee, (m, sig)


def test_one_multiply_rounds_like_the_ieee_quotient_for_normal_scales():
    off_by_an_ulp = 0
    for sig in NORMAL:
        for m in CODE_SIGNIFICANDS:
            ieee, y0, _ = _quotients(sig, m)
            off_by_an_ulp += y0 != ieee
            for shift in SHIFTS:
                scale = Fraction(2) ** shift
                assert e4m3(y0 * scale) == e4m3(ieee * scale), (m, sig, shift)
    assert off_by_an_ulp  # the fact is about rounding to e4m3fn, not about y0 being the quotient


def test_one_multiply_is_not_enough_for_subnormal_scales():
    wrong = []
    for sig in SUBNORMAL:
        for m in CODE_SIGNIFICANDS:
            ieee, y0, _ = _quotients(sig, m)
            wrong += [shift for shift in SHIFTS if e4m3(y0 * Fraction(2) ** shift) != e4m3(ieee * Fraction(2) ** shift)]
    assert wrong
