"""What the object-store back-ends built on an HTTP SDK share (``gcs``, ``azure``).

A back-end subclasses ``BlobStore`` and sets, in its ``__init__``: ``url``, ``prefix``, ``_part``
(``StorageOptions.part_size``) and ``_pool`` (its thread pool, ``max_concurrency`` threads). It
implements ``_translate`` (an SDK failure -> ``StorageError``, transient or not), ``_http_status``
(the HTTP status an SDK error carries, 0 if none), ``_download_range`` (one ranged GET into a
``SliceWriter``) and ``_object_size`` (for the truncation message). Here, once for both:

- names: ``_key`` (checked, under the prefix) and ``_where`` (for messages);
- ``_run``: a request with every non-``CheckpointError`` failure translated (``base.translated``,
  also ``s3``'s and ``hdfs``'s; ``storage.retry`` decides on retries from the result);
- ``_parallel``: jobs on the pool, the first failure raised once all ended (no job left writing
  into a caller's buffer after ``read_into`` returns or raises);
- ``read_into``: ranged GETs of ``part_size`` bytes in parallel (``base.read_spans``, as
  ``s3``), straight into the caller's buffer; a missing object is ``MissingDataFileError``, a
  short one ``TruncatedDataFileError``.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ClassVar, TypeVar

from ..errors import MissingDataFileError, StorageError, TruncatedDataFileError
from .base import check_name, read_spans, translated, truncated_error

__all__ = ["BlobStore", "SliceWriter"]

T = TypeVar("T")


class SliceWriter:
    """A write-only file over ``view[at:end]``: what an SDK's ranged download writes into."""

    def __init__(self, view: memoryview, at: int, end: int) -> None:
        self._view, self.at, self._end = view, at, end

    def write(self, data: bytes) -> int:
        n = min(len(data), self._end - self.at)
        self._view[self.at : self.at + n] = data[:n]
        self.at += n
        if n < len(data):
            raise StorageError(errno.EPROTO, "the server sent more bytes than the range asked for")
        return len(data)


class BlobStore:
    """The shared half of an object-store back-end (module docstring)."""

    url: str
    prefix: str
    _part: int
    _pool: ThreadPoolExecutor
    _read_op: ClassVar[str] = "ranged download"  # the request, as messages name it

    # ------------------------------------------------------------ the back-end's part

    def _translate(self, op: str, name: str, e: BaseException) -> StorageError:
        raise NotImplementedError

    def _http_status(self, e: BaseException) -> int:
        raise NotImplementedError

    def _download_range(self, key: str, first: int, length: int, writer: SliceWriter) -> None:
        raise NotImplementedError

    def _object_size(self, key: str) -> int | None:
        raise NotImplementedError

    def _missing_object(self, e: BaseException) -> bool:
        """Whether ``e`` says the object itself does not exist (not its bucket or container)."""
        return self._http_status(e) == 404

    # ------------------------------------------------------------ shared

    def _key(self, name: str) -> str:
        check_name(name, self.url)
        return f"{self.prefix}/{name}" if self.prefix else name

    def _where(self, name: str) -> str:
        return f"{self.url}/{name}" if name else self.url

    def _run(self, op: str, name: str, fn: Callable[[], T]) -> T:
        return translated(op, name, fn, self._translate)

    def _parallel(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Run ``jobs`` on the back-end's pool; the first failure is raised once all are done."""
        if len(jobs) == 1:
            jobs[0]()
            return
        futures: list[Future[None]] = [self._pool.submit(job) for job in jobs]
        first: BaseException | None = None
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # re-raised below
                first = first or e
        if first is not None:
            raise first

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        key = self._key(name)
        view, spans = read_spans(out, offset, self._part, self._where(name), lambda: self.size(name))
        if not spans:
            return

        def one(start: int, end: int) -> Callable[[], None]:
            def run() -> None:
                writer = SliceWriter(view, start, end)
                try:
                    self._download_range(key, offset + start, end - start, writer)
                except Exception as e:
                    if self._missing_object(e):
                        raise MissingDataFileError(f"data file {self._where(name)} is missing") from e
                    if self._http_status(e) == 416:
                        raise self._truncated(key, name, offset, len(view)) from e
                    raise
                if writer.at != end:
                    raise self._truncated(key, name, offset, len(view))

            return run

        self._run(self._read_op, name, lambda: self._parallel([one(s, e) for s, e in spans]))

    def _truncated(self, key: str, name: str, offset: int, length: int) -> TruncatedDataFileError:
        try:
            found = self._object_size(key)
            size: int | str = "no" if found is None else found
        except Exception:
            size = "fewer"
        return truncated_error(self._where(name), offset, length, size)

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        self.read_into(name, offset, out)  # no cache shared between processes

    def size(self, name: str) -> int | None:
        raise NotImplementedError
