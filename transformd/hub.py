"""Sources named the way engines name them: Hugging Face repo ids, resolved through the local hub cache.

``vllm serve org/Model --revision REV`` and ``transformd resolve org/Model --revision REV`` take the same
argument: the daemon looks ``org/Model`` up in its hub cache and converts the snapshot directory it finds.

**Path or repo id.** A source is a path when it is absolute, starts with ``.``, ``/`` or ``~``, or exists
(so a directory ``org/Model`` under the working directory is that directory, as for the engines). Otherwise
it is a repo id when it has the form ``namespace/name`` (exactly one ``/``) and passes huggingface_hub's own
repo-id rule (:func:`huggingface_hub.utils.validate_repo_id`: ASCII letters, digits, ``-``, ``_``, ``.``; no
``--`` or ``..``; neither part starts or ends with ``-`` or ``.``; at most 96 characters a part). The daemon, which
knows nothing of a caller's working directory, sees an absolute path or a repo id; anything else is a 400.
A repo id without namespace (``gpt2``) is not accepted: it cannot be told from a relative path.

**Revision.** A branch or tag the cache recorded (``main``, the default; ``refs/pr/1``) or a full 40-digit
commit hash. Its form is checked before anything is opened (no ``..``, no component starting with ``.``).

**Where.** The hub cache is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``,
else ``~/.cache/huggingface/hub`` (huggingface_hub's own order, read when asked, not at import); the daemon's
``--hub-cache`` overrides it. The lookup follows huggingface_hub's offline rules
(:func:`huggingface_hub.snapshot_download` with ``local_files_only=True``: ``refs/<revision>``, then
``snapshots/<commit>``, incomplete when its cached file list names a missing file), done here (:func:`_lookup`)
so that no record is opened in a way another user could block. A repo or revision not in the cache is an
error that says how to fetch it (``hf download org/Model --revision REV``). Only a daemon started with
``--allow-download`` fetches it itself (:func:`download_repo`; the token from ``HF_TOKEN`` or ``hf auth login``).

**Trust** (the daemon). The hub cache is read only when it is an allowed root: under an ``--allow-root``, or
added with ``--allow-hub-cache``; else a repo id is the usual 403, before anything in the cache is looked at.
The snapshot found is then an ordinary source: every file is checked on its open descriptor
(:mod:`transformd.cache.securefs`; a snapshot's links into ``blobs/`` stay inside the root), and a blob's
name is a claim that :mod:`transformd.cache.keys` verifies by hashing. The cache key is the content key (and
its writers), so the same weights as a path and as a repo id share one entry.

This module imports neither torch nor huggingface_hub at import time (the start-up hook's client uses
:func:`is_repo_id`); huggingface_hub is imported inside the functions that look things up.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .errors import EXIT_FAILURE, SourceError

__all__ = [
    "DEFAULT_REVISION",
    "DownloadError",
    "HubError",
    "HubNotAllowedError",
    "HubResolver",
    "HubSource",
    "InvalidRepoIdError",
    "InvalidRevisionError",
    "RepoNotCachedError",
    "RevisionNotCachedError",
    "RevisionWithoutRepoError",
    "check_repo_id",
    "check_revision",
    "default_hub_cache",
    "download_repo",
    "is_repo_id",
    "locate",
    "resolve_repo",
    "source_path",
]

#: The revision asked for when none is given (huggingface_hub's default branch).
DEFAULT_REVISION = "main"
#: Longest part of a repo id (huggingface_hub's rule) and longest revision accepted.
MAX_REPO_PART_CHARS = 96
MAX_REVISION_CHARS = 256
#: The shape of a repo id: ``namespace/name``, ASCII, each part starting and ending with a letter, digit or ``_``.
_REPO_ID = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?/[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?$")
#: A repo id as the API's schema documents it: every id of this form is accepted (up to 96 characters a part);
#: :func:`check_repo_id` applies huggingface_hub's full rule (which also allows e.g. ``a__b``).
REPO_ID_PATTERN = r"^[A-Za-z0-9]+(?:[._-][A-Za-z0-9]+)*/[A-Za-z0-9]+(?:[._-][A-Za-z0-9]+)*$"
#: A revision: a branch or tag name (``/``-separated parts of letters, digits and ``_``, joined by single ``.``,
#: ``+`` or ``-``: no ``..``, no part starting with ``.``) or a commit hash. The API's schema and the check.
REVISION_PATTERN = r"^[A-Za-z0-9_]+(?:[.+-][A-Za-z0-9_]+)*(?:/[A-Za-z0-9_]+(?:[.+-][A-Za-z0-9_]+)*)*$"
_REVISION = re.compile(REVISION_PATTERN)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
#: Largest ``refs/<revision>`` read for a lookup (it holds one commit hash).
_MAX_REF_BYTES = 1024
#: Most entries of one repo's folder in the hub cache checked before a lookup.
_MAX_REPO_ENTRIES = 100_000
#: Largest ``trees/<commit>.json`` (huggingface_hub's list of a snapshot's files) read for a lookup.
_MAX_TREE_BYTES = 64 << 20
#: The format of those lists that huggingface_hub writes (``huggingface_hub._tree_cache``); others it ignores.
_TREE_FORMAT = 1


class HubError(SourceError):
    """A repo id or revision that cannot be used. ``http_status`` and ``code`` are the daemon's HTTP answer."""

    http_status = 400
    code = "bad_source"


