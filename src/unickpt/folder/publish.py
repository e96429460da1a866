"""Atomic publication of small objects: the metadata commit, ``latest`` pointers, lock files.

A *publisher* makes an object appear under its final name in one step, whatever the backend:
readers see the previous version or the new one, never a torn, empty or half-written object.
``publisher_for(storage)`` picks the strategy from the backend's ``StorageCapabilities``:

- ``PutPublisher`` (``atomic_put``: object stores, memory): ``publish`` is one ``put``,
  ``create`` one conditional put (``create_exclusive``: S3 ``If-None-Match: *``). No temporary
  name ever exists, so there are no leftovers.
- ``RenamePublisher`` (``atomic_rename``: POSIX, NFS, HDFS): ``publish`` writes a temporary name
  exclusively (``write``: its bytes are durable when it returns), renames it over the target and
  syncs the folder (``needs_sync``). Where ``rename`` cannot replace (``rename_replaces`` False)
  an existing target is first renamed aside (``<name>.old-<time><hex>``), then the temporary
  takes its place and the old version is deleted. The name is missing for that instant (and
  after a crash right there), so readers of published objects read through the publisher:
  ``read`` then finds the version moved aside, and still sees old or new, never nothing.
  ``create`` is the backend's ``create_exclusive`` where rename replaces (O_CREAT|O_EXCL; a
  reader may briefly see it empty, which the save lock tolerates), else a temporary renamed
  into place (the rename refuses an existing name: content-atomic).

Temporary names are the publisher's business only: ``<name>.tmp-<32 hex>`` (and ``.old-``),
created next to the target. Code that cleans up asks the publisher which names are its own
leftovers (``leftovers`` / ``is_leftover``) and deletes nothing else, so a user's
``unickpt.metadata.json.tmp-notes`` is never touched. Callers delete leftovers only where no
other publication of the same name can be running (the metadata's under the save lock).

Every object that must appear whole goes through here: the metadata (published by the commit,
read by loads through ``folder.probe``), lock generations and data markers (``create``), and
the manager's ``latest`` pointer.
"""

from __future__ import annotations

import errno
import re
import time
import uuid
from typing import Protocol

from ..errors import StorageError
from ..storage.base import METADATA_LIMIT, Buffer, Storage, is_exists_error

__all__ = ["Publisher", "PutPublisher", "RenamePublisher", "publisher_for", "publish"]

_LEFTOVER = re.compile(r"\.(?:tmp|old)-[0-9a-f]{32}")
_ASIDE_LOOKS = 3  # a reader that finds a name missing looks for the version moved aside this often


class Publisher(Protocol):
    """Atomic publication on one storage (see the module docstring)."""

    storage: Storage

    def publish(self, name: str, data: Buffer) -> None:
        """Create or replace ``name`` with ``data`` atomically for readers; durable on return."""

    def create(self, name: str, data: Buffer) -> bool:
        """Create ``name`` holding ``data`` unless it exists (True: created by this call)."""

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        """The published object (None: never published), at most ``limit`` bytes."""

    def leftovers(self, name: str) -> list[str]:
        """Names this strategy left behind while publishing ``name`` (interrupted
        publications), for the caller to delete."""

    def is_leftover(self, candidate: str, name: str) -> bool:
        """Whether ``candidate`` is a name this strategy makes while publishing ``name``."""


class PutPublisher:
    """Object stores: one atomic put per publication, conditional for ``create``."""

    def __init__(self, storage: Storage) -> None:
        if not storage.capabilities.atomic_put:
            raise StorageError(errno.ENOTSUP, f"PutPublisher needs atomic puts, which {storage.url} lacks")
        self.storage = storage

    def __repr__(self) -> str:
        return f"PutPublisher({self.storage.url})"

    def publish(self, name: str, data: Buffer) -> None:
        self.storage.put(name, bytes(data))

    def create(self, name: str, data: Buffer) -> bool:
        return self.storage.create_exclusive(name, bytes(data))

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        return self.storage.read(name, limit)

    def leftovers(self, name: str) -> list[str]:
        return []

    def is_leftover(self, candidate: str, name: str) -> bool:
        return False


