"""``transformd resolve SRC`` (the engine start-up hook) and ``transformd health``.

``resolve`` asks the daemon for the converted checkpoint of ``SRC``, shows the conversion's
progress on standard error while it waits, and prints the converted directory as the only line
of standard output, so an engine starts with::

    vllm serve "$(transformd resolve /models/X --engine vllm)"

Progress: a tqdm bar when standard error is a terminal, else one line every few seconds (and on
every change of state), so container logs show how far a long conversion is.

Exit status: 0 with the directory printed; 2 when the request is the problem (4xx: source
outside the allowed roots, not an MXFP8 checkpoint, bad arguments) or the conversion failed on
the checkpoint's content; 1 when the daemon cannot be reached, fails (5xx) or the wait timed out.
Errors are one line on standard error: ``transformd: error: ...``.

``health`` exits 0 when the daemon answers ``GET /healthz`` with status ``ok`` (the Dockerfile's
HEALTHCHECK uses it), and 1 when it is degraded (the reasons are printed as text on standard error)
or cannot be reached. ``--allow-degraded`` exits 0 for a degraded daemon too (a liveness probe: a
degraded daemon still serves what it has cached, and restarting it does not mend a read-only disk).

"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from ..client import (
    DEFAULT_RECONNECT_S,
    ENV_SOCKET,
    ENV_TOKEN_FILE,
    CheckpointStatus,
    TransformdClient,
    TransformdError,
)
from ..engines import ENGINE_ENV, TARGET_CHOICES, Engine, engine_from_env, readiness_lines
from ..progress import draws_a_bar, human_bytes
from .common import (EXIT_FAILURE, EXIT_OK, EXIT_TERMINATED, Terminated, exit_code, fail, missing_here,
                     non_negative_float, positive_float, shown)

__all__ = ["ProgressReporter", "add_commands", "resolve_with_progress", "run_health", "run_resolve"]

TARGETS = TARGET_CHOICES
ENGINES = tuple(e.value for e in Engine)
SCALE_MODES = ("exact", "amax")
#: Seconds without an answer to the request after which ``resolve`` says what the daemon is doing.
IDENTIFY_NOTICE_S = 3.0
#: The daemon's refusals after which the caller's own view of SRC is looked at: a typo outside the roots (403), or a
#: relative typo read as a repo id (403 hub cache not allowed, 404 not cached) gets "no such directory" first.
_TYPO_CODES = frozenset({"source_not_allowed", "repo_not_cached", "repo_not_found"})


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``resolve`` and ``health`` (handlers in ``handler``, as :mod:`transformd.cli` expects)."""
    connection = argparse.ArgumentParser(add_help=False)
    where = connection.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH",
                       help=f"daemon's unix socket (default: ${ENV_SOCKET}, $XDG_RUNTIME_DIR/transformd.sock, "
                            "/run/transformd/transformd.sock)")
    where.add_argument("--url", metavar="URL", help="daemon's TCP address instead, e.g. http://127.0.0.1:8471")
    connection.add_argument("--token-file", metavar="FILE",
                            help=f"bearer token for --url (default: ${ENV_TOKEN_FILE})")
    connection.add_argument("--request-timeout", metavar="S", type=positive_float, default=30.0,
                            help="limit for each HTTP request (default 30)")

    resolve = subparsers.add_parser(
        "resolve",
        parents=[connection],
        help="ask the daemon for the converted checkpoint of SRC; print its directory",
        description="Ask the transformd daemon for the block-FP8 conversion of the MXFP8 checkpoint SRC "
                    "(converting it now, or from the cache), show progress on standard error while waiting, "
                    "and print the converted directory as the only line of standard output: "
                    'vllm serve "$(transformd resolve /models/X --engine vllm)".',
    )
    resolve.add_argument("src", metavar="SRC",
                         help="MXFP8 checkpoint directory, as the daemon sees it, or a Hugging Face repo id org/Model "
                              "(looked up in the daemon's hub cache; a path that exists here is a path)")
    resolve.add_argument("--revision", metavar="REV",
                         help="with a repo id: branch, tag or full commit hash in the hub cache (default main)")
    resolve.add_argument("--target", choices=TARGETS, default="auto",
                         help="auto (default): the daemon picks for --engine and its GPU (ocp for vllm, sglang, "
                              "transformers; for raw consumers fnuz on gfx94x, else ocp; the MXFP8 source itself on "
                              "GPUs with native MX); fnuz: float8_e4m3fnuz for kernels that take FNUZ directly; "
                              "ocp: float8_e4m3fn")
    resolve.add_argument("--engine", choices=ENGINES, default=None,
                         help="who loads the output (vllm, sglang, transformers, raw): picks the target for auto "
                              "(and for sglang writes fused expert stacks per expert), and the daemon refuses (exit 2) "
                              "a checkpoint that engine could not load at any tensor-parallel size. Default: "
                              f"${ENGINE_ENV}; with neither, a checkpoint some engine would load wrong without an "
                              "error is refused (raw: transformd.loader or your own kernels, no check)")
    resolve.add_argument("--scale-mode", choices=SCALE_MODES, default="exact",
                         help="exact: power-of-two tile scales (default); amax: amax/448")
    resolve.add_argument("--select", metavar="REGEX",
                         help="a check: every MXFP8 weight's name must match (RE2), else nothing is converted")
    resolve.add_argument("--timeout", metavar="S", type=positive_float, default=None,
                         help="give up waiting after S seconds (exit 1; the conversion goes on). Default: no limit")
    resolve.add_argument("--reconnect", metavar="S", type=non_negative_float, default=DEFAULT_RECONNECT_S,
                         help="when the daemon goes away during the wait (restarted), wait up to S seconds for it "
                              f"to answer again and ask it again (default {DEFAULT_RECONNECT_S:g}; 0: fail at once)")
    resolve.add_argument("--poll-interval", metavar="S", type=positive_float, default=0.5, help=argparse.SUPPRESS)
    resolve.add_argument("--progress-every", metavar="S", type=non_negative_float, default=5.0,
                         help="seconds between progress lines when standard error is not a terminal (default 5)")
    resolve.set_defaults(handler=run_resolve)

    health = subparsers.add_parser(
        "health",
        parents=[connection],
        help="exit 0 when the daemon is healthy, 1 when it is degraded or cannot be reached",
        description="Ask the transformd daemon for GET /healthz and print its status. Exit 0 when it is ok; 1 when "
                    "it is degraded (the reasons, e.g. a cache directory that is not writable, are printed on "
                    "standard error) or cannot be reached.",
    )
    health.add_argument("--quiet", "-q", action="store_true", help="print nothing when healthy")
    health.add_argument("--allow-degraded", action="store_true",
                        help="exit 0 for a degraded daemon too (still printing why): for liveness probes, since a "
                             "degraded daemon still serves its cache and a restart does not mend its disk")
    health.set_defaults(handler=run_health)


