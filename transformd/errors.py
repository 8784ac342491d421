"""Every error transformd raises on purpose, in one tree rooted at :class:`TransformdError`.

Each class states, once, how it reaches a user: ``code`` (stable, machine-readable, the API's
``error.code``), ``http_status`` (the daemon's answer) and ``exit_code`` (the CLI's exit status:
2 when the input or the request is the problem, 1 when something failed). The daemon maps an
exception to its answer with :func:`http_error`, the CLI to its exit status with
:func:`exit_code`, and the client raises the same classes from the daemon's answers
(:meth:`TransformdError.from_answer`), so ``except CacheFullError`` works on both sides.

::

    TransformdError                      500 internal_error       exit 1
    +-- BadRequestError (ValueError)     400 bad_request          exit 2   settings, select, cache keys, ...
    +-- UnauthorizedError                401 unauthorized         exit 2
    +-- NotAllowedError                  403 permission_denied    exit 2   source outside the roots, unreadable
    +-- NotFoundError (LookupError)      404 not_found            exit 2   source, entry, file, lease
    +-- ConflictError                    409 conflict             exit 2   leased entry, source changed
    +-- SourceError (ValueError)         422 invalid_source       exit 2   the source directory (see cache.securefs)
    |   +-- SourceChangedError           409 source_changed               (also a ConflictError)
    +-- InvalidCheckpointError (ValueError) 422 invalid_checkpoint exit 2
    |   +-- CheckpointError               (names the file and the tensor)
    |       +-- MxFormatError             (a weight/scale pair breaks the MXFP8 contract)
    +-- ConversionFailedError            422 or 500               a conversion that ran (elsewhere) failed
    +-- CacheError                       503 cache_unavailable    exit 1
    |   +-- CacheFullError               507 cache_full
    |   |   +-- DiskFullError            507 disk_full
    |   +-- CacheTimeoutError            504 timeout
    +-- OutputError (OSError)            the ``--out`` directory cannot be written
    +-- DaemonUnavailableError           no answer from the daemon (client side)
    +-- ResolveTimeoutError              the client gave up waiting (client side)
    +-- ServerError                      another 5xx answer (client side)

Modules add leaves where they raise them (``cache.securefs``, ``cache.errors``, ``hub``, ``daemon.settings``),
always under these classes, so the mapping below covers them without knowing them.

This module imports nothing heavy: the client and the CLI's thin commands import it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

EXIT_OK = 0
#: Something failed that is not the caller's input: the daemon, the disk, the cache.
EXIT_FAILURE = 1
#: The input or the request is the problem (bad checkpoint, bad arguments, not allowed, not found).
EXIT_BAD_INPUT = 2

#: Longest message an answer carries (a converter's message can quote a lot).
MAX_MESSAGE_CHARS = 4000


class TransformdError(Exception):
    """Root of transformd's errors. ``status``/``code`` of an instance: the daemon's answer it came from
    (client side), else the class's own ``http_status``/``code``."""

    code: ClassVar[str] = "internal_error"
    http_status: ClassVar[int] = 500
    exit_code: ClassVar[int] = EXIT_FAILURE
    #: HTTP status of the daemon's answer this error was raised from (client side); None when raised here.
    status: int | None = None
    #: Seconds the daemon asked to wait before retrying (its ``Retry-After`` header), if any.
    retry_after: float | None = None

    def __init__(self, message: str = "", *args: Any) -> None:
        super().__init__(message, *args)
        self.message = str(message)

    def __str__(self) -> str:
        if self.status is None:
            return self.message or type(self).__name__
        code = self.__dict__.get("code")
        return f"{self.message or type(self).__name__} (HTTP {self.status}" + (f", {code})" if code else ")")

    @property
    def is_client_error(self) -> bool:
        """True when the request (the source, its recipe, the key) is the problem: a 4xx."""
        return 400 <= (self.status or self.http_status) < 500

    def api_status(self) -> int:
        """The HTTP status the daemon answers with (a class may decide per instance)."""
        return self.http_status

    def api_code(self) -> str:
        return self.code

    def api_message(self) -> str:
        """The message of the daemon's answer (a class may add advice that only fits the API)."""
        return str(self)

    @classmethod
    def from_answer(cls, message: str, *, status: int | None, code: str | None) -> TransformdError:
        """This class, raised by the client from the daemon's answer (``status``, ``code``, ``message``)."""
        err = cls.__new__(cls)
        TransformdError.__init__(err, " ".join(str(message).split()))
        err.status = status
        if code:
            err.code = code  # instance attribute: the daemon's code for this answer
        return err


