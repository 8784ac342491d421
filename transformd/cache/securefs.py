"""Reading a source checkpoint only through descriptors that were checked when they were opened.

:func:`open_source` walks a checkpoint directory relative to directory descriptors and opens every
file it will ever read (``O_RDONLY | O_NONBLOCK | O_NOCTTY``: a FIFO or a device never blocks the
open). Each opened descriptor is then checked, not its name: ``fstat`` (only regular files and
directories are accepted) and the real path the kernel reports for it (``/proc/self/fd/N``), which
must lie inside one of the allowed roots. A symlink swapped between a check and an open cannot
redirect a read: what was checked is the open file itself.

The conversion never reopens the source by name. :meth:`SourceTree.view` builds a private directory
whose entries are symlinks to ``/proc/self/fd/N`` of the checked descriptors; the converter reads
that directory, so it can only read the files that were checked and identified (the cache key
covers exactly those), and names starting with a dot are not in it. Errors that name a view path
are rewritten to name the source path (:meth:`SourceTree.relocate`).

Messages never name a path outside the roots, nor say whether it exists: every such case is the
same :class:`OutsideRootsError`.

The daemon opens a source *for* a caller inside :func:`reading_as`: the opens of :func:`open_source` (and the download
records of :meth:`SourceTree.read_meta`, in whatever thread) happen within the reader's ``opening()`` (the caller's own
file-system credentials, where the daemon may take them: :mod:`transformd.daemon.fscreds`), a permission the kernel
refuses on the way or inside is the reader's one ``refusal``, and the finished tree passes the reader's ``check``
before anything (a size, a digest) is taken from it. Without such credentials an entry that cannot be opened (a
broken link, say) is first asked about (``hides``): a name that leads where the caller could not look is that same
refusal, not a message about what lies there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat as stat_mod
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..errors import BadRequestError, CacheError, NotAllowedError, NotFoundError, SourceError

#: Flags of every open of a source file: never blocks (FIFO), never becomes a controlling terminal.
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC
#: Most files and directories of one source (a guard against pointing the daemon at a huge tree).
MAX_SOURCE_ENTRIES = 100_000
#: Most files held open at once for one source.
MAX_SOURCE_FILES = 10_000
#: Hidden directory read for download records (huggingface_hub's ``--local-dir`` metadata): hints only.
LOCAL_DIR_META = (".cache", "huggingface", "download")
#: Largest metadata record read.
MAX_META_BYTES = 4096


class OutsideRootsError(NotAllowedError, SourceError):
    """A path (or something it leads to) is outside the allowed roots. Says nothing about what lies there."""

    code = "source_not_allowed"


class SourceNotFoundError(NotFoundError, SourceError):
    """The source directory does not exist (said only for paths inside the roots)."""

    code = "source_not_found"


class SourceNotDirectoryError(BadRequestError, SourceError):
    """The source is not a directory."""

    code = "bad_source"

    def api_message(self) -> str:
        return f"{self}; give the checkpoint directory"


class SourcePermissionError(NotAllowedError, SourceError):
    """The daemon itself may not open a source file or directory inside the roots."""

    code = "permission_denied"


class NotRegularError(SourceError):
    """A source entry is neither a regular file nor a directory (FIFO, device, socket)."""


class SourceReader(Protocol):
    """Who a source is opened for (:func:`reading_as`); the daemon's is :class:`transformd.daemon.fscreds.Reader`."""

    kernel: bool  #: the opens run with the caller's own credentials (the kernel checks them)

    def opening(self) -> AbstractContextManager[None]: ...

    def refusal(self, source: str, missing: str | None = None) -> Exception: ...

    def check(self, tree: SourceTree) -> None: ...

    def hides(self, real: str) -> str | None: ...


_reading = threading.local()


@contextlib.contextmanager
def reading_as(reader: SourceReader | None) -> Iterator[None]:
    """Within (this thread): sources are opened for ``reader`` (see the module docstring); None: for nobody but the
    process itself."""
    before = getattr(_reading, "reader", None)
    _reading.reader = reader
    try:
        yield
    finally:
        _reading.reader = before


