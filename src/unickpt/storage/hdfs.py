"""``hdfs://namenode:port/path``: the storage protocol on HDFS, through ``hdfs-native``'s client.

``hdfs-native`` (the ``hdfs`` extra) speaks HDFS's RPC and data-transfer protocols itself (no
JVM, no libhdfs); it is also what fsspec's ``hdfs`` protocol uses. unickpt calls its ``Client``
directly so that it sees the client's own error kinds and owns the only retry loop
(``storage.retry``). ``hdfs:///path`` uses the default file system of the Hadoop configuration
(``HADOOP_CONF_DIR`` / ``HADOOP_HOME``); ``StorageOptions.client_options`` are the ``Client``'s
keyword arguments (``config`` overrides, ``kerberos_principal`` ...).

Threads: the engine calls the protocol methods from many threads at once; the client is
thread-safe (its own runtime), and releases the GIL during I/O.

- ``write``: ``create`` without overwrite (HDFS refuses an existing name: exclusive across
  hosts), the caller's buffers streamed in order, ``hsync`` (the DataNodes fsync the blocks),
  ``close`` (the NameNode completes the file). A failed write deletes what it created.
  HDFS files are written by one stream each: the engine's parallelism is its many data files
  (``SaveOptions.files_per_rank``); ``hdfs-native`` 0.14 exposes no ``concat``, so one file is
  not split into parts written in parallel.
- ``read_into``: positional reads (``read_range_stream``, no seek state shared between threads);
  ranges over ``part_size`` are cut into spans read in parallel (``max_concurrency`` at a time).
- ``create_exclusive``: ``create`` without overwrite; ``FileExistsError`` -> False.
- ``rename``: HDFS ``Rename2`` with ``OVERWRITE``: atomic, replaces ``dst`` (publication is a
  temporary + rename, ``folder.publish.RenamePublisher``).
- ``list``: one recursive ``listStatus`` of the deepest folder the prefix names, files only.
  HDFS symbolic links are off unless a cluster enables them; the client reports none, so there
  is nothing to follow.
- ``sync``: a no-op; HDFS makes names durable in its edit log before answering.

Errors: ``FileNotFoundError`` is a value (None / [] / False, or ``MissingDataFileError`` for
data reads); ``FileExistsError`` -> ``exists_error``; ``PermissionError`` /
``AccessControlException`` -> ``StorageError(EACCES)``; connection failures, timeouts,
``StandbyException`` and DataNode pipeline failures -> ``TransientStorageError`` (retried);
everything else ``StorageError(EIO)`` naming the operation and the file.
"""

from __future__ import annotations

import errno
import posixpath
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..errors import (
    CheckpointError,
    MissingDataFileError,
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
    size_limit_error,
    translated,
)
from .options import StorageOptions

__all__ = ["HdfsStorage", "CAPABILITIES", "split_hdfs_path"]

T = TypeVar("T")

CAPABILITIES = StorageCapabilities(
    atomic_put=False,
    atomic_rename=True,
    rename_replaces=True,
    conditional_create=True,
    needs_sync=False,
    shared_page_cache=False,
)

# words in the client's messages that mark a failure worth retrying (the NameNode failed over,
# a DataNode pipeline broke, the connection dropped or timed out)
_TRANSIENT_WORDS = (
    "StandbyException",
    "RetriableException",
    "SafeModeException",
    "connection",
    "Connection",
    "timed out",
    "Timeout",
    "DataTransferError",
    "All nodes failed",
    "Datanode",
    "broken pipe",
)


def split_hdfs_path(path: str) -> tuple[str, str]:
    """``(authority, root)`` of the registry's ``path`` (the URL after ``hdfs://``):
    ``"nn:8020/a/b"`` -> ``("nn:8020", "/a/b")``, ``"/a/b"`` (from ``hdfs:///a/b``) ->
    ``("", "/a/b")``."""
    authority, slash, rest = path.partition("/")
    root = "/" + rest.strip("/") if slash else "/"
    for part in root.split("/")[1:]:
        if part in (".", ".."):
            raise StorageError(errno.EINVAL, f"hdfs://{path}: '.' and '..' are not allowed in the root")
    return authority, root


