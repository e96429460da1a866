"""Who reads which piece when: the reader threads of one rank's read stage.

``engine.load.reader.read_needs`` cuts every run into pieces (``RunJob.pieces``) and calls
``read_pieces`` once with all of them. Two orders:

* ``streams`` (local files read through this host's page cache: ``engine.load.reader``): each
  file is one stream, its pieces read in file order by one thread at a time; up to ``threads``
  files are read side by side (largest first). The kernel's readahead keeps the device's queue
  full for a file read front to back (the raw ``read`` baseline of ``bench/save_load.py`` reads
  so), while several threads on one file, each at its own offset, measured slower and cost
  about twice the CPU per byte (page-cache contention), which two ranks on a small host share
  with the checksums (docs/design.md, "Load").
* otherwise (object stores, remote files: every ranged read is a round trip; O_DIRECT reads,
  which have no readahead) one pool of ``threads`` readers over all pieces, in run order, so
  one file's pieces are in flight in parallel.

In ``streams`` order a job that splits its pieces (``SplitJob``: ``read_bytes`` then ``settle``,
as ``RunJob`` does) only has its bytes read by the file's reader; the rest of the piece (its
checksums, the copies into place) runs on ``verifiers`` threads of its own, so the reader's next
read is already in flight while the last piece is verified: the device keeps streaming the file
instead of waiting out each piece's checksum (one reader per file would otherwise alternate
read, verify, read). At most ``BACKLOG`` pieces per reader are read and not yet settled (a
bound on the temporaries held). Every piece is still settled (verified) before
``read_pieces`` returns.

Either way a failure stops the readers at their next piece and the first failure is raised
once every reader and verifier has stopped (no thread is left writing into a destination).

The threads: a ``ReaderThreads`` (one per ``Checkpointer``, in its ``Resources``) keeps the
reader and verifier threads between that checkpointer's loads, so a load borrows threads that
are already running; without one (``ops``), ``read_pieces`` starts and stops its own.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from typing import Protocol, runtime_checkable

from ...errors import ConfigurationError

__all__ = ["BACKLOG", "PieceJob", "SplitJob", "ReaderThreads", "read_pieces"]

BACKLOG = 4  # pieces per reader read and waiting for their verification


class PieceJob(Protocol):
    """What ``read_pieces`` needs of a run (``engine.load.reader.RunJob``)."""

    name: str

    def start(self) -> None: ...

    def pieces(self) -> list[tuple[int, int]]: ...

    def read_piece(self, p: int) -> None: ...


@runtime_checkable
class SplitJob(Protocol):
    """A ``PieceJob`` whose pieces are read (``read_bytes``) apart from the rest of their
    handling (``settle``: checksums, hand-over), which may then run on another thread."""

    def read_bytes(self, p: int) -> None: ...

    def settle(self, p: int) -> None: ...


class ReaderThreads:
    """The reader and verifier threads of one checkpointer's loads, kept between them.

    ``Checkpointer`` creates one (``Resources.readers``) and closes it in ``close``; each load's
    ``read_pieces`` borrows ``pool(kind, n)`` (``kind``: "read" or "verify"; at least ``n``
    threads) instead of starting and joining threads of its own: on a host whose cores the ranks
    fill, starting a load's 3-6 threads and waiting for each to run cost about 1-2 ms a load
    (docs/performance.md, "Load from RAM"). A pool too small for a load is replaced by a larger
    one; the old one stays open until ``close`` (a load on another thread may still be handing
    it tasks). A process forked from this one has none of these threads: it starts its own on
    first use. Any thread may call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str, tuple[ThreadPoolExecutor, int]] = {}
        self._retired: list[ThreadPoolExecutor] = []  # replaced by larger ones, shut down by close
        self._pid = os.getpid()
        self._closed = False

    def pool(self, kind: str, n: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise ConfigurationError("this Checkpointer is closed: create a new one")
            if self._pid != os.getpid():  # a forked child: the parent's threads are not here
                self._pools, self._retired, self._pid = {}, [], os.getpid()
            have = self._pools.get(kind)
            if have is not None and have[1] >= n:
                return have[0]
            if have is not None:
                self._retired.append(have[0])
            pool = ThreadPoolExecutor(n, thread_name_prefix=f"unickpt-{kind}")
            self._pools[kind] = (pool, n)
            return pool

    def close(self) -> None:
        """Stop the threads once they finished what they run (idempotent)."""
        with self._lock:
            self._closed = True
            pools = [p for p, _ in self._pools.values()] + self._retired
            self._pools, self._retired = {}, []
            mine = self._pid == os.getpid()
        if mine:
            for pool in pools:
                pool.shutdown(wait=True)


@contextmanager
def _threads(kind: str, n: int, kept: ReaderThreads | None) -> Iterator[ThreadPoolExecutor]:
    """``n`` threads for one ``read_pieces``: borrowed from ``kept``, else started here and
    stopped on exit. The caller waits for every task it submitted before leaving."""
    if kept is not None:
        yield kept.pool(kind, n)
        return
    pool = ThreadPoolExecutor(n, thread_name_prefix=f"unickpt-{kind}")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True)


