"""Path walking that never follows a symbolic link inside a checkpoint root (LocalStorage only).

The root folder is opened as the user named it (it may be a link: ``ckpts/latest -> step_100``,
and so may the folders above it); every folder below it is opened relative to its parent's
descriptor with O_NOFOLLOW|O_DIRECTORY, and files are created, opened, stat'ed, renamed and
unlinked relative to their folder's descriptor. A link (or a FIFO, a device ...) where unickpt
expects a folder raises ``UnsafePathError`` for writes and reads (``open_dir``, ``open_regular``,
``stat_in``: a load never reads ``data/<save_id>/...`` through a folder link); the readers of
names (``walk_names``, ``open_chain`` for deletes) skip it, never descending into it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..errors import UnsafePathError

__all__ = [
    "DIR_FLAGS",
    "open_root",
    "open_dir",
    "open_regular",
    "stat_in",
    "open_chain",
    "walk_names",
    "kind_of",
    "unsafe",
    "read_at_most",
]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW_DIR = DIR_FLAGS | os.O_NOFOLLOW


def kind_of(mode: int) -> str:
    """``st_mode`` in words: 'a symbolic link', 'a FIFO', 'a regular file' ..."""
    for test, word in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return word
    return "not a regular file"


def unsafe(path: str, what: str, code: int = errno.ELOOP) -> UnsafePathError:
    return UnsafePathError(
        code,
        f"{path} is {what}: unickpt reads, writes and deletes only regular files and folders inside a "
        "checkpoint and never goes through a link it did not make; remove it or use another folder",
    )


def _kind_at(dirfd: int, name: str) -> str:
    """What ``name`` in the folder ``dirfd`` is, in words (not following a link)."""
    try:
        return kind_of(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
    except OSError:
        return "not a folder"


def open_root(root: str, create: bool, mode: int = 0o777) -> int:
    """A descriptor of the checkpoint root (created first, with ``mode``, when ``create``)."""
    if create:
        os.makedirs(root, mode=mode, exist_ok=True)
    return os.open(root, DIR_FLAGS)


@contextmanager
def open_dir(
    root: str, parts: Sequence[str], create: bool, mode: int = 0o755, *, reading: bool = False
) -> Iterator[int]:
    """A descriptor of ``root/parts[0]/.../parts[-1]``, each folder opened (and, with ``create``,
    made with ``mode``) relative to its parent without following a link. Raises ``UnsafePathError``
    when one of them is a link or no folder, FileNotFoundError when one is missing (without
    ``create``), NotADirectoryError when the root is no folder (and, with ``reading``, when one
    of them is a regular file: nothing to read there, nothing unsafe either)."""
    fd = open_root(root, create, mode)
    try:
        for i, comp in enumerate(parts):
            if create:
                try:
                    os.mkdir(comp, mode, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nfd = os.open(comp, _NOFOLLOW_DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    path = os.path.join(root, *parts[: i + 1])
                    what = _kind_at(fd, comp)
                    if what != "a regular file":
                        raise unsafe(path, what) from None
                    if reading:  # no folder: nothing to read there, nothing unsafe either
                        raise NotADirectoryError(errno.ENOTDIR, "not a folder", path) from None
                    raise unsafe(path, "a regular file where a folder belongs") from None
                raise
            os.close(fd)
            fd = nfd
        yield fd
    finally:
        os.close(fd)


def open_regular(root: str, parts: Sequence[str], flags: int) -> int:
    """A descriptor of the regular file ``root/parts...`` opened with ``flags`` (which include
    O_NOFOLLOW): its folders as ``open_dir`` opens them, the file relative to the last one.
    ``UnsafePathError`` for a link (folder or file) or a file that is not regular;
    IsADirectoryError for a folder; FileNotFoundError / NotADirectoryError pass through."""
    path = os.path.join(root, *parts)
    with open_dir(root, parts[:-1], create=False, reading=True) as dfd:
        try:
            fd = os.open(parts[-1], flags, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise unsafe(path, "a symbolic link") from None
            raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a folder", path)
        raise unsafe(path, kind_of(mode), errno.EINVAL)
    return fd


def stat_in(root: str, parts: Sequence[str]) -> os.stat_result:
    """``lstat`` of ``root/parts...`` with its folders opened as ``open_dir`` opens them (a
    folder link on the way raises ``UnsafePathError``); OSError passes through."""
    with open_dir(root, parts[:-1], create=False, reading=True) as dfd:
        return os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)


def open_chain(rootfd: int, parts: Sequence[str]) -> list[int] | None:
    """Descriptors of every folder from ``rootfd`` (not included) down ``parts``, opened without
    following links; None (all closed) when one is missing, a link or no folder."""
    fds: list[int] = []
    fd = rootfd
    for comp in parts:
        try:
            fd = os.open(comp, _NOFOLLOW_DIR, dir_fd=fd)
        except OSError:
            for f in fds:
                os.close(f)
            return None
        fds.append(fd)
    return fds


def walk_names(fd: int, prefix: str, rel: str = "") -> Iterator[str]:
    """Every non-folder name under the folder ``fd`` (relative, '/'-separated) starting with
    ``prefix``; descends only into real folders whose names can lead to ``prefix``."""
    with os.scandir(fd) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in entries:
        full = rel + name
        if not is_dir:
            if full.startswith(prefix):
                yield full
            continue
        sub = full + "/"
        if not (sub.startswith(prefix) or prefix.startswith(sub)):
            continue
        try:
            nfd = os.open(name, _NOFOLLOW_DIR, dir_fd=fd)
        except OSError:  # gone, or replaced by a link meanwhile: never followed
            continue
        try:
            yield from walk_names(nfd, prefix, sub)
        finally:
            os.close(nfd)


def read_at_most(fd: int, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes from ``fd`` (one more than allowed tells the caller it is over)."""
    chunks, got = [], 0
    while got <= limit:
        b = os.read(fd, min(1 << 20, limit + 1 - got))
        if not b:
            break
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)