def current_reader() -> SourceReader | None:
    return getattr(_reading, "reader", None)


def real_path(path: str) -> str | None:
    """``os.path.realpath``, or None when the path changed under it (a link swapped between its ``lstat`` and its
    ``readlink`` raised out of it: a 500 of an attack review)."""
    for _ in range(3):
        try:
            return os.path.realpath(path)
        except (OSError, RecursionError):
            continue
    return None


def within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def fd_path(fd: int) -> str:
    """The real path of the open descriptor ``fd`` as the kernel reports it."""
    return os.readlink(f"/proc/self/fd/{fd}")


@dataclass
class OpenedFile:
    """One checked, open file of a source: ``rel`` is ``/``-separated, relative to the source."""

    rel: str
    fd: int
    st: os.stat_result
    real: str

    @property
    def proc_path(self) -> str:
        return f"/proc/self/fd/{self.fd}"


@dataclass
class SourceTree:
    """Open, checked descriptors of every file of a source (sorted by ``rel``); close when done."""

    src: str
    real: str
    top_fd: int
    files: list[OpenedFile] = field(default_factory=list)
    #: relative names of entries that are neither files nor directories (FIFOs, devices, sockets): never opened
    specials: list[str] = field(default_factory=list)
    #: (relative name, real path, stat) of every directory walked, the top included ("")
    dirs: list[tuple[str, str, os.stat_result]] = field(default_factory=list)
    #: who it was opened for (:func:`reading_as`): its later opens (download records) are that reader's too
    reader: SourceReader | None = None
    _views: list[str] = field(default_factory=list)

    def close(self) -> None:
        for v in self._views:
            shutil.rmtree(v, ignore_errors=True)
        self._views = []
        for f in self.files:
            with contextlib.suppress(OSError):
                os.close(f.fd)
        self.files = []
        if self.top_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.top_fd)
            self.top_fd = -1

    def __enter__(self) -> SourceTree:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def changed(self) -> list[str]:
        """Names of files whose content changed (size, mtime or ctime of the open file) since they were opened."""
        out = []
        for f in self.files:
            try:
                now = os.fstat(f.fd)
            except OSError:
                out.append(f.rel)
                continue
            if (now.st_size, now.st_mtime_ns, now.st_ctime_ns) != (f.st.st_size, f.st.st_mtime_ns, f.st.st_ctime_ns):
                out.append(f.rel)
        return out

    def view(self) -> Path:
        """A private directory mirroring the source, each file a symlink to its checked descriptor.

        Lives until :meth:`close`. Only this process can follow the links (``/proc/self``), and a head start's worker
        (:mod:`transformd.checkpoint.headstart`), to which it passes the descriptors under the same numbers.
        """
        d = tempfile.mkdtemp(prefix="transformd-src-")
        self._views.append(d)
        for f in self.files:
            p = os.path.join(d, *f.rel.split("/"))
            os.makedirs(os.path.dirname(p), exist_ok=True)
            os.symlink(f.proc_path, p)
        for rel, _, _ in self.dirs:
            if rel:
                os.makedirs(os.path.join(d, *rel.split("/")), exist_ok=True)
        for rel in self.specials:  # not a regular file there either: the converter refuses it by name
            p = os.path.join(d, *rel.split("/"))
            os.makedirs(os.path.dirname(p), exist_ok=True)
            os.mkfifo(p, 0o600)
        return Path(d)

    def relocate(self, exc: BaseException, view: Path | str) -> BaseException:
        """``exc`` with every mention of the view directory replaced by the source path (in place)."""
        v, s = os.fspath(view), self.src.rstrip(os.sep)
        try:
            exc.args = tuple(a.replace(v, s) if isinstance(a, str) else a for a in exc.args)
            for attr in ("file", "filename", "message"):
                value = getattr(exc, attr, None)
                if isinstance(value, str) and v in value:
                    setattr(exc, attr, value.replace(v, s))
        except (AttributeError, TypeError):
            pass
        return exc

    def facts(self) -> AccessFacts:
        """The permissions a caller needs to read this source itself (see :func:`collect_facts`)."""
        return collect_facts(((f.real, f.st) for f in self.files), ((real, st) for _, real, st in self.dirs))

    def read_meta(self, rel: str) -> str | None:
        """The download record of ``rel`` under ``.cache/huggingface/download`` (a hint), or None.

        Every component is opened with ``O_NOFOLLOW`` relative to the source's descriptor, by the tree's reader
        (:func:`reading_as`) when it has one.
        """
        try:
            opening = self.reader.opening() if self.reader is not None else contextlib.nullcontext()
            with opening:
                return self._read_meta(rel)
        except Exception:  # noqa: BLE001 - a hint only
            return None

    def _read_meta(self, rel: str) -> str | None:
        parts = [*LOCAL_DIR_META, *rel.split("/")]
        parts[-1] += ".metadata"
        fds: list[int] = []
        try:
            cur = self.top_fd
            for p in parts[:-1]:
                cur = os.open(p, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=cur)
                fds.append(cur)
            fd = os.open(parts[-1], OPEN_FLAGS | os.O_NOFOLLOW, dir_fd=cur)
            fds.append(fd)
            st = os.fstat(fd)
            if not stat_mod.S_ISREG(st.st_mode) or st.st_size > MAX_META_BYTES:
                return None
            return os.pread(fd, MAX_META_BYTES, 0).decode("utf-8", "replace")
        except OSError:
            return None
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _outside(shown: str, roots: Sequence[str]) -> OutsideRootsError:
    return OutsideRootsError(
        f"{shown} is outside the allowed roots ({', '.join(roots) or '(none)'}); the daemon reads nothing "
        "outside them, and symlinks are resolved first, so a symlink under a root that points outside is refused "
        "too: copy or move the checkpoint's files themselves under an allowed root, or restart the daemon with "
        "--allow-root naming the directory where they really are (or add it to TRANSFORMD_ALLOW_ROOTS)"
    )