def read_pieces(
    jobs: Sequence[PieceJob],
    threads: int,
    spans: dict[str, list[float]],
    streams: bool,
    kept: ReaderThreads | None = None,
) -> None:
    """Read every piece of ``jobs`` (``streams``: one thread per file at a time, else one pool
    over all pieces); each piece's time and bytes added to its file's entry of ``spans``
    (``[first start, last end, bytes]``); ``kept``: the checkpointer's threads to run on (else
    threads of this call's own). Raises the first failure after all readers stopped."""
    lock = threading.Lock()

    def piece(job: PieceJob, p: int, n: int, bytes_only: bool = False) -> None:
        t0 = time.perf_counter()
        if bytes_only:
            job.read_bytes(p)  # type: ignore[attr-defined]  # a SplitJob: settled elsewhere
        else:
            job.read_piece(p)
        t1 = time.perf_counter()
        with lock:
            span = spans.setdefault(job.name, [t0, t1, 0])
            span[0], span[1], span[2] = min(span[0], t0), max(span[1], t1), span[2] + n

    for job in jobs:
        job.start()
    if streams:
        _by_file(jobs, threads, piece, kept)
    else:
        _pool(jobs, threads, piece, kept)


def _pool(
    jobs: Sequence[PieceJob],
    threads: int,
    piece: Callable[[PieceJob, int, int, bool], None],
    kept: ReaderThreads | None,
) -> None:
    """One pool of ``threads`` over every piece, in run order; after a failure the pieces not
    started yet are dropped."""
    with _threads("read", max(1, threads), kept) as pool:
        futures: list[Future[None]] = []
        try:
            for job in jobs:
                for p, (lo, hi) in enumerate(job.pieces()):
                    futures.append(pool.submit(piece, job, p, hi - lo, False))
            for f in futures:
                f.result()
        finally:  # after a failure: drop the pieces not started yet, wait for the others
            for f in futures:
                f.cancel()
            wait(futures)


def _by_file(
    jobs: Sequence[PieceJob],
    threads: int,
    piece: Callable[[PieceJob, int, int, bool], None],
    kept: ReaderThreads | None = None,
) -> None:
    """Each file's pieces in file order by one thread; up to ``threads`` files at a time, the
    largest first (the last file to start is a small one). Pieces of a ``SplitJob`` are settled
    on verifier threads (module docstring)."""
    files: dict[str, list[tuple[int, int, PieceJob, int]]] = {}
    for job in jobs:
        for p, (lo, hi) in enumerate(job.pieces()):
            files.setdefault(job.name, []).append((lo, hi, job, p))
    streams = [sorted(ps, key=lambda x: x[0]) for ps in files.values()]
    streams.sort(key=lambda s: -sum(hi - lo for lo, hi, _, _ in s))
    queue = deque(streams)
    take = threading.Lock()
    failures: list[BaseException] = []
    workers = min(max(1, threads), len(streams))
    # decided once per job, not per piece (a runtime-checkable protocol's isinstance reads attributes)
    split_jobs = {id(job) for job in jobs if isinstance(job, SplitJob)}
    settling: list[Future[None]] = []  # the verifiers' tasks (split jobs only)
    slots = threading.BoundedSemaphore(BACKLOG * workers)

    def failed(e: BaseException) -> None:
        with take:
            failures.append(e)

    def settle(job: SplitJob, p: int) -> None:
        try:
            if not failures:  # after a failure the load fails anyway: nothing more to verify
                job.settle(p)
        except BaseException as e:
            failed(e)
        finally:
            slots.release()

    def read_split(job: PieceJob, p: int, n: int, verify_pool: ThreadPoolExecutor) -> None:
        """``piece`` for a split job: times only its read; its settling queued to a verifier."""
        slots.acquire()
        try:
            piece(job, p, n, True)
        except BaseException:
            slots.release()
            raise
        task = verify_pool.submit(settle, job, p)  # type: ignore[arg-type]  # in split_jobs: a SplitJob
        with take:
            settling.append(task)

    def reader(verify_pool: ThreadPoolExecutor | None) -> None:
        while True:
            with take:
                if failures or not queue:
                    return
                stream = queue.popleft()
            for lo, hi, job, p in stream:
                if failures:  # another reader (or a verifier) failed: stop at this piece
                    return
                try:
                    if verify_pool is not None and id(job) in split_jobs:
                        read_split(job, p, hi - lo, verify_pool)
                    else:
                        piece(job, p, hi - lo, False)
                except BaseException as e:
                    failed(e)
                    return

    verifying = _threads("verify", verifiers(workers), kept) if split_jobs else nullcontext(None)
    with verifying as verify_pool:
        try:
            if workers <= 1:
                reader(verify_pool)
            else:
                with _threads("read", workers, kept) as pool:
                    started = [pool.submit(reader, verify_pool) for _ in range(workers)]
                    try:
                        wait(started)  # a reader records its failure and returns: none raises
                    except BaseException as e:  # interrupted: readers stop at their next piece
                        failed(e)
                        wait(started)
                        raise
        finally:  # every piece read is settled (or skipped after a failure)
            with take:
                tasks = list(settling)
            wait(tasks)
    if failures:
        raise failures[0]


def verifiers(readers: int) -> int:
    """Verifier threads for ``readers`` streams: one per two readers (a checksum runs several
    times faster than a page-cache read delivers bytes), at least one."""
    return max(1, readers // 2)
