"""The storage protocol: the only way unickpt touches bytes at rest, and the whole of it.

A backend is rooted at one location (a checkpoint folder, a manager root) and sees flat,
'/'-separated *names* relative to it. It implements every method below and states once, in a
frozen ``StorageCapabilities`` record, what it guarantees beyond the baseline. The engine, the
save lock, ``CheckpointManager`` and ``ops`` call nothing else; behaviour that only some
backends have is a declared method plus a capability flag, never an attribute probed with
``getattr``. ``folder.publish`` builds atomic publication on top (temporary name + rename, or one
atomic put), ``storage.retry`` wraps every method with an explicit retry decision, and
``tests/fixtures/contract.py`` is the test suite every backend passes.

What each step of a save and a load asks of a backend:
  save   rank 0, before any data byte: ``list`` (is the folder unickpt's), the save lock
         (``create_exclusive`` of a lock generation, ``read``, ``list``, ``delete`` of older
         generations), ``create_exclusive`` of the save's data marker.
         every rank, in parallel threads: ``write`` of each of its data files.
         rank 0, commit: ``sync`` of every data folder and of ``data`` (only where
         ``needs_sync``) -> ``size`` of every data file -> lock heartbeat ``update_exclusive`` +
         ``list`` -> ``read`` of the old metadata -> publication of the metadata
         (``folder.publish``: ``write`` of a temporary + ``rename`` + ``sync`` of the folder, or
         one ``put``) -> ``list`` / ``delete`` of stale data, markers and publication leftovers ->
         lock release (``read``, ``delete``). A failed save: ``list`` / ``delete`` of its own data.
  load   rank 0: ``read`` of the metadata (``list`` only on the error path, for a precise
         message); every rank: ``size`` of the files it reads, then ``read_into`` (or
         ``read_into_cached`` for bytes other ranks of its host read too) of byte ranges, in
         parallel threads.
  manager (rank 0) ``list``, ``read`` of metadata and of the ``latest`` pointer, publication of
         the pointer, ``delete`` for retention. Tools: ``read``, ``size``, ``read_into``.

Baseline semantics (every backend)
- Names: '/'-separated, relative, no empty, '.' or '..' part; a name that would leave the root
  is refused with ``StorageError(EINVAL)`` by every method (``check_name``). A name is a file,
  never a folder; folders exist only as prefixes.
- A missing name is a value: ``read`` and ``size`` return None, ``list`` returns [], ``delete``
  ignores it, ``update_exclusive`` returns False. Only ``read_into`` / ``read_into_cached``
  raise for it (``MissingDataFileError``), ``rename`` too (``StorageError(ENOENT)``).
- Errors are ``CheckpointError`` subclasses naming the operation and the object: backends raise
  ``StorageError`` carrying the errno where there is one (``TransientStorageError`` for failures
  they know to be worth retrying); plain ``OSError`` / ``TimeoutError`` from client libraries is
  classified and converted by ``storage.retry``.
- Safety (DESIGN.md section 8): ``write`` and ``create_exclusive`` never replace an existing
  name; nothing inside the root is followed when it is a link (the root itself may be one); only
  regular objects are read; whole-object reads stop at their ``limit``.
- Idempotency, for retries after a failure whose effect is unknown (``storage.retry``): reads,
  ``size``, ``list``, ``delete``, ``put``, ``sync`` may simply be repeated; ``write``,
  ``create_exclusive``, ``update_exclusive`` and ``rename`` may not (a repeat after an attempt
  that did take effect would misreport), so the retry layer checks what the earlier attempt left
  before it repeats or reports them.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from ..errors import CheckpointError, MissingDataFileError, SizeLimitError, StorageError, TruncatedDataFileError

T = TypeVar("T")

Buffer = bytes | bytearray | memoryview

__all__ = [
    "Storage",
    "StorageCapabilities",
    "Buffer",
    "METADATA_LIMIT",
    "SMALL_FILE_LIMIT",
    "size_limit_error",
    "check_name",
    "check_prefix",
    "exists_error",
    "is_exists_error",
    "unsupported_error",
    "translated",
    "read_spans",
    "truncated_error",
]

METADATA_LIMIT = 1 << 30  # default cap of a metadata read (LoadOptions.limits.max_metadata_bytes)
SMALL_FILE_LIMIT = 64 << 10  # cap of a lock, marker or ``latest`` pointer read


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageCapabilities:
    """What a backend guarantees beyond the baseline, stated once (``Storage.capabilities``).

    ``folder.publish.publisher_for`` picks the publication strategy from it, the load engine
    its read deduplication, the save engine its durability calls. Typical records:

    ==================  ==========  ============  ===============  ==================  ==========  =================
    backend             atomic_put  atomic_rename  rename_replaces  conditional_create  needs_sync  shared_page_cache
    ==================  ==========  ============  ===============  ==================  ==========  =================
    local / NFS         no          yes           yes              yes (NFSv3+)        yes         yes
    memory              yes         yes           yes              yes (one process)   no          no
    S3 (If-None-Match)  yes         no            no               yes                 no          no
    HDFS                no          yes           Rename2          yes                 no          no
    ==================  ==========  ============  ===============  ==================  ==========  =================
    """

    # ``put(name, data)`` replaces a whole object in one step: a reader sees the old bytes or the
    # new ones, never a mix, an empty or a missing object (object stores: PUT).
    atomic_put: bool
    # ``rename(src, dst)`` moves an object in one step: ``dst`` never shows a partial object.
    # Without it ``rename`` raises ``StorageError(ENOTSUP)``.
    atomic_rename: bool
    # ``rename`` over an existing ``dst`` replaces it atomically (POSIX ``rename``, HDFS
    # Rename2/OVERWRITE). False: ``rename`` refuses an existing ``dst`` (``exists_error``), and
    # publication over an existing name moves the old object aside first (``folder.publish``).
    rename_replaces: bool
    # ``create_exclusive`` is atomic across hosts: of concurrent creators of one name on any
    # machines exactly one wins (O_CREAT|O_EXCL on local disks and NFSv3+, S3 If-None-Match, HDFS
    # create without overwrite). False: exact only within one process; the save lock is then
    # best effort between jobs.
    conditional_create: bool
    # Names created, renamed or deleted in a folder are durable only after ``sync(folder)``
    # (POSIX: fsync of the directory). False: ``sync`` is a no-op and the engine skips it.
    needs_sync: bool
    # Processes of one host reading these objects share one cache (the kernel's page cache for
    # local/NFS files): ranks of one host read shared bytes themselves (``read_into_cached``)
    # instead of forwarding them over the process group.
    shared_page_cache: bool
    # The kernel reads ahead of one reader going through a file front to back (local files read
    # through the page cache, not with O_DIRECT): the load engine then gives each file one reader
    # (``engine.load.schedule``) instead of spreading one file's pieces over its threads.
    reads_ahead: bool = False
    # Each host sees only the data files its own ranks wrote (a node-local RAM tier,
    # ``recovery.tier.NodeShmStorage``): the commit cannot check other hosts' files by size, so the
    # tier checks every chunk of every file itself (``recovery.replicate``) before a step counts.
    node_local: bool = False

    def __post_init__(self) -> None:
        if self.rename_replaces and not self.atomic_rename:
            raise ValueError("StorageCapabilities: rename_replaces needs atomic_rename")


@runtime_checkable
class Storage(Protocol):
    """One storage location (see the module docstring for the call order and the baseline)."""

    url: str  # where it is, for messages: ``<url>/<name>`` names an object
    capabilities: StorageCapabilities

    # ------------------------------------------------------------------ data files

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        """Create ``name`` holding the concatenation of ``parts`` (large, zero-copy: data files,
        and the temporaries of ``folder.publish``); its bytes are durable when it returns (its
        name after ``sync`` where ``needs_sync``). Exclusive: an existing object (or link) of
        that name is never replaced (``exists_error``: ``UnsafePathError(EEXIST)``). A failed
        write leaves no object behind. Any rank, many threads at once (distinct names)."""

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with ``len(out)`` bytes of ``name`` from ``offset`` (any offset and
        length, 0 included). ``MissingDataFileError`` / ``TruncatedDataFileError`` (the range
        ends past the object) naming the object. Many threads at once."""

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        """``read_into`` for bytes that other processes of this host read as well: through the
        host's shared cache where ``shared_page_cache`` (never bypassing it, e.g. with direct
        I/O), so the device delivers them once; backends without one read as ``read_into``."""

    def size(self, name: str) -> int | None:
        """Size in bytes, or None when missing (a folder is not a name: None)."""

    # ------------------------------------------------------------------ small objects

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        """The whole object, or None when missing (metadata, locks, markers, pointers);
        ``SizeLimitError`` (``size_limit_error``) when it holds more than ``limit`` bytes, read
        no further than that."""

    def put(self, name: str, data: bytes) -> None:
        """Create or replace ``name`` with ``data`` (small objects). Atomic for readers only
        where ``atomic_put``; elsewhere a concurrent reader may see a partial object, so
        unickpt publishes through ``folder.publish`` and never calls ``put`` there."""

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` unless it exists: True if this call created it,
        False if the name was taken. Of concurrent creators exactly one gets True (across hosts
        where ``conditional_create``). Durable (name included) when it returns True. Where
        ``atomic_put`` is False a reader may see the object before its bytes are complete."""

    def update_exclusive(self, name: str, expected: bytes, data: bytes) -> bool:
        """Replace the content of ``name`` with ``data`` if it still holds exactly ``expected``
        (compare-and-swap; the save lock's heartbeat); False if it is gone or holds other bytes.
        Never creates ``name``. Only the object's creator updates it."""

    # ------------------------------------------------------------------ names

    def list(self, prefix: str = "") -> list[str]:
        """Every name starting with ``prefix`` (a plain string prefix: ``"a/b"`` matches
        ``a/b1`` and ``a/b/c``), recursively, sorted; ``[]`` when there is none. Folders
        reached through links are not entered. Backends may page internally; callers list the
        narrowest prefix they can."""

    def delete(self, names: Sequence[str]) -> None:
        """Remove ``names`` (files; a link is removed, never followed); missing names are
        ignored. Folders left empty may disappear."""

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` in one step (``atomic_rename``; ``StorageError(ENOTSUP)``
        without). An existing ``dst`` is replaced atomically where ``rename_replaces``, else
        refused with ``exists_error``. Missing ``src``: ``StorageError(ENOENT)``. The names are
        durable after ``sync`` of their folders where ``needs_sync``."""

    def sync(self, folder: str = "") -> None:
        """Make the names created, renamed or deleted directly in ``folder`` ('' is the root)
        durable; a missing folder is ignored. A no-op where not ``needs_sync``."""


def size_limit_error(where: str, size: int, limit: int) -> SizeLimitError:
    """The error of a whole-file read of ``where`` (``size`` bytes or more) over ``limit`` bytes."""
    return SizeLimitError(
        f"{where} holds {size} bytes or more, over the cap of {limit} bytes ({limit / (1 << 20):.4g} MiB) "
        "for this kind of file: it is not a file unickpt wrote, or its cap must be raised"
    )


def check_name(name: str, root: str) -> list[str]:
    """The parts of ``name``, or ``StorageError(EINVAL)`` when it would leave ``root`` or is no
    file name (absolute, empty, with an empty, '.' or '..' part, or a backslash)."""
    if not isinstance(name, str):
        raise StorageError(errno.EINVAL, f"storage names are strings, got {type(name).__name__} under {root}")
    parts = name.split("/")
    if "\\" in name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise StorageError(errno.EINVAL, f"name {name!r} escapes the checkpoint folder {root}")
    return parts


def check_prefix(prefix: str, root: str) -> str:
    """``prefix`` for ``list``: like a name, except that it may be '' or end with '/' (or in a
    partial last part)."""
    if prefix:
        check_name(prefix[:-1] if prefix.endswith("/") else prefix, root)
    return prefix


def exists_error(where: str) -> StorageError:
    """What ``write`` / ``rename`` raise for a name that exists already."""
    from ..errors import UnsafePathError

    return UnsafePathError(
        errno.EEXIST,
        f"refusing to write {where}: something of that name exists already "
        "(unickpt creates each of its files exclusively and never writes through a link)",
    )


def is_exists_error(e: BaseException) -> bool:
    """Whether ``e`` says that a name exists already (``exists_error`` or an OSError(EEXIST))."""
    return isinstance(e, OSError) and e.errno == errno.EEXIST


def unsupported_error(op: str, url: str) -> StorageError:
    """What a backend raises for an operation its capabilities say it does not have."""
    return StorageError(errno.ENOTSUP, f"{op} is not supported by the storage at {url} (see its capabilities)")


def translated(
    op: str, name: str, fn: Callable[[], T], translate: Callable[[str, str, BaseException], StorageError]
) -> T:
    """``fn()``: one request ``op`` of a remote back-end about ``name``. A ``CheckpointError``
    passes unchanged; any other failure is raised as ``translate(op, name, e)`` (the back-end's
    ``StorageError``, transient or not), from ``e``; ``storage.retry`` decides on retries from
    it. The request wrapper of ``blob_store``, ``s3`` and ``hdfs``."""
    try:
        return fn()
    except CheckpointError:
        raise
    except Exception as e:
        raise translate(op, name, e) from e


def read_spans(
    out: memoryview, offset: int, part: int, where: str, size: Callable[[], int | None]
) -> tuple[memoryview, list[tuple[int, int]]]:
    """The start of a remote back-end's ``read_into`` (``blob_store``, ``s3``) of the object
    ``where`` at ``offset`` into ``out``: ``out`` as bytes and its spans ``(start, end)`` of at
    most ``part`` bytes, one ranged request each. An empty ``out`` has no span, once ``size()``
    has shown that the object exists (``MissingDataFileError`` if not); a negative ``offset`` is
    ``StorageError(EINVAL)``."""
    view = memoryview(out).cast("B")
    if len(view) == 0:
        if size() is None:
            raise MissingDataFileError(f"data file {where} is missing")
        return view, []
    if offset < 0:
        raise StorageError(errno.EINVAL, f"negative offset {offset} reading {where}")
    return view, [(s, min(s + part, len(view))) for s in range(0, len(view), part)]


def truncated_error(where: str, offset: int, length: int, size: int | str) -> TruncatedDataFileError:
    """What a remote back-end's ``read_into`` raises when the object ``where`` ended before byte
    ``offset + length`` (``size``: its size, or "no" / "fewer" when it is gone or unknown)."""
    return TruncatedDataFileError(
        f"data file {where} is truncated: wanted bytes [{offset}, {offset + length}) but it has {size}"
    )