def _check_fd(fd: int, shown: str, roots: Sequence[str] | None) -> str:
    real = fd_path(fd)
    if roots is not None and not any(within(real, r) for r in roots):
        raise _outside(shown, roots)
    return real


def open_source(
    src: str | os.PathLike[str],
    roots: Sequence[str] | None = None,
    *,
    max_entries: int = MAX_SOURCE_ENTRIES,
) -> SourceTree:
    """Open and check every non-hidden regular file under ``src`` (see the module docstring).

    ``roots``: real paths every opened file and directory must lie in; None checks no roots (the
    library and the command line, run by the user on their own files). Raises
    :class:`OutsideRootsError`, :class:`NotRegularError` or :class:`SourceError`.
    """
    shown = os.fspath(src)
    reader = current_reader()
    if reader is None:
        return _open_source(shown, roots, max_entries, None)
    with reader.opening():
        tree = _open_source(shown, roots, max_entries, reader)
    try:
        reader.check(tree)  # (before anything is taken from it: a size in a 507, a digest)
    except BaseException:
        tree.close()
        raise
    return tree


def _refused(reader: SourceReader | None, e: OSError, src: str) -> Exception | None:
    """The reader's one refusal for a permission the kernel refused it (or None)."""
    if reader is not None and reader.kernel and e.errno in (errno.EACCES, errno.EPERM):
        return reader.refusal(src)
    return None


def _hidden(reader: SourceReader | None, path: str, src: str) -> Exception | None:
    """The reader's one refusal when ``path`` (an entry that cannot be opened, followed like the kernel does) leads
    through a directory the reader could not search (or None)."""
    if reader is None or reader.kernel:
        return None
    missing = reader.hides(path)
    return None if missing is None else reader.refusal(src, missing)


