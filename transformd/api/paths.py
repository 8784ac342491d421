"""Which paths the daemon may read: sources under the allowed roots, and nothing a request can redirect elsewhere.

A source is accepted when its real path (every symlink resolved) is inside an allowed root (itself
resolved once, when the daemon starts), and so is the real path of every file and directory the
conversion or the cache key would read inside it, symlinks included. Names are checked before
anything touches the file system: an absolute path without NUL bytes, at most :data:`MAX_PATH_CHARS`.

Residual risk, for the record: a local user who can write inside an allowed root could swap a
symlink between this check and the conversion's reads. The cache detects a changed (device, inode)
of any source file at the end of a conversion and discards the result (409 ``source_changed``),
so a swap is only missed when it is undone before the conversion ends.
"""

from __future__ import annotations

import os
import re
import stat as stat_mod
from collections.abc import Iterable
from pathlib import Path

from .errors import ApiError

#: Longest source path accepted.
MAX_PATH_CHARS = 4096
#: Most directory entries scanned in one source (a guard against pointing the daemon at a huge tree).
MAX_SOURCE_ENTRIES = 100_000
#: Hidden directories the cache key reads from (huggingface_hub's local-dir metadata); other hidden names are
#: neither read nor converted and are not checked.
_READ_HIDDEN = frozenset({".cache"})
#: A checkpoint file name as the API accepts it in a URL.
FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")


def check_file_name(name: str) -> str:
    """``name`` if it can be a shard name (no ``/``, no ``..``, no leading dot); else a 404 error."""
    if not FILE_NAME_RE.fullmatch(name) or ".." in name:
        shown = repr(name[:80]) + ("..." if len(name) > 80 else "")
        raise ApiError(404, "unknown_file", f"no file {shown} in this checkpoint (file names have no '/' or '..')")
    return name


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class SourcePolicy:
    """The allowed roots and the checks every source goes through."""

    def __init__(self, roots: Iterable[str | os.PathLike[str]]):
        self.roots = tuple(os.path.realpath(os.fspath(r)) for r in roots)

    def describe(self) -> str:
        return ", ".join(self.roots) if self.roots else "(none)"

    def allowed(self, real: str) -> bool:
        return any(_within(real, root) for root in self.roots)

    def check_syntax(self, source: str) -> str:
        """The source string if it is a plausible absolute path; a 400 error otherwise. Touches nothing."""
        if not source or len(source) > MAX_PATH_CHARS or "\0" in source:
            raise ApiError(400, "bad_source", f"source must be an absolute path of 1..{MAX_PATH_CHARS} characters")
        if not os.path.isabs(source):
            raise ApiError(
                400,
                "bad_source",
                f"source {source!r} is not an absolute path; give the checkpoint directory's full path",
            )
        return source

    def resolve(self, source: str) -> Path:
        """The real path of ``source`` after every check; raises :class:`ApiError` (403, 404, 400).

        Blocking (stats every file of the source): call it from a worker thread.
        """
        self.check_syntax(source)
        if not self.roots:
            raise ApiError(
                403,
                "source_not_allowed",
                f"source {source} is refused: this daemon allows no source directories; start it with "
                "--allow-root DIR (or TRANSFORMD_ALLOW_ROOTS)",
            )
        real = os.path.realpath(source)
        if not self.allowed(real):
            raise ApiError(
                403,
                "source_not_allowed",
                f"source {source} (real path {real}) is outside the allowed roots ({self.describe()}). Sources are "
                "checked after resolving symlinks, so a symlink under a root that points outside is refused too; "
                f"move or copy the checkpoint under an allowed root, or restart the daemon with --allow-root "
                f"{real} (or add it to TRANSFORMD_ALLOW_ROOTS)",
            )
        try:
            st = os.stat(real)
        except FileNotFoundError:
            raise ApiError(404, "source_not_found", f"source directory {source} does not exist") from None
        except PermissionError:
            raise ApiError(403, "permission_denied", f"the daemon may not read {source}") from None
        except OSError as e:
            raise ApiError(400, "bad_source", f"cannot use source {source}: {e.strerror}") from None
        if not stat_mod.S_ISDIR(st.st_mode):
            raise ApiError(400, "bad_source", f"source {source} is not a directory; give the checkpoint directory")
        self._check_tree(real, source)
        return Path(real)

    def _check_tree(self, real_top: str, source: str) -> None:
        """Every entry the conversion or the key could read must resolve inside the allowed roots."""
        seen = 0
        stack = [real_top]
        visited: set[tuple[int, int]] = set()
        while stack:
            d = stack.pop()
            try:
                entries = list(os.scandir(d))
            except PermissionError:
                raise ApiError(403, "permission_denied", f"the daemon may not list {d} (in source {source})") from None
            except OSError as e:
                raise ApiError(422, "invalid_source", f"cannot list {d} (in source {source}): {e.strerror}") from None
            for e in entries:
                seen += 1
                if seen > MAX_SOURCE_ENTRIES:
                    raise ApiError(
                        422,
                        "invalid_source",
                        f"source {source} holds more than {MAX_SOURCE_ENTRIES} files and directories",
                    )
                if e.name.startswith(".") and not (d == real_top and e.name in _READ_HIDDEN):
                    continue
                real = e.path
                if e.is_symlink():
                    real = os.path.realpath(e.path)
                    if not self.allowed(real):
                        raise ApiError(
                            403,
                            "source_not_allowed",
                            f"{e.path} in source {source} is a symlink to {real}, outside the allowed roots "
                            f"({self.describe()}); the daemon reads nothing outside them, symlinks are resolved "
                            f"first: replace the link by the file itself, or restart the daemon with --allow-root "
                            f"{os.path.dirname(real)}",
                        )
                try:
                    st = os.stat(real)
                except FileNotFoundError:
                    raise ApiError(422, "invalid_source", f"{e.path} in source {source} is a broken symlink") from None
                except OSError as err:
                    raise ApiError(422, "invalid_source", f"cannot stat {e.path}: {err.strerror}") from None
                if stat_mod.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) not in visited:
                    visited.add((st.st_dev, st.st_ino))
                    stack.append(real)
