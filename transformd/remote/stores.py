"""The two places the tier keeps entries: an S3 bucket (through obstore) and a shared directory (``file://``).

Both offer the few operations the tier needs (:class:`ObjectStore`); every failure of the store becomes a
:class:`~.errors.RemoteError` whose one-line message names the remote URL and the object, never a credential.
Names given to a store are the tier's own (:mod:`.names`), already checked.

S3: obstore's :class:`~obstore.store.S3Store` reads the standard AWS variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL``, ``AWS_REGION``, web identity for a
Kubernetes service account, the instance's metadata); a profile (``AWS_PROFILE`` or a shared credentials file)
is read through boto3 when it is installed. A server that answers a ranged GET with the whole object's status
(``200``, as ``rclone serve s3`` 1.75 does) is read one stream per file instead (obstore checks for ``206``, as it
should).

Bounds, as measured against ``rclone serve s3`` on loopback (a stopped server, and a link slowed to 0.5 MB/s by a
proxy). Every request: :data:`CONNECT_TIMEOUT_S` to connect, at most :data:`MAX_RETRIES` retries within
:data:`RETRY_TIMEOUT_S`. A read: :data:`READ_TIMEOUT_S` without a byte (obstore's ``read_timeout``, which starts
again with each read of an answer), and no ceiling on its whole length: a file read as one stream (a server
without ranges) lasts as long as the file takes (obstore's default ``timeout``, 30 s for every request, cut such a
stream mid-file: a 64 MiB stream read over 40 s ended at 30.5 s). A write: obstore has no bound on the progress of
a send (its ``read_timeout`` runs from the request's start to the answer's first byte: a 10 MiB PUT taking 21.8 s
at 0.5 MB/s failed under a 5 s one and passed under 60 s), so each write request gets one ceiling,
:data:`WRITE_TIMEOUT_S`, as its ``timeout`` and its ``read_timeout``. A request is one part of :data:`PART_BYTES`
(or a small object), never a whole file, so the bound is per 32 MiB sent, whatever the shard's size. Before, both
were 30 s: with up to ``FILES_AT_ONCE`` (:mod:`.publish`) x :data:`UPLOAD_CONCURRENCY` = 32 parts in flight (1 GiB),
a link slower than about 36 MB/s failed every large upload (a 20 MiB PUT at 0.5 MB/s was cut at 30.0 s). At 300 s
those 32 parts need about 3.6 MB/s; a server that stops reading fails the part after 300 s, then the multipart
upload's abort after at most 300 s more; the upload is then a failure of the tier (counted, logged once, the entry
stays local, no manifest written).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from .._durable import temporary_beside
from .errors import RemoteConfigError, RemoteCorruptError, RemoteDeniedError, RemoteError, RemoteUnavailableError

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0
#: The longest one write request (a part, or a small object) may take (see the module).
WRITE_TIMEOUT_S = 300.0
#: obstore's ``timeout`` of reads: none in effect (a day); :data:`READ_TIMEOUT_S` bounds them.
_READ_CEILING = timedelta(days=1)
MAX_RETRIES = 2
RETRY_TIMEOUT_S = 20.0
#: Files at least this large are uploaded in parts of this size (multipart).
PART_BYTES = 32 << 20
UPLOAD_CONCURRENCY = 8


class NotPartialError(RemoteError):
    """The server answered a ranged read with the whole object's status: read the object as one stream."""