def _open_source(shown: str, roots: Sequence[str] | None, max_entries: int,
                 reader: SourceReader | None) -> SourceTree:
    try:
        top = os.open(shown, DIR_FLAGS)
    except OSError as e:
        if (refusal := _refused(reader, e, shown)) is not None:
            raise refusal from None
        if roots is not None:
            real = real_path(shown)
            if real is None or not any(within(real, r) for r in roots):
                raise _outside(f"source {shown}", roots) from None
        if e.errno == errno.ENOENT:
            raise SourceNotFoundError(f"source checkpoint directory {shown} does not exist") from None
        if e.errno == errno.ENOTDIR:
            raise SourceNotDirectoryError(f"source checkpoint {shown} is not a directory") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise SourcePermissionError(f"the daemon may not read the source directory {shown}") from None
        raise SourceError(f"cannot read source checkpoint directory {shown}: {e.strerror}") from None
    tree = SourceTree(shown, "", top, reader=reader)
    try:
        tree.real = _check_fd(top, f"source {shown}", roots)
        tree.dirs.append(("", tree.real, os.fstat(top)))
        _walk(tree, top, "", roots, {(tree.dirs[0][2].st_dev, tree.dirs[0][2].st_ino)}, [0], max_entries)
        tree.files.sort(key=lambda f: f.rel)
    except BaseException:
        tree.close()
        raise
    return tree


def _walk(
    tree: SourceTree,
    dfd: int,
    prefix: str,
    roots: Sequence[str] | None,
    seen: set[tuple[int, int]],
    count: list[int],
    max_entries: int,
) -> None:
    reader = tree.reader
    try:
        entries = sorted(((e.name, e.is_symlink()) for e in os.scandir(dfd)), key=lambda t: t[0])
    except OSError as e:
        if (refusal := _refused(reader, e, tree.src)) is not None:
            raise refusal from None
        raise SourceError(f"cannot list {os.path.join(tree.src, prefix)}: {e.strerror}") from None
    for name, is_link in entries:
        if name.startswith("."):
            continue  # never read, never converted, not in the key
        count[0] += 1
        if count[0] > max_entries:
            raise SourceError(f"source {tree.src} holds more than {max_entries} files and directories")
        rel = prefix + name
        shown = os.path.join(tree.src, rel)
        way = os.path.join(tree.real, rel)
        # A link that leads outside is refused before anything behind it is opened (a device there could act on
        # an open); the check that counts is the one on the opened descriptor below. A link through a directory
        # the reader could not search is the reader's refusal first, whatever lies behind it.
        if is_link and roots is not None and (refusal := _hidden(reader, way, tree.src)) is not None:
            raise refusal
        if is_link and roots is not None and not _link_inside(dfd, name, tree, rel, roots):
            raise _outside(shown, roots)
        try:
            pre = os.stat(name, dir_fd=dfd)  # type only: the descriptor's fstat below is what counts
        except OSError as e:
            if (refusal := _refused(reader, e, tree.src) or _hidden(reader, way, tree.src)) is not None:
                raise refusal from None
            if roots is not None and not _link_inside(dfd, name, tree, rel, roots):
                raise _outside(shown, roots) from None
            if isinstance(e, FileNotFoundError):
                raise SourceError(f"{shown} in source checkpoint {tree.src} is a broken symlink") from None
            raise SourceError(f"cannot stat {shown}: {e.strerror}") from None
        if not (stat_mod.S_ISREG(pre.st_mode) or stat_mod.S_ISDIR(pre.st_mode)):
            if roots is not None and not _link_inside(dfd, name, tree, rel, roots):
                raise _outside(shown, roots)
            tree.specials.append(rel)  # never opened: a placeholder FIFO in the view lets the converter refuse it
            continue
        flags = DIR_FLAGS if stat_mod.S_ISDIR(pre.st_mode) else OPEN_FLAGS
        try:
            fd = os.open(name, flags, dir_fd=dfd)
        except OSError as e:
            if (refusal := _refused(reader, e, tree.src) or _hidden(reader, way, tree.src)) is not None:
                raise refusal from None
            if roots is not None and not _link_inside(dfd, name, tree, rel, roots):
                raise _outside(shown, roots) from None
            if e.errno in (errno.EACCES, errno.EPERM):
                raise SourcePermissionError(f"the daemon may not read {shown}") from None
            if e.errno in (errno.EMFILE, errno.ENFILE):  # this process's limit, not the source's fault (was a 422)
                raise CacheError(f"cannot open {shown} now: {e.strerror} (the open-file limit of the process); "
                                 "retry later") from None
            raise SourceError(f"cannot open {shown}: {e.strerror}") from None
        keep = False
        try:
            real = _check_fd(fd, shown, roots)
            st = os.fstat(fd)
            if stat_mod.S_ISDIR(st.st_mode):
                ident = (st.st_dev, st.st_ino)
                if ident in seen:
                    continue  # a loop, or the same directory twice
                seen.add(ident)
                tree.dirs.append((rel, real, st))
                _walk(tree, fd, rel + "/", roots, seen, count, max_entries)
            elif stat_mod.S_ISREG(st.st_mode):
                if len(tree.files) >= MAX_SOURCE_FILES:
                    raise SourceError(f"source {tree.src} holds more than {MAX_SOURCE_FILES} files")
                tree.files.append(OpenedFile(rel, fd, st, real))
                keep = True
            else:  # it became a FIFO or device between the stat and the open: refuse, without reading
                raise _not_regular(shown, roots, dfd, name, tree, rel)
        finally:
            if not keep:
                os.close(fd)


