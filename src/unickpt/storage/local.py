"""Local / POSIX (and NFS-like shared folder) storage.

Writes go to the final name (data file names are unique per save, so nothing readable is
overwritten), are fsynced, and the folder is fsynced on commit. The metadata commit writes a
temporary file, fsyncs it and ``os.replace``s it over the old one: atomic on POSIX and NFS.
Reads use ``os.preadv`` into caller buffers (no intermediate copies, GIL released).
"""

from __future__ import annotations

import collections
import errno
import os
import uuid
from typing import Sequence

from ..errors import (
    MissingDataFileError,
    StorageError,
    TruncatedDataFileError,
)
from .base import Buffer

__all__ = ["LocalStorage"]

_IOV_MAX = 512


def _write_all(fd: int, views: list[memoryview]) -> None:
    """writev in batches of at most IOV_MAX buffers, resuming after short writes."""
    pending = collections.deque(views)
    while pending:
        batch = [pending[i] for i in range(min(_IOV_MAX, len(pending)))]
        n = os.writev(fd, batch)
        while n:
            head = pending[0]
            if n >= len(head):
                n -= len(head)
                pending.popleft()
            else:
                pending[0] = head[n:]
                n = 0


class LocalStorage:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _oserror(self, op: str, name: str, e: OSError) -> StorageError:
        hint = " (disk full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        return StorageError(e.errno, f"{op} {self._path(name)} failed{hint}: {e.strerror or e}")

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        path = self._path(name)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise self._oserror("open for write", name, e) from None
        try:
            _write_all(fd, [memoryview(p).cast("B") for p in parts if len(p)])
            os.fsync(fd)
        except OSError as e:
            raise self._oserror("write", name, e) from None
        finally:
            os.close(fd)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise MissingDataFileError(f"data file {path} is missing") from None
        except OSError as e:
            raise self._oserror("open", name, e) from None
        try:
            view = memoryview(out).cast("B")
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    raise TruncatedDataFileError(
                        f"data file {path} is truncated: wanted bytes [{offset}, {offset + len(view)}) "
                        f"but it ends at {offset + got}"
                    )
                got += n
        except OSError as e:
            raise self._oserror("read", name, e) from None
        finally:
            os.close(fd)

    def read(self, name: str) -> bytes | None:
        try:
            with open(self._path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            return None
        except OSError as e:
            raise self._oserror("read", name, e) from None

    def size(self, name: str) -> int | None:
        try:
            st = os.stat(self._path(name))
        except FileNotFoundError:
            return None
        return st.st_size if not os.path.isdir(self._path(name)) else None

    def list(self, prefix: str = "") -> list[str]:
        out = []
        if not os.path.isdir(self.root):
            return out
        for dirpath, _dirs, files in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            for f in files:
                name = f if rel == "." else f"{rel}/{f}".replace(os.sep, "/")
                if name.startswith(prefix):
                    out.append(name)
        return sorted(out)

    def delete(self, names: Sequence[str]) -> None:
        parents = set()
        for n in names:
            try:
                os.unlink(self._path(n))
            except FileNotFoundError:
                pass
            except OSError as e:
                raise self._oserror("delete", n, e) from None
            parents.add(os.path.dirname(self._path(n)))
        for d in sorted(parents, key=len, reverse=True):  # drop folders left empty, inside root only
            while d.startswith(self.root + os.sep):
                try:
                    os.rmdir(d)
                except OSError:
                    break
                d = os.path.dirname(d)

    def commit(self, name: str, data: bytes) -> None:
        path = self._path(name)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            os.makedirs(self.root, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            dfd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise self._oserror("commit", name, e) from None

    def sync_dir(self, name: str = "") -> None:
        """fsync a folder so that new file names in it are durable."""
        try:
            dfd = os.open(self._path(name) if name else self.root, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
