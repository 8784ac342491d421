"""Which paths the daemon may read: sources under the allowed roots, and nothing a request can redirect elsewhere.

Names are checked before anything touches the file system: an absolute path without NUL bytes, at
most :data:`MAX_PATH_CHARS`. Where a source leads is checked on the open descriptors, not on names
(:mod:`transformd.cache.securefs`): every file and directory the identity or the conversion reads is
opened once, and its real path, as the kernel reports it for the open descriptor, must be inside an
allowed root (resolved once, when the daemon starts). The conversion then reads those descriptors
only, so a symlink swapped after the check cannot redirect a read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from ..cache.securefs import within
from .errors import ApiError

#: Longest source path accepted.
MAX_PATH_CHARS = 4096
#: A checkpoint file name as the API accepts it in a URL.
FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")


def check_file_name(name: str) -> str:
    """``name`` if it can be a shard name (no ``/``, no ``..``, no leading dot); else a 404 error."""
    if not FILE_NAME_RE.fullmatch(name) or ".." in name:
        shown = repr(name[:80]) + ("..." if len(name) > 80 else "")
        raise ApiError(404, "unknown_file", f"no file {shown} in this checkpoint (file names have no '/' or '..')")
    return name


class SourcePolicy:
    """The allowed roots and the checks every source goes through."""

    def __init__(self, roots: Iterable[str | os.PathLike[str]]):
        self.roots = tuple(os.path.realpath(os.fspath(r)) for r in roots)

    def describe(self) -> str:
        return ", ".join(self.roots) if self.roots else "(none)"

    def allowed(self, real: str) -> bool:
        return any(within(real, root) for root in self.roots)

    def check_syntax(self, source: str) -> str:
        """The source string if it is a plausible absolute path; a 400 error otherwise. Touches nothing."""
        if not source or len(source) > MAX_PATH_CHARS or "\0" in source:
            raise ApiError(400, "bad_source", f"source must be an absolute path of 1..{MAX_PATH_CHARS} characters")
        try:
            source.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON): no file name can hold it
            raise ApiError(400, "bad_source", "source is not valid Unicode (a lone surrogate?)") from None
        if not os.path.isabs(source):
            raise ApiError(
                400,
                "bad_source",
                f"source {source!r} is not an absolute path; give the checkpoint directory's full path",
            )
        return source

    def resolve(self, source: str) -> Path:
        """Blocking: the real directory ``source`` leads to, checked as a conversion opens it (every file and
        directory of it, at open time, inside the roots); raises :class:`ApiError` (403 outside the roots, without
        saying whether the outside path exists)."""
        from ..cache.securefs import open_source
        from .errors import error_for_exception

        self.check_allowed(source)
        try:
            with open_source(source, self.roots) as tree:
                return Path(tree.real)
        except ApiError:
            raise
        except Exception as e:
            raise error_for_exception(e) from e

    def check_allowed(self, source: str) -> str:
        """``source`` if it may be asked for at all (syntax, some root configured); raises :class:`ApiError`.

        Where it leads is checked when its files are opened (:mod:`transformd.cache.securefs`).
        """
        self.check_syntax(source)
        if not self.roots:
            raise ApiError(
                403,
                "source_not_allowed",
                f"source {source} is refused: this daemon allows no source directories; start it with "
                "--allow-root DIR (or TRANSFORMD_ALLOW_ROOTS)",
            )
        return source