def _link_inside(dfd: int, name: str, tree: SourceTree, rel: str, roots: Sequence[str]) -> bool:
    """Whether a name that cannot be opened resolves (as far as it does) inside the roots."""
    real = real_path(os.path.join(tree.real, rel))
    return real is not None and any(within(real, r) for r in roots)


def _not_regular(
    shown: str, roots: Sequence[str] | None, dfd: int, name: str, tree: SourceTree, rel: str
) -> SourceError:
    if roots is not None and not _link_inside(dfd, name, tree, rel, roots):
        return _outside(shown, roots)
    return NotRegularError(
        f"{shown} is not a regular file (a FIFO, device or socket); a checkpoint holds only files and directories"
    )


def check_roots(roots: Iterable[str | os.PathLike[str]]) -> tuple[str, ...]:
    """The real paths of ``roots``."""
    return tuple(os.path.realpath(os.fspath(r)) for r in roots)


#: (real path, uid, gid, mode) of one file or directory.
Fact = tuple[str, int, int, int]


@dataclass(frozen=True)
class AccessFacts:
    """What a caller must be allowed for a source: files to read, directories to list, directories to pass."""

    files: tuple[Fact, ...]
    dirs: tuple[Fact, ...]
    ancestors: tuple[Fact, ...]


def _fact(path: str, st: os.stat_result) -> Fact:
    return (path, st.st_uid, st.st_gid, stat_mod.S_IMODE(st.st_mode))


def collect_facts(
    files: Iterable[tuple[str, os.stat_result]], dirs: Iterable[tuple[str, os.stat_result]]
) -> AccessFacts:
    """The facts of a source from its opened files and directories (real path, fstat), plus the directories above
    each real path (stat by name: a permission only an owner can change)."""
    file_facts = tuple(_fact(p, st) for p, st in files)
    dir_facts = tuple(_fact(p, st) for p, st in dirs)
    inside = {p for p, *_ in dir_facts}
    above: dict[str, Fact] = {}
    for path, *_ in (*file_facts, *dir_facts):
        parent = os.path.dirname(path)
        while parent and parent not in above and parent not in inside:
            try:
                above[parent] = _fact(parent, os.stat(parent))
            except OSError:
                above[parent] = (parent, -1, -1, 0)  # cannot be told: nobody but root passes
            if parent == os.sep:
                break
            parent = os.path.dirname(parent)
    return AccessFacts(file_facts, dir_facts, tuple(above.values()))