class InvalidRepoIdError(HubError):
    """Not a repo id of the form ``namespace/name`` (or a hostile one: ``..``, ``--``, control characters)."""


class InvalidRevisionError(HubError):
    code = "bad_revision"


class RevisionWithoutRepoError(HubError):
    """A revision was given with a directory: it applies to repo ids only."""

    http_status = 422
    code = "revision_needs_repo_id"


class HubNotAllowedError(HubError):
    """The daemon's hub cache is not an allowed root."""

    http_status = 403
    code = "source_not_allowed"


class RepoNotCachedError(HubError):
    """The repo is not in the local hub cache."""

    http_status = 404
    code = "repo_not_cached"


class RevisionNotCachedError(RepoNotCachedError):
    """The repo is cached, but not at this revision."""

    code = "revision_not_cached"


class DownloadError(HubError):
    """``--allow-download``: fetching from the Hub failed (no such repo or revision, no access, no network)."""

    http_status, exit_code = 502, EXIT_FAILURE
    code = "download_failed"


@dataclass(frozen=True)
class HubSource:
    """A repo id at a revision, and the snapshot directory of the hub cache it resolved to."""

    repo_id: str
    revision: str
    commit: str
    snapshot: Path

    def as_dict(self) -> dict[str, Any]:
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit,
                "snapshot": str(self.snapshot)}

    def describe(self) -> str:
        at = self.revision if self.revision == self.commit else f"{self.revision} (commit {self.commit})"
        return f"{self.repo_id} at {at}: {self.snapshot}"


def default_hub_cache(environ: Mapping[str, str] | None = None) -> Path:
    """huggingface_hub's cache directory as the environment says now (``HF_HUB_CACHE`` > ``HF_HOME/hub`` >
    ``$XDG_CACHE_HOME/huggingface/hub`` > ``~/.cache/huggingface/hub``): the order of
    ``huggingface_hub.constants``, which reads it once at import."""
    env = os.environ if environ is None else environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expanduser(os.path.expandvars(explicit)))
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expanduser(os.path.expandvars(home))) / "hub"


def is_full_commit(revision: str | None) -> bool:
    """Whether ``revision`` is a full commit hash (40 lowercase hex digits), not a branch, a tag or a prefix."""
    return revision is not None and _COMMIT.fullmatch(revision) is not None