class ObjectStore(Protocol):
    url: str

    def size(self, name: str) -> int | None:
        """The size of object ``name``; None when there is none."""

    def read_bytes(self, name: str, limit: int) -> bytes | None:
        """Object ``name`` whole (at most ``limit`` bytes, else :class:`RemoteCorruptError`); None when absent."""

    def read_range(self, name: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of object ``name``; :class:`NotPartialError` where the server cannot."""

    def read_stream(self, name: str) -> Iterator[memoryview]:
        """Object ``name`` from its start, in chunks."""

    def write_file(self, name: str, path: Path) -> None:
        """Upload the file at ``path`` (in parts when large); replaces an object of that name."""

    def write_bytes(self, name: str, data: bytes, *, create: bool) -> bool:
        """Write ``data``; with ``create``, only where no object of that name is (False then) when the store can
        tell, else it replaces it."""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split("Debug source:")[0].split())
    return text[:400] or type(e).__name__


def _s3_error(url: str, name: str, e: BaseException, doing: str) -> RemoteError:
    from obstore import exceptions as ox

    where = f"remote {url}: {doing} {name}"
    text = _one_line(e)
    if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError)) or any(
        s in text for s in ("403 Forbidden", "401 Unauthorized", "SignatureDoesNotMatch", "InvalidAccessKeyId",
                            "AccessDenied")
    ):
        return RemoteDeniedError(f"{where}: access denied (check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the "
                                 f"profile, and the bucket's policy): {text}")
    if "non-partial response" in text or "NotPartial" in str(e):
        return NotPartialError(f"{where}: the server does not answer ranged reads")
    return RemoteUnavailableError(f"{where}: {text}")


class S3ObjectStore:
    """``s3://BUCKET/PREFIX`` through obstore (see the module)."""

    def __init__(self, url: str, bucket: str, prefix: str, *, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 read_timeout_s: float = READ_TIMEOUT_S, write_timeout_s: float = WRITE_TIMEOUT_S):
        from obstore.store import S3Store

        self.url = url
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
        client: dict[str, Any] = {
            "connect_timeout": timedelta(seconds=connect_timeout_s),
            "read_timeout": timedelta(seconds=read_timeout_s),
            "timeout": _READ_CEILING,
            "allow_http": endpoint.startswith("http://"),
        }
        retry: dict[str, Any] = {
            "max_retries": MAX_RETRIES,
            "retry_timeout": timedelta(seconds=min(RETRY_TIMEOUT_S, 4 * (connect_timeout_s + read_timeout_s))),
            "backoff": {"init_backoff": timedelta(seconds=0.2), "max_backoff": timedelta(seconds=2), "base": 2},
        }
        config: dict[str, Any] = {}
        if endpoint:
            config["endpoint"] = endpoint
        provider = _profile_credentials(url)
        if provider is None and not _has_credentials():
            raise RemoteDeniedError(
                f"remote {url}: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a "
                "web identity (AWS_WEB_IDENTITY_TOKEN_FILE); the instance's metadata is disabled "
                "(AWS_EC2_METADATA_DISABLED)")
        try:
            self._store = S3Store(bucket, prefix=prefix or None, config=config, client_options=client,
                                  retry_config=retry, credential_provider=provider)
            self._writer = S3Store(bucket, prefix=prefix or None, config=config, retry_config=retry,
                                   client_options={**client, "timeout": timedelta(seconds=write_timeout_s),
                                                   "read_timeout": timedelta(seconds=write_timeout_s)},
                                   credential_provider=provider)  # (the same client, a write's bounds: see above)
        except Exception as e:  # noqa: BLE001 - obstore's configuration errors
            raise RemoteConfigError(f"remote {url}: {_one_line(e)}") from None

    def size(self, name: str) -> int | None:
        import obstore

        try:
            return int(obstore.head(self._store, name)["size"])
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - obstore's errors, mapped
            raise _s3_error(self.url, name, e, "reading") from None

    def read_bytes(self, name: str, limit: int) -> bytes | None:
        import obstore

        try:
            got = obstore.get(self._store, name)
            if got.meta["size"] > limit:
                raise RemoteCorruptError(f"remote {self.url}: {name} is {got.meta['size']} bytes, more than "
                                         f"{limit} that it may have")
            return bytes(got.bytes())
        except FileNotFoundError:
            return None
        except RemoteError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _s3_error(self.url, name, e, "reading") from None

    def read_range(self, name: str, start: int, end: int) -> memoryview:
        import obstore

        try:
            return memoryview(obstore.get_range(self._store, name, start=start, end=end))
        except FileNotFoundError:
            raise RemoteCorruptError(f"remote {self.url}: {name} is missing (its manifest lists it)") from None
        except Exception as e:  # noqa: BLE001
            raise _s3_error(self.url, name, e, "reading") from None

    def read_stream(self, name: str) -> Iterator[memoryview]:
        import obstore

        try:
            for chunk in obstore.get(self._store, name).stream(min_chunk_size=8 << 20):
                yield memoryview(chunk)
        except FileNotFoundError:
            raise RemoteCorruptError(f"remote {self.url}: {name} is missing (its manifest lists it)") from None
        except Exception as e:  # noqa: BLE001
            raise _s3_error(self.url, name, e, "reading") from None

    def write_file(self, name: str, path: Path) -> None:
        import obstore

        try:
            obstore.put(self._writer, name, Path(path), chunk_size=PART_BYTES, max_concurrency=UPLOAD_CONCURRENCY)
        except Exception as e:  # noqa: BLE001
            raise _s3_error(self.url, name, e, "writing") from None

    def write_bytes(self, name: str, data: bytes, *, create: bool) -> bool:
        import obstore
        from obstore import exceptions as ox

        try:
            obstore.put(self._writer, name, data, mode="create" if create else "overwrite", use_multipart=False)
            return True
        except (ox.AlreadyExistsError, ox.PreconditionError):
            return False
        except Exception as e:  # noqa: BLE001
            raise _s3_error(self.url, name, e, "writing") from None


def _has_credentials() -> bool:
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return True
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE") or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get(
            "AWS_CONTAINER_CREDENTIALS_FULL_URI") or env.get("AWS_SKIP_SIGNATURE", "").lower() == "true":
        return True
    return env.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true"  # (the instance's role, the chain's last)


