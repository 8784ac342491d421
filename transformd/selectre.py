"""``select`` patterns: matched in linear time, so no pattern can freeze the daemon or the converter.

A pattern is compiled with RE2 (google-re2: no backtracking). RE2 has no lookaround and no
backreferences; a pattern that needs them is compiled with Python's ``re`` only when its shape
bounds the backtracking: at most one unbounded repetition, no repetition or alternation inside
a repetition, no backreference. Everything else is refused (:class:`SelectError`) with a message
saying why. Python's ``re`` holds the GIL while it matches and cannot be interrupted, so the
refusal is the only protection it gets.
"""

from __future__ import annotations

from typing import Any

try:  # Python 3.11+
    from re import _constants as _sre_c  # type: ignore[attr-defined]
    from re import _parser as _sre_p  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre_c  # type: ignore[no-redef]
    import sre_parse as _sre_p  # type: ignore[no-redef]
import re

import re2

from .errors import BadRequestError

#: Longest pattern accepted.
MAX_SELECT_CHARS = 1000

_REPEATS = {_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT, getattr(_sre_c, "POSSESSIVE_REPEAT", None)} - {None}


class SelectError(BadRequestError):
    """The pattern is refused; the message says why."""

    code = "bad_select"


def _walk(items: Any, depth: int, counts: list[int]) -> None:
    for op, arg in items:
        if op in _REPEATS:
            lo, hi, sub = arg
            if depth > 0:
                raise SelectError("a repetition inside a repetition can take exponential time")
            if hi == _sre_c.MAXREPEAT:
                counts[0] += 1
            _walk(sub, depth + 1, counts)
        elif op == _sre_c.GROUPREF or op == getattr(_sre_c, "GROUPREF_EXISTS", None):
            raise SelectError("backreferences are not supported")
        elif op == _sre_c.SUBPATTERN:
            _walk(arg[-1], depth, counts)
        elif op == _sre_c.BRANCH:
            if depth > 0:
                raise SelectError("an alternation inside a repetition can take exponential time")
            for branch in arg[1]:
                _walk(branch, depth, counts)
        elif op in (_sre_c.ASSERT, _sre_c.ASSERT_NOT):
            _walk(arg[1], depth, counts)
        elif op == getattr(_sre_c, "ATOMIC_GROUP", None):
            _walk(arg, depth, counts)


def compile_select(pattern: str) -> Any:
    """A compiled pattern with ``search``; raises :class:`SelectError` (see the module docstring)."""
    if not isinstance(pattern, str) or len(pattern) > MAX_SELECT_CHARS:
        raise SelectError(f"a pattern of at most {MAX_SELECT_CHARS} characters is needed")
    try:
        pattern.encode("utf-8")
    except UnicodeEncodeError:
        raise SelectError("the pattern is not valid Unicode (a lone surrogate?)") from None
    options = re2.Options()
    options.log_errors = False  # a refused pattern is the caller's error, not a line in the daemon's log
    try:
        return re2.compile(pattern, options)
    except re2.error as err:
        rejected = err.args[0].decode("utf-8", "replace") if err.args and isinstance(err.args[0], bytes) else str(err)
    try:
        parsed = _sre_p.parse(pattern)
    except re.error as err:
        raise SelectError(f"not a valid regular expression: {err}") from None
    counts = [0]
    try:
        _walk(parsed, 0, counts)
    except SelectError as err:
        raise SelectError(f"RE2 cannot match it ({rejected[:120]}) and {err}") from None
    if counts[0] > 1:
        raise SelectError(
            f"RE2 cannot match it ({rejected[:120]}) and with lookaround only one unbounded repetition is allowed"
        )
    return re.compile(pattern)