class BadRequestError(TransformdError, ValueError):
    code, http_status, exit_code = "bad_request", 400, EXIT_BAD_INPUT


class UnauthorizedError(TransformdError):
    code, http_status, exit_code = "unauthorized", 401, EXIT_BAD_INPUT


class NotAllowedError(TransformdError):
    """The caller (or the daemon) may not use this source: outside the allowed roots, or unreadable."""

    code, http_status, exit_code = "permission_denied", 403, EXIT_BAD_INPUT


class NotFoundError(TransformdError, LookupError):
    code, http_status, exit_code = "not_found", 404, EXIT_BAD_INPUT

    def __str__(self) -> str:  # LookupError would otherwise quote the message like a KeyError
        return TransformdError.__str__(self)


class ConflictError(TransformdError):
    code, http_status, exit_code = "conflict", 409, EXIT_BAD_INPUT


class SourceError(TransformdError, ValueError):
    """The source checkpoint directory is missing, empty, unreadable, or not what the request may use."""

    code, http_status, exit_code = "invalid_source", 422, EXIT_BAD_INPUT


class SourceChangedError(ConflictError, SourceError):
    """The source changed while it was read or converted; the result was discarded."""

    code = "source_changed"

    def api_message(self) -> str:
        return f"{self}; POST the checkpoint again once it is complete"


class InvalidCheckpointError(TransformdError, ValueError):
    """The source is not a convertible MXFP8 checkpoint."""

    code, http_status, exit_code = "invalid_checkpoint", 422, EXIT_BAD_INPUT

    def api_message(self) -> str:
        return f"invalid checkpoint: {self}"


class CheckpointError(InvalidCheckpointError):
    """A checkpoint file or directory is malformed or cannot be converted as asked.

    The message names the file, the tensor and the problem, so an operator can act on it without reading code.
    """

    def __init__(self, problem: str, *, file: str | os.PathLike[str] | None = None, tensor: str | None = None):
        self.problem = problem
        self.file = str(file) if file is not None else None
        self.tensor = tensor
        parts = (f"file {self.file}" if self.file else "", f"tensor {tensor}" if tensor else "")
        where = ", ".join(p for p in parts if p)
        super().__init__(f"{where}: {problem}" if where else problem)


class MxFormatError(CheckpointError):
    """An input tensor pair breaks the MXFP8 contract (message: file, tensor, problem)."""

    def __init__(self, problem: str, *, tensor: str | None = None, file: str | None = None):
        super().__init__(problem, file=file, tensor=tensor)

    def located(self, *, tensor: str | None = None, file: str | None = None) -> MxFormatError:
        """The same error with a file and tensor name filled in where they were missing."""
        return MxFormatError(self.problem, tensor=self.tensor or tensor, file=self.file or file)


def is_invalid_input(error_type: str | None) -> bool:
    """Whether the error class named ``error_type`` (as a failure record keeps it: another process failed on the
    checkpoint) means the checkpoint itself is the problem: an :class:`InvalidCheckpointError` or a
    :class:`SourceError`, or a leaf of either defined anywhere."""
    todo: list[type[BaseException]] = [InvalidCheckpointError, SourceError]
    while todo:
        cls = todo.pop()
        if cls.__name__ == error_type:
            return True
        todo.extend(cls.__subclasses__())
    return False


