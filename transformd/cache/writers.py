"""Who could rewrite a source's files in place, a part of its cache key (:mod:`.keys`), named as the host names them.

A process in a user namespace (a rootless container, a Kubernetes pod with ``hostUsers: false``) sees a file's
owner under another id than the host: uid 1000 outside may be 0 inside, and every owner the namespace does not map
shows as the same overflow id (``/proc/sys/fs/overflowuid``, 65534). Writers are named in the ids of the parent
namespace, through this process's ``/proc/self/uid_map`` and ``gid_map`` (in the initial namespace the map is the
identity and nothing changes). So a ``transformd convert --cache-dir`` in a container computes the key the host's
daemon computed for the same files, and finds its entry. An owner that cannot be told apart (the overflow id, an
id the map does not cover) names the file itself (``file:<device>:<inode>``): such a file's entries are never
shared with another file's, since another owner may hide behind the same id. A POSIX ACL's user and group ids
are translated the same way (the kernel shows them in the reader's namespace); one that cannot be is named by file.

Only one level is translated, to the parent namespace's ids, which are the host's for a container. A process in a
nested namespace (a container inside a rootless one) names writers in its parent's ids, which may name other users
on the host: two owners can then share a name, as they could before. Run the daemon in the host's user namespace
or one level below it (a container's), where that cannot happen.
"""

from __future__ import annotations

import functools
import os
import stat as stat_mod
import struct
from collections.abc import Iterable

import blake3

__all__ = ["source_writers"]

#: POSIX ACL xattr (``system.posix_acl_access``): a little-endian u32 version, then (u16 tag, u16 perm, u32 id).
_ACL_HEADER, _ACL_ENTRY = struct.Struct("<I"), struct.Struct("<HHI")
#: ACL entry tags that carry a uid (ACL_USER) or a gid (ACL_GROUP).
_ACL_USER, _ACL_GROUP = 0x02, 0x08
_IDENTITY = ((0, 0, 2**32 - 1),)


@functools.cache
def _id_map(kind: str) -> tuple[tuple[int, int, int], ...] | None:
    """This process's map of ``kind`` (``uid`` or ``gid``) ids to its parent namespace's, as ``(inside, outside,
    count)`` ranges; None where ids need no translation (the initial namespace, or no ``/proc``)."""
    try:
        with open(f"/proc/self/{kind}_map", encoding="ascii") as f:
            ranges = tuple(tuple(int(v) for v in line.split()) for line in f if line.strip())
    except (OSError, ValueError):
        return None
    return None if ranges == _IDENTITY else ranges  # type: ignore[return-value]


@functools.cache
def _overflow_id(kind: str) -> int:
    try:
        with open(f"/proc/sys/fs/overflow{kind}", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65534


def _outside(kind: str, n: int) -> int | None:
    """``n`` (a ``kind`` id as this process sees it) as the parent namespace names it; None when it cannot be told
    (the overflow id that every unmapped owner shows as, or an id outside the map)."""
    ranges = _id_map(kind)
    if ranges is None:
        return n
    if n == _overflow_id(kind):
        return None
    for inside, outside, count in ranges:
        if inside <= n < inside + count:
            return outside + n - inside
    return None


def _acl_outside(acl: bytes) -> bytes | None:
    """The ACL ``acl`` with its user and group ids as the parent namespace names them; None when one cannot be."""
    if _id_map("uid") is None and _id_map("gid") is None:
        return acl
    body = memoryview(acl)[_ACL_HEADER.size:]
    if len(acl) < _ACL_HEADER.size or len(body) % _ACL_ENTRY.size:
        return None
    out = [acl[:_ACL_HEADER.size]]
    for tag, perm, n in _ACL_ENTRY.iter_unpack(body):
        if tag in (_ACL_USER, _ACL_GROUP):
            n = _outside("uid" if tag == _ACL_USER else "gid", n)
            if n is None:
                return None
        out.append(_ACL_ENTRY.pack(tag, perm, n))
    return b"".join(out)


def source_writers(files: Iterable[tuple[int, os.stat_result]]) -> tuple[str, ...]:
    """Who could change the bytes of these files (open descriptors and their stats) in place, sorted: ``uid:N``
    for each owner (who may always give himself write permission), ``gid:N`` for each group with write
    permission, ``other`` when everyone has it, and ``acl:<digest>`` for each POSIX access ACL (its named users
    and groups, whose write permission shows in the mode only as the group's); ids as the parent user namespace
    names them, ``file:<device>:<inode>`` where that cannot be told (the module's docstring). Root is not named:
    it can write anything, the daemon's files included. (ACLs a file system keeps elsewhere, NFSv4's, are not
    seen.)"""
    found: set[str] = set()
    for fd, st in files:
        unknown = f"file:{st.st_dev}:{st.st_ino}"
        uid = _outside("uid", st.st_uid)
        found.add(unknown if uid is None else f"uid:{uid}")
        if st.st_mode & stat_mod.S_IWGRP:
            gid = _outside("gid", st.st_gid)
            found.add(unknown if gid is None else f"gid:{gid}")
        if st.st_mode & stat_mod.S_IWOTH:
            found.add("other")
        try:
            acl = os.getxattr(fd, "system.posix_acl_access")
        except OSError:  # none, or no ACLs on this file system
            continue
        acl = _acl_outside(acl)
        found.add(unknown if acl is None else "acl:" + blake3.blake3(acl).hexdigest()[:32])
    return tuple(sorted(found))
