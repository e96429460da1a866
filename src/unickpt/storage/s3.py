"""``s3://bucket/prefix``: the storage protocol on an S3 object store (AWS, MinIO, SeaweedFS ...).

Built on s3fs for what it is good at (credentials, endpoint and region from ``StorageOptions
.client_options`` or the standard ``AWS_*`` variables, one asyncio event loop per process, the
aiobotocore client) and on that client directly for every request, so that unickpt sees S3's
own error codes and owns the only retry loop (``storage.retry``; botocore and s3fs are told not
to retry).

Threads: the engine calls the protocol methods from many threads; each one submits its
requests to the file system's event loop (``fsspec.asyn.sync``), where they run concurrently.

- ``write``: one ``PutObject`` up to ``part_size``; larger files as a multipart upload whose
  parts (``part_size`` bytes, S3's minimum is 5 MiB) are uploaded ``max_concurrency`` at a time
  from zero-copy readers over the caller's buffers; the upload is completed with
  ``If-None-Match: *`` so an existing object is never replaced, and aborted on any failure (no
  object, no dangling parts).
- ``read_into``: ranged ``GetObject`` requests of ``part_size`` bytes, in parallel, each copied
  straight into its slice of ``out``.
- ``create_exclusive``: ``PutObject`` with ``If-None-Match: *`` (412 -> False: exactly one of
  concurrent creators wins, across hosts); ``update_exclusive``: read, compare, ``PutObject``
  with ``If-Match: <etag>``.
- No rename: publication is one atomic ``put`` (``folder.publish.PutPublisher``), metadata last.
- ``list``: ``ListObjectsV2`` pages of at most 1000 keys under the narrowest prefix asked;
  ``delete``: ``DeleteObjects`` in batches of 1000.

Errors: HTTP 5xx / 429 / throttling codes and connection failures become
``TransientStorageError`` (retried by ``storage.retry``); 404 is a value (None / [] / False, or
``MissingDataFileError`` for data reads); 403 -> ``StorageError(EACCES)``; a missing bucket ->
``StorageError(ENOENT)``; everything else ``StorageError(EIO)`` naming the request, the object
and S3's error code.
"""

from __future__ import annotations

import asyncio
import errno
import io
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from ..errors import (
    MissingDataFileError,
    SizeLimitError,
    StorageError,
    TransientStorageError,
    TruncatedDataFileError,
)
from .base import (
    METADATA_LIMIT,
    Buffer,
    StorageCapabilities,
    check_name,
    check_prefix,
    exists_error,
    read_spans,
    size_limit_error,
    translated,
    truncated_error,
    unsupported_error,
)
from .options import StorageOptions

__all__ = ["S3Storage", "CAPABILITIES", "SpanReader"]

T = TypeVar("T")

CAPABILITIES = StorageCapabilities(
    atomic_put=True,
    atomic_rename=False,
    rename_replaces=False,
    conditional_create=True,
    needs_sync=False,
    shared_page_cache=False,
)

_DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "ErrTooManyRequest",
        "ConditionalRequestConflict",  # 409: a concurrent conditional write is in progress
        "OperationAborted",
    }
)


class SpanReader(io.RawIOBase):
    """A seekable, readable file over bytes ``[start, end)`` of the concatenation of ``parts``,
    without copying them (botocore refuses memoryview bodies but takes a file)."""

    def __init__(self, parts: Sequence[memoryview], start: int, end: int) -> None:
        super().__init__()
        self._parts = parts
        self._start, self._end, self._pos = start, end, 0
        offsets, at = [], 0
        for p in parts:
            offsets.append(at)
            at += len(p)
        self._offsets = offsets

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        size = self._end - self._start
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: size}[whence]
        self._pos = max(0, min(size, base + offset))
        return self._pos

    def readinto(self, buf: Any) -> int:
        out = memoryview(buf).cast("B")
        done = 0
        at = self._start + self._pos
        while done < len(out) and at < self._end:
            i = _part_at(self._offsets, at)
            part = self._parts[i]
            inner = at - self._offsets[i]
            n = min(len(out) - done, len(part) - inner, self._end - at)
            out[done : done + n] = part[inner : inner + n]
            done += n
            at += n
        self._pos += done
        return done

    def __len__(self) -> int:
        return self._end - self._start


