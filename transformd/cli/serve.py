"""``transformd serve``: run the daemon. Flags override ``TRANSFORMD_*`` environment variables.

:func:`add_commands` registers ``serve`` on the main CLI's subparsers.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from .common import EXIT_BAD_INPUT, user_path, visible


def _settings_from_args(args: argparse.Namespace) -> Any:
    from ..daemon.settings import Settings

    flags = {
        "socket": args.socket,
        "host": args.host,
        "port": args.port,
        "token_file": args.token_file,
        "cache_dir": args.cache_dir,
        "cache_budget": args.cache_budget,
        "allow_roots": args.allow_root,
        "device": args.device,
        "hub_cache": args.hub_cache,
        "allow_hub_cache": args.allow_hub_cache,
        "allow_download": args.allow_download,
        "max_concurrent_conversions": args.max_concurrent_conversions,
        "max_queued_conversions": args.max_queued_conversions,
        "admin_uids": args.admin_uid,
        "remote": args.remote,
        "remote_read_only": args.remote_read_only,
        "log_level": args.log_level,
    }
    return Settings(**{k: v for k, v in flags.items() if v is not None})


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the daemon until SIGINT/SIGTERM."""
    from pydantic import ValidationError

    from ..daemon.server import serve

    try:
        settings = _settings_from_args(args)
    except ValidationError as e:
        problems = "; ".join(f"{_named(err['loc'])}: {err['msg']}" for err in e.errors())
        print(f"transformd: error: bad settings: {problems}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if settings.device == "cuda":  # before the server starts: its start-up would fail with a traceback
        from ..convert import resolve_device

        resolve_device("cuda")  # RuntimeError: one line, exit 1
    handler = logging.StreamHandler()
    handler.setFormatter(VisibleFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler])
    return serve(settings)  # a SettingsError (2) or CacheError (1) is reported by transformd.cli.main


def _named(loc: tuple[Any, ...]) -> str:
    """A setting as an operator sets it: ``max_queued_conversions (TRANSFORMD_MAX_QUEUED_CONVERSIONS)``."""
    name = ".".join(str(x) for x in loc)
    return f"{name} (TRANSFORMD_{name.upper()})" if name.isidentifier() else name


class VisibleFormatter(logging.Formatter):
    """Log lines with their control characters escaped (:func:`~transformd.cli.common.visible`): an error names
    tensors and files of untrusted checkpoints, and must not drive the terminal that shows the log. A record's
    message stays on its line (a newline in a caller's path is written ``\\n``: it forged log lines, an attack
    review found); tracebacks keep their lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        return super().formatMessage(record).replace("\r", "\\r").replace("\n", "\\n")

    def format(self, record: logging.LogRecord) -> str:
        return visible(super().format(record))


def add_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` (its handler is ``args.handler``)."""
    p = subparsers.add_parser(
        "serve",
        help="run the daemon: HTTP API on a unix socket (default) or a loopback TCP port with a token",
        description="Run the transformd daemon. Listens on a unix socket by default (0660). --port listens on TCP "
        "(loopback unless --host) and requires --token-file; the unix socket is then opened too only when --socket "
        "or TRANSFORMD_SOCKET names one. Sources must lie under an --allow-root: without one that is a readable "
        "directory (or --allow-hub-cache) it does not start. Every flag can also be set with a "
        "TRANSFORMD_* environment variable (TRANSFORMD_ALLOW_ROOTS is os.pathsep-separated).",
    )
    p.add_argument(
        "--socket",
        metavar="PATH",
        type=user_path,
        help="unix socket (default: $TRANSFORMD_SOCKET, $XDG_RUNTIME_DIR/transformd.sock, "
        "/run/transformd/transformd.sock); with --port, only when given",
    )
    p.add_argument("--host", metavar="H", help="TCP address to bind (default 127.0.0.1; needs --port)")
    p.add_argument("--port", metavar="P", type=int, help="TCP port (0: any free port); requires --token-file")
    p.add_argument("--token-file", metavar="F", type=user_path, help="file holding the bearer token of TCP clients")
    p.add_argument("--cache-dir", metavar="DIR", type=user_path,
                   help="cache root (default: $TRANSFORMD_CACHE_DIR, ...)")
    p.add_argument("--cache-budget", metavar="SIZE", help="cache byte budget: bytes, 500G, 1.5TiB, 80%%")
    p.add_argument(
        "--allow-root",
        "--allow-roots",  # (the environment variable is plural: a natural typo, taken as it is meant)
        metavar="DIR",
        dest="allow_root",
        type=user_path,
        action="append",
        help="accept sources under DIR (repeatable; symlinks are resolved before the check)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where conversions run (default auto)")
    p.add_argument("--hub-cache", metavar="DIR", type=user_path,
                   help="Hugging Face hub cache where repo ids (org/Model) are looked up (default: $HF_HUB_CACHE, "
                   "else $HF_HOME/hub, else ~/.cache/huggingface/hub)")
    p.add_argument("--allow-hub-cache", action="store_true", default=None,
                   help="add the hub cache to the allowed roots (else repo ids work only under an --allow-root)")
    p.add_argument("--allow-download", action="store_true", default=None,
                   help="download a repo id that is not in the hub cache (token: HF_TOKEN or `hf auth login`); "
                   "without it the daemon never downloads")
    p.add_argument("--max-concurrent-conversions", metavar="N", type=int, help="conversions at once (default 1)")
    p.add_argument(
        "--max-queued-conversions",
        metavar="N",
        type=int,
        help="conversions waiting for a worker before requests get 503 (default 16)",
    )
    p.add_argument("--admin-uid", metavar="UID", type=int, action="append",
                   help="a uid that may see, release and delete every caller's leases and entries (repeatable; "
                   "default: the daemon's own uid; root is an admin only when named)")
    p.add_argument("--remote", metavar="URL",
                   help="remote tier many nodes share: s3://BUCKET[/PREFIX] (credentials and endpoint from the AWS "
                   "variables: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_PROFILE) or "
                   "file:///PATH; a request that misses the cache downloads the entry from it before converting, and "
                   "what this daemon converts is uploaded to it in the background (default: $TRANSFORMD_REMOTE)")
    p.add_argument("--remote-read-only", action="store_true", default=None,
                   help="only download from the remote tier, never upload to it")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"],
                   help="log verbosity on standard error (default info)")
    p.set_defaults(handler=cmd_serve)
    return p
