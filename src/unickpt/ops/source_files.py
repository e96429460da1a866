"""Reading the files of a checkpoint another tool wrote (``unickpt convert --from dcp|hf|verl-fsdp``)
without trusting the names its metadata gives.

Every reader of another tool's files opens them here (``ops.dcp_read``: DCP's ``.metadata`` and
``*.distcp`` files; ``ops.hf_read``: ``model.safetensors.index.json`` and the shards it names;
``ops.torch_save_read``: verl's rank files). Every name goes through :func:`check_relative_name`
(a relative '/'-separated path: no absolute path, ``..``, ``.``, empty part, backslash or NUL),
then :func:`open_regular` opens it below the source folder: each folder relative to its parent
with O_NOFOLLOW|O_DIRECTORY, the file with O_NOFOLLOW|O_NONBLOCK (a FIFO opens at once instead of
waiting for a writer), and ``fstat`` must say "regular file" before a byte is read. A link (to a
file or a folder), a FIFO, a device or a socket is refused with ``UnsafePathError``; the source
folder itself may be a link, as the user named it. Reads are bounded by the size ``fstat`` gave:
:func:`read_range` refuses a range past the end before it allocates, :func:`read_small_file` a
file over its cap (``SizeLimitError``).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import (
    CheckpointError,
    MissingDataFileError,
    SizeLimitError,
    StorageError,
    TruncatedDataFileError,
    UnsafePathError,
)
from ..storage.local_files import DIR_FLAGS, kind_of, read_at_most, unsafe

__all__ = ["check_relative_name", "is_subfolder", "open_regular", "read_range", "read_small_file"]

_DIR_NOFOLLOW = DIR_FLAGS | os.O_NOFOLLOW
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never through a link, never blocks


def check_relative_name(name: object, folder: str, where: str) -> list[str]:
    """The parts of ``name``, a file name inside ``folder`` given by ``where`` (the metadata that
    names it); ``UnsafePathError`` for anything that is no plain relative path."""
    if not isinstance(name, str):
        raise UnsafePathError(errno.EINVAL, f"{where} names a file by a {type(name).__name__}, not a string")
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(
            errno.EINVAL,
            f"{where} names the file {name!r}, which is not a plain relative path inside {folder}: refused "
            "(an absolute path, '..', '.' or an empty part could read files outside the checkpoint)",
        )
    return parts


@contextmanager
def open_regular(folder: str, name: str, where: str) -> Iterator[tuple[int, int]]:
    """``(fd, size)`` of the regular file ``folder/name`` (module docstring), closed on exit.

    Raises ``UnsafePathError`` (a bad name, a link on the way, a non-regular file),
    ``MissingDataFileError`` (missing) or ``StorageError`` (any other failure to open it)."""
    parts = check_relative_name(name, folder, where)
    path = os.path.join(folder, *parts)
    try:
        ffd = _open_below(folder, parts, path, where)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise MissingDataFileError(f"{path} (named by {where}) is missing") from None
    except OSError as e:
        raise StorageError(e.errno, f"cannot open {path} (named by {where}): {e.strerror}") from None
    try:
        st = os.fstat(ffd)
        if not stat.S_ISREG(st.st_mode):
            raise _with_where(unsafe(path, kind_of(st.st_mode), errno.EINVAL), where)
        yield ffd, st.st_size
    finally:
        os.close(ffd)


def _open_below(folder: str, parts: list[str], path: str, where: str) -> int:
    """A read descriptor of ``folder/parts...``, each part opened without following a link."""
    fd = os.open(folder, DIR_FLAGS)
    try:
        for i, comp in enumerate(parts[:-1]):
            try:
                nfd = os.open(comp, _DIR_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _unsafe_at(fd, comp, os.path.join(folder, *parts[: i + 1]), where) from None
                raise
            os.close(fd)
            fd = nfd
        try:
            return os.open(parts[-1], _READ, dir_fd=fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _unsafe_at(fd, parts[-1], path, where) from None
            raise
    finally:
        os.close(fd)


def is_subfolder(folder: str, name: str) -> bool:
    """True if ``folder/name`` is a real folder, False if nothing is there; ``UnsafePathError``
    for a link (even to a folder) or a non-folder: how an importer decides which parts of a layout
    (ByteCheckpoint's ``model/``, ``optimizer/`` ...) to read, without leaving ``folder``."""
    check_relative_name(name, folder, f"the layout of {folder}")
    path = os.path.join(folder, name)
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISDIR(mode):
        return True
    raise unsafe(path, kind_of(mode) if not stat.S_ISREG(mode) else "a regular file where a folder belongs")


def _unsafe_at(dirfd: int, name: str, path: str, where: str) -> UnsafePathError:
    try:
        what = kind_of(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
    except OSError:
        what = "not a folder"
    if what == "a regular file":
        what = "a regular file where a folder belongs"
    return _with_where(unsafe(path, what), where)


def _with_where(e: UnsafePathError, where: str) -> UnsafePathError:
    return UnsafePathError(e.errno, f"{e.strerror} (named by {where})")


def read_range(fd: int, size: int, offset: int, length: int, path: str, what: str) -> bytes:
    """``length`` bytes at ``offset`` of the open file ``fd`` of ``size`` bytes: refused with
    ``TruncatedDataFileError`` before anything is allocated when the range ends past ``size``."""
    if offset < 0 or length < 0 or offset > size - length:
        raise TruncatedDataFileError(
            f"{what} is stored at bytes [{offset}, {offset + length}) of {path}, which holds {size} bytes"
        )
    pieces, got = [], 0
    while got < length:  # one piece unless the range is over the 2 GiB a single read returns
        try:
            piece = os.pread(fd, min(length - got, 1 << 30), offset + got)
        except OSError as e:
            raise StorageError(e.errno, f"cannot read {what} from {path}: {e.strerror}") from None
        if not piece:
            raise TruncatedDataFileError(f"{path} ended at byte {offset + got} while reading {what}")
        pieces.append(piece)
        got += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)  # b"" for length 0


def read_small_file(folder: str, name: str, limit: int, where: str) -> bytes:
    """The whole regular file ``folder/name`` if it holds at most ``limit`` bytes, else
    ``SizeLimitError`` (checked on ``fstat`` before reading, and again on what was read)."""
    path = os.path.join(folder, name)
    with open_regular(folder, name, where) as (fd, size):
        try:
            data = b"" if size > limit else read_at_most(fd, limit)
        except OSError as e:
            raise StorageError(e.errno, f"cannot read {path}: {e.strerror}") from None
    if size > limit or len(data) > limit:
        raise SizeLimitError(
            f"{path} holds {max(size, len(data))} bytes or more, over the cap of {limit} bytes "
            f"({limit / (1 << 20):.4g} MiB) that convert reads for this kind of file: refused"
        )
    return data