def _client(args: argparse.Namespace) -> TransformdClient:
    return TransformdClient(socket=args.socket, url=args.url, token_file=args.token_file,
                            timeout=args.request_timeout)


def run_resolve(args: argparse.Namespace) -> int:
    """Handler of ``transformd resolve``."""
    args.engine = args.engine or engine_from_env()  # (the engine's container may name it once: TRANSFORMD_ENGINE)
    reporter = ProgressReporter(sys.stderr, every_s=args.progress_every)
    try:
        with _client(args) as client:
            path, last = resolve_with_progress(
                client,
                args.src,
                reporter,
                target=args.target,
                engine=args.engine,
                scale_mode=args.scale_mode,
                select=args.select,
                poll_interval=args.poll_interval,
                timeout=args.timeout,
                reconnect_s=args.reconnect,
                revision=args.revision,
            )
    except TransformdError as err:
        return fail(_said_of_a_typo(args.src, err), exit_code(err))
    except Terminated:
        return fail("terminated (SIGTERM; the conversion goes on in the daemon)", EXIT_TERMINATED)
    except KeyboardInterrupt:
        return fail("interrupted (the conversion goes on in the daemon)", 130)
    if last is not None:
        _say_target_and_readiness(last.raw, args.engine)
    print(path, flush=True)
    return EXIT_OK


