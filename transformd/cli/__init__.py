"""Command line: ``transformd convert | sample | inspect | demo | cache ...``.

Conventions every subcommand keeps, so scripts can rely on them:

* the last line of standard output is the directory the command produced (or
  read), so ``DIR=$(transformd convert ... | tail -n1)`` works;
* errors are one line on standard error, ``transformd: error: ...``; exit code 2
  for bad input (a malformed checkpoint, invalid MXFP8 values, a non-empty
  ``--out``, bad arguments), 1 for environment failures (I/O, no GPU);
* SIGTERM (``kill``, systemd, Kubernetes) stops a command as Ctrl-C does: nothing half-written is left (a
  conversion's staging directory is removed), exit code 143 (130 for Ctrl-C);
* progress goes to standard error: a bar when that is a terminal, else a line every 5 s
  (``--progress-every``); ``convert`` ends with a one-line summary there (bytes, tensors, time,
  rate, target, mode, device, where).

One module a command group, each with ``add_commands(subparsers)`` registering parsers whose defaults carry
``handler=<callable(args) -> int>``: :mod:`.convert` (convert, sample, inspect, demo), :mod:`.cache`
(cache ls/verify/gc/rm), :mod:`.serve` (serve), :mod:`.resolve` (resolve, health). Their imports are light
(the heavy modules load inside the handlers), so ``transformd resolve`` never imports torch. Exit codes and
the one-line error format are in :mod:`.common`, taken from each error's class (:mod:`transformd.errors`).
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from . import cache, convert, resolve, serve
from .common import EXIT_BAD_INPUT, EXIT_TERMINATED, Terminated, exit_code, fail

__all__ = ["build_parser", "main", "run"]

#: The command groups, in the order ``--help`` lists them.
COMMAND_MODULES = (convert, cache, serve, resolve)


def build_parser() -> argparse.ArgumentParser:
    """The ``transformd`` parser with every command."""
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="transformd",
        description="Convert MXFP8 checkpoints to 128x128 block FP8 (FNUZ or OCP e4m3).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        module.add_commands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``transformd`` script; returns the exit code."""
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # the subcommand's usage, not the top-level one (which names no flag of the command)
            _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exit_:  # argparse reports usage errors itself, with code 2
        return exit_.code if isinstance(exit_.code, int) else EXIT_BAD_INPUT
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return args.handler(args)
    except Terminated:
        return fail("terminated (SIGTERM)", EXIT_TERMINATED)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except Exception as err:
        code = exit_code(err)
        if code is None:
            raise
        return fail(err, code)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` ran (``cache ls``: ls's), following the chosen sub-parsers down."""
    while True:
        chosen = [(action, getattr(args, action.dest, None)) for action in parser._actions
                  if isinstance(action, argparse._SubParsersAction)]
        if not chosen or chosen[0][1] not in chosen[0][0].choices:
            return parser
        action, name = chosen[0]
        parser = action.choices[name]


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def run() -> NoReturn:
    """The ``transformd`` script and ``python -m transformd``: :func:`main`, then end the process at once.

    Once a command has returned, everything it wrote is closed, fsynced and renamed; what remains of a normal
    exit is the interpreter's teardown, which takes 0.5-0.65 s after ``import torch`` (``convert``, ``demo``):
    a quarter of a small conversion's whole process (2.5 -> 1.85 s on the 2-core CPU machine). So the atexit
    handlers run and the standard streams are flushed, then ``os._exit``; a command that left a non-daemon
    thread running exits normally, which waits for it.
    """
    code = main()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        raise SystemExit(code)
    atexit._run_exitfuncs()  # logging's flush, weakref finalizers, temporary directories
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # a closed pipe, a closed or missing stream
            pass
    os._exit(code)