class HdfsStorage:
    """The files under ``hdfs://<authority><root>`` (``path`` as the registry passes it).

    ``client`` replaces the ``hdfs_native.Client`` (an object with the same methods; the tests
    use one on a local folder when no HDFS cluster is reachable)."""

    capabilities = CAPABILITIES

    def __init__(self, path: str, options: StorageOptions | None = None, *, client: Any = None) -> None:
        options = options if options is not None else StorageOptions()
        authority, root = split_hdfs_path(path)
        self.root = root
        self.url = f"hdfs://{authority}{root}".rstrip("/") if root != "/" else f"hdfs://{authority}/"
        self._part = options.part_size
        self._concurrency = options.max_concurrency
        if client is None:
            try:
                from hdfs_native import Client
            except ImportError as e:  # the registry turns this into MissingDependencyError
                raise ImportError(f"hdfs:// needs hdfs-native: {e}") from e
            kwargs = dict(options.client_options)
            url = f"hdfs://{authority}" if authority else None
            try:
                client = Client(url, **kwargs)
            except CheckpointError:
                raise
            except Exception as e:
                raise self._translate("connect", "", e) from e
        self._client = client

    def __repr__(self) -> str:
        return f"HdfsStorage({self.url!r})"

    # ------------------------------------------------------------------ plumbing

    def _path(self, name: str) -> str:
        check_name(name, self.url)
        return posixpath.join(self.root, name)

    def _where(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    def _call(self, op: str, name: str, fn: Callable[[], T]) -> T:
        return translated(op, name, fn, self._translate)

    def _translate(self, op: str, name: str, e: BaseException) -> StorageError:
        where = self._where(name)
        text = f"HDFS {op} of {where} failed: {type(e).__name__}: {e}"
        if isinstance(e, PermissionError) or "AccessControlException" in str(e):
            return StorageError(errno.EACCES, f"{text}; check the HDFS user and the folder's permissions")
        if isinstance(e, (ConnectionError, TimeoutError)) or any(w in str(e) for w in _TRANSIENT_WORDS):
            return TransientStorageError(errno.EIO, text)
        if isinstance(e, OSError) and e.errno is not None:
            return StorageError(e.errno, text)
        return StorageError(errno.EIO, text)

    def _write_options(self, overwrite: bool) -> Any:
        write_options = getattr(self._client, "write_options", None)
        if write_options is not None:  # a stand-in client brings its own record
            return write_options(overwrite=overwrite, create_parent=True)
        from hdfs_native import WriteOptions

        return WriteOptions(overwrite=overwrite, create_parent=True)

    def _info(self, path: str) -> Any | None:
        try:
            return self._client.get_file_info(path)
        except FileNotFoundError:
            return None

    def _create(self, path: str, parts: Sequence[memoryview], *, overwrite: bool, durable: bool) -> None:
        """Create ``path`` holding ``parts``; on failure remove what this call created."""
        writer = self._client.create(path, self._write_options(overwrite))
        try:
            for part in parts:
                if len(part):
                    writer.write(part)
            if durable:
                writer.hsync()
            writer.close()
        except BaseException:
            try:
                writer.close()
            except Exception:
                pass
            try:
                self._client.delete(path, False)
            except Exception:  # the original error matters more
                pass
            raise

    # ------------------------------------------------------------------ data files

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        path = self._path(name)
        views = [memoryview(p).cast("B") for p in parts]

        def create() -> None:
            try:
                self._create(path, views, overwrite=False, durable=True)
            except FileExistsError:
                raise exists_error(self._where(name)) from None

        self._call("create", name, create)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        path = self._path(name)
        view = memoryview(out).cast("B")
        if offset < 0:
            raise StorageError(errno.EINVAL, f"negative offset {offset} reading {self._where(name)}")

        def read() -> None:
            info = self._info(path)
            if info is None or info.isdir:
                raise MissingDataFileError(f"data file {self._where(name)} is missing")
            if offset + len(view) > info.length:
                raise TruncatedDataFileError(
                    f"data file {self._where(name)} is truncated: wanted bytes [{offset}, "
                    f"{offset + len(view)}) but it has {info.length}"
                )
            if not len(view):
                return
            reader = self._client.read(path)
            spans = [(s, min(s + self._part, len(view))) for s in range(0, len(view), self._part)]

            def one(span: tuple[int, int]) -> None:
                start, end = span
                at = start
                for chunk in reader.read_range_stream(offset + start, end - start):
                    view[at : at + len(chunk)] = chunk
                    at += len(chunk)
                if at != end:
                    raise TruncatedDataFileError(
                        f"data file {self._where(name)} ended early: wanted bytes [{offset}, "
                        f"{offset + len(view)}), got {at - start} of span [{offset + start}, {offset + end})"
                    )

            if len(spans) == 1:
                one(spans[0])
                return
            with ThreadPoolExecutor(min(self._concurrency, len(spans)), thread_name_prefix="unickpt-hdfs") as pool:
                for f in [pool.submit(one, s) for s in spans]:
                    f.result()

        self._call("read", name, read)

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        self.read_into(name, offset, out)  # no cache shared between processes

    def size(self, name: str) -> int | None:
        path = self._path(name)

        def size() -> int | None:
            info = self._info(path)
            return None if info is None or info.isdir else int(info.length)

        return self._call("getFileInfo", name, size)

    # ------------------------------------------------------------------ small objects

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        path = self._path(name)

        def read() -> bytes | None:
            try:  # the reader is bound to the file it opened: its length is that file's
                reader = self._client.read(path)
            except (FileNotFoundError, IsADirectoryError):
                return None
            length = len(reader)
            if length > limit:
                raise size_limit_error(self._where(name), length, limit)
            data = b"".join(reader.read_range_stream(0, length))
            if len(data) > limit:
                raise size_limit_error(self._where(name), len(data), limit)
            return data

        return self._call("read", name, read)

    def put(self, name: str, data: bytes) -> None:
        path = self._path(name)
        self._call("create", name, lambda: self._create(path, [memoryview(data)], overwrite=True, durable=True))

    def create_exclusive(self, name: str, data: bytes) -> bool:
        path = self._path(name)

        def create() -> bool:
            try:
                self._create(path, [memoryview(data)], overwrite=False, durable=True)
            except FileExistsError:
                return False
            return True

        return self._call("create", name, create)

    def update_exclusive(self, name: str, expected: bytes, data: bytes) -> bool:
        """Compare, then replace through a temporary and an overwriting rename (HDFS has no
        compare-and-swap; only the object's creator updates it, so the check cannot go stale)."""
        path = self._path(name)

        def swap() -> bool:
            info = self._info(path)
            if info is None or info.isdir or info.length != len(expected):
                return False
            try:
                found = b"".join(self._client.read(path).read_range_stream(0, len(expected)))
            except FileNotFoundError:
                return False
            if found != expected:
                return False
            temp = f"{path}.unickpt-swap-{uuid.uuid4().hex[:12]}"
            self._create(temp, [memoryview(data)], overwrite=False, durable=True)
            try:
                self._client.rename(temp, path, True)
            except BaseException:
                try:
                    self._client.delete(temp, False)
                except Exception:
                    pass
                raise
            return True

        return self._call("update", name, swap)

    # ------------------------------------------------------------------ names

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix, self.url)
        folder = posixpath.join(self.root, prefix.rsplit("/", 1)[0]) if "/" in prefix else self.root
        base = self.root.rstrip("/") + "/"

        def listing() -> list[str]:
            try:
                found = list(self._client.list_status(folder, True))
            except FileNotFoundError:
                return []
            except NotADirectoryError:
                return []
            names = []
            for status in found:
                if status.isdir:
                    continue
                full = status.path if status.path.startswith("/") else posixpath.join(folder, status.path)
                if not full.startswith(base):
                    continue
                rel = full[len(base) :]
                if rel.startswith(prefix):
                    names.append(rel)
            return sorted(names)

        return self._call("listStatus", prefix, listing)

    def delete(self, names: Sequence[str]) -> None:
        paths = [(n, self._path(n)) for n in names]
        for name, path in paths:

            def remove(path: str = path) -> None:
                info = self._info(path)
                if info is None or info.isdir:
                    return
                try:
                    self._client.delete(path, False)
                except FileNotFoundError:
                    pass

            self._call("delete", name, remove)

    def rename(self, src: str, dst: str) -> None:
        src_path, dst_path = self._path(src), self._path(dst)

        def move() -> None:
            info = self._info(src_path)
            if info is None or info.isdir:
                raise StorageError(errno.ENOENT, f"cannot rename {self._where(src)}: it does not exist")
            parent = posixpath.dirname(dst_path)
            if self._info(parent) is None:
                self._client.mkdirs(parent, 0o755, True)
            self._client.rename(src_path, dst_path, True)

        self._call("rename", src, move)

    def sync(self, folder: str = "") -> None:
        if folder:
            check_name(folder, self.url)