def is_repo_id(source: str | os.PathLike[str], *, paths_exist: bool = True) -> bool:
    """Whether ``source`` names a repo rather than a directory (the rule in the module docstring; no
    huggingface_hub, no validation beyond the shape: :func:`check_repo_id` says what is wrong with it).

    ``paths_exist``: a name that exists (relative to the working directory) is a path; the daemon passes
    False (its working directory means nothing to a caller).
    """
    if not isinstance(source, str):
        return False  # a Path object is a path
    if not source or source[0] in "./~" or source.count("/") != 1 or "\0" in source:
        return False
    return not (paths_exist and os.path.lexists(source))


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if it is a ``namespace/name`` repo id by huggingface_hub's rule; else :class:`InvalidRepoIdError`."""
    shown = repr(repo_id[:120]) + ("..." if len(repo_id) > 120 else "")
    problem = None
    too_long = any(len(part) > MAX_REPO_PART_CHARS for part in repo_id.split("/"))
    if too_long or not _REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id:
        problem = "letters, digits, '-', '_', '.' only; no '--' or '..'; at most 96 characters a part"
    else:
        try:
            from huggingface_hub.utils import validate_repo_id
        except ImportError:  # pragma: no cover - huggingface_hub is a dependency; the shape above still holds
            validate_repo_id = None
        if validate_repo_id is not None:
            try:
                validate_repo_id(repo_id)
            except ValueError as e:
                problem = str(e)
    if problem is not None:
        raise InvalidRepoIdError(f"{shown} is not a Hugging Face repo id of the form namespace/name ({problem})")
    return repo_id


def check_revision(revision: str | None) -> str:
    """``revision`` (default ``main``) if it is a branch, tag or full commit hash in form; else :class:`HubError`.

    huggingface_hub reads ``refs/<revision>`` by name: ``..`` or an absolute name would leave the repo."""
    if revision is None:
        return DEFAULT_REVISION
    if len(revision) > MAX_REVISION_CHARS or not _REVISION.fullmatch(revision):
        shown = repr(revision[:80]) + ("..." if len(revision) > 80 else "")
        raise InvalidRevisionError(
            f"revision {shown} is neither a branch or tag name (letters, digits and '_' joined by single '.', '+' "
            "or '-', '/'-separated) nor a 40-digit commit hash"
        )
    return revision


def _fetch_hint(repo_id: str, revision: str, cache_dir: Path) -> str:
    return f"hf download {repo_id} --revision {revision} --cache-dir {cache_dir}"


def _inside(real: str, roots: Sequence[str]) -> bool:
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _real(path: str) -> str:
    """``os.path.realpath``, or ``""`` (inside nothing) when a link changed under it: its ``readlink`` raises then,
    which was a 500 (an attack review's race)."""
    try:
        return os.path.realpath(path)
    except (OSError, RecursionError):
        return ""


def _check_repo_folder(storage: str, roots: Sequence[str] | None, hidden: Callable[[str], bool] | None = None) -> None:
    """Before the repo's folder is looked into: everything in it must be a directory or a regular file, links
    included (a FIFO would block a reader, a device would never end), and, for the daemon, lead nowhere outside the
    roots. A check of kinds and places; :func:`_lookup` reads the records it needs, each through one checked
    descriptor (sizes included), since one may be swapped after this looked. ``hidden``: whether a link leads where
    the caller the lookup is done for could not look (such a link is passed over as a broken one is, unlooked at)."""
    bad = _bad_record
    if roots is not None and not _inside(_real(storage), roots):
        raise bad(".")
    pending, seen = [(storage, "")], 0
    while pending:
        top, prefix = pending.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue  # unreadable: huggingface_hub reports what it misses
        for e in entries:
            seen += 1
            rel = prefix + e.name
            if seen > _MAX_REPO_ENTRIES:
                raise bad(rel)
            link = e.is_symlink()
            if link and hidden is not None and hidden(e.path):
                continue
            try:
                st = os.stat(e.path)
            except OSError:
                continue  # a broken link (an interrupted download): huggingface_hub reports what is missing
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise bad(rel)
            if link and roots is not None and not _inside(_real(e.path), roots):
                raise bad(rel)
            if stat.S_ISDIR(st.st_mode) and not link:
                pending.append((e.path, rel + "/"))


