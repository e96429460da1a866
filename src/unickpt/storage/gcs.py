"""``gs://bucket/prefix``: the storage protocol on Google Cloud Storage (JSON API).

Built on google-cloud-storage (the JSON API over HTTP/1.1; no gRPC probe of the bucket, which
gcsfs makes and emulators do not answer). Endpoint and credentials as Google's clients take
them: ``STORAGE_EMULATOR_HOST`` (an emulator, anonymous), else Application Default Credentials
(``GOOGLE_APPLICATION_CREDENTIALS``, the metadata server, ``gcloud auth``); ``StorageOptions
.client_options`` are keyword arguments of ``google.cloud.storage.Client`` (``project``,
``credentials``, ``client_options={"api_endpoint": ...}``). The client's own retries are off
(``retry=None`` on every request): ``storage.retry`` owns the only retry loop.

Threads: the engine calls the protocol methods from many threads; each backend has one pool of
``max_concurrency`` threads for the pieces of one large write or read, and one HTTP connection
pool sized for them.

- ``write``: one upload with ``ifGenerationMatch=0`` (exclusive) up to ``part_size``; larger
  files as a *parallel composite upload*: parts of ``part_size`` bytes uploaded in parallel as
  temporary objects ``<name>.unickpt-part-<token>-<i>``, composed (32 at a time, in levels) into
  ``<name>`` with ``ifGenerationMatch=0`` (one atomic step: a reader never sees part of it), the
  temporaries deleted after, and on any failure. A process killed mid-upload leaves its parts
  under ``data/<save_id>/`` (never a partial ``<name>``); a bucket lifecycle rule on
  ``*.unickpt-part-*`` removes them.
- ``read_into``: ranged downloads of ``part_size`` bytes, in parallel, each written straight
  into its slice of ``out``.
- ``create_exclusive``: upload with ``ifGenerationMatch=0`` (412 -> False, across hosts);
  ``update_exclusive``: read with its generation, compare, upload with ``ifGenerationMatch=<gen>``.
- No rename: publication is one atomic ``put`` (``folder.publish.PutPublisher``).
- ``list``: paged object listing under the narrowest prefix; ``delete``: one request per
  object, in parallel; 404 ignored.

Errors: HTTP 429 / 408 / 5xx and connection failures become ``TransientStorageError``
(retried by ``storage.retry``); 404 is a value (None / [] / False, ``MissingDataFileError`` for
data reads), except from a listing or an upload, where it means the bucket is missing
(``StorageError(ENOENT)``); 401 / 403 -> ``StorageError(EACCES)``; anything else
``StorageError(EPROTO)`` naming the request, the object and the HTTP status.
"""

from __future__ import annotations

import errno
import secrets
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import (
    CheckpointError,
    StorageError,
    TransientStorageError,
)
from .base import (
    METADATA_LIMIT,
    Buffer,
    StorageCapabilities,
    check_name,
    check_prefix,
    exists_error,
    size_limit_error,
    unsupported_error,
)
from .blob_store import BlobStore, SliceWriter
from .options import StorageOptions
from .s3 import SpanReader

__all__ = ["GcsStorage", "CAPABILITIES", "PART_MARK"]


CAPABILITIES = StorageCapabilities(
    atomic_put=True,
    atomic_rename=False,
    rename_replaces=False,
    conditional_create=True,
    needs_sync=False,
    shared_page_cache=False,
)

PART_MARK = ".unickpt-part-"  # temporaries of a composite upload: <name>.unickpt-part-<token>-<i>
_COMPOSE_MAX = 32  # GCS composes at most 32 sources in one request
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def _status(e: BaseException) -> int:
    code = getattr(e, "code", None)
    if isinstance(code, int):
        return code
    response = getattr(e, "response", None)
    status = getattr(response, "status_code", None)
    return int(status) if isinstance(status, int) else 0


def _is_connection_error(e: BaseException) -> bool:
    try:
        import requests.exceptions as rx
        import urllib3.exceptions as ux
    except ImportError:  # pragma: no cover - google-cloud-storage needs requests
        return False
    kinds = (rx.ConnectionError, rx.Timeout, rx.ChunkedEncodingError, ux.ProtocolError, ux.HTTPError)
    return isinstance(e, kinds) or isinstance(e, (ConnectionError, TimeoutError))


