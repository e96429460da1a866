"""The storage protocol: the only way the engine touches bytes at rest.

A backend is rooted at one checkpoint location and sees flat, '/'-separated names relative to it.
Call order for a save: ``write`` for every data file (any rank, in parallel) -> ``sync`` by each
writer -> the coordinator ``commit``s the metadata file (atomic: readers see the old metadata or
the new one, never a torn one). For a load: ``read`` of the metadata -> ``size`` checks ->
``read_into`` of byte ranges, in parallel. A missing name is a value (``size`` returns None), not
an exception; backends raise ``StorageError`` subclasses for real failures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

Buffer = bytes | bytearray | memoryview

__all__ = ["Storage", "Buffer"]


@runtime_checkable
class Storage(Protocol):
    url: str

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        """Create/replace ``name`` with the concatenation of ``parts``; durable when it returns."""

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with ``len(out)`` bytes of ``name`` starting at ``offset``.

        Raises MissingDataFileError / TruncatedDataFileError naming the file."""

    def read(self, name: str) -> bytes | None:
        """The whole object, or None if it does not exist (small files: metadata, markers)."""

    def size(self, name: str) -> int | None:
        """Size in bytes, or None if missing."""

    def list(self, prefix: str = "") -> list[str]:
        """Names under ``prefix`` (recursive), sorted."""

    def delete(self, names: Sequence[str]) -> None:
        """Remove names; missing ones are ignored."""

    def commit(self, name: str, data: bytes) -> None:
        """Atomically publish ``name``: readers see the old content or the new, never a mix."""
