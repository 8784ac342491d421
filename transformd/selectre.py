"""``select`` patterns: compiled and matched by RE2 only, in linear time, so no pattern can hold the daemon.

RE2 (google-re2) never backtracks: a match costs time linear in the text, and the binding releases the GIL
while it runs, so a pattern that is slow to match still stops no other request. A pattern RE2 cannot compile
(lookaround, backreferences, atomic groups, possessive repeats, repetition counts above 1000, or a syntax
error) is refused with :class:`SelectError`, whose message names the construct RE2 lacks. There is no fallback
to Python's ``re``: it backtracks while it holds the GIL and cannot be interrupted (an attack review froze the
daemon's ``/healthz`` for 25 s with a 66-character pattern of bounded repeats that RE2 refused).
"""

from __future__ import annotations

import re
from typing import Any

import re2

from .errors import TransformdError

#: Longest pattern accepted.
MAX_SELECT_CHARS = 1000
#: Memory RE2 may use for one compiled pattern (its default, 8 MiB, said explicitly): a pattern whose program
#: would be larger is refused ("pattern too large"), which bounds the time compiling and matching can take.
MAX_SELECT_MEM = 1 << 20

#: Syntax of Perl or Python's ``re`` that RE2 does not have, by the text that starts it: what a refusal names.
_LACKED = (
    (re.compile(r"\(\?<[=!]"), "lookbehind ((?<=...) or (?<!...))"),
    (re.compile(r"\(\?[=!]"), "lookahead ((?=...) or (?!...))"),
    (re.compile(r"\(\?P=|\\[1-9]|\\g<|\\k<"), "backreferences (\\1, (?P=name))"),
    (re.compile(r"\(\?>"), "atomic groups ((?>...))"),
    (re.compile(r"[*+?}]\+"), "possessive repetition (a*+, a++, a?+, a{n}+)"),
    (re.compile(r"\(\?\("), "conditionals ((?(1)...))"),
    (re.compile(r"\\[ZG]"), "the \\Z and \\G anchors (use \\z or $)"),
    (re.compile(r"\{(?:100[1-9]|10[1-9]\d|1[1-9]\d\d|[2-9]\d{3}|\d{5,})"), "repetition counts above 1000"),
)


class SelectError(TransformdError, ValueError):
    """The pattern is refused (422); the message says why."""

    code, http_status = "bad_select", 422


def lacked_syntax(pattern: str) -> str | None:
    """The syntax of ``pattern`` that RE2 does not have, named for a person; None when none is recognised."""
    for found, name in _LACKED:
        if found.search(pattern[:MAX_SELECT_CHARS]) is not None:  # (fixed patterns, no nested repeats: linear)
            return name
    return None


def compile_select(pattern: str) -> Any:
    """``pattern`` compiled by RE2 (an object with ``search``); raises :class:`SelectError` (see the module doc)."""
    if not isinstance(pattern, str) or len(pattern) > MAX_SELECT_CHARS:
        raise SelectError(f"a pattern of at most {MAX_SELECT_CHARS} characters is needed")
    try:
        pattern.encode("utf-8")
    except UnicodeEncodeError:
        raise SelectError("the pattern is not valid Unicode (a lone surrogate?)") from None
    options = re2.Options()
    options.log_errors = False  # a refused pattern is the caller's error, not a line in the daemon's log
    options.max_mem = MAX_SELECT_MEM
    try:
        return re2.compile(pattern, options)
    except re2.error as err:
        said = err.args[0].decode("utf-8", "replace") if err.args and isinstance(err.args[0], bytes) else str(err)
    lacked = lacked_syntax(pattern)
    if lacked is not None:
        raise SelectError(f"select is matched by RE2 (linear time), which has no {lacked}; RE2 said: "
                          f"{said[:120]}") from None
    raise SelectError(f"not a valid regular expression for RE2: {said[:160]}") from None