class GcsStorage(BlobStore):
    """The objects under ``gs://<bucket>/<prefix>``; ``path`` is ``bucket/prefix`` (registry)."""

    capabilities = CAPABILITIES

    def __init__(self, path: str, options: StorageOptions | None = None) -> None:
        try:
            import requests.adapters
            from google.cloud import storage as gcs
        except ImportError as e:  # the registry turns this into MissingDependencyError
            raise ImportError(f"gs:// needs google-cloud-storage: {e}") from e
        options = options if options is not None else StorageOptions()
        bucket, _, prefix = path.strip("/").partition("/")
        if not bucket:
            raise StorageError(errno.EINVAL, f"gs://{path}: no bucket name")
        self.prefix = prefix.strip("/")
        self.url = f"gs://{bucket}/{self.prefix}" if self.prefix else f"gs://{bucket}"
        self._part = options.part_size
        self._concurrency = options.max_concurrency
        try:
            self._client = gcs.Client(**dict(options.client_options))
        except Exception as e:
            raise StorageError(
                errno.EACCES,
                f"cannot create a Google Cloud Storage client for {self.url}: {e}; set GOOGLE_APPLICATION_CREDENTIALS "
                "(or STORAGE_EMULATOR_HOST for an emulator), or pass client_options",
            ) from e
        pool = max(10, 2 * self._concurrency)
        adapter = requests.adapters.HTTPAdapter(pool_connections=pool, pool_maxsize=pool, max_retries=0)
        http = self._client._http  # the client's requests session (an AuthorizedSession with credentials)
        http.mount("https://", adapter)
        http.mount("http://", adapter)
        self._bucket = self._client.bucket(bucket)
        self.bucket = bucket
        self._pool = ThreadPoolExecutor(self._concurrency, thread_name_prefix="unickpt-gcs")
        self._pool_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"GcsStorage({self.url!r})"

    # ------------------------------------------------------------------ plumbing

    def _translate(self, op: str, name: str, e: BaseException, *, missing_bucket: bool = False) -> StorageError:
        where = self._where(name)
        status = _status(e)
        detail = str(e).splitlines()[0][:300] if str(e) else ""
        text = f"GCS {op} of {where} failed: {status or type(e).__name__} ({detail})"
        if status in _TRANSIENT_STATUS:
            return TransientStorageError(errno.EIO, text)
        if status == 404 and missing_bucket:
            return StorageError(errno.ENOENT, f"{text}; the bucket {self.bucket!r} does not exist: create it first")
        if status in (401, 403):
            return StorageError(
                errno.EACCES, f"{text}; check the credentials (GOOGLE_APPLICATION_CREDENTIALS or client_options)"
            )
        if status:
            return StorageError(errno.EPROTO, text)  # a request GCS refused: retrying cannot help
        if _is_connection_error(e):
            return TransientStorageError(errno.ECONNRESET, f"GCS {op} of {where} failed: cannot reach the server ({e})")
        if isinstance(e, OSError):
            return StorageError(e.errno if e.errno is not None else errno.EIO, text)
        return StorageError(errno.EPROTO, f"GCS {op} of {where} failed: {type(e).__name__}: {e}")

    def _upload(self, key: str, body: Any, size: int, **conditions: Any) -> None:
        blob = self._bucket.blob(key)
        blob.upload_from_file(
            body,
            size=size,
            content_type="application/octet-stream",
            checksum=None,  # unickpt checks its own CRC32C of every shard on load
            retry=None,
            **conditions,
        )

    # ------------------------------------------------------------------ data files

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        key = self._key(name)
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(len(v) for v in views)

        def single() -> None:
            try:
                self._upload(key, SpanReader(views, 0, total), total, if_generation_match=0)
            except Exception as e:
                if _status(e) == 412:
                    raise exists_error(self._where(name)) from e
                if _status(e) == 404:
                    raise self._translate("upload", name, e, missing_bucket=True) from e
                raise

        if total <= self._part:
            self._run("upload", name, single)
            return
        self._run("composite upload", name, lambda: self._composite(name, key, views, total))

    def _composite(self, name: str, key: str, views: list[memoryview], total: int) -> None:
        if self._bucket.get_blob(key, retry=None) is not None:  # fail before uploading anything
            raise exists_error(self._where(name))
        token = secrets.token_hex(6)
        spans = [(s, min(s + self._part, total)) for s in range(0, total, self._part)]
        temps = [f"{key}{PART_MARK}{token}-{i:05d}" for i in range(len(spans))]
        made: list[str] = []
        made_lock = threading.Lock()

        def upload(i: int) -> Callable[[], None]:
            def run() -> None:
                start, end = spans[i]
                self._upload(temps[i], SpanReader(views, start, end), end - start, if_generation_match=0)
                with made_lock:
                    made.append(temps[i])

            return run

        try:
            try:
                self._parallel([upload(i) for i in range(len(spans))])
            except Exception as e:
                if _status(e) == 404:
                    raise self._translate("upload", name, e, missing_bucket=True) from e
                raise
            level, sources = 0, list(temps)
            while len(sources) > _COMPOSE_MAX:  # compose in levels of 32
                level += 1
                groups = [sources[i : i + _COMPOSE_MAX] for i in range(0, len(sources), _COMPOSE_MAX)]
                nxt = [f"{key}{PART_MARK}{token}-L{level}-{j:05d}" for j in range(len(groups))]

                def compose(group: list[str], dst: str) -> Callable[[], None]:
                    def run() -> None:
                        self._compose(group, dst)
                        with made_lock:
                            made.append(dst)

                    return run

                self._parallel([compose(g, d) for g, d in zip(groups, nxt)])
                sources = nxt
            try:
                self._compose(sources, key)
            except Exception as e:
                if _status(e) == 412:
                    raise exists_error(self._where(name)) from e
                raise
        finally:
            self._delete_keys(made)

    def _compose(self, sources: list[str], dst: str) -> None:
        blob = self._bucket.blob(dst)
        blob.content_type = "application/octet-stream"
        blob.compose([self._bucket.blob(s) for s in sources], if_generation_match=0, retry=None)

    def _http_status(self, e: BaseException) -> int:
        return _status(e)

    def _download_range(self, key: str, first: int, length: int, writer: SliceWriter) -> None:
        self._bucket.blob(key).download_to_file(
            writer, start=first, end=first + length - 1, raw_download=True, checksum=None, retry=None
        )

    def _object_size(self, key: str) -> int | None:
        blob = self._bucket.get_blob(key, retry=None)
        return None if blob is None else int(blob.size or 0)

    def size(self, name: str) -> int | None:
        key = self._key(name)

        def head() -> int | None:
            blob = self._bucket.get_blob(key, retry=None)
            return None if blob is None else int(blob.size or 0)

        return self._run("get metadata", name, head)

    # ------------------------------------------------------------------ small objects

    def _get_whole(self, key: str, limit: int, where: str) -> tuple[bytes, int] | None:
        """The object's bytes and generation, or None when missing."""
        from google.api_core import exceptions as gx

        blob = self._bucket.get_blob(key, retry=None)
        if blob is None:
            return None
        size = int(blob.size or 0)
        if size > limit:
            raise size_limit_error(where, size, limit)
        if size == 0:
            return b"", int(blob.generation)
        try:
            data = blob.download_as_bytes(if_generation_match=blob.generation, checksum=None, retry=None)
        except (gx.NotFound, gx.PreconditionFailed):  # replaced or deleted in between: read it again
            return self._get_whole(key, limit, where)
        if len(data) > limit:
            raise size_limit_error(where, len(data), limit)
        return data, int(blob.generation)

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        key = self._key(name)

        def get() -> bytes | None:
            found = self._get_whole(key, limit, self._where(name))
            return None if found is None else found[0]

        return self._run("download", name, get)

    def put(self, name: str, data: bytes) -> None:
        key = self._key(name)
        body = bytes(data)

        def upload() -> None:
            try:
                self._upload(key, SpanReader([memoryview(body)], 0, len(body)), len(body))
            except Exception as e:
                if _status(e) == 404:
                    raise self._translate("upload", name, e, missing_bucket=True) from e
                raise

        self._run("upload", name, upload)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        key = self._key(name)
        body = bytes(data)

        def create() -> bool:
            try:
                self._upload(key, SpanReader([memoryview(body)], 0, len(body)), len(body), if_generation_match=0)
            except Exception as e:
                if _status(e) == 412:
                    return False
                if _status(e) == 404:
                    raise self._translate("upload", name, e, missing_bucket=True) from e
                raise
            return True

        return self._run("upload ifGenerationMatch=0", name, create)

    def update_exclusive(self, name: str, expected: bytes, data: bytes) -> bool:
        key = self._key(name)
        want, body = bytes(expected), bytes(data)

        def swap() -> bool:
            try:
                found = self._get_whole(key, max(len(want), 1), self._where(name))
            except CheckpointError as e:  # it holds more than we expect: not ours any more
                if isinstance(e, StorageError):
                    raise
                return False
            if found is None or found[0] != want:
                return False
            try:
                self._upload(key, SpanReader([memoryview(body)], 0, len(body)), len(body), if_generation_match=found[1])
            except Exception as e:
                if _status(e) in (404, 412):
                    return False
                raise
            return True

        return self._run("upload ifGenerationMatch", name, swap)

    # ------------------------------------------------------------------ names

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix, self.url)
        base = f"{self.prefix}/" if self.prefix else ""

        def pages() -> list[str]:
            try:
                blobs = self._client.list_blobs(self._bucket, prefix=base + prefix, retry=None, page_size=1000)
                return sorted(b.name[len(base) :] for b in blobs)
            except Exception as e:
                if _status(e) == 404:
                    raise self._translate("list", prefix, e, missing_bucket=True) from e
                raise

        return self._run("list", prefix, pages)

    def _delete_keys(self, keys: Sequence[str]) -> None:
        def one(key: str) -> Callable[[], None]:
            def run() -> None:
                try:
                    self._bucket.blob(key).delete(retry=None)
                except Exception as e:
                    if _status(e) != 404:
                        raise

            return run

        if keys:
            self._parallel([one(k) for k in keys])

    def delete(self, names: Sequence[str]) -> None:
        keys = [self._key(n) for n in names]
        if keys:
            self._run("delete", names[0], lambda: self._delete_keys(keys))

    def rename(self, src: str, dst: str) -> None:
        self._key(src), self._key(dst)
        raise unsupported_error("rename", self.url)

    def sync(self, folder: str = "") -> None:
        if folder:
            check_name(folder, self.url)
