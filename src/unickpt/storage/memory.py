"""In-memory storage (``memory://name``): a process-wide dict of objects, for tests and staging.

Only visible inside one process; multi-rank jobs must use a shared backend (local/NFS, S3, HDFS).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ..errors import MissingDataFileError, TruncatedDataFileError
from .base import Buffer

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
        with _LOCK:
            _OBJECTS[self._key(name)] = data

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

    def read(self, name: str) -> bytes | None:
        with _LOCK:
            return _OBJECTS.get(self._key(name))

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
