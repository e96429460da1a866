"""In-memory storage (``memory://name``): a process-wide dict of objects, for tests and staging.

Only visible inside one process; multi-rank jobs must use a shared backend (local/NFS, S3, HDFS).
It keeps the same contract as the local backend (``storage.base``): ``write`` creates a name
exclusively, ``read`` is capped by its ``limit``, and ``create_exclusive`` / ``update_exclusive``
are atomic (under one lock), so ``engine.lock`` gets a real lock here too.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Sequence

from ..errors import MissingDataFileError, TruncatedDataFileError, UnsafePathError
from .base import METADATA_LIMIT, Buffer, size_limit_error

__all__ = ["MemoryStorage", "clear_memory_storage"]

_OBJECTS: dict[str, bytes] = {}
_LOCK = threading.Lock()


def clear_memory_storage() -> None:
    with _LOCK:
        _OBJECTS.clear()


class MemoryStorage:
    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/")
        self.url = f"memory://{self.root}"

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        if not self.create_exclusive(name, data):
            raise UnsafePathError(
                errno.EEXIST,
                f"refusing to write {self.url}/{name}: it exists already (unickpt creates its files exclusively)",
            )

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        with _LOCK:
            data = _OBJECTS.get(self._key(name))
        if data is None:
            raise MissingDataFileError(f"data file {self.url}/{name} is missing")
        view = memoryview(out).cast("B")
        end = offset + len(view)
        if end > len(data):
            raise TruncatedDataFileError(
                f"data file {self.url}/{name} is truncated: wanted bytes [{offset}, {end}) but it has {len(data)}"
            )
        view[:] = data[offset:end]

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        with _LOCK:
            data = _OBJECTS.get(self._key(name))
        if data is not None and len(data) > limit:
            raise size_limit_error(f"{self.url}/{name}", len(data), limit)
        return data

    def size(self, name: str) -> int | None:
        with _LOCK:
            data = _OBJECTS.get(self._key(name))
        return None if data is None else len(data)

    def list(self, prefix: str = "") -> list[str]:
        start = self._key(prefix)
        n = len(self.root) + 1
        with _LOCK:
            return sorted(k[n:] for k in _OBJECTS if k.startswith(start))

    def delete(self, names: Sequence[str]) -> None:
        with _LOCK:
            for name in names:
                _OBJECTS.pop(self._key(name), None)

    def commit(self, name: str, data: bytes) -> None:
        with _LOCK:
            _OBJECTS[self._key(name)] = bytes(data)

    def sync_dir(self, name: str = "") -> None:
        return None

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Store ``name`` only if it does not exist (atomic); False if it does."""
        with _LOCK:
            if self._key(name) in _OBJECTS:
                return False
            _OBJECTS[self._key(name)] = bytes(data)
        return True

    def update_exclusive(self, name: str, expected: bytes, data: bytes) -> bool:
        """Replace ``name`` with ``data`` if it holds exactly ``expected`` (atomic)."""
        with _LOCK:
            if _OBJECTS.get(self._key(name)) != expected:
                return False
            _OBJECTS[self._key(name)] = bytes(data)
        return True