def _profile_credentials(url: str) -> Any:
    """boto3's credentials of ``AWS_PROFILE`` or of the shared credentials file, when no key is in the environment;
    else None (obstore reads the environment itself)."""
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID"):
        return None
    shared = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or Path.home() / ".aws" / "credentials")
    if not env.get("AWS_PROFILE") and not (shared.is_file() and shared.stat().st_size):
        return None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        raise RemoteConfigError(f"remote {url}: AWS profiles are read through boto3, which is not installed "
                                "(pip install boto3), or set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY") from None
    try:
        return Boto3CredentialProvider(boto3.Session(profile_name=env.get("AWS_PROFILE") or None))
    except Exception as e:  # noqa: BLE001 - a missing profile, no credentials in it
        raise RemoteDeniedError(f"remote {url}: no credentials from the AWS profile: {_one_line(e)}") from None


class FileObjectStore:
    """``file:///PATH``: objects are files under a directory shared by the nodes (NFS, a test's directory)."""

    def __init__(self, url: str, root: Path):
        self.url, self.root = url, root
        if not root.is_dir():
            raise RemoteUnavailableError(f"remote {url}: {root} is not a directory")

    def _path(self, name: str) -> Path:
        return self.root / name

    def size(self, name: str) -> int | None:
        try:
            return os.stat(self._path(name)).st_size
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error(name, e) from None

    def read_bytes(self, name: str, limit: int) -> bytes | None:
        try:
            with open(self._path(name), "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error(name, e) from None
        if len(data) > limit:
            raise RemoteCorruptError(f"remote {self.url}: {name} is more than {limit} bytes")
        return data

    def read_range(self, name: str, start: int, end: int) -> memoryview:
        try:
            with open(self._path(name), "rb") as f:
                return memoryview(os.pread(f.fileno(), end - start, start))
        except FileNotFoundError:
            raise RemoteCorruptError(f"remote {self.url}: {name} is missing (its manifest lists it)") from None
        except OSError as e:
            raise self._error(name, e) from None

    def read_stream(self, name: str) -> Iterator[memoryview]:
        try:
            with open(self._path(name), "rb") as f:
                while chunk := f.read(8 << 20):
                    yield memoryview(chunk)
        except FileNotFoundError:
            raise RemoteCorruptError(f"remote {self.url}: {name} is missing (its manifest lists it)") from None
        except OSError as e:
            raise self._error(name, e) from None

    def write_file(self, name: str, path: Path) -> None:
        with open(path, "rb") as f:
            self._write(name, lambda out: _copy(f, out), create=False)

    def write_bytes(self, name: str, data: bytes, *, create: bool) -> bool:
        return self._write(name, lambda out: out.write(data), create=create)

    def _write(self, name: str, fill: Any, *, create: bool) -> bool:
        dest = self._path(name)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = temporary_beside(dest)
            try:
                with open(tmp, "xb") as out:
                    fill(out)
                    out.flush()
                    os.fsync(out.fileno())
                if not create:
                    os.replace(tmp, dest)
                    return True
                try:
                    os.link(tmp, dest)  # (fails where a file is: the first writer's stays)
                    return True
                except FileExistsError:
                    return False
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        except OSError as e:
            raise self._error(name, e) from None

    def _error(self, name: str, e: OSError) -> RemoteError:
        cls = RemoteDeniedError if isinstance(e, PermissionError) else RemoteUnavailableError
        return cls(f"remote {self.url}: {name}: {e.strerror or e}")


def _copy(src: Any, out: Any) -> None:
    while chunk := src.read(8 << 20):
        out.write(chunk)
