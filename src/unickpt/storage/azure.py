"""``az://container/prefix`` (also ``abfs://``): the storage protocol on Azure Blob Storage.

Built on azure-storage-blob (the Blob REST API). The account and credentials, first found wins:
``StorageOptions.client_options`` (``connection_string``, or ``account_url`` + ``credential``,
plus any ``BlobServiceClient`` keyword), ``$AZURE_STORAGE_CONNECTION_STRING``,
``$AZURE_STORAGE_ACCOUNT_NAME`` + ``$AZURE_STORAGE_ACCOUNT_KEY``, or ``$AZURE_STORAGE_ACCOUNT_NAME``
with ``DefaultAzureCredential`` (when azure-identity is installed). ``abfs://container@account
.dfs.core.windows.net/prefix`` names the account in the URL (its blob endpoint is used). The SDK's
own retries are off (``retry_total=0``): ``storage.retry`` owns the only retry loop.

- ``write``: one Put Blob with ``If-None-Match: *`` up to ``part_size``; larger files as blocks of
  ``part_size`` bytes staged in parallel (``max_concurrency`` threads), then one Put Block List
  with ``If-None-Match: *`` (atomic: the blob appears whole or not at all; uncommitted blocks of
  a killed writer are invisible and expire after a week).
- ``read_into``: ranged Get Blob requests of ``part_size`` bytes, in parallel.
- ``create_exclusive``: Put Blob with ``If-None-Match: *`` (409/412 -> False);
  ``update_exclusive``: read with its ETag, compare, Put Blob with ``If-Match: <etag>``.
- No rename: publication is one atomic ``put``. ``list``: paged listing under the narrowest
  prefix; ``delete``: one Delete Blob per name, in parallel, 404 ignored.

Errors: 408 / 429 / 5xx and connection failures -> ``TransientStorageError``; 404 is a value,
except ``ContainerNotFound`` (``StorageError(ENOENT)`` naming the container); 401 / 403 ->
``StorageError(EACCES)`` (bad key: ``AuthenticationFailed``; no permission:
``AuthorizationPermissionMismatch``); anything else ``StorageError(EPROTO)`` with the service's code.
"""

from __future__ import annotations

