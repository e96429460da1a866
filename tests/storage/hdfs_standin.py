"""A stand-in for ``hdfs_native.Client`` on a local folder, for machines with no HDFS cluster.

It implements the calls ``HdfsStorage`` makes, with HDFS's semantics where they differ from
POSIX: ``create`` without overwrite fails with ``FileExistsError`` for an existing file and
makes the file visible (empty) as soon as it is opened; ``rename(overwrite=True)`` replaces a
file atomically and refuses to replace a folder; ``list_status`` returns absolute paths (the
file itself when given a file); a reader's ``read_range_stream`` yields chunks of at most
64 KiB, like the client's packets, and stops at the end of the file. Errors are the built-in
exception types ``hdfs-native`` raises. What it cannot stand for (the NameNode/DataNode
protocols, leases, failover) is what the gated tests on a real cluster
(``UNICKPT_TEST_HDFS_URL``) exercise.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["LocalHdfsClient"]

_PACKET = 64 << 10


@dataclass(frozen=True)
class _Status:
    path: str
    length: int
    isdir: bool


@dataclass(frozen=True)
class _WriteOptions:
    overwrite: bool
    create_parent: bool


class _Reader:
    """Bound to the file it opened (HDFS: the block list fetched at open), like the client's."""

    def __init__(self, local: str) -> None:
        self._fd = os.open(local, os.O_RDONLY | os.O_CLOEXEC)

    def __len__(self) -> int:
        return os.fstat(self._fd).st_size

    def __del__(self) -> None:
        os.close(self._fd)

    def read_range_stream(self, offset: int, length: int) -> Iterator[bytes]:
        at, end = offset, offset + length
        while at < end:
            chunk = os.pread(self._fd, min(_PACKET, end - at), at)
            if not chunk:
                return
            at += len(chunk)
            yield chunk


class _Writer:
    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, buf: Any) -> int:
        return self._f.write(buf)

    def hsync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class LocalHdfsClient:
    """HDFS paths ``/a/b`` map to ``<folder>/a/b``."""

    def __init__(self, folder: str) -> None:
        self._folder = folder
        os.makedirs(folder, exist_ok=True)

    def _local(self, path: str) -> str:
        assert path.startswith("/"), path
        return os.path.join(self._folder, path.lstrip("/"))

    def write_options(self, *, overwrite: bool, create_parent: bool) -> _WriteOptions:
        return _WriteOptions(overwrite, create_parent)

    def get_file_info(self, path: str) -> _Status:
        local = self._local(path)
        st = os.stat(local)  # FileNotFoundError as the client raises it
        return _Status(path, st.st_size if not os.path.isdir(local) else 0, os.path.isdir(local))

    def list_status(self, path: str, recursive: bool = False) -> Iterator[_Status]:
        local = self._local(path)
        if not os.path.exists(local):
            raise FileNotFoundError(f"File does not exist: {path}")
        if not os.path.isdir(local):
            yield self.get_file_info(path)
            return
        for dirpath, dirnames, filenames in os.walk(local):
            rel = os.path.relpath(dirpath, self._folder)
            base = "/" + ("" if rel == "." else rel)
            for d in sorted(dirnames):
                yield _Status(os.path.join(base, d), 0, True)
            for f in sorted(filenames):
                yield _Status(os.path.join(base, f), os.path.getsize(os.path.join(dirpath, f)), False)
            if not recursive:
                return

    def read(self, path: str) -> _Reader:
        local = self._local(path)
        if not os.path.isfile(local):
            raise FileNotFoundError(f"File does not exist: {path}")
        return _Reader(local)

    def create(self, path: str, write_options: _WriteOptions) -> _Writer:
        local = self._local(path)
        parent = os.path.dirname(local)
        if not os.path.isdir(parent):
            if not write_options.create_parent:
                raise FileNotFoundError(f"Parent directory does not exist: {path}")
            os.makedirs(parent, exist_ok=True)
        if os.path.isdir(local):
            raise IsADirectoryError(path)
        mode = "wb" if write_options.overwrite else "xb"  # HDFS: create fails for an existing file
        return _Writer(open(local, mode))

    def mkdirs(self, path: str, permission: int = 0o755, create_parent: bool = False) -> None:
        local = self._local(path)
        if create_parent:
            os.makedirs(local, exist_ok=True)
        else:
            os.mkdir(local)

    def rename(self, src: str, dst: str, overwrite: bool = False) -> None:
        s, d = self._local(src), self._local(dst)
        if not os.path.exists(s):
            raise FileNotFoundError(src)
        if os.path.exists(d):
            if not overwrite:
                raise FileExistsError(dst)
            if os.path.isdir(d):
                raise OSError(f"rename destination {dst} is a directory")
        os.replace(s, d)

    def delete(self, path: str, recursive: bool = False) -> bool:
        local = self._local(path)
        if not os.path.exists(local):
            return False
        if os.path.isdir(local):
            if recursive:
                import shutil

                shutil.rmtree(local)
            else:
                os.rmdir(local)
        else:
            os.unlink(local)
        return True
