"""The cache's budget: sizes as operators write them (``500G``, ``1.5TiB``, ``80%``)."""

from __future__ import annotations

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "p": 10**15,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}


def parse_size(text: str | int, *, total: int | None = None) -> int:
    """Parse ``"500G"``, ``"1.5TiB"``, ``"123456"`` or ``"80%"`` (of ``total``) into bytes."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    s = text.strip().lower().replace(" ", "")
    if s.endswith("%"):
        if total is None:
            raise ValueError(f"a percentage ({text}) needs a total to refer to")
        pct = float(s[:-1])
        if not 0 <= pct <= 100:
            raise ValueError(f"percentage out of range: {text}")
        return int(total * pct / 100)
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot parse size {text!r}; use bytes or a suffix like 500G, 1.5TiB, or 80%")
    value = float(num) * _UNITS[unit]
    if value < 0:
        raise ValueError(f"size must not be negative: {text}")
    return int(value)
