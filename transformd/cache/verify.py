"""Integrity: re-hash entries against their manifests; quarantine damaged ones."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat as stat_mod
import time
from dataclasses import dataclass, field
from pathlib import Path

from .._durable import (
    rmtree_force,
)
from .errors import (
    EntryNotFoundError,
)
from .keys import (
    hash_own_file,
    validate_key,
)
from .manifest import CHECKPOINT_DIR, MANIFEST_NAME, Manifest


@dataclass
class VerifyResult:
    key: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    #: where the entry was moved when it was quarantined
    quarantined_to: Path | None = None




class VerifyMixin:
    """The :class:`~transformd.cache.store.Cache` methods that re-hash entries against their manifests and
    quarantine damaged ones (a part of ``Cache``, kept here for size)."""


    def verify(self, key: str | None = None, *, quarantine: bool = True) -> list[VerifyResult]:
        """Re-hash entry files against their manifests; move corrupt entries to ``quarantine/``.

        A quarantined entry is never served again (a later request converts afresh). Checks:
        the manifest parses and names this key, no file is missing, extra or a symlink, and every
        file has the recorded size and digest.
        """
        if key is not None:
            validate_key(key)
            if not self.entry_dir(key).is_dir():
                raise EntryNotFoundError(key, self.root)
            keys = [key]
        else:
            keys = sorted(e.key for e in self._scan_entries())
        results = []
        for k in keys:
            res = self._check_entry(k)
            if not res.ok and quarantine:
                res.quarantined_to = self._quarantine(k, res.problems)
            results.append(res)
        return results

    def _check_entry(self, key: str) -> VerifyResult:
        d = self.entry_dir(key)
        res = VerifyResult(key, ok=True)
        try:
            manifest = Manifest.read(d / MANIFEST_NAME)
        except (OSError, ValueError, KeyError, TypeError) as e:
            res.ok = False
            res.problems.append(f"manifest.json unreadable: {e}")
            return res
        if manifest.key != key:
            res.problems.append(f"manifest.json is for key {manifest.key}, not {key}")
        ckpt = d / CHECKPOINT_DIR
        actual: dict[str, str] = {}
        for dirpath, dirnames, filenames in os.walk(ckpt):
            for n in dirnames + filenames:
                p = os.path.join(dirpath, n)
                rel = os.path.relpath(p, ckpt).replace(os.sep, "/")
                st = os.lstat(p)
                if stat_mod.S_ISLNK(st.st_mode):
                    res.problems.append(f"{rel}: is a symlink")
                elif stat_mod.S_ISREG(st.st_mode):
                    actual[rel] = p
        expected = {f.name: f for f in manifest.files}
        for name in sorted(actual.keys() - expected.keys()):
            res.problems.append(f"{name}: not in the manifest")
        for name in sorted(expected.keys() - actual.keys()):
            res.problems.append(f"{name}: missing")
        for name in sorted(expected.keys() & actual.keys()):
            rec = expected[name]
            p = actual[name]
            try:
                size = os.stat(p).st_size
                if size != rec.size:
                    res.problems.append(f"{name}: size {size} bytes, manifest says {rec.size}")
                    continue
                digest = hash_own_file(p)
            except OSError as e:
                res.problems.append(f"{name}: unreadable: {e.strerror}")
                continue
            res.files_checked += 1
            res.bytes_checked += size
            if digest != rec.digest:
                res.problems.append(f"{name}: content digest {digest} differs from the manifest's {rec.digest}")
        res.ok = not res.problems
        return res

    def _quarantine(self, key: str, problems: list[str]) -> Path | None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        dest = self.quarantine_dir / f"{key}.{stamp}.{secrets.token_hex(2)}"
        with self._gc_lock():
            try:
                os.rename(self.entry_dir(key), dest)
            except FileNotFoundError:
                return None
            rmtree_force(self.leases_dir / key)
        with contextlib.suppress(OSError):
            (dest / "QUARANTINED.txt").write_text(
                f"quarantined by transformd cache verify at {stamp}Z (pid {os.getpid()}):\n"
                + "".join(f"- {p}\n" for p in problems)
            )
        return dest