def _said_of_a_typo(src: str, err: TransformdError) -> str:
    """The daemon's refusal of ``src``, led by what the caller's own view says when nothing is there: advice to
    restart the daemon with another root, or to download a repo, is no help for a typo. The daemon's answer follows
    (it may see another file system, a container's)."""
    if getattr(err, "code", None) not in _TYPO_CODES:
        return str(err)
    path = missing_here(src)
    if path is None:
        return str(err)
    from ..hub import default_hub_cache, is_repo_id

    if not is_repo_id(src):
        return f"no such directory: {path} (the daemon's answer: {err})"
    hub = default_hub_cache()
    if os.path.lexists(hub / f"models--{src.replace('/', '--')}"):
        return str(err)  # a repo of that name is here: the daemon's answer is the news
    return (f"{src} is neither a directory here (no {path}) nor a repo in the Hugging Face hub cache {hub}: check the "
            f"name (the daemon's answer: {err})")


def resolve_with_progress(
    client: TransformdClient, src: str, reporter: ProgressReporter, **options: Any
) -> tuple[Path, CheckpointStatus | None]:
    """``client.resolve(src, **options)`` with its progress and notices on ``reporter`` (closed at the end): the
    converted directory and the last answer seen.

    The daemon answers the request once it has the checkpoint's key: for a large checkpoint it never saw, that
    takes a read of the whole checkpoint (converted at the same time), with no progress to show until then, so
    a line says so after :data:`IDENTIFY_NOTICE_S` seconds without an answer.
    """
    last: list[CheckpointStatus] = []
    waiting = threading.Timer(IDENTIFY_NOTICE_S, lambda: last or reporter.notice(
        f"the daemon is reading {src} to key it (a large checkpoint new to it is converted as it is read, "
        "when a conversion worker is free); progress shows once it has the key"))
    waiting.daemon = True

    said: dict[str, Any] = {}

    def progress(status: CheckpointStatus) -> None:
        waiting.cancel()
        if status.raw.get("target_reason"):  # (the request's answer says why this target; the polls do not)
            said["target_reason"] = status.raw["target_reason"]
        elif said and isinstance(status.raw, dict):
            status.raw.update(said)
        last[:] = [status]
        reporter.update(status)

    waiting.start()
    try:
        path = client.resolve(src, progress=progress, notice=reporter.notice, **options)
    finally:
        waiting.cancel()
        reporter.close()
    return path, (last[0] if last else None)


def _say_target_and_readiness(body: dict[str, Any], engine: str | None) -> None:
    """Why this target, and whether the engines load the result, on standard error (from the daemon's answer)."""
    recipe = body.get("recipe") or {}
    if body.get("target_reason"):
        print(shown(f"transformd: target {recipe.get('target', 'none')}: {body['target_reason']}"), file=sys.stderr)
    for name, r in (body.get("readiness") or {}).items():
        if engine in (None, name) and isinstance(r, dict):
            first, *rest = readiness_lines(r)
            for line in [f"transformd: {name}: {first}", *rest]:
                print(("  " if line.startswith(" ") else "") + shown(line), file=sys.stderr)  # (shown: one line)
            for warning in r.get("warnings") or []:  # (e.g. a flag the engine needs: convert prints the same)
                print(shown(f"transformd: warning: {name}: {warning}"), file=sys.stderr)


