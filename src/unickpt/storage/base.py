"""The storage protocol: the only way the engine touches bytes at rest.

A backend is rooted at one checkpoint location and sees flat, '/'-separated names relative to it.
Call order for a save: ``write`` for every data file (any rank, in parallel) -> ``sync`` by each
writer -> the coordinator ``commit``s the metadata file (atomic: readers see the old metadata or
the new one, never a torn one). For a load: ``read`` of the metadata -> ``size`` checks ->
``read_into`` of byte ranges, in parallel. A missing name is a value (``size`` returns None), not
an exception; backends raise ``StorageError`` subclasses for real failures.

Safety contract (DESIGN.md section 8), which every backend keeps:
- ``write`` creates its name exclusively: an existing file (or link) there is never overwritten
  (``UnsafePathError``); data file names are unique per save, so a save never needs to.
- Nothing inside the root is followed when it is a symbolic link (the root itself, given by the
  user, may be one); only regular files are read (a FIFO or device is ``UnsafePathError``).
- ``read`` of a whole (small) file is bounded by ``limit`` bytes (``SizeLimitError`` beyond):
  ``METADATA_LIMIT`` for metadata, ``SMALL_FILE_LIMIT`` for locks, markers and pointers.
Optional methods, used by ``engine.lock`` where a backend has them (the lock is best effort
without): ``create_exclusive(name, data) -> bool`` (atomic create-if-absent) and
``update_exclusive(name, expected, data) -> bool`` (rewrite a file that still holds
``expected``; False if it is gone or holds something else).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ..errors import SizeLimitError

Buffer = bytes | bytearray | memoryview

__all__ = ["Storage", "Buffer", "METADATA_LIMIT", "SMALL_FILE_LIMIT", "size_limit_error"]

METADATA_LIMIT = 1 << 30  # default cap of a metadata read (LoadOptions.max_metadata_bytes)
SMALL_FILE_LIMIT = 64 << 10  # cap of a lock, marker or ``latest`` pointer read


def size_limit_error(where: str, size: int, limit: int) -> SizeLimitError:
    """The error of a whole-file read of ``where`` (``size`` bytes or more) over ``limit`` bytes."""
    return SizeLimitError(
        f"{where} holds {size} bytes or more, over the cap of {limit} bytes ({limit / (1 << 20):.4g} MiB) "
        "for this kind of file: it is not a file unickpt wrote, or its cap must be raised"
    )


@runtime_checkable
class Storage(Protocol):
    url: str

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        """Create ``name`` (it must not exist) with the concatenation of ``parts``; durable
        when it returns. A failed write leaves no file behind."""

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with ``len(out)`` bytes of ``name`` starting at ``offset``.

        Raises MissingDataFileError / TruncatedDataFileError naming the file."""

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        """The whole object, or None if it does not exist (small files: metadata, markers);
        ``SizeLimitError`` when it holds more than ``limit`` bytes (nothing beyond is read)."""

    def size(self, name: str) -> int | None:
        """Size in bytes, or None if missing."""

    def list(self, prefix: str = "") -> list[str]:
        """Names under ``prefix`` (recursive), sorted."""

    def delete(self, names: Sequence[str]) -> None:
        """Remove names; missing ones are ignored."""

    def commit(self, name: str, data: bytes) -> None:
        """Atomically publish ``name``: readers see the old content or the new, never a mix."""
