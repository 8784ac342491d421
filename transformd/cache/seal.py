"""Digests of a conversion's output taken while the conversion goes on, so that its publish has little left to hash.

An entry's manifest records the BLAKE3 digest of every file it holds (:meth:`Cache._seal`). Hashing them all after
the conversion took 0.3-0.4 s of a 16 GiB conversion on the H200 machine (from the page cache, four files at a
time), on the path of every cold conversion and every first ``resolve``. :class:`DigestsAlongside` is a thread that
looks at the output directory every :data:`POLL_S` and hashes each safetensors shard once its size has reached the
end its header declares (the shards are written front to back: header first, then the tensors in order), while the
next shards are being converted; the publish then hashes only the last of them and the small files.

A digest taken early stands only for the file as it was then: it is kept with the file's device, inode, size,
modification and change times from before the hashing, and :meth:`DigestsAlongside.digest` gives it to the seal only
when the file still has the same (a converter that rewrote a shard, or wrote another file under its name, has it
hashed again at the seal; the change time moves with any write and cannot be set back, the inode number alone may be
reused at once). The :class:`~.converter.Converter` contract says a finished shard is not written again; a rewrite
in place within one tick of a coarse file-system clock is what this cannot see. The files are read, not
memory-mapped as at the seal (:func:`.keys.hash_own_file`): a converter still runs, and one that shortened a mapped
file would kill the process with SIGBUS; here that ends in an error, and anything that goes wrong (a file removed
meanwhile, an unreadable header) only leaves that file to the seal.
"""

from __future__ import annotations

import json
import os
import stat as stat_mod
import struct
import threading
from pathlib import Path

from ..safetensors_header import MAX_HEADER_BYTES
from .keys import hash_file

__all__ = ["POLL_S", "DigestsAlongside"]

#: How often the output directory is looked at (seconds); a shard takes 0.1-0.5 s to write on the H200 machine.
POLL_S = 0.1

_Signature = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns


def _signature(st: os.stat_result) -> _Signature:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def declared_size(path: str) -> int | None:
    """The size a safetensors file will have once written: 8 + its header's length + the end of its last tensor;
    None while its header is not all there yet, or for a file that is not safetensors."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            return None
        raw = f.read(n)
    if len(raw) < n:
        return None
    header = json.loads(raw)
    ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"]
    return 8 + n + max(ends, default=0)


class DigestsAlongside:
    """A thread hashing the finished shards of the output directory ``out`` while a converter writes it (see the
    module). Use as a context manager around the converter's call; then :meth:`digest` for each file."""

    def __init__(self, out: Path, poll_s: float = POLL_S):
        self.out, self.poll_s = out, poll_s
        self._digests: dict[str, tuple[_Signature, str]] = {}  # file name -> (signature, digest)
        self._declared: dict[tuple[int, int], int | None] = {}  # (st_dev, st_ino) -> declared size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="transformd-seal", daemon=True)

    def __enter__(self) -> DigestsAlongside:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop after the file being hashed, if any (so nothing reads the directory once the caller removes it)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def digest(self, path: str, st: os.stat_result) -> str | None:
        """The digest taken of the file at ``path`` whose stat is ``st`` now, if it was taken of the same file with
        the same size, modification and change times; else None (to hash it). Take ``st`` before the file's mode
        is changed (a chmod moves the change time)."""
        name = os.path.relpath(path, self.out)
        known = self._digests.get(name)
        return known[1] if known is not None and known[0] == _signature(st) else None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                entries = list(os.scandir(self.out))
            except OSError:
                continue  # (not created yet, or removed)
            for entry in entries:
                if self._stop.is_set():
                    return
                if entry.name.endswith(".safetensors") and entry.name not in self._digests:
                    self._try(entry)

    def _try(self, entry: os.DirEntry[str]) -> None:
        try:
            before = os.stat(entry.path, follow_symlinks=False)
            if not stat_mod.S_ISREG(before.st_mode):
                return
            inode = (before.st_dev, before.st_ino)
            if self._declared.get(inode) is None:
                self._declared[inode] = declared_size(entry.path)
            if before.st_size != self._declared[inode]:
                return  # (still being written)
            digest = hash_file(entry.path, background=True)  # (read: see the module)
        except Exception:  # noqa: BLE001 - a file removed or shortened meanwhile, a header not ours: for the seal
            return
        self._digests[entry.name] = (_signature(before), digest)  # (a write since moved the change time)
