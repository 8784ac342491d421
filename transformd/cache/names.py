"""Entry directory names: the capability to open a cache entry.

A key can be computed by anyone who knows a source's content (a gated Hugging Face repo's key follows from what
the Hub shows everyone: file names, sizes, LFS digests, and the default recipe), so a key must not open its entry.
An entry (and its conversion's staging directory) is named ``<key>-<tag>``, where ``tag`` is a keyed blake3 of the
key under a secret of the cache (:data:`SECRET_NAME`, 32 random bytes, readable by the cache's owner only).
``entries/`` and ``staging/`` are 0711: others pass through to a name they were given and list nothing, so an
entry is opened only by the cache's owner and root, and by whoever the daemon gave its path (a caller who passed
its read check). The key stays a prefix of the name: the cache's own bookkeeping (locks, leases, status and failure
records, staging cleanup) works by key as before, and a name whose tag does not check is not an entry.

:meth:`EntryNames.name` is the one mapping from a key to its directory name (what a remote tier that stores
entries by key restores them under).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat as stat_mod
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from .._durable import fsync_path
from .entry import Entry
from .errors import CacheError
from .keys import KEY_HEX_LEN, KEY_RE, validate_key
from .manifest import CHECKPOINT_DIR, MANIFEST_NAME

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

#: The cache's secret, at its root: 32 random bytes, mode 0400, its owner's.
SECRET_NAME = "entry-names.key"
SECRET_BYTES = 32
#: Hex digits of the tag after the key (128 bits: not to be guessed through a 0711 directory).
TAG_HEX_LEN = 32
NAME_RE = re.compile(rf"^([0-9a-f]{{{KEY_HEX_LEN}}})-([0-9a-f]{{{TAG_HEX_LEN}}})$")


class EntryNames:
    """Key -> entry directory name under the secret of the cache at ``root`` (read once, created by its owner)."""

    def __init__(self, root: Path):
        self.path = root / SECRET_NAME
        self._secret: bytes | None = None
        self._names: dict[str, str] = {}  # key -> name, remembered (a hit names its entry on every request)

    def ensure(self) -> None:
        """The cache's owner: the secret on disk (the one in use if this process has one: a cache directory
        removed and made again keeps naming its entries as before)."""
        if self.path.exists():
            return
        with contextlib.suppress(OSError):  # (a read-only disk: naming an entry then says the secret is missing)
            _create_secret(self.path, self._secret)
            self._secret = None
            self._names.clear()

    def name(self, key: str, *, create: bool = False) -> str:
        """``<key>-<tag>``. ``create``: make the secret if the cache has none yet (its owner only). Raises
        :class:`CacheError` when the secret cannot be read (another user's cache: its daemon hands out paths)."""
        name = self._names.get(key)
        if name is None:
            name = f"{key}-{self._tag(key, create)}"
            if len(self._names) >= 4096:
                self._names.clear()
            self._names[key] = name
        return name

    def key_of(self, name: str) -> str | None:
        """The key a directory name is the entry name of, or None (not one: another secret's, an old layout's, a
        stranger's)."""
        m = NAME_RE.fullmatch(name)
        if m is None or not secrets.compare_digest(m.group(2), self._tag(m.group(1), False)):
            return None
        return m.group(1)

    def _tag(self, key: str, create: bool) -> str:
        secret = self._secret if self._secret is not None else self._load(create)
        return blake3.blake3(key.encode(), key=secret).hexdigest(length=TAG_HEX_LEN // 2)

    def _load(self, create: bool) -> bytes:
        try:
            secret = _read_secret(self.path)
        except FileNotFoundError:
            if not create:
                raise self._unreadable("it has none yet") from None
            _create_secret(self.path, None)
            secret = _read_secret(self.path)
        except PermissionError:
            raise self._unreadable("only its owner may read it") from None
        except OSError as e:
            raise self._unreadable(e.strerror or str(e)) from e
        self._secret = secret
        return secret

    def _unreadable(self, why: str) -> CacheError:
        return CacheError(
            f"cannot name the entries of the cache at {self.path.parent}: they are named under the secret in "
            f"{self.path}, and {why}; another user's cache is used through its daemon, which gives the path of an "
            "entry to the callers who may read its source"
        )


def _read_secret(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode) or st.st_size != SECRET_BYTES:
            raise CacheError(f"{path} is not a transformd cache secret (a regular file of {SECRET_BYTES} bytes); "
                             "remove it: the cache's entries are then evicted as unreachable and converted again")
        if stat_mod.S_IMODE(st.st_mode) & 0o077 and st.st_uid == os.geteuid():
            os.fchmod(fd, 0o400)  # (mended: others must not read it)
        data = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != SECRET_BYTES:
        raise CacheError(f"{path} changed while it was read")
    return data


def _create_secret(path: Path, secret: bytes | None) -> None:
    """Write ``secret`` (None: a new one) beside ``path`` and link it into place: a concurrent creator's stays,
    whichever came first."""
    tmp = path.with_name(f".tmp.{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
    try:
        os.write(fd, secret if secret is not None else secrets.token_bytes(SECRET_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        os.unlink(tmp)


class NamesMixin:
    """The :class:`~transformd.cache.store.Cache` methods that map keys to entry directories (a part of ``Cache``,
    kept here with the names; it uses the cache's directories and gc lock)."""

    root: Path
    _names: EntryNames

    if TYPE_CHECKING:
        entries_dir: Path
        trash_dir: Path

        def _gc_lock(self, *, shared: bool = False) -> AbstractContextManager[None]: ...

    def entry_name(self, key: str) -> str:
        """The directory name of ``key``'s entry, and the prefix of its conversions' staging directories."""
        return self._names.name(validate_key(key))

    def entry_dir(self, key: str) -> Path:
        """``entries/<entry_name(key)>``: the entry's directory (it may not exist)."""
        return self.entries_dir / self.entry_name(key)

    def key_of_entry(self, name: str) -> str | None:
        """The key whose entry ``entries/<name>`` is, or None when ``name`` is not an entry's name."""
        return self._names.key_of(name)

    def entry_at(self, key: str, path: str | os.PathLike[str]) -> Entry | None:
        """The entry of ``key`` at ``path`` (its checkpoint directory, as a daemon answered it), or None when ``path``
        is not a published entry of ``key`` in this cache. For a user who may not read the cache's secret: the
        daemon that passed his read check gave him the path."""
        checkpoint = Path(path)
        root = checkpoint.parent
        m = NAME_RE.fullmatch(root.name)
        if checkpoint.name != CHECKPOINT_DIR or m is None or m.group(1) != validate_key(key):
            return None
        try:
            if not os.path.samefile(root.parent, self.entries_dir):
                return None
            last_used = os.stat(root / MANIFEST_NAME).st_mtime
        except OSError:
            return None
        return Entry(key, root, last_used)

    def _migrate_entry_names(self) -> list[str]:
        """Move the entries named otherwise than :meth:`entry_name` says (by their bare key: the layout before names;
        under another secret: one removed and made again) to their name, so none is left unreachable garbage; one
        whose name is taken already goes to the trash. Returns their keys."""
        moved: list[str] = []
        try:
            if os.statvfs(self.root).f_flag & os.ST_RDONLY:  # (nothing can be moved there; its entries are read)
                return moved
        except OSError:
            pass
        with self._gc_lock():
            return self._migrate_locked(moved)

    def _migrate_locked(self, moved: list[str]) -> list[str]:
        try:
            names = os.listdir(self.entries_dir)
        except FileNotFoundError:
            return moved
        for name in names:
            key = name[:KEY_HEX_LEN]
            if not (KEY_RE.fullmatch(name) or NAME_RE.fullmatch(name)) or name == self.entry_name(key):
                continue
            try:
                os.rename(self.entries_dir / name, self.entry_dir(key))
                moved.append(key)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                os.rename(self.entries_dir / name, self.trash_dir / f"{name}.{os.getpid()}.{secrets.token_hex(4)}")
        if moved:
            fsync_path(self.entries_dir)
        return moved
