"""Path walking that never follows a symbolic link inside a checkpoint root (LocalStorage only).

The root folder is opened as the user named it (it may be a link: ``ckpts/latest -> step_100``);
every folder below it is opened relative to its parent's descriptor with O_NOFOLLOW|O_DIRECTORY,
and files are created, renamed and unlinked relative to their folder's descriptor. A link (or a
FIFO, a device ...) where unickpt expects a folder raises ``UnsafePathError`` for writes; the
readers of names (``walk_names``, ``open_chain`` for deletes) skip it, never descending into it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..errors import UnsafePathError

__all__ = ["DIR_FLAGS", "open_root", "open_dir", "open_chain", "walk_names", "kind_of", "unsafe", "read_at_most"]

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


def _describe(dirfd: int, name: str, path: str) -> UnsafePathError:
    try:
        what = kind_of(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
    except OSError:
        what = "not a folder"
    return unsafe(path, what if what != "a regular file" else "a regular file where a folder belongs")


def open_root(root: str, create: bool) -> int:
    """A descriptor of the checkpoint root (created first when ``create``)."""
    if create:
        os.makedirs(root, exist_ok=True)
    return os.open(root, DIR_FLAGS)


@contextmanager
def open_dir(root: str, parts: Sequence[str], create: bool) -> Iterator[int]:
    """A descriptor of ``root/parts[0]/.../parts[-1]``, each folder opened (and, with ``create``,
    made) relative to its parent without following a link. Raises ``UnsafePathError`` when one
    of them is a link or no folder, FileNotFoundError when one is missing (without ``create``)."""
    fd = open_root(root, create)
    try:
        for i, comp in enumerate(parts):
            if create:
                try:
                    os.mkdir(comp, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nfd = os.open(comp, _NOFOLLOW_DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _describe(fd, comp, os.path.join(root, *parts[: i + 1])) from None
                raise
            os.close(fd)
            fd = nfd
        yield fd
    finally:
        os.close(fd)


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