class ConversionFailedError(TransformdError):
    """A conversion ran and failed: another process' conversion this one waited for, or the daemon's.

    ``error_type`` is the class name of the original exception (e.g. ``MxFormatError``), so a caller can tell
    invalid input (answered 422) from an infrastructure failure (500); ``detail`` is its message.
    """

    code = "conversion_failed"
    key: str | None = None
    error_type: str | None = None
    detail: str = ""

    def __init__(self, message: str, *, key: str | None = None, error_type: str | None = None, detail: str = ""):
        super().__init__(message)
        self.key, self.error_type, self.detail = key, error_type, detail

    def api_status(self) -> int:
        return 422 if is_invalid_input(self.error_type) else 500

    def api_code(self) -> str:
        return "invalid_checkpoint" if is_invalid_input(self.error_type) else self.code

    def api_message(self) -> str:
        return f"invalid checkpoint: {self.detail}" if is_invalid_input(self.error_type) else str(self)


class CacheError(TransformdError):
    """The cache cannot be used (its directory, its files), or a cache operation failed."""

    code, http_status, exit_code = "cache_unavailable", 503, EXIT_FAILURE

    def api_message(self) -> str:
        return f"the cache cannot be used: {self}"


class CacheFullError(CacheError):
    """A conversion needs more room than the cache can make without evicting leased entries.

    Raised before anything was evicted or written: the cache is left as it was.
    The numbers are attributes, so the daemon can report them (HTTP 507).
    """

    code, http_status = "cache_full", 507
    root: Path | None = None
    needed_bytes = budget_bytes = used_bytes = leased_bytes = 0
    free_bytes: int | None = None

    def __init__(
        self,
        message: str,
        *,
        root: Path,
        needed_bytes: int,
        budget_bytes: int,
        used_bytes: int,
        leased_bytes: int = 0,
        free_bytes: int | None = None,
    ):
        super().__init__(message)
        self.root = root
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes
        self.used_bytes = used_bytes
        self.leased_bytes = leased_bytes
        self.free_bytes = free_bytes

    def api_message(self) -> str:
        return str(self)


class DiskFullError(CacheFullError):
    """The file system of the cache ran out of space (ENOSPC/EDQUOT) during a conversion or its publish.

    The staging directory was removed; every existing entry is intact.
    """

    code = "disk_full"


class CacheTimeoutError(CacheError, TimeoutError):
    """Waiting for another process' conversion took longer than the caller's timeout."""

    code, http_status = "timeout", 504

    def api_message(self) -> str:
        return str(self)


class OutputError(TransformdError, OSError):
    """The output directory cannot be written: too little free space (checked before anything is written, and
    ENOSPC/EDQUOT while writing), a read-only file system, no permission.

    An :class:`OSError` with the original ``errno``; the message names the output directory the caller gave
    (never the hidden staging directory beside it) and, for space, the bytes needed and free.
    """

    code = "output_error"

    def __init__(self, errno_: int, message: str, *, out: Path, needed_bytes: int | None = None,
                 free_bytes: int | None = None):
        OSError.__init__(self, errno_, message)
        self.message = message
        self.out = out
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes

    def __str__(self) -> str:
        return str(self.strerror)


class DaemonUnavailableError(TransformdError):
    """The daemon could not be reached (no socket, connection refused, timed out)."""

    code = "daemon_unavailable"


class ResolveTimeoutError(TransformdError, TimeoutError):
    """The client gave up waiting (its ``timeout``); the conversion goes on in the daemon."""

    code = "timeout"


class ServerError(TransformdError):
    """The daemon answered with a 5xx that no other class names: it failed."""


def exit_code(err: BaseException) -> int:
    """The CLI's exit status for ``err``: the class's own, or 1 for anything transformd did not raise on purpose."""
    if isinstance(err, TransformdError):
        return EXIT_BAD_INPUT if err.status is not None and err.is_client_error else err.exit_code
    return EXIT_FAILURE


def error_class(status: int) -> type[TransformdError]:
    """The class the client raises for an answer with HTTP ``status`` (the daemon's code rides on the instance)."""
    for cls in (BadRequestError, UnauthorizedError, NotAllowedError, NotFoundError, ConflictError,
                InvalidCheckpointError, CacheFullError):
        if cls.http_status == status:
            return cls
    return ServerError if status >= 500 else TransformdError