class RenamePublisher:
    """File systems: a temporary name written exclusively, renamed over the target, the folder
    synced where the backend needs it."""

    def __init__(self, storage: Storage) -> None:
        caps = storage.capabilities
        if not caps.atomic_rename:
            raise StorageError(errno.ENOTSUP, f"RenamePublisher needs an atomic rename, which {storage.url} lacks")
        self.storage = storage
        self._replaces = caps.rename_replaces
        self._sync = caps.needs_sync

    def __repr__(self) -> str:
        return f"RenamePublisher({self.storage.url})"

    @staticmethod
    def temporary_name(name: str, kind: str = "tmp") -> str:
        """A fresh temporary next to ``name``: ``kind`` "tmp" for a new version (random), "old"
        for the previous one moved aside (the time first, so later ones sort after)."""
        if kind == "old":
            return f"{name}.old-{time.time_ns():016x}{uuid.uuid4().hex[:16]}"
        return f"{name}.{kind}-{uuid.uuid4().hex}"

    def publish(self, name: str, data: Buffer) -> None:
        tmp = self.temporary_name(name)
        try:
            self.storage.write(tmp, [data])
            if self._replaces:
                self.storage.rename(tmp, name)
            else:
                self._swap(tmp, name)
        except BaseException:
            self._discard(tmp)
            raise
        self._sync_folder(name)

    def _swap(self, tmp: str, name: str) -> None:
        """Rename ``tmp`` to ``name`` on a backend whose rename refuses an existing target."""
        try:
            self.storage.rename(tmp, name)
            return
        except StorageError as e:
            if not is_exists_error(e):
                raise
        old = self.temporary_name(name, "old")
        self.storage.rename(name, old)
        try:
            self.storage.rename(tmp, name)
        except BaseException:
            try:  # put the previous version back; if that fails too it stays under ``old``
                self.storage.rename(old, name)
            except Exception:
                pass
            raise
        self._discard(old)

    def create(self, name: str, data: Buffer) -> bool:
        if self._replaces:  # a rename would replace a concurrent creator's object
            return self.storage.create_exclusive(name, bytes(data))
        tmp = self.temporary_name(name)
        try:
            self.storage.write(tmp, [data])
            self.storage.rename(tmp, name)
        except StorageError as e:
            self._discard(tmp)
            if is_exists_error(e):
                return False
            raise
        except BaseException:
            self._discard(tmp)
            raise
        self._sync_folder(name)
        return True

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        data = self.storage.read(name, limit)
        if data is not None or self._replaces:
            return data
        for _ in range(_ASIDE_LOOKS):  # missing: a swap (``_swap``) may be under way, or crashed
            aside = [n for n in self.storage.list(name + ".old-") if self.is_leftover(n, name)]
            for old in reversed(aside):  # the newest version moved aside first
                data = self.storage.read(old, limit)
                if data is not None:
                    return data
            data = self.storage.read(name, limit)  # the swap finished meanwhile
            if data is not None or not aside:
                return data
        return None

    def leftovers(self, name: str) -> list[str]:
        return [n for n in self.storage.list(name + ".") if self.is_leftover(n, name)]

    def is_leftover(self, candidate: str, name: str) -> bool:
        return candidate.startswith(name) and _LEFTOVER.fullmatch(candidate[len(name) :]) is not None

    def _sync_folder(self, name: str) -> None:
        if self._sync:
            self.storage.sync(name.rsplit("/", 1)[0] if "/" in name else "")

    def _discard(self, tmp: str) -> None:
        try:  # best effort: a leftover is found and deleted by the next cleanup
            self.storage.delete([tmp])
        except Exception:
            pass


def publisher_for(storage: Storage) -> Publisher:
    """The publication strategy the capabilities of ``storage`` allow: one atomic put where the
    backend has it (one call, no temporary), else temporary name + atomic rename."""
    caps = storage.capabilities
    if caps.atomic_put:
        return PutPublisher(storage)
    if caps.atomic_rename:
        return RenamePublisher(storage)
    raise StorageError(
        errno.ENOTSUP,
        f"the storage at {storage.url} can publish nothing atomically (neither atomic put nor atomic rename): "
        "unickpt cannot commit checkpoints there",
    )


def publish(storage: Storage, name: str, data: Buffer) -> None:
    """``publisher_for(storage).publish(name, data)``."""
    publisher_for(storage).publish(name, data)
