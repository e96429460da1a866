"""In-memory storage (``memory://name``): objects in a ``MemoryStore``, for tests and staging.

A ``MemoryStore`` is a dict of objects under one lock; ``DEFAULT_MEMORY_STORE`` is the one every
``memory://`` URL of the process shares (so ``save("memory://x")`` and ``load("memory://x")``
meet), tests may give a backend a store of their own. Only visible inside one process:
multi-rank jobs use a shared backend (local/NFS, S3, HDFS).

It keeps the whole storage contract (``storage.base``), every operation atomic under the
store's lock: ``put`` and ``rename`` replace whole objects (so ``folder.publish`` publishes with
one ``put``), ``create_exclusive`` / ``update_exclusive`` are exact within the process (a real
save lock between threads), ``write`` creates exclusively, ``read`` is capped by its ``limit``,
names that would leave the root are refused. No durability: ``sync`` is a no-op.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Sequence

from ..errors import MissingDataFileError, StorageError, TruncatedDataFileError
from .base import (
    METADATA_LIMIT,
    Buffer,
    StorageCapabilities,
    check_name,
    check_prefix,
    exists_error,
    size_limit_error,
)
from .options import StorageOptions

__all__ = ["MemoryStorage", "MemoryStore", "DEFAULT_MEMORY_STORE", "clear_memory_storage", "CAPABILITIES"]

CAPABILITIES = StorageCapabilities(
    atomic_put=True,
    atomic_rename=True,
    rename_replaces=True,
    conditional_create=True,  # within the process, the only place the objects are seen
    needs_sync=False,
    shared_page_cache=False,
)


class MemoryStore:
    """Objects by full key (``<root>/<name>``), guarded by one lock."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def clear(self) -> None:
        with self.lock:
            self.objects.clear()


DEFAULT_MEMORY_STORE = MemoryStore()


def clear_memory_storage() -> None:
    """Drop every object of ``DEFAULT_MEMORY_STORE`` (all ``memory://`` URLs of the process)."""
    DEFAULT_MEMORY_STORE.clear()


def _join(parts: Sequence[Buffer]) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


class MemoryStorage:
    """The objects of ``store`` under the key prefix ``root``."""

    capabilities = CAPABILITIES

    def __init__(self, root: str, options: StorageOptions | None = None, store: MemoryStore | None = None) -> None:
        del options  # nothing to configure
        self.root = root.rstrip("/")
        self.url = f"memory://{self.root}"
        self._store = store if store is not None else DEFAULT_MEMORY_STORE

    def __repr__(self) -> str:
        return f"MemoryStorage({self.root!r})"

    def _key(self, name: str) -> str:
        check_name(name, self.url)
        return f"{self.root}/{name}"

    def _get(self, name: str) -> bytes | None:
        key = self._key(name)
        with self._store.lock:
            return self._store.objects.get(key)

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        if not self.create_exclusive(name, _join(parts)):
            raise exists_error(f"{self.url}/{name}")

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        data = self._get(name)
        if data is None:
            raise MissingDataFileError(f"data file {self.url}/{name} is missing")
        view = memoryview(out).cast("B")
        end = offset + len(view)
        if offset < 0 or end > len(data):
            raise TruncatedDataFileError(
                f"data file {self.url}/{name} is truncated: wanted bytes [{offset}, {end}) but it has {len(data)}"
            )
        view[:] = data[offset:end]

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        self.read_into(name, offset, out)  # no cache shared with other processes

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        data = self._get(name)
        if data is not None and len(data) > limit:
            raise size_limit_error(f"{self.url}/{name}", len(data), limit)
        return data

    def size(self, name: str) -> int | None:
        data = self._get(name)
        return None if data is None else len(data)

    def list(self, prefix: str = "") -> list[str]:
        start = f"{self.root}/{check_prefix(prefix, self.url)}"
        n = len(self.root) + 1
        with self._store.lock:
            return sorted(k[n:] for k in self._store.objects if k.startswith(start))

    def delete(self, names: Sequence[str]) -> None:
        keys = [self._key(n) for n in names]
        with self._store.lock:
            for key in keys:
                self._store.objects.pop(key, None)

    def put(self, name: str, data: bytes) -> None:
        key = self._key(name)
        with self._store.lock:
            self._store.objects[key] = bytes(data)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Store ``name`` only if it does not exist (atomic); False if it does."""
        key = self._key(name)
        data = bytes(data)
        with self._store.lock:
            if key in self._store.objects:
                return False
            self._store.objects[key] = data
        return True

    def update_exclusive(self, name: str, expected: bytes, data: bytes) -> bool:
        """Replace ``name`` with ``data`` if it holds exactly ``expected`` (atomic)."""
        key = self._key(name)
        with self._store.lock:
            if self._store.objects.get(key) != bytes(expected):
                return False
            self._store.objects[key] = bytes(data)
        return True

    def rename(self, src: str, dst: str) -> None:
        skey, dkey = self._key(src), self._key(dst)
        with self._store.lock:
            data = self._store.objects.pop(skey, None)
            if data is None:
                raise StorageError(errno.ENOENT, f"rename {self.url}/{src} -> {dst} failed: the source is missing")
            self._store.objects[dkey] = data

    def sync(self, folder: str = "") -> None:
        if folder:
            check_name(folder, self.url)