import base64
import errno
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import (
    CheckpointError,
    SizeLimitError,
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

__all__ = ["AzureBlobStorage", "CAPABILITIES"]


CAPABILITIES = StorageCapabilities(
    atomic_put=True,
    atomic_rename=False,
    rename_replaces=False,
    conditional_create=True,
    needs_sync=False,
    shared_page_cache=False,
)

_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_EXISTS_CODES = frozenset({"BlobAlreadyExists", "ConditionNotMet"})


def _status(e: BaseException) -> int:
    status = getattr(e, "status_code", None)
    return int(status) if isinstance(status, int) else 0


def _code(e: BaseException) -> str:
    code = getattr(e, "error_code", None)
    return str(code) if code is not None else ""


def _taken(e: BaseException) -> bool:
    return _status(e) in (409, 412) and (_code(e) in _EXISTS_CODES or _status(e) == 412)


def _is_connection_error(e: BaseException) -> bool:
    try:
        from azure.core.exceptions import ServiceRequestError, ServiceResponseError
    except ImportError:  # pragma: no cover - the SDK needs azure-core
        return False
    return isinstance(e, (ServiceRequestError, ServiceResponseError, ConnectionError, TimeoutError))


def _service_client(account: str | None, options: StorageOptions) -> Any:
    from azure.storage.blob import BlobServiceClient

    kwargs = dict(options.client_options)
    kwargs.setdefault("retry_total", 0)  # one retry owner: storage.retry
    kwargs.setdefault("max_single_put_size", options.part_size)
    kwargs.setdefault("max_single_get_size", options.part_size)
    conn = kwargs.pop("connection_string", None) or os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if conn and "account_url" not in kwargs:
        return BlobServiceClient.from_connection_string(conn, **kwargs)
    name = account or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    url = kwargs.pop("account_url", None) or (f"https://{name}.blob.core.windows.net" if name else None)
    if url is None:
        raise StorageError(
            errno.EINVAL,
            "no Azure storage account: set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME "
            "(+ AZURE_STORAGE_ACCOUNT_KEY), or client_options={'account_url': ..., 'credential': ...}",
        )
    credential = kwargs.pop("credential", None)
    if credential is None and os.environ.get("AZURE_STORAGE_ACCOUNT_KEY") and name:
        credential = {"account_name": name, "account_key": os.environ["AZURE_STORAGE_ACCOUNT_KEY"]}
    if credential is None:
        try:
            from azure.identity import DefaultAzureCredential
        except ImportError:
            pass
        else:
            credential = DefaultAzureCredential()
    return BlobServiceClient(url, credential=credential, **kwargs)


class AzureBlobStorage(BlobStore):
    """The blobs under ``az://<container>/<prefix>``; ``path`` is ``container[@account-host]/prefix``."""

    capabilities = CAPABILITIES
    _read_op = "Get Blob"

    def __init__(self, path: str, options: StorageOptions | None = None, scheme: str = "az") -> None:
        try:
            import azure.storage.blob  # noqa: F401
        except ImportError as e:  # the registry turns this into MissingDependencyError
            raise ImportError(f"{scheme}:// needs azure-storage-blob: {e}") from e
        options = options if options is not None else StorageOptions()
        head, _, prefix = path.strip("/").partition("/")
        container, _, host = head.partition("@")
        if not container:
            raise StorageError(errno.EINVAL, f"{scheme}://{path}: no container name")
        account = host.split(".", 1)[0] if host else None
        self.container = container
        self.prefix = prefix.strip("/")
        self.url = f"{scheme}://{head}/{self.prefix}" if self.prefix else f"{scheme}://{head}"
        self._part = options.part_size
        self._concurrency = options.max_concurrency
        try:
            self._service = _service_client(account, options)
        except CheckpointError:
            raise
        except Exception as e:
            raise StorageError(errno.EINVAL, f"cannot create an Azure Blob client for {self.url}: {e}") from e
        self._container = self._service.get_container_client(container)
        self._pool = ThreadPoolExecutor(self._concurrency, thread_name_prefix="unickpt-azure")

    def __repr__(self) -> str:
        return f"AzureBlobStorage({self.url!r})"

    # ------------------------------------------------------------------ plumbing

    def _blob(self, key: str) -> Any:
        return self._container.get_blob_client(key)

    def _translate(self, op: str, name: str, e: BaseException) -> StorageError:
        where = self._where(name)
        status, code = _status(e), _code(e)
        detail = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        text = f"Azure {op} of {where} failed: {code or status or type(e).__name__} ({detail})"
        if status in _TRANSIENT_STATUS or code in ("ServerBusy", "OperationTimedOut", "InternalError"):
            return TransientStorageError(errno.EIO, text)
        if code == "ContainerNotFound":
            return StorageError(errno.ENOENT, f"{text}; create the container {self.container!r} first")
        if status in (401, 403):
            return StorageError(
                errno.EACCES,
                f"{text}; check the credentials (AZURE_STORAGE_CONNECTION_STRING / account key / "
                "DefaultAzureCredential) and the identity's role on the container",
            )
        if status:
            return StorageError(errno.EPROTO, text)
        if _is_connection_error(e):
            return TransientStorageError(
                errno.ECONNRESET, f"Azure {op} of {where} failed: cannot reach the server ({e})"
            )
        if isinstance(e, OSError):
            return StorageError(e.errno if e.errno is not None else errno.EIO, text)
        return StorageError(errno.EPROTO, f"Azure {op} of {where} failed: {type(e).__name__}: {e}")

    def _missing_container(self, e: BaseException) -> bool:
        return _code(e) == "ContainerNotFound"

    # ------------------------------------------------------------------ data files

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        key = self._key(name)
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(len(v) for v in views)
        blob = self._blob(key)

        def single() -> None:
            try:
                blob.upload_blob(SpanReader(views, 0, total), length=total, overwrite=False, max_concurrency=1)
            except Exception as e:
                if _taken(e):
                    raise exists_error(self._where(name)) from e
                raise

        def blocks() -> None:
            from azure.storage.blob import BlobBlock

            token = os.urandom(6).hex()
            spans = [(s, min(s + self._part, total)) for s in range(0, total, self._part)]
            ids = [base64.b64encode(f"{token}-{i:06d}".encode()).decode() for i in range(len(spans))]

            def stage(i: int) -> Callable[[], None]:
                def run() -> None:
                    start, end = spans[i]
                    blob.stage_block(ids[i], SpanReader(views, start, end), length=end - start)

                return run

            self._parallel([stage(i) for i in range(len(spans))])
            try:
                # If-None-Match: * (the SDK's etag/match_condition are not taken by this call)
                blob.commit_block_list([BlobBlock(block_id=b) for b in ids], headers={"If-None-Match": "*"})
            except Exception as e:
                if _taken(e):
                    raise exists_error(self._where(name)) from e
                raise

        self._run(
            "Put Blob" if total <= self._part else "Put Block List", name, single if total <= self._part else blocks
        )

    def _http_status(self, e: BaseException) -> int:
        return _status(e)

    def _missing_object(self, e: BaseException) -> bool:
        return _status(e) == 404 and not self._missing_container(e)

    def _download_range(self, key: str, first: int, length: int, writer: SliceWriter) -> None:
        self._blob(key).download_blob(offset=first, length=length, max_concurrency=1).readinto(writer)

    def _object_size(self, key: str) -> int | None:
        return int(self._blob(key).get_blob_properties().size)

    def size(self, name: str) -> int | None:
        key = self._key(name)

        def head() -> int | None:
            try:
                return int(self._blob(key).get_blob_properties().size)
            except Exception as e:
                if _status(e) == 404 and not self._missing_container(e):
                    return None
                raise

        return self._run("Get Blob Properties", name, head)

    # ------------------------------------------------------------------ small objects

    def _get_whole(self, key: str, limit: int, where: str) -> tuple[bytes, str] | None:
        from azure.core import MatchConditions

        blob = self._blob(key)
        try:
            props = blob.get_blob_properties()
        except Exception as e:
            if _status(e) == 404 and not self._missing_container(e):
                return None
            raise
        if int(props.size) > limit:
            raise size_limit_error(where, int(props.size), limit)
        if int(props.size) == 0:
            return b"", str(props.etag)
        try:
            data = blob.download_blob(
                etag=props.etag, match_condition=MatchConditions.IfNotModified, max_concurrency=1
            ).readall()
        except Exception as e:
            if _status(e) in (404, 412) and not self._missing_container(e):  # replaced meanwhile
                return self._get_whole(key, limit, where)
            raise
        if len(data) > limit:
            raise size_limit_error(where, len(data), limit)
        return bytes(data), str(props.etag)

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        key = self._key(name)

        def get() -> bytes | None:
            found = self._get_whole(key, limit, self._where(name))
            return None if found is None else found[0]

        return self._run("Get Blob", name, get)

    def put(self, name: str, data: bytes) -> None:
        key = self._key(name)
        body = bytes(data)
        self._run("Put Blob", name, lambda: self._blob(key).upload_blob(body, overwrite=True, max_concurrency=1))

    def create_exclusive(self, name: str, data: bytes) -> bool:
        key = self._key(name)
        body = bytes(data)

        def create() -> bool:
            try:
                self._blob(key).upload_blob(body, overwrite=False, max_concurrency=1)
            except Exception as e:
                if _taken(e):
                    return False
                raise
            return True

        return self._run("Put Blob If-None-Match", name, create)

    def update_exclusive(self, name: str, expected: bytes, data: bytes) -> bool:
        from azure.core import MatchConditions

        key = self._key(name)
        want, body = bytes(expected), bytes(data)

        def swap() -> bool:
            try:
                found = self._get_whole(key, max(len(want), 1), self._where(name))
            except SizeLimitError:  # it holds more than we expect: not ours any more
                return False
            if found is None or found[0] != want:
                return False
            try:
                self._blob(key).upload_blob(
                    body,
                    overwrite=True,
                    etag=found[1],
                    match_condition=MatchConditions.IfNotModified,
                    max_concurrency=1,
                )
            except Exception as e:
                if _status(e) in (404, 409, 412) and not self._missing_container(e):
                    return False
                raise
            return True

        return self._run("Put Blob If-Match", name, swap)

    # ------------------------------------------------------------------ names

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix, self.url)
        base = f"{self.prefix}/" if self.prefix else ""

        def pages() -> list[str]:
            blobs = self._container.list_blobs(name_starts_with=base + prefix, results_per_page=5000)
            return sorted(b.name[len(base) :] for b in blobs)

        return self._run("List Blobs", prefix, pages)

    def delete(self, names: Sequence[str]) -> None:
        keys = [self._key(n) for n in names]
        if not keys:
            return

        def one(key: str) -> Callable[[], None]:
            def run() -> None:
                try:
                    self._blob(key).delete_blob()
                except Exception as e:
                    if _status(e) != 404 or self._missing_container(e):
                        raise

            return run

        self._run("Delete Blob", names[0], lambda: self._parallel([one(k) for k in keys]))

    def rename(self, src: str, dst: str) -> None:
        self._key(src), self._key(dst)
        raise unsupported_error("rename", self.url)

    def sync(self, folder: str = "") -> None:
        if folder:
            check_name(folder, self.url)


def abfs_storage(path: str, options: StorageOptions) -> AzureBlobStorage:
    """``abfs://container@account.dfs.core.windows.net/prefix`` (or ``abfs://container/prefix``)."""
    return AzureBlobStorage(path, options, scheme="abfs")
