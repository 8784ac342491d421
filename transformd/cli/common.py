"""What every command shares: exit codes, the one-line error, the target and engine arguments."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TextIO

from .. import errors
from ..engines import TARGET_CHOICES, Engine
from ..errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILURE", "EXIT_OK", "EXIT_TERMINATED", "Terminated", "add_target_arguments",
           "exit_code", "fail", "missing_here", "non_negative_float", "positive_float", "positive_int", "shown",
           "visible"]

#: Exit status after SIGTERM (128 + 15, as a shell reports a process the signal ended).
EXIT_TERMINATED = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, as Ctrl-C's KeyboardInterrupt is (:func:`transformd.cli.main`):
    the same clean-ups run (before, the process died at once and left a conversion's staging directory behind)."""


def exit_code(err: BaseException) -> int | None:
    """The exit status for an error a command raised; None for a bug (the traceback is worth more than a line).

    transformd's own errors carry theirs (:mod:`transformd.errors`: 2 when the input or request is the problem,
    1 when something failed); other bad values are 2, other I/O failures 1.
    """
    if isinstance(err, errors.TransformdError):
        return errors.exit_code(err)
    if isinstance(err, (ValueError, FileExistsError)):
        return EXIT_BAD_INPUT
    if isinstance(err, (OSError, RuntimeError)):
        return EXIT_FAILURE
    return None


def fail(err: BaseException | str, code: int, stream: TextIO | None = None) -> int:
    """Print ``transformd: error: MESSAGE`` (one line) on standard error; return ``code``."""
    message = shown(err) or type(err).__name__  # one line, whatever the exception text holds
    print(f"transformd: error: {message}", file=stream or sys.stderr)
    return code


def shown(text: object) -> str:
    """``text`` on one line, fit for a terminal or a log: each run of whitespace one space, every other control
    character written as Python escapes it (``\\x1b``). Tensor and file names come from untrusted checkpoints, and
    messages from a daemon: neither may break a line or drive the terminal (move the cursor, clear the screen)."""
    return visible(" ".join(str(text).split()))


def visible(text: str) -> str:
    """``text`` with its lines kept and every other control character escaped (see :func:`shown`): for tables."""
    return "\n".join("".join(c if c.isprintable() else repr(c)[1:-1] for c in line) for line in text.split("\n"))


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """``--target`` and ``--engine``, shared by ``convert`` and ``resolve``."""
    parser.add_argument(
        "--target", choices=TARGET_CHOICES, default="auto",
        help="auto (default): ocp for vllm/sglang/transformers; for raw consumers fnuz on gfx94x, else ocp; nothing "
             "converted on GPUs with native MX (gfx950, NVIDIA 10.x+). fnuz: float8_e4m3fnuz (MI300-class kernels); "
             "ocp: float8_e4m3fn",
    )
    parser.add_argument(
        "--engine", choices=[e.value for e in Engine], default=None,
        help="who loads the output: picks the target for auto (and for sglang writes fused expert stacks per expert), "
             "and refuses a checkpoint that engine could not load at any tensor-parallel size. Default: "
             "$TRANSFORMD_ENGINE; with neither, a checkpoint some engine would load wrong without an error is refused; "
             "raw = transformd.loader or your own kernels (no check)",
    )


def missing_here(source: str) -> str | None:
    """The absolute path ``source`` names in the caller's own view when nothing is there (a typo), else None.

    The CLI runs as the caller, so before any advice about a daemon's roots or downloads it can say "no such
    directory". Only a name that is certainly absent counts (ENOENT, or a file where a directory was expected): a
    path the caller may not look into (EACCES) is left to the daemon's answer.
    """
    path = os.path.abspath(os.path.expanduser(source))
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return path
    except (OSError, ValueError):  # (EACCES, ELOOP, a NUL byte: not "absent")
        return None
    return None


def user_path(text: str) -> Path:
    """A path as a shell gives it (argparse's type): a leading ``~`` is the home directory (exec-form arguments,
    YAML and unit files pass it quoted; it named ``./~``)."""
    return Path(os.path.expanduser(text))


def positive_float(text: str) -> float:
    """A finite number of seconds above 0 (argparse's type)."""
    return _seconds(text, zero_ok=False)


def non_negative_float(text: str) -> float:
    """A finite number of seconds, 0 or more (argparse's type)."""
    return _seconds(text, zero_ok=True)


def _seconds(text: str, *, zero_ok: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not ((value >= 0) if zero_ok else (value > 0)) or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text} is not {'a number of seconds (0 or more)' if zero_ok else 'a positive number of seconds'}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value
