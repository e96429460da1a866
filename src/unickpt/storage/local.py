"""Local / POSIX (and NFS-like shared folder) storage.

Capabilities: atomic rename that replaces (``os.replace``, atomic on POSIX and NFS), exclusive
create atomic across hosts (O_CREAT|O_EXCL, NFSv3+), names durable only after ``sync`` (fsync of
the folder), the host's page cache shared by its processes; no atomic ``put`` (an in-place
rewrite), so ``folder.publish`` publishes here by temporary file + rename.

Writes create the final name (data file names are unique per save, so nothing readable is
overwritten) and are fsynced; ``sync`` fsyncs a folder. Large files are written with O_DIRECT in
big sequential chunks (``StorageOptions.direct_writes``, on by default): page-aligned parts go to
the disk straight from their memory (the async snapshot's file images), others through a reused
aligned bounce buffer; this skips the page cache copy, so a background save costs the training job
little CPU. Filesystems without O_DIRECT fall back to buffered ``writev``. Reads use buffered
``preadv`` into the caller's memory by default. With ``StorageOptions.direct_reads`` (default:
``UNICKPT_DIRECT_READS=1`` when the backend is created) large reads (>= 1 MiB) bypass the page
cache: O_DIRECT ``preadv`` of the page-aligned cover of the range, straight into the caller's
memory where its address has the file offset's page phase, else into a reused aligned bounce
buffer and copied out. It is not a clear win for checkpoint loads (docs/performance.md), so it is
opt-in. ``read_into_cached`` always reads through the page cache: the engine uses it for byte
ranges that several ranks of one host read, so the device delivers them once even with direct
reads on.

Safety (see ``storage.base``): files are created with O_CREAT|O_EXCL|O_NOFOLLOW (data files,
publication temporaries, locks, markers) and written, renamed and unlinked relative to
folder descriptors opened without following links (``local_files``, the one module that
writes, renames and deletes local files): a link inside the root is
never written or deleted through, a folder that is a link is refused for writes and skipped by
``list`` and ``delete``. Reads open with O_NOFOLLOW|O_NONBLOCK and accept regular files only
(a FIFO cannot block a load); ``read`` stops at its ``limit``.

Failure behaviour: every ``OSError`` becomes a ``StorageError`` carrying the errno and naming the
operation and the path ("(disk full)" for ENOSPC/EDQUOT); a ``write`` that fails removes its
partial file so a full disk gets its space back at once. Names that would escape the root
(absolute, ``..``, empty parts) are refused. ``create_exclusive`` and ``update_exclusive`` give
``folder.lock`` its lock files (an atomic exclusive create, and the holder's in-place heartbeat
that never recreates a file that is gone).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import stat
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..errors import (
    CheckpointError,
    MissingDataFileError,
    StorageError,
    TruncatedDataFileError,
)
from .aligned import ALIGN, BOUNCE_POOL, address_of, is_aligned
from .base import (
    METADATA_LIMIT,
    Buffer,
    StorageCapabilities,
    check_name,
    check_prefix,
    exists_error,
    size_limit_error,
)
from .local_files import (
    create_at,
    fsync,
    kind_of,
    open_chain,
    open_dir,
    open_file_at,
    open_regular,
    open_root,
    pwrite_all,
    read_at_most,
    remove_folder_at,
    rename_at,
    stat_in,
    storage_error,
    sync_folder,
    truncate,
    unlink_at,
    unsafe,
    walk_names,
    write_all,
)
from .options import StorageOptions

__all__ = ["LocalStorage", "storage_error"]

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never blocks on a FIFO
_DIRECT_MIN = 1 << 20  # smaller files are written buffered, smaller reads read buffered


_SEGMENT = 64 << 20  # a direct-written file is cut into segments of this size ...
_SEGMENT_WRITERS = 2  # ... written by this many threads: one fills its bounce buffer while the
# other's write is with the device (a single thread alternates copy and write, idling the disk)


def _segments(views: list[memoryview], size: int) -> list[tuple[int, list[memoryview]]]:
    """The byte stream of ``views`` cut at multiples of ``size``: [(file offset, views)]."""
    out: list[tuple[int, list[memoryview]]] = []
    cur: list[memoryview] = []
    start = pos = 0
    for v in views:
        i = 0
        while i < len(v):
            n = min(size - (pos - start), len(v) - i)
            cur.append(v[i : i + n])
            i += n
            pos += n
            if pos - start == size:
                out.append((start, cur))
                cur, start = [], pos
    if cur:
        out.append((start, cur))
    return out


def _write_direct(fd: int, views: list[memoryview], total: int) -> None:
    """Write ``views`` back to back with O_DIRECT, as segments (aligned file offsets) written in
    parallel; the last partial block is padded, then the file is cut to ``total``."""
    segments = _segments(views, _SEGMENT)
    if len(segments) <= 1:
        for pos, seg in segments:
            _write_direct_at(fd, seg, pos)
    else:
        _reserve(fd, -(-total // ALIGN) * ALIGN)
        with ThreadPoolExecutor(_SEGMENT_WRITERS, thread_name_prefix="unickpt-segment") as pool:
            for f in [pool.submit(_write_direct_at, fd, seg, pos) for pos, seg in segments]:
                f.result()
    truncate(fd, total)


def _reserve(fd: int, size: int) -> None:
    """Allocate the file's blocks up front: segments written concurrently would otherwise get
    interleaved extents (slower to read back), and a full disk fails here, before any write."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def _write_direct_at(fd: int, views: list[memoryview], pos: int) -> None:
    """Write ``views`` back to back from the aligned file offset ``pos`` with O_DIRECT: aligned
    chunks straight from memory, the rest via a bounce buffer; a last partial block is padded."""
    bounce = BOUNCE_POOL.get()
    try:
        chunk = bounce.capacity
        fill = 0  # bytes pending in the bounce buffer
        # pos: file offset of the bounce buffer's first byte (always aligned)
        for v in views:
            i = 0
            while i < len(v):
                if fill == 0 and len(v) - i >= ALIGN and is_aligned(v[i : i + ALIGN]):
                    n = (len(v) - i) // ALIGN * ALIGN
                    n = min(n, 64 << 20)
                    pwrite_all(fd, v[i : i + n], pos)
                    pos += n
                    i += n
                    continue
                n = min(chunk - fill, len(v) - i)
                bounce.view[fill : fill + n] = v[i : i + n]
                fill += n
                i += n
                if fill == chunk:
                    pwrite_all(fd, bounce.view[:chunk], pos)
                    pos += chunk
                    fill = 0
        if fill:
            padded = -(-fill // ALIGN) * ALIGN
            bounce.view[fill:padded] = bytes(padded - fill)
            pwrite_all(fd, bounce.view[:padded], pos)
    finally:
        BOUNCE_POOL.put(bounce)


def _pread_full(fd: int, dst: memoryview, pos: int, direct: bool = False) -> int:
    """preadv into ``dst`` from ``pos`` until it is full or the file ends; the bytes read.
    ``direct``: ``dst``, ``pos`` and the length are block-aligned, and a read that comes back
    short by a partial block has hit the end of the file (O_DIRECT refuses to go on from there)."""
    got = 0
    while got < len(dst):
        n = os.preadv(fd, [dst[got:]], pos + got)
        got += n
        if n == 0 or (direct and n % ALIGN):
            break
    return got


def _read_direct(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset`` with O_DIRECT reads of page-aligned ranges; the bytes read
    (less than ``len(view)`` only at end of file).

    Where ``view``'s address has the same page phase as ``offset``, its aligned middle is read
    in place; the rest (or all of it) goes through a pooled bounce buffer and is copied out."""
    end = offset + len(view)
    direct_lo = direct_hi = offset  # the part of [offset, end) read straight into ``view``
    if (address_of(view) - offset) % ALIGN == 0:
        direct_lo = -(-offset // ALIGN) * ALIGN
        direct_hi = max(direct_lo, end // ALIGN * ALIGN)
    pieces = [(offset, direct_lo, False), (direct_lo, direct_hi, True), (direct_hi, end, False)]
    for lo, hi, in_place in pieces:
        if hi <= lo:
            continue
        part = view[lo - offset : hi - offset]
        got = _pread_full(fd, part, lo, direct=True) if in_place else _bounced(fd, part, lo)
        if got < hi - lo:
            return lo - offset + got
    return len(view)


def _bounced(fd: int, view: memoryview, lo: int) -> int:
    """Fill ``view`` with the file's bytes from ``lo`` through a bounce buffer; the bytes delivered."""
    hi = lo + len(view)
    bounce = BOUNCE_POOL.get()
    try:
        pos = lo // ALIGN * ALIGN
        done = 0
        while lo + done < hi:
            n = min(bounce.capacity, -(-(hi - pos) // ALIGN) * ALIGN)
            got = _pread_full(fd, bounce.view[:n], pos, direct=True)
            skip = lo + done - pos
            take = min(got - skip, hi - lo - done)
            if take <= 0:
                break
            view[done : done + take] = bounce.view[skip : skip + take]
            done += take
            pos += got
            if got < n:
                break
        return done
    finally:
        BOUNCE_POOL.put(bounce)


CAPABILITIES = StorageCapabilities(
    atomic_put=False,
    atomic_rename=True,
    rename_replaces=True,
    conditional_create=True,
    needs_sync=True,
    shared_page_cache=True,
    reads_ahead=True,
)


class LocalStorage:
    """Files under the folder ``root`` (see the module docstring)."""

    capabilities = CAPABILITIES
    file_mode = 0o644  # of the files it creates (before the umask); ShmStorage: 0o600
    folder_mode = 0o755  # of the folders it creates below the root; ShmStorage: 0o700

    def __init__(self, root: str, options: StorageOptions | None = None) -> None:
        options = options if options is not None else StorageOptions()
        self.root = os.path.abspath(os.path.expanduser(root))  # "~/ckpts": the home folder's, not "./~"
        self.url = self.root
        self.direct_io = options.resolved_direct_writes()  # O_DIRECT writes of files >= 1 MiB
        self.direct_reads = options.resolved_direct_reads()  # O_DIRECT reads of ranges >= 1 MiB
        if self.direct_reads:  # an O_DIRECT read is only what it asks for: no read-ahead
            self.capabilities = dataclasses.replace(type(self).capabilities, reads_ahead=False)

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"

    def _parts(self, name: str) -> list[str]:
        return check_name(name, self.root)

    def _path(self, name: str) -> str:
        return os.path.join(self.root, *self._parts(name))

    def _oserror(self, op: str, name: str, e: OSError) -> StorageError:
        return storage_error(op, self._path(name), e)

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        """Create ``name`` exclusively (O_CREAT|O_EXCL|O_NOFOLLOW, in folders opened without
        following links): a file or link already there is refused, never written through."""
        *folders, base = self._parts(name)
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        total = sum(len(v) for v in views)
        try:
            with open_dir(self.root, folders, create=True, mode=self.folder_mode) as dfd:
                try:
                    fd = create_at(dfd, base, self.file_mode)
                except FileExistsError:
                    raise exists_error(self._path(name)) from None
                try:
                    direct = self.direct_io and total >= _DIRECT_MIN and _set_direct(fd)
                    if direct:
                        _write_direct(fd, views, total)
                    else:
                        write_all(fd, views)
                    fsync(fd)
                except OSError as e:
                    try:  # never leave a partial file behind (and give a full disk its space back)
                        unlink_at(dfd, base)
                    except OSError:
                        pass
                    raise self._oserror("write", name, e) from None
                finally:
                    os.close(fd)
        except CheckpointError:
            raise
        except OSError as e:
            raise self._oserror("open for write", name, e) from None

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        self._read(name, offset, view, direct=self.direct_reads and len(view) >= _DIRECT_MIN)

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        """``read_into`` through the page cache, even with direct reads on (bytes other
        processes of this host read as well: the device delivers them once)."""
        self._read(name, offset, memoryview(out).cast("B"), direct=False)

    def _open_regular(self, name: str, flags: int) -> int:
        """Open ``name`` for reading: never through a link (the file's or a folder's inside the
        root), never blocking (a FIFO), and only when it is a regular file (``UnsafePathError``
        otherwise). OSError passes through."""
        return open_regular(self.root, self._parts(name), flags | _READ)

    def _read(self, name: str, offset: int, view: memoryview, direct: bool) -> None:
        path = self._path(name)
        fd = -1
        try:
            if direct:
                try:
                    fd = self._open_regular(name, os.O_DIRECT)
                except OSError as e:
                    if e.errno != errno.EINVAL or isinstance(e, CheckpointError):
                        raise
                    direct = False  # the filesystem has no O_DIRECT: read buffered
            if fd < 0:
                fd = self._open_regular(name, 0)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise MissingDataFileError(f"data file {path} is missing") from None
        except CheckpointError:
            raise
        except OSError as e:
            raise self._oserror("open", name, e) from None
        try:
            got = _read_direct(fd, view, offset) if direct else _pread_full(fd, view, offset)
        except OSError as e:
            raise self._oserror("read", name, e) from None
        finally:
            os.close(fd)
        if got < len(view):
            raise TruncatedDataFileError(
                f"data file {path} is truncated: wanted bytes [{offset}, {offset + len(view)}) "
                f"but it ends at {offset + got}"
            )

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        """The whole file (a regular file of at most ``limit`` bytes), or None when missing."""
        try:
            fd = self._open_regular(name, 0)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None  # missing, or the root is a regular file: not here
        except CheckpointError:
            raise
        except OSError as e:
            raise self._oserror("read", name, e) from None
        try:
            size = os.fstat(fd).st_size
            data = b"" if size > limit else read_at_most(fd, limit)
        except OSError as e:
            raise self._oserror("read", name, e) from None
        finally:
            os.close(fd)
        if size > limit or len(data) > limit:
            raise size_limit_error(self._path(name), max(size, len(data)), limit)
        return data

    def size(self, name: str) -> int | None:
        path = self._path(name)
        try:
            st = stat_in(self.root, self._parts(name))  # never through a folder link inside the root
        except (FileNotFoundError, NotADirectoryError):
            return None
        except CheckpointError:
            raise
        except OSError as e:
            raise self._oserror("stat", name, e) from None
        if stat.S_ISDIR(st.st_mode):
            return None
        if not stat.S_ISREG(st.st_mode):
            raise unsafe(path, kind_of(st.st_mode), errno.EINVAL)
        return st.st_size

    def list(self, prefix: str = "") -> list[str]:
        """Names under ``prefix``; folders reached through a link are not entered."""
        check_prefix(prefix, self.root)
        try:
            fd = open_root(self.root, create=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise self._oserror("list", prefix or ".", e) from None
        try:
            return sorted(walk_names(fd, prefix))
        except OSError as e:
            raise self._oserror("list", prefix or ".", e) from None
        finally:
            os.close(fd)

    def delete(self, names: Sequence[str]) -> None:
        """Unlink ``names`` relative to their folders (a link is removed, never followed; names
        under a folder that is a link are left alone), then remove folders left empty, inside
        the root only."""
        by_folder: dict[tuple[str, ...], set[str]] = {}
        for n in names:
            parts = self._parts(n)
            by_folder.setdefault(tuple(parts[:-1]), set()).add(parts[-1])
        try:
            rootfd = open_root(self.root, create=False)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            raise self._oserror("delete", names[0], e) from None
        try:
            for key, bases in by_folder.items():
                self._delete_in(rootfd, key, bases)
        finally:
            os.close(rootfd)

    def _delete_in(self, rootfd: int, folders: tuple[str, ...], bases: Iterable[str]) -> None:
        chain = open_chain(rootfd, folders)
        if chain is None:
            return  # missing, or reached through a link: nothing unickpt may delete there
        try:
            dfd = chain[-1] if chain else rootfd
            for base in bases:
                try:
                    unlink_at(dfd, base)
                except (FileNotFoundError, IsADirectoryError):
                    pass  # missing, or a folder (names are files): nothing to delete
                except OSError as e:
                    raise self._oserror("delete", "/".join((*folders, base)), e) from None
            parents = [rootfd, *chain[:-1]]
            for i in range(len(folders) - 1, -1, -1):  # folders left empty, deepest first
                try:
                    remove_folder_at(parents[i], folders[i])
                except OSError:
                    break
        finally:
            for fd in chain:
                os.close(fd)

    def put(self, name: str, data: bytes) -> None:
        """Create or rewrite ``name`` in place (O_TRUNC, never through a link, regular files
        only), fsync it and its folder. Not atomic for readers (``capabilities.atomic_put`` is
        False): unickpt publishes through ``folder.publish`` (temporary + rename) instead."""
        *folders, base = self._parts(name)
        try:
            with open_dir(self.root, folders, create=True, mode=self.folder_mode) as dfd:
                fd = open_file_at(dfd, base, os.O_WRONLY | os.O_CREAT, self.file_mode, self._path(name))
                try:
                    truncate(fd, 0)
                    write_all(fd, [memoryview(data).cast("B")])
                    fsync(fd)
                finally:
                    os.close(fd)
                sync_folder(dfd)
        except CheckpointError:
            raise
        except OSError as e:
            raise self._oserror("put", name, e) from None

    def rename(self, src: str, dst: str) -> None:
        """``os.replace`` relative to both folders' descriptors (opened without following
        links; ``dst``'s folders are created): atomic, replaces ``dst`` (a link there is
        replaced, not followed). Durable after ``sync`` of the folders."""
        *sfolders, sbase = self._parts(src)
        *dfolders, dbase = self._parts(dst)
        try:
            with (
                open_dir(self.root, sfolders, create=False) as sfd,
                open_dir(self.root, dfolders, create=True, mode=self.folder_mode) as dfd,
            ):
                rename_at(sfd, sbase, dfd, dbase)
        except CheckpointError:
            raise
        except FileNotFoundError:
            raise StorageError(errno.ENOENT, f"rename {self._path(src)} -> {dst}: the source is missing") from None
        except OSError as e:
            raise self._oserror("rename", src, e) from None

    def sync(self, folder: str = "") -> None:
        """fsync a folder so that the names created, renamed or deleted in it are durable."""
        try:
            with open_dir(self.root, self._parts(folder) if folder else [], create=False) as dfd:
                sync_folder(dfd)
        except FileNotFoundError:
            return
        except CheckpointError:
            raise
        except OSError as e:
            raise self._oserror("fsync folder", folder or ".", e) from None

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` only if nothing of that name exists (O_CREAT|O_EXCL|
        O_NOFOLLOW, atomic on POSIX and NFSv3+); durable when it returns. False if it exists."""
        *folders, base = self._parts(name)
        try:
            with open_dir(self.root, folders, create=True, mode=self.folder_mode) as dfd:
                try:
                    fd = create_at(dfd, base, self.file_mode)
                except FileExistsError:
                    return False
                try:
                    try:
                        write_all(fd, [memoryview(data)])
                        fsync(fd)
                    finally:
                        os.close(fd)
                    sync_folder(dfd)
                except OSError:
                    try:
                        unlink_at(dfd, base)
                    except OSError:
                        pass
                    raise
        except CheckpointError:
            raise
        except OSError as e:
            raise self._oserror("create", name, e) from None
        return True

    def update_exclusive(self, name: str, expected: bytes, data: bytes) -> bool:
        """Rewrite ``name`` with ``data`` if it still holds exactly ``expected`` (read and written
        through one descriptor, never through a link); False if it is gone or holds other bytes.
        Only the process that created ``name`` updates it, so the check cannot go stale."""
        *folders, base = self._parts(name)
        try:
            with open_dir(self.root, folders, create=False) as dfd:
                try:
                    fd = open_file_at(dfd, base, os.O_RDWR, path=self._path(name))
                except FileNotFoundError:
                    return False
                try:
                    if read_at_most(fd, len(expected)) != expected:
                        return False
                    pwrite_all(fd, memoryview(data), 0)
                    truncate(fd, len(data))
                    fsync(fd)
                finally:
                    os.close(fd)
        except FileNotFoundError:
            return False
        except CheckpointError:
            raise
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise unsafe(self._path(name), "a symbolic link") from None
            raise self._oserror("update", name, e) from None
        return True


def _set_direct(fd: int) -> bool:
    """Turn on O_DIRECT for ``fd``; False where the filesystem has no direct I/O."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    return True