def _read_record(storage: str, rel: str, limit: int, roots: Sequence[str] | None) -> bytes | None:
    """The bytes of the record ``rel`` of a repo's folder (None: there is none), read through one descriptor opened
    without blocking and checked: a regular file inside the roots, of at most ``limit`` bytes. A record swapped for
    a FIFO or a device after :func:`_check_repo_folder` looked is refused, never waited on. Other errors (a folder
    one may not read) are raised as they are."""
    try:
        fd = _open_beneath(storage, rel)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        if e.errno in (errno.ENXIO, errno.EWOULDBLOCK):  # (a FIFO or socket without a writer)
            raise _bad_record(rel) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (
            roots is not None and not _inside(os.path.realpath(f"/proc/self/fd/{fd}"), roots)
        ):
            raise _bad_record(rel)
        data = os.pread(fd, limit + 1, 0)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise _bad_record(rel, f" of more than {limit} bytes")
    return data


def _open_beneath(storage: str, rel: str) -> int:
    """``rel`` under ``storage`` opened one component at a time with ``O_NOFOLLOW`` (huggingface_hub writes records
    as plain files in plain directories: a link there was planted, and is never followed, so what it leads to is
    never looked at; an attack review read records planted as links into another user's 0700 directory)."""
    names = [n for n in rel.split(os.sep) if n]
    if not names or ".." in names:
        raise FileNotFoundError(errno.ENOENT, "no such record", rel)
    fd = os.open(storage, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in names[:-1]:
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return os.open(names[-1], os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def _bad_record(rel: str, what: str = ", which is not a plain file or directory inside the allowed roots") -> HubError:
    err = HubError(f"the hub cache folder of this repo holds {rel!r}{what}; the daemon does not read it (remove it, "
                   "or fetch the repo again)")
    err.http_status, err.code = 422, "invalid_source"
    return err


class _NotFound(Exception):
    """:func:`_lookup` found no complete snapshot (``incomplete``: one whose cached file list names a missing file)."""

    def __init__(self, incomplete: bool = False):
        super().__init__()
        self.incomplete = incomplete


def _lookup(storage: str, revision: str, roots: Sequence[str] | None,
            hidden: Callable[[str], bool] | None = None) -> str:
    """The snapshot of the repo whose hub cache folder is ``storage`` at ``revision``, found by huggingface_hub's
    rules for an offline lookup (``snapshot_download(..., local_files_only=True)``): a branch or tag is the commit
    that ``refs/<revision>`` holds; the snapshot is ``snapshots/<commit>``; it is incomplete when the file list that
    huggingface_hub caches for the commit (``trees/<commit>.json``) names a file it lacks. Done here, not by
    huggingface_hub, because it opens those records by name: another user who may write a shared hub cache could
    swap one for a FIFO after :func:`_check_repo_folder` looked, and block it for good. Each record is read once
    (:func:`_read_record`). Raises :class:`_NotFound`."""
    storage = os.path.abspath(storage)
    commit = revision
    if not _COMMIT.fullmatch(revision):
        ref = _read_record(storage, os.path.join("refs", revision), _MAX_REF_BYTES, roots)
        commit = "" if ref is None else ref.decode("ascii", "replace")
    snapshot = os.path.join(storage, "snapshots", commit)
    if not _COMMIT.fullmatch(commit) or not _is_dir(snapshot, hidden):
        raise _NotFound
    tree = _read_record(storage, os.path.join("trees", commit + ".json"), _MAX_TREE_BYTES, roots)
    if tree is not None and _lacks_listed_files(tree, snapshot):
        raise _NotFound(incomplete=True)
    return snapshot


def _is_dir(path: str, hidden: Callable[[str], bool] | None) -> bool:
    """Whether ``path`` is a directory; raises :class:`PermissionError` when the way to it is not the caller's to
    look at (``hidden``, or the kernel's refusal), whether or not something is there."""
    if hidden is not None and hidden(path):
        raise PermissionError(errno.EACCES, "permission denied")
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except PermissionError:
        raise
    except OSError:
        return False


def _lacks_listed_files(tree: bytes, snapshot: str) -> bool:
    """Whether ``snapshot`` lacks a file that huggingface_hub's cached list ``tree`` names (its own rule: a list it
    cannot read, or of another format, says nothing; names that would leave the snapshot are not looked up)."""
    try:
        data = json.loads(tree)
        files = data.get("files") if data.get("format_version") == _TREE_FORMAT else None
    except (ValueError, AttributeError):
        return False
    if not isinstance(files, dict):
        return False
    for name in files:
        parts = name.split("/") if isinstance(name, str) else [".."]
        if any(p in ("", ".", "..") for p in parts):
            continue
        if not os.path.isfile(os.path.join(snapshot, *parts)):
            return True
    return False


def _source_of(repo_id: str, revision: str, found: str, storage: str) -> HubSource:
    """The snapshot found, checked to be ``<repo>/snapshots/<commit>`` (the commit comes from a file of the cache:
    it must not lead anywhere else)."""
    path = Path(found)
    parent = _real(str(path.parent))
    if not parent or parent != _real(os.path.join(storage, "snapshots")) or not _COMMIT.fullmatch(
        path.name
    ):
        raise RevisionNotCachedError(f"revision {revision} of {repo_id} does not name a snapshot of the hub cache")
    return HubSource(repo_id, revision, path.name, path)


def resolve_repo(
    repo_id: str,
    revision: str | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    roots: Sequence[str] | None = None,
    hint: str = "",
    hidden: Callable[[str], bool] | None = None,
) -> HubSource:
    """The cached snapshot of ``repo_id`` at ``revision`` (default ``main``), offline.

    ``cache_dir``: the hub cache (default :func:`default_hub_cache`); ``roots``: real paths the revision's record
    must lie in (the daemon's allowed roots). Raises :class:`InvalidRepoIdError`, :class:`HubError` (revision),
    :class:`RepoNotCachedError` or :class:`RevisionNotCachedError` (each message says how to fetch it, with
    ``hint`` appended); :class:`PermissionError` when the folder of the repo or its snapshot lies where the caller
    cannot look (``hidden``: whether a path is such for the caller the daemon looks for; else the kernel said so).
    """
    repo_id = check_repo_id(repo_id)
    revision = check_revision(revision)
    cache = Path(cache_dir) if cache_dir is not None else default_hub_cache()
    from huggingface_hub.file_download import repo_folder_name

    storage = os.path.join(cache, repo_folder_name(repo_id=repo_id, repo_type="model"))
    fetch = f"fetch it with: {_fetch_hint(repo_id, revision, cache)}{hint}"
    if not _is_dir(storage, hidden):
        raise RepoNotCachedError(f"{repo_id} is not in the Hugging Face hub cache {cache}; {fetch}")
    _check_repo_folder(storage, roots, hidden)
    try:
        found = _lookup(storage, revision, roots, hidden)
    except _NotFound as e:
        if e.incomplete:
            raise RevisionNotCachedError(
                f"the cached snapshot of {repo_id} at {revision} in {cache} is incomplete (an interrupted "
                f"download?); {fetch}"
            ) from None
        raise RevisionNotCachedError(
            f"{repo_id} is in the Hugging Face hub cache {cache}, but not at revision {revision} (a branch or tag "
            f"that a download recorded, or a full 40-digit commit hash); {fetch}"
        ) from None
    except PermissionError:
        raise
    except OSError as e:
        raise RepoNotCachedError(f"cannot look up {repo_id} in the hub cache {cache}: {e.strerror or e}") from None
    return _source_of(repo_id, revision, found, storage)


def download_repo(
    repo_id: str, revision: str | None = None, *, cache_dir: str | os.PathLike[str] | None = None
) -> HubSource:
    """Fetch ``repo_id`` at ``revision`` into the hub cache with huggingface_hub (network; the token from
    ``HF_TOKEN`` or ``hf auth login``) and return its snapshot. Raises :class:`DownloadError`."""
    repo_id = check_repo_id(repo_id)
    revision = check_revision(revision)
    cache = Path(cache_dir) if cache_dir is not None else default_hub_cache()
    from huggingface_hub import snapshot_download
    from huggingface_hub.file_download import repo_folder_name

    try:
        found = snapshot_download(repo_id, revision=revision, cache_dir=cache)
    except Exception as e:  # noqa: BLE001 - no such repo or revision, gated, no network: all say why
        missing = type(e).__name__ in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError")
        err = DownloadError(f"cannot download {repo_id} at {revision}: {type(e).__name__}: {str(e)[:500]}")
        if missing:
            err.http_status, err.code = 404, "repo_not_found"
        raise err from None
    storage = os.path.join(cache, repo_folder_name(repo_id=repo_id, repo_type="model"))
    return _source_of(repo_id, revision, found, storage)


def source_path(
    source: str | os.PathLike[str],
    revision: str | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    note: TextIO | None = None,
) -> Path:
    """The directory ``source`` names (the command line and the library): a path as it is, a repo id resolved
    offline (:func:`resolve_repo`; ``note`` gets one line saying which snapshot). ``revision`` with a path is an
    error."""
    return locate(source, revision, cache_dir=cache_dir, note=note)[0]


def locate(
    source: str | os.PathLike[str],
    revision: str | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    note: TextIO | None = None,
) -> tuple[Path, HubSource | None]:
    """:func:`source_path`, and the repo id, revision and commit it resolved (None for a path)."""
    if not is_repo_id(source):
        if revision is not None:
            raise RevisionWithoutRepoError(
                f"--revision {revision} applies to a Hugging Face repo id; {source} is a directory"
            )
        return Path(os.path.expanduser(os.fspath(source))), None  # (a quoted ~ of exec-form args: the home)
    found = resolve_repo(os.fspath(source), revision, cache_dir=cache_dir)
    if note is not None:
        print(f"transformd: {found.describe()}", file=note, flush=True)
    return found.snapshot, found


class HubResolver:
    """The daemon's repo-id lookups: its hub cache, whether that is an allowed root, whether it may download."""

    def __init__(self, cache_dir: str | os.PathLike[str], roots: Sequence[str], *, allow_download: bool = False):
        self.cache_dir = Path(cache_dir)
        self.roots = tuple(roots)
        self.allow_download = allow_download

    def wants(self, source: str, revision: str | None) -> bool:
        """Whether a request is for the hub (a repo id, or a revision given with a path, which is refused)."""
        return revision is not None or is_repo_id(source, paths_exist=False)

    def allowed(self) -> bool:
        return _inside(os.path.realpath(self.cache_dir), self.roots)

    def resolve(self, source: str, revision: str | None, *, opening: Callable[[], AbstractContextManager[Any]] | None
                = None, hidden: Callable[[str], bool] | None = None) -> HubSource:
        """Blocking: the snapshot of repo id ``source``; raises :class:`HubError` (400, 403, 404, 502), or
        :class:`PermissionError` when what it needs lies where the caller cannot look. ``opening``: held around the
        lookup's reads (the caller's credentials), not the download; ``hidden``: see :func:`resolve_repo`."""
        if not is_repo_id(source, paths_exist=False):
            if os.path.isabs(source):
                check_revision(revision)
                raise RevisionWithoutRepoError(
                    "revision applies to a Hugging Face repo id (namespace/name); the source is a directory"
                )
            raise InvalidRepoIdError(
                f"source {source[:120]!r} is neither an absolute path nor a Hugging Face repo id (namespace/name)"
            )
        check_repo_id(source)
        check_revision(revision)
        if not self.allowed():  # before anything in the hub cache is looked at
            raise HubNotAllowedError(
                f"repo id {source} is refused: this daemon's Hugging Face hub cache is not an allowed root; start "
                "it with --allow-hub-cache (TRANSFORMD_ALLOW_HUB_CACHE=1), or with an --allow-root that contains "
                "its hub cache (--hub-cache, HF_HUB_CACHE, HF_HOME)"
            )
        hint = "" if self.allow_download else " (this daemon never downloads: it was not started with --allow-download)"
        try:
            with opening() if opening is not None else contextlib.nullcontext():
                return resolve_repo(source, revision, cache_dir=self.cache_dir, roots=self.roots, hint=hint,
                                    hidden=hidden)
        except RepoNotCachedError:
            if not self.allow_download:
                raise
        return download_repo(source, revision, cache_dir=self.cache_dir)