def _part_at(offsets: list[int], at: int) -> int:
    lo, hi = 0, len(offsets) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offsets[mid] <= at:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _client_error_parts(e: BaseException) -> tuple[str, int] | None:
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _is_connection_error(e: BaseException) -> bool:
    try:
        import botocore.exceptions as bx
    except ImportError:  # pragma: no cover - s3fs needs botocore
        return False
    kinds = (bx.EndpointConnectionError, bx.ConnectionClosedError, bx.ReadTimeoutError, bx.ConnectTimeoutError)
    return isinstance(e, kinds) or isinstance(e, getattr(bx, "HTTPClientError", ()))


class S3Storage:
    """The objects under ``s3://<bucket>/<prefix>``; ``path`` is ``bucket/prefix`` (registry)."""

    capabilities = CAPABILITIES

    def __init__(self, path: str, options: StorageOptions | None = None) -> None:
        try:
            import s3fs
            from fsspec.asyn import sync
        except ImportError as e:  # the registry turns this into MissingDependencyError
            raise ImportError(f"s3:// needs s3fs: {e}") from e
        options = options if options is not None else StorageOptions()
        bucket, _, prefix = path.strip("/").partition("/")
        if not bucket:
            raise StorageError(errno.EINVAL, f"s3://{path}: no bucket name")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._part = options.part_size
        self._concurrency = options.max_concurrency
        client_options = dict(options.client_options)
        config = dict(client_options.pop("config_kwargs", {}) or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})  # one retry owner
        # every shard carries unickpt's own CRC32C, checked on load: no SHA-256 of each payload
        # for the signature, no extra CRC per request (both cost CPU per byte; pass config_kwargs
        # in client_options to turn them back on)
        config.setdefault("s3", {"payload_signing_enabled": False})
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("response_checksum_validation", "when_required")
        config.setdefault("max_pool_connections", max(10, 2 * self._concurrency))
        self._fs = s3fs.S3FileSystem(
            skip_instance_cache=True,
            use_listings_cache=False,
            config_kwargs=config,
            **client_options,
        )
        self._sync = sync
        self._client = sync(self._fs.loop, self._fs.set_session)

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r})"

    # ------------------------------------------------------------------ plumbing

    def _key(self, name: str) -> str:
        check_name(name, self.url)
        return f"{self.prefix}/{name}" if self.prefix else name

    def _where(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _run(self, op: str, name: str, make: Callable[[], Awaitable[T]]) -> T:
        """Run one coroutine on the file system's loop; translate S3's errors (module docstring)."""

        async def call() -> T:
            return await make()

        return translated(op, name, lambda: self._sync(self._fs.loop, call), self._translate)

    def _translate(self, op: str, name: str, e: BaseException) -> StorageError:
        where = self._where(name) if name else self.url
        parts = _client_error_parts(e)
        if parts is not None:
            code, status = parts
            text = f"S3 {op} of {where} failed: {code or status} ({e})"
            if status >= 500 or status == 429 or code in _TRANSIENT_CODES:
                return TransientStorageError(errno.EIO, text)
            if code == "NoSuchBucket":
                return StorageError(errno.ENOENT, f"{text}; create the bucket {self.bucket!r} first")
            if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return StorageError(errno.EACCES, f"{text}; check the credentials (AWS_* or client_options)")
            return StorageError(errno.EPROTO, text)  # a request S3 refused: retrying cannot help
        if _is_connection_error(e) or isinstance(e, (TimeoutError, ConnectionError, asyncio.TimeoutError)):
            return TransientStorageError(errno.ECONNRESET, f"S3 {op} of {where} failed: cannot reach the server ({e})")
        if isinstance(e, OSError):
            return StorageError(e.errno if e.errno is not None else errno.EIO, f"S3 {op} of {where} failed: {e}")
        return StorageError(errno.EPROTO, f"S3 {op} of {where} failed: {type(e).__name__}: {e}")

    @staticmethod
    def _code(e: BaseException) -> tuple[str, int]:
        return _client_error_parts(e) or ("", 0)

    @staticmethod
    def _absent(e: BaseException) -> bool:
        code, status = S3Storage._code(e)
        return status == 404 and code != "NoSuchBucket"

    @staticmethod
    def _precondition_failed(e: BaseException) -> bool:
        code, status = S3Storage._code(e)
        return status == 412 or code == "PreconditionFailed"

    # ------------------------------------------------------------------ data files

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        key = self._key(name)
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(len(v) for v in views)

        async def single() -> None:
            try:
                await self._client.put_object(
                    Bucket=self.bucket, Key=key, Body=SpanReader(views, 0, total), ContentLength=total, IfNoneMatch="*"
                )
            except Exception as e:
                if self._precondition_failed(e):
                    raise exists_error(self._where(name)) from e
                raise

        if total <= self._part:
            self._run("PutObject", name, single)
            return
        self._run("multipart upload", name, lambda: self._multipart(name, key, views, total))

    async def _multipart(self, name: str, key: str, views: list[memoryview], total: int) -> None:
        created = await self._client.create_multipart_upload(Bucket=self.bucket, Key=key)
        upload_id = created["UploadId"]
        spans = [(s, min(s + self._part, total)) for s in range(0, total, self._part)]
        gate = asyncio.Semaphore(self._concurrency)

        async def part(number: int, start: int, end: int) -> dict[str, Any]:
            async with gate:
                r = await self._client.upload_part(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=SpanReader(views, start, end),
                    ContentLength=end - start,
                )
            return {"PartNumber": number, "ETag": r["ETag"]}

        try:
            done = await asyncio.gather(*(part(i + 1, s, e) for i, (s, e) in enumerate(spans)))
            await self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": list(done)}, IfNoneMatch="*"
            )
        except BaseException as e:
            try:
                await self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception:  # the original error matters; the server expires abandoned uploads
                pass
            if isinstance(e, Exception) and self._precondition_failed(e):
                raise exists_error(self._where(name)) from e
            raise

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        key = self._key(name)
        view, spans = read_spans(out, offset, self._part, self._where(name), lambda: self.size(name))
        if not spans:
            return
        gate = asyncio.Semaphore(self._concurrency)

        async def one(start: int, end: int) -> None:
            first, last = offset + start, offset + end - 1
            async with gate:
                try:
                    r = await self._client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={first}-{last}")
                except Exception as e:
                    if self._absent(e):
                        raise MissingDataFileError(f"data file {self._where(name)} is missing") from e
                    if self._code(e)[1] == 416:
                        raise await self._truncated(key, name, offset, len(view)) from e
                    raise
                async with r["Body"] as body:
                    at = start
                    while at < end:
                        chunk = await body.read(min(1 << 20, end - at))
                        if not chunk:
                            break
                        view[at : at + len(chunk)] = chunk
                        at += len(chunk)
                    if at != end:
                        raise await self._truncated(key, name, offset, len(view))

        async def all_spans() -> None:
            await asyncio.gather(*(one(s, e) for s, e in spans))

        self._run("GetObject", name, all_spans)

    async def _truncated(self, key: str, name: str, offset: int, length: int) -> TruncatedDataFileError:
        try:
            size: int | str = int((await self._client.head_object(Bucket=self.bucket, Key=key))["ContentLength"])
        except Exception:
            size = "fewer"
        return truncated_error(self._where(name), offset, length, size)

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        self.read_into(name, offset, out)  # no cache shared between processes

    def size(self, name: str) -> int | None:
        key = self._key(name)

        async def head() -> int | None:
            try:
                r = await self._client.head_object(Bucket=self.bucket, Key=key)
            except Exception as e:
                if self._absent(e):
                    return None
                raise
            return int(r["ContentLength"])

        return self._run("HeadObject", name, head)

    # ------------------------------------------------------------------ small objects

    async def _get_whole(self, key: str, limit: int, where: str) -> tuple[bytes, str] | None:
        try:
            r = await self._client.get_object(Bucket=self.bucket, Key=key)
        except Exception as e:
            if self._absent(e):
                return None
            raise
        if int(r.get("ContentLength", 0)) > limit:
            r["Body"].close()
            raise size_limit_error(where, int(r["ContentLength"]), limit)
        chunks: list[bytes] = []
        got = 0
        async with r["Body"] as body:
            while got <= limit:
                chunk = await body.read(min(1 << 20, limit + 1 - got))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise size_limit_error(where, len(data), limit)
        return data, str(r.get("ETag", ""))

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        key = self._key(name)

        async def get() -> bytes | None:
            found = await self._get_whole(key, limit, self._where(name))
            return None if found is None else found[0]

        return self._run("GetObject", name, get)

    def put(self, name: str, data: bytes) -> None:
        key = self._key(name)
        body = bytes(data)
        self._run("PutObject", name, lambda: self._client.put_object(Bucket=self.bucket, Key=key, Body=body))

    def create_exclusive(self, name: str, data: bytes) -> bool:
        key = self._key(name)
        body = bytes(data)

        async def create() -> bool:
            try:
                await self._client.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*")
            except Exception as e:
                if self._precondition_failed(e):
                    return False
                raise
            return True

        return self._run("PutObject If-None-Match", name, create)

    def update_exclusive(self, name: str, expected: bytes, data: bytes) -> bool:
        key = self._key(name)
        want, body = bytes(expected), bytes(data)

        async def swap() -> bool:
            try:
                found = await self._get_whole(key, max(len(want), 1), self._where(name))
            except SizeLimitError:  # it holds more than we expect: not ours any more
                return False
            if found is None or found[0] != want:
                return False
            try:
                await self._client.put_object(Bucket=self.bucket, Key=key, Body=body, IfMatch=found[1])
            except Exception as e:
                if self._precondition_failed(e) or self._absent(e):
                    return False
                raise
            return True

        return self._run("PutObject If-Match", name, swap)

    # ------------------------------------------------------------------ names

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix, self.url)
        base = f"{self.prefix}/" if self.prefix else ""

        async def pages() -> list[str]:
            names: list[str] = []
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base + prefix, "MaxKeys": 1000}
            while True:
                r = await self._client.list_objects_v2(**kwargs)
                names.extend(o["Key"][len(base) :] for o in r.get("Contents", ()))
                token = r.get("NextContinuationToken")
                if not r.get("IsTruncated") or not token:
                    return sorted(names)
                kwargs["ContinuationToken"] = token

        return self._run("ListObjectsV2", prefix, pages)

    def delete(self, names: Sequence[str]) -> None:
        keys = [self._key(n) for n in names]
        if not keys:
            return

        async def batches() -> None:
            for i in range(0, len(keys), _DELETE_BATCH):
                batch = keys[i : i + _DELETE_BATCH]
                r = await self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
                failed = [f for f in r.get("Errors", ()) if f.get("Code") != "NoSuchKey"]
                if failed:
                    first = failed[0]
                    code = str(first.get("Code", ""))
                    transient = code in _TRANSIENT_CODES or code.startswith("Internal")
                    raise (TransientStorageError if transient else StorageError)(
                        errno.EIO if transient else errno.EPROTO,
                        f"S3 DeleteObjects under {self.url} failed for {len(failed)} key(s), first "
                        f"{first.get('Key')}: {code} {first.get('Message', '')}",
                    )

        self._run("DeleteObjects", names[0], batches)

    def rename(self, src: str, dst: str) -> None:
        self._key(src), self._key(dst)
        raise unsupported_error("rename", self.url)

    def sync(self, folder: str = "") -> None:
        if folder:
            check_name(folder, self.url)
