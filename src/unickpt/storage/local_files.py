"""The one layer that touches local files: every write, rename, link, unlink, fsync and folder
creation unickpt makes on a local file system goes through the functions of this module.

Users: ``storage.local.LocalStorage`` (and ``ShmStorage``), the Hugging Face export
(``engine.export.hf``: several ranks write one file at offsets) and the output folders of ``unickpt
merge`` / ``convert`` (``ops.output_files``). ``tests/unit/test_boundaries.py`` checks that no
module outside ``storage/`` calls the ``os`` functions behind them (a short list of exceptions is
written there, each with its reason).

Path walking never follows a symbolic link inside a root: the root folder is opened as the user
named it (it may be a link: ``ckpts/latest -> step_100``, and so may the folders above it); every
folder below it is opened relative to its parent's descriptor with O_NOFOLLOW|O_DIRECTORY, and
files are created, opened, stat'ed, renamed, linked and unlinked relative to their folder's
descriptor (``*_at``). A link (or a FIFO, a device ...) where unickpt expects a folder raises
``UnsafePathError`` for writes and reads (``open_dir``, ``open_regular``, ``stat_in``: a load
never reads ``data/<save_id>/...`` through a folder link); the readers of names (``walk_names``,
``open_chain`` for deletes) skip it, never descending into it.

Writing: ``create_at`` (``create_stream_at``: as a file object) creates a file exclusively
(O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC: a file or link already there is refused, never written
through); ``open_file_at`` opens an existing regular file (one another rank created, one
rewritten in place); ``truncate`` sizes it; ``write_all`` / ``pwrite_all`` write every byte
(resuming after short writes); ``fsync`` makes a file's bytes durable and ``sync_folder`` the
names in a folder; ``rename_at`` (replaces), ``link_at`` (an exclusive placement: refuses an
existing name), ``unlink_at``, ``make_folders`` (a root), ``make_folder_at`` and
``remove_folder_at`` change names. ``OSError`` passes
through; ``storage_error`` turns one into the one-line ``StorageError`` callers raise.
"""

from __future__ import annotations

import collections
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import BinaryIO

from ..errors import StorageError, UnsafePathError

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
    "CREATE_FLAGS",
    "create_at",
    "create_stream_at",
    "open_file_at",
    "truncate",
    "write_all",
    "pwrite_all",
    "fsync",
    "sync_folder",
    "rename_at",
    "link_at",
    "unlink_at",
    "make_folder_at",
    "remove_folder_at",
    "make_folders",
    "storage_error",
]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW_DIR = DIR_FLAGS | os.O_NOFOLLOW
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC  # never through a link
_SAFE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never through a link, never blocks on a FIFO
_IOV_MAX = 512


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
        make_folders(root, mode)
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
                    make_folder_at(fd, comp, mode)
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


# ---------------------------------------------------------------------- writing and naming


def make_folders(path: str, mode: int = 0o777) -> None:
    """``path`` and the folders above it, created when missing (as the user named them: a root)."""
    os.makedirs(path, mode=mode, exist_ok=True)


def make_folder_at(dirfd: int, name: str, mode: int = 0o755) -> None:
    """The folder ``name`` in the folder ``dirfd``; FileExistsError when something is there."""
    os.mkdir(name, mode, dir_fd=dirfd)


def remove_folder_at(dirfd: int, name: str) -> None:
    """Remove the empty folder ``name`` of the folder ``dirfd`` (OSError when not empty)."""
    os.rmdir(name, dir_fd=dirfd)


def create_at(dirfd: int, name: str, mode: int = 0o644) -> int:
    """A write descriptor of the new file ``name`` in the folder ``dirfd``, created exclusively
    (``CREATE_FLAGS``): FileExistsError when a file or a link of that name is there."""
    return os.open(name, CREATE_FLAGS, mode, dir_fd=dirfd)


def open_file_at(dirfd: int, name: str, flags: int, mode: int = 0o644, path: str = "") -> int:
    """A descriptor of the regular file ``name`` in the folder ``dirfd`` opened with ``flags``
    (``O_WRONLY``, ``O_RDWR``, ``O_CREAT`` ...; O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC are added): never
    through a link, never blocking on a FIFO. ``UnsafePathError`` (naming ``path``) for a link or
    a file that is not regular; FileNotFoundError and other OSErrors pass through."""
    try:
        fd = os.open(name, flags | _SAFE_OPEN, mode, dir_fd=dirfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise unsafe(path or name, "a symbolic link") from None
        if e.errno == errno.ENXIO:  # a FIFO without a reader (O_NONBLOCK)
            raise unsafe(path or name, "a FIFO", errno.EINVAL) from None
        raise
    try:
        kind = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(kind):
        os.close(fd)
        raise unsafe(path or name, kind_of(kind), errno.EINVAL)
    return fd


def create_stream_at(dirfd: int, name: str, mode: int = 0o644) -> BinaryIO:
    """``create_at`` as a binary file object (for writers that take one: ``torch.save``); the
    caller closes it, after ``fsync(f.fileno())`` when the bytes must be durable."""
    fd = create_at(dirfd, name, mode)
    try:
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def truncate(fd: int, size: int) -> None:
    """Cut or extend the file ``fd`` to ``size`` bytes (an extension reads as zeros)."""
    os.ftruncate(fd, size)


def write_all(fd: int, views: Sequence[memoryview]) -> None:
    """writev of ``views`` at the file position, in batches of at most IOV_MAX buffers,
    resuming after short writes."""
    pending = collections.deque(v for v in views if len(v))  # an empty view would never drain
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


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Every byte of ``view`` at ``offset`` (pwrite, resuming after short writes)."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def fsync(fd: int) -> None:
    """Make the bytes written through ``fd`` durable."""
    os.fsync(fd)


def sync_folder(dirfd: int) -> None:
    """Make the names created, renamed or removed in the folder ``dirfd`` durable."""
    os.fsync(dirfd)


def rename_at(src_dirfd: int, src: str, dst_dirfd: int, dst: str) -> None:
    """Rename ``src`` (in ``src_dirfd``) to ``dst`` (in ``dst_dirfd``), replacing ``dst`` (a link
    there is replaced, not followed); atomic, durable after ``sync_folder``."""
    os.replace(src, dst, src_dir_fd=src_dirfd, dst_dir_fd=dst_dirfd)


def link_at(src_dirfd: int, src: str, dst_dirfd: int, dst: str) -> None:
    """Give the file ``src`` the second name ``dst`` (a hard link, ``src`` not followed if it is
    a link): an exclusive placement, FileExistsError when ``dst`` exists."""
    os.link(src, dst, src_dir_fd=src_dirfd, dst_dir_fd=dst_dirfd, follow_symlinks=False)


def unlink_at(dirfd: int, name: str, missing_ok: bool = False) -> None:
    """Remove the name ``name`` from the folder ``dirfd`` (a link is removed, never followed)."""
    try:
        os.unlink(name, dir_fd=dirfd)
    except FileNotFoundError:
        if not missing_ok:
            raise


def storage_error(op: str, path: str, e: OSError) -> StorageError:
    """``e`` as one line naming the operation and the file, its errno kept: ``"<op> <path>
    failed (disk full): <reason>"``."""
    hint = " (disk full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return StorageError(e.errno, f"{op} {path} failed{hint}: {e.strerror or e}")
