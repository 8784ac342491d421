"""The remote tier's errors: leaves of :class:`~transformd.errors.CacheError` (a tier that fails is an unavailable
cache, never the caller's input) and one :class:`~transformd.errors.BadRequestError` (a remote URL that cannot be).

::

    CacheError
    +-- RemoteError                      anything the tier could not do; the caller converts locally instead
        +-- RemoteUnavailableError       unreachable, slow past the timeouts, a server error
        +-- RemoteDeniedError            credentials absent, wrong or not allowed (one line, naming the remote)
        +-- RemoteCorruptError           an object differs from the manifest (size, digest) or a manifest is hostile
    BadRequestError
    +-- RemoteConfigError                ``--remote`` is not ``s3://BUCKET[/PREFIX]`` or ``file:///PATH``

Messages name the remote by its URL and the object; they never carry a credential.
"""

from __future__ import annotations

from ..errors import BadRequestError, CacheError


class RemoteError(CacheError):
    """The remote tier failed; nothing it fetched was kept."""

    code = "remote_unavailable"


class RemoteUnavailableError(RemoteError):
    pass


class RemoteDeniedError(RemoteError):
    code = "remote_denied"


class RemoteCorruptError(RemoteError):
    code = "remote_corrupt"


class RemoteConfigError(BadRequestError):
    pass
