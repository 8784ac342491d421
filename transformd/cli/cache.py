"""``transformd cache ls | verify [KEY] | gc | rm KEY``: inspect and maintain the cache.

:func:`add_commands` registers the ``cache`` command on the main CLI's subparsers; every leaf
sets ``func`` to a handler that takes the parsed namespace and returns an exit status.
"""

from __future__ import annotations

import argparse
import os
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from ..errors import TransformdError
from ..progress import human_bytes
from .common import exit_code, fail, shown

if TYPE_CHECKING:
    from ..cache import Cache, VerifyResult


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return "?"
    d = max(0.0, now - t)
    if d < 60:
        rel = f"{d:.0f}s ago"
    elif d < 3600:
        rel = f"{d / 60:.0f}m ago"
    elif d < 86400:
        rel = f"{d / 3600:.0f}h ago"
    else:
        rel = f"{d / 86400:.0f}d ago"
    return f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(t))} ({rel})"


def _table(rows: list[list[str]], header: list[str], out: TextIO, *, right: Sequence[int] = ()) -> None:
    rows = [[shown(c) for c in r] for r in rows]  # a source's path is whatever its directory was named
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        cells = [
            str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.write("  ".join(cells).rstrip() + "\n")


def _open(args: argparse.Namespace) -> Cache:
    """The cache these commands look at; it must exist already (a mistyped --cache-dir is refused, exit 2, and
    not created: only commands that convert create a cache)."""
    from ..cache.store import Cache, existing_root  # here: the parser is built for every command

    root = existing_root(args.cache_dir)
    changes, owner = args.cache_command in ("gc", "rm"), (root / "entries").stat().st_uid
    # (entries/ is 0711: no other user lists it; the owner's own failures, a read-only disk, the cache says itself)
    if owner != os.geteuid() and not os.access(root / "entries", os.R_OK | os.X_OK | (os.W_OK if changes else 0)):
        from ..errors import CacheError

        raise CacheError(f"this user may not {'change' if changes else 'list'} the cache {root} (uid {owner}'s): run "
                         f"'transformd cache {args.cache_command}' as that user, or as root")
    return Cache(root, budget_bytes=getattr(args, "budget", None) if args.cache_command == "gc" else None)


def _daemon_cache(args: argparse.Namespace) -> tuple[str, dict[str, Any]] | None:
    """Where the daemon is and ``GET /v1/cache`` (the entries this caller may see), when no cache was named (no
    --cache-dir, no $TRANSFORMD_CACHE_DIR) and a daemon answers: the cache ``transformd resolve`` resolves through,
    not ``~/.cache/transformd`` (which said "no entries" right after a resolve). None: list the local cache."""
    from ..cache.store import ENV_CACHE_DIR
    from ..client import TransformdClient

    if args.cache_dir is not None or os.environ.get(ENV_CACHE_DIR):
        return None
    try:
        with TransformdClient(socket=getattr(args, "socket", None), timeout=10.0) as client:
            return client.where, client.cache()
    except TransformdError:  # no daemon here (or it cannot answer): the local cache, as before
        return None


def _ls_daemon(where: str, body: dict[str, Any], as_json: bool, out: TextIO) -> int:
    """``cache ls`` of the daemon's cache, from its answer."""
    if as_json:
        json.dump({**body, "daemon": where}, out, indent=1)
        out.write("\n")
        return 0
    now = time.time()
    out.write(f"cache {body.get('root')} (of the daemon at {where}, the entries this user may see; --cache-dir DIR "
              "lists another)\n")
    rows = []
    for e in body.get("entries") or []:
        recipe = e.get("recipe") if isinstance(e.get("recipe"), dict) else {}
        said = f"{recipe.get('target', '?')}/{recipe.get('scale_mode', '?')}"
        said += f" select={recipe['select']}" if recipe.get("select") else ""
        last = e.get("last_used")
        rows.append([str(e.get("key")), human_bytes(e.get("size_bytes")), _ago(last if isinstance(last, float | int)
                     else None, now), said, str(len(e.get("leases") or [])), str(e.get("source") or "?")])
    if rows:
        _table(rows, ["KEY", "SIZE", "LAST USED", "RECIPE", "LEASES", "SOURCE"], out, right=(1, 4))
    else:
        out.write("no entries\n")
    out.write(f"{len(rows)} entries, {human_bytes(body.get('usage_bytes'))} of {human_bytes(body.get('budget_bytes'))} "
              f"budget, {human_bytes(body.get('free_bytes'))} free on disk\n")
    for c in body.get("conversions") or []:
        out.write(f"converting {c.get('key')} from {c.get('source')}: {c.get('state')}\n")
    return 0


def cmd_ls(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    daemon = _daemon_cache(args)
    if daemon is not None:
        return _ls_daemon(*daemon, args.json, out)
    cache = _open(args)
    now = time.time()
    entries = cache.entries()
    leases = {}
    for lease in cache.leases():
        if lease.is_live(now):
            leases[lease.key] = leases.get(lease.key, 0) + 1
    rows, records = [], []
    for e in entries:
        try:
            m = e.manifest
            size, recipe, source, created = e.size_bytes, m.recipe.describe(), m.source_hint, m.created_at
        except (OSError, ValueError, KeyError, TypeError):
            size, recipe, source, created = None, "?", "(manifest unreadable: run verify)", None
        rows.append([e.key, human_bytes(size), _ago(e.last_used, now), recipe, str(leases.get(e.key, 0)), source])
        records.append(
            {
                "key": e.key,
                "path": str(e.path),
                "size_bytes": size,
                "last_used": e.last_used,
                "created_at": created,
                "recipe": recipe,
                "live_leases": leases.get(e.key, 0),
                "source": source,
            }
        )
    usage = cache.usage()
    flights = cache.in_flight()
    if args.json:
        json.dump(
            {
                "root": str(cache.root),
                "budget_bytes": usage.budget_bytes,
                "used_bytes": usage.used_bytes,
                "free_bytes": usage.free_bytes,
                "quarantined": usage.quarantined,
                "entries": records,
                "in_flight": [f.as_dict() for f in flights],
            },
            out,
            indent=1,
        )
        out.write("\n")
        return 0
    named = args.cache_dir is not None or os.environ.get("TRANSFORMD_CACHE_DIR")
    out.write(f"cache {cache.root}{'' if named else ' (no daemon answers here)'}\n")
    if rows:
        _table(rows, ["KEY", "SIZE", "LAST USED", "RECIPE", "LEASES", "SOURCE"], out, right=(1, 4))
    else:
        out.write("no entries\n")
    pct = 100.0 * usage.used_bytes / usage.budget_bytes if usage.budget_bytes else 0.0
    out.write(
        f"{usage.entries} entries, {human_bytes(usage.used_bytes)} of {human_bytes(usage.budget_bytes)} budget "
        f"({pct:.0f}%), {human_bytes(usage.leased_bytes)} leased, {human_bytes(usage.free_bytes)} free on disk, "
        f"{usage.quarantined} quarantined\n"
    )
    for f in flights:
        detail = f" {json.dumps(f.detail, sort_keys=True)}" if f.detail else ""
        out.write(
            f"converting {f.key} (pid {f.pid} on {f.host}, since {_ago(f.started_at, now)}) "
            f"from {f.source}: {f.state}{detail}\n"
        )
    return 0


def _print_verify(results: list[VerifyResult], out: TextIO) -> None:
    for r in results:
        if r.ok:
            out.write(f"ok       {r.key}  {r.files_checked} files, {human_bytes(r.bytes_checked)}\n")
        else:
            where = f" -> quarantined to {r.quarantined_to}" if r.quarantined_to else ""
            out.write(f"CORRUPT  {r.key}{where}\n")
            out.writelines(f"           {shown(p)}\n" for p in r.problems)


def cmd_verify(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    cache = _open(args)
    results = cache.verify(args.key, quarantine=not args.no_quarantine)
    if args.json:
        json.dump(
            [
                {
                    "key": r.key,
                    "ok": r.ok,
                    "problems": r.problems,
                    "files_checked": r.files_checked,
                    "bytes_checked": r.bytes_checked,
                    "quarantined_to": str(r.quarantined_to) if r.quarantined_to else None,
                }
                for r in results
            ],
            out,
            indent=1,
        )
        out.write("\n")
    else:
        _print_verify(results, out)
        bad = sum(not r.ok for r in results)
        out.write(f"{len(results)} entries checked, {bad} corrupt\n")
    return 1 if any(not r.ok for r in results) else 0


def cmd_gc(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    cache = _open(args)
    report = cache.gc(purge_quarantine=args.purge_quarantine)
    for key, size in report.evicted:
        out.write(f"evicted  {key}  {human_bytes(size)}\n")
    c = report.cleanup
    out.write(
        f"evicted {len(report.evicted)} entries ({human_bytes(report.freed_bytes)}); "
        f"{human_bytes(report.used_bytes)} used of {human_bytes(report.budget_bytes)} budget; "
        f"removed {len(c.staging_removed)} stale staging, {len(c.locks_removed)} stale locks, "
        f"{report.leases_removed} expired leases, {report.quarantine_removed} quarantined entries\n"
    )
    return 0


def cmd_rm(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    cache = _open(args)
    status = 0
    for key in args.keys:
        try:
            freed = cache.rm(key, force=args.force)
        except TransformdError as e:  # one key's problem; the others are still removed
            status = max(status, fail(e, exit_code(e)))
            continue
        out.write(f"removed  {key}  {human_bytes(freed)}\n")
    return status


def add_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cache ls|verify|gc|rm`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``).

    Each leaf parser sets ``handler``: :func:`transformd.cli.main` calls ``args.handler(args)`` and exits with
    its return value (0 ok; 1 failure or corrupt entries
    found by verify; 2 bad arguments). Errors are one line on standard error.
    """
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=None,
        help="cache root (default: $TRANSFORMD_CACHE_DIR, $XDG_CACHE_HOME/transformd or ~/.cache/transformd); "
        "it must be an existing transformd cache: these commands never create one (exit 2 otherwise)",
    )
    p = subparsers.add_parser(
        "cache",
        help="inspect and maintain the cache of converted checkpoints",
        description="Inspect and maintain the cache of converted checkpoints.",
    )
    sub = p.add_subparsers(dest="cache_command", metavar="COMMAND", required=True)

    ls = sub.add_parser("ls", parents=[common], help="list entries: key, size, last use, recipe, leases, source",
                        description="List the entries of a cache. Without --cache-dir (and $TRANSFORMD_CACHE_DIR), "
                                    "the cache of the daemon 'transformd resolve' would ask, when one answers (the "
                                    "entries this user may see); else the default cache directory. The first line "
                                    "says which cache is listed.")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.add_argument("--socket", metavar="PATH", help="the daemon's unix socket (default: as 'transformd resolve')")
    ls.set_defaults(handler=cmd_ls)

    verify = sub.add_parser(
        "verify", parents=[common], help="re-hash entry files against their manifests; quarantine corrupt entries"
    )
    verify.add_argument("key", nargs="?", metavar="KEY", help="only this entry (default: all)")
    verify.add_argument("--no-quarantine", action="store_true", help="report corrupt entries but leave them in place")
    verify.add_argument("--json", action="store_true", help="print JSON instead of text")
    verify.set_defaults(handler=cmd_verify)

    gc = sub.add_parser(
        "gc", parents=[common], help="apply the budget (evict least recently used entries) and remove leftovers"
    )
    gc.add_argument("--budget", metavar="SIZE", help="apply this budget instead (bytes, 500G, 1.5TiB, 80%%)")
    gc.add_argument("--purge-quarantine", action="store_true", help="also delete quarantined entries")
    gc.set_defaults(handler=cmd_gc)

    rm = sub.add_parser("rm", parents=[common], help="remove entries")
    rm.add_argument("keys", nargs="+", metavar="KEY", help="entry keys, as 'transformd cache ls' shows them")
    rm.add_argument("--force", action="store_true", help="remove even while a live lease holds the entry")
    rm.set_defaults(handler=cmd_rm)
    return p
