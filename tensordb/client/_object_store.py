"""Objects in S3 and S3-compatible stores, read with parallel ranged GETs (botocore).

``storage_options`` follows the fsspec / s3fs convention: ``key``, ``secret``, ``token``,
``anon``, ``endpoint_url``, ``client_kwargs`` (passed to the botocore client, e.g.
``region_name``) and ``config_kwargs`` (to ``botocore.config.Config``), plus
``max_concurrency`` (GETs in flight, default 16) and ``part_size`` (bytes per GET,
default 8 MiB). Credentials come from those options or from the standard environment
(``AWS_ACCESS_KEY_ID`` and its kin, the shared config files), nowhere else: the
instance-metadata lookup is off, so a host without credentials fails at once instead
of waiting on a link-local address.

Every GET names the object's ETag (``If-Match``), so an object replaced during an import
is refused, never mixed. The object store's errors are the store's: a missing bucket or
key ``NotFound``, a denied one ``Unauthorized``, an object that changed or ends early
``CorruptData``, an endpoint that does not answer ``NodeUnavailable``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from storage_engine import add_work
from tensordb.errors import CorruptData, InvalidInput, NodeUnavailable, NotFound, Unauthorized

__all__ = ["OBJECT_SCHEMES", "ObjectInfo", "ObjectPath", "ObjectStore", "is_object_url"]

OBJECT_SCHEMES = ("s3://",)
_OPTIONS = {"key", "secret", "token", "anon", "endpoint_url", "client_kwargs",
            "config_kwargs", "max_concurrency", "part_size"}
_MISSING = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch",
           "ExpiredToken", "InvalidToken", "AllAccessDisabled", "AccountProblem"}
_CHANGED = {"PreconditionFailed", "412"}
_SHORT = {"InvalidRange", "416"}


def is_object_url(path: object) -> bool:
    return isinstance(path, str) and path.startswith(OBJECT_SCHEMES)


class ObjectPath(PurePosixPath):
    """An object's name as a path (``.name``, ``.parent``), shown as its URL."""

    def __str__(self) -> str:
        return "s3://" + super().__str__()


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    path: ObjectPath