def run_health(args: argparse.Namespace) -> int:
    """Handler of ``transformd health``: 0 ok; 1 degraded (reasons on standard error) or unreachable."""
    try:
        with _client(args) as client:
            data = client.health(degraded_ok=True)
    except TransformdError as err:
        return fail(err, EXIT_FAILURE)
    status = str(data.get("status", "ok"))
    problems = [shown(p) for p in (data.get("problems") or [])]
    if not args.quiet or status.lower() != "ok":
        print(shown(status))
    if status.lower() == "ok":
        return EXIT_OK
    reasons = "; ".join(problems) or "no reason given"
    if status.lower() == "degraded" and getattr(args, "allow_degraded", False):
        print(f"transformd: warning: transformd at {client.where} is degraded: {reasons}", file=sys.stderr)
        return EXIT_OK
    return fail(f"transformd at {client.where} is {status}: {reasons}", EXIT_FAILURE)


class ProgressReporter:
    """Turns :class:`CheckpointStatus` updates into a tqdm bar (terminal) or periodic lines (logs) on ``stream``."""

    def __init__(self, stream: TextIO, *, every_s: float = 5.0, tty: bool | None = None,
                 clock: Any = time.monotonic) -> None:
        self._stream = stream
        self._tty = draws_a_bar(stream) if tty is None else tty
        self._every = every_s
        self._clock = clock
        self._bar: Any = None
        self._last_line: float | None = None
        self._last_state: str | None = None

    def update(self, status: CheckpointStatus) -> None:
        if status.ready and self._last_state is None:
            return  # a cache hit: nothing to report
        if self._tty:
            self._update_bar(status)
        else:
            self._update_lines(status)
        self._last_state = status.state

    def _update_bar(self, status: CheckpointStatus) -> None:
        p = status.progress
        if p is None or p.bytes_total is None or p.bytes_done is None:
            if status.state != self._last_state and not status.ready:
                print(shown(f"transformd: {status.key[:12]} {status.state}"), file=self._stream, flush=True)
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=p.bytes_total, unit="B", unit_scale=True, unit_divisor=1024, file=self._stream,
                             desc=shown(f"converting {status.key[:12]}"), dynamic_ncols=True)
        self._bar.total = p.bytes_total
        self._bar.update(max(0, p.bytes_done - self._bar.n))
        if p.tensors_total:
            self._bar.set_postfix_str(f"{p.tensors_done}/{p.tensors_total} tensors", refresh=False)

    def _update_lines(self, status: CheckpointStatus) -> None:
        now = self._clock()
        changed = status.state != self._last_state
        due = self._last_line is None or now - self._last_line >= self._every
        if not (changed or due):
            return
        self._last_line = now
        print(shown(f"transformd: {status.key[:12]} {describe(status)}"), file=self._stream, flush=True)

    def notice(self, message: str) -> None:
        """A line about the connection (the daemon went away, reconnected), so progress that starts over
        is explained; the next update prints (or starts a new bar) whatever its state."""
        self.close()
        print(shown(f"transformd: {message}"), file=self._stream, flush=True)
        self._last_state = "notice"
        self._last_line = None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def describe(status: CheckpointStatus) -> str:
    """One line: ``converting 1.2/3.4 GiB (35%), 120/400 tensors, 800 MiB/s, ~3s left``."""
    p = status.progress
    if status.ready:
        return f"ready: {status.path}"
    if p is None:
        return status.state
    parts = [p.phase] if p.phase and p.phase != status.state else []
    if p.bytes_total:
        done = human_bytes(p.bytes_done or 0)
        parts.append(f"{done}/{human_bytes(p.bytes_total)} ({p.fraction:.0%})")
    if p.tensors_total:
        parts.append(f"{p.tensors_done or 0}/{p.tensors_total} tensors")
    if p.rate_bytes_per_s:
        parts.append(f"{human_bytes(p.rate_bytes_per_s)}/s")
    if p.eta_s is not None and status.state == "converting":
        parts.append(f"~{p.eta_s:.0f}s left")
    return f"{status.state} " + ", ".join(parts) if parts else status.state