class ObjectStore:
    """One bucket of an S3 API endpoint, and a pool of ``max_concurrency`` threads for
    its GETs. A context manager: leaving it shuts the pool down."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None) -> None:
        if not is_object_url(url):
            raise InvalidInput(f"{url!r} is not an object URL ({', '.join(OBJECT_SCHEMES)})")
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise InvalidInput(f"{url!r} names no bucket")
        self.url, self.bucket, self.prefix = url, bucket, prefix
        opts = dict(storage_options or {})
        unknown = sorted(set(opts) - _OPTIONS)
        if unknown:
            raise InvalidInput(f"storage_options {unknown} are not known; known: "
                               f"{sorted(_OPTIONS)}")
        self.max_concurrency = _positive(opts.pop("max_concurrency", 16), "max_concurrency")
        self.part_size = _positive(opts.pop("part_size", 8 << 20), "part_size")
        try:
            import boto3
            from botocore import UNSIGNED
            from botocore.config import Config
        except ImportError:
            raise InvalidInput("reading s3:// needs boto3: pip install 'tensordb[s3]'") \
                from None
        for what in ("client_kwargs", "config_kwargs"):
            if not isinstance(opts.get(what, {}), Mapping):
                raise InvalidInput(f"storage_options[{what!r}] must be a mapping")
        client_kwargs = dict(opts.get("client_kwargs") or {})
        config_kwargs = {"retries": {"mode": "standard", "max_attempts": 3},
                         "connect_timeout": 5, "read_timeout": 60,
                         **dict(opts.get("config_kwargs") or {})}
        config_kwargs["max_pool_connections"] = self.max_concurrency
        if opts.get("anon"):
            config_kwargs["signature_version"] = UNSIGNED
        if opts.get("endpoint_url") is not None:
            client_kwargs["endpoint_url"] = opts["endpoint_url"]
        # credentials: the options, else the environment and shared files; never the
        # instance-metadata service (a host off a cloud would wait on it)
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        try:
            session = boto3.session.Session(aws_access_key_id=opts.get("key"),
                                            aws_secret_access_key=opts.get("secret"),
                                            aws_session_token=opts.get("token"))
            self._client = session.client("s3", config=Config(**config_kwargs),
                                          **client_kwargs)
        except Exception as exc:  # botocore's errors for bad settings are many
            raise InvalidInput(f"{url}: cannot make an S3 client from storage_options: "
                               f"{exc}") from None
        self.endpoint = self._client.meta.endpoint_url
        self._pool = ThreadPoolExecutor(self.max_concurrency, "tensordb-s3")
        self._prefetched: dict[str, Future[Any]] = {}

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    @property
    def pool(self) -> ThreadPoolExecutor:
        return self._pool

    def prefetch(self, key: str, fn: Callable[[], Any]) -> None:
        """Start ``fn`` (a read of ``key``) on the pool now; ``prefetched`` hands it out."""
        self._prefetched[key] = self._pool.submit(fn)

    def prefetched(self, key: str) -> Future[Any] | None:
        return self._prefetched.pop(key, None)

    def _path(self, key: str) -> ObjectPath:
        return ObjectPath(f"{self.bucket}/{key}")

    @contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """The object store's failures as the store's errors, naming ``what``."""
        from botocore import exceptions as bx

        try:
            yield
        except bx.ClientError as exc:
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            msg = f"{what}: {code or status} {err.get('Message', '')}".rstrip()
            if code in _MISSING or (not code and status == "404"):
                raise NotFound(msg) from None
            if code in _DENIED or (not code and status == "403"):
                raise Unauthorized(msg) from None
            if code in _CHANGED:
                raise CorruptData(f"{what} changed during the import (its ETag is no longer "
                                  f"the one read at the start): {msg}") from None
            if code in _SHORT:
                raise CorruptData(f"{what} is shorter than its header says: {msg}") from None
            if status.startswith("5") or code in {"SlowDown", "ServiceUnavailable"}:
                raise NodeUnavailable(f"{self.endpoint} failed: {msg}") from None
            raise InvalidInput(msg) from None
        except bx.NoCredentialsError:
            raise Unauthorized(f"{what}: no credentials: give key and secret in "
                               f"storage_options, or set AWS_ACCESS_KEY_ID and "
                               f"AWS_SECRET_ACCESS_KEY (or anon=True for a public bucket)") \
                from None
        except (bx.EndpointConnectionError, bx.ConnectionClosedError, bx.ReadTimeoutError,
                bx.ConnectTimeoutError, bx.ResponseStreamingError, bx.IncompleteReadError,
                bx.HTTPClientError) as exc:  # the connection went, or never came
            raise NodeUnavailable(f"{what}: the object store at {self.endpoint} does not "
                                  f"answer: {exc}") from None

    def head(self, key: str) -> ObjectInfo:
        with self.errors(str(self._path(key))):
            r = self._client.head_object(Bucket=self.bucket, Key=key)
        return ObjectInfo(key, int(r["ContentLength"]), str(r["ETag"]), self._path(key))

    def children(self, prefix: str) -> list[ObjectInfo]:
        """The objects right under ``prefix`` (a folder: ``prefix`` ends with ``/``)."""
        out: list[ObjectInfo] = []
        with self.errors(str(self._path(prefix))):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter="/")
            for page in pages:
                for o in page.get("Contents", []):
                    out.append(ObjectInfo(o["Key"], int(o["Size"]), str(o["ETag"]),
                                          self._path(o["Key"])))
        return out

    def read(self, obj: ObjectInfo, offset: int, n: int, what: str) -> bytes:
        """``n`` bytes of ``obj`` from ``offset`` (a header, an index): CorruptData when
        the object ends first."""
        buf = bytearray(n)
        self.read_into(obj, offset, memoryview(buf), what)
        return bytes(buf)

    def read_into(self, obj: ObjectInfo, offset: int, dst: memoryview | Any,
                  what: str = "") -> None:
        """Fill ``dst`` (a writable buffer) with ``obj``'s bytes from ``offset``: one
        ranged GET, streamed into it."""
        view = memoryview(dst).cast("B")
        self._get(obj, offset, view.nbytes, what, lambda done: view[done:], None)

    def read_stream(self, obj: ObjectInfo, offset: int, nbytes: int, buf: memoryview,
                    put: Callable[[int, memoryview], None], what: str = "") -> None:
        """``nbytes`` of ``obj`` from ``offset`` through ``buf``: one ranged GET, each
        piece handed to ``put(position in the range, bytes)``."""
        self._get(obj, offset, nbytes, what, lambda done: buf[:min(buf.nbytes, nbytes - done)],
                  put)

    def _get(self, obj: ObjectInfo, offset: int, n: int, what: str,
             room: Callable[[int], memoryview],
             put: Callable[[int, memoryview], None] | None) -> None:
        if n == 0:
            return
        where = f"{obj.path} ({what})" if what else str(obj.path)
        done = 0
        with self.errors(where):
            r = self._client.get_object(Bucket=self.bucket, Key=obj.key, IfMatch=obj.etag,
                                        Range=f"bytes={offset}-{offset + n - 1}")
            body = r["Body"]
            try:
                while done < n:
                    space = room(done)
                    got = body.readinto(space)
                    if not got:
                        break
                    if put is not None:
                        put(done, space[:got])
                    done += got
            finally:
                body.close()
        add_work("object_bytes_fetched", done)
        if done < n:
            raise CorruptData(f"{where}: the object ends inside the range (read {done} of "
                              f"{n} bytes from offset {offset})")


def _positive(v: object, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise InvalidInput(f"storage_options[{what!r}] must be a positive int, not {v!r}")
    return v
