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
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

__all__ = ["BACKLOG", "PieceJob", "SplitJob", "read_pieces"]

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


def read_pieces(jobs: Sequence[PieceJob], threads: int, spans: dict[str, list[float]], streams: bool) -> None:
    """Read every piece of ``jobs`` (``streams``: one thread per file at a time, else one pool
    over all pieces); each piece's time and bytes added to its file's entry of ``spans``
    (``[first start, last end, bytes]``). Raises the first failure after all readers stopped."""
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
        _by_file(jobs, threads, piece)
    else:
        _pool(jobs, threads, piece)


def _pool(jobs: Sequence[PieceJob], threads: int, piece: Callable[[PieceJob, int, int, bool], None]) -> None:
    """One pool of ``threads`` over every piece, in run order; after a failure the pieces not
    started yet are dropped."""
    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="unickpt-read")
    try:
        futures = [
            pool.submit(piece, job, p, hi - lo, False) for job in jobs for p, (lo, hi) in enumerate(job.pieces())
        ]
        for f in futures:
            f.result()
    finally:  # after a failure: drop the pieces not started yet
        pool.shutdown(wait=True, cancel_futures=True)


def _by_file(jobs: Sequence[PieceJob], threads: int, piece: Callable[[PieceJob, int, int, bool], None]) -> None:
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
    verify_pool = ThreadPoolExecutor(verifiers(workers), thread_name_prefix="unickpt-verify") if split_jobs else None
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

    def read_split(job: PieceJob, p: int, n: int) -> None:
        """``piece`` for a split job: times only its read; its settling queued to a verifier."""
        assert verify_pool is not None
        slots.acquire()
        try:
            piece(job, p, n, True)
        except BaseException:
            slots.release()
            raise
        verify_pool.submit(settle, job, p)  # type: ignore[arg-type]  # in split_jobs: a SplitJob

    def reader() -> None:
        while True:
            with take:
                if failures or not queue:
                    return
                stream = queue.popleft()
            for lo, hi, job, p in stream:
                if failures:  # another reader (or a verifier) failed: stop at this piece
                    return
                try:
                    if id(job) in split_jobs:
                        read_split(job, p, hi - lo)
                    else:
                        piece(job, p, hi - lo, False)
                except BaseException as e:
                    failed(e)
                    return

    try:
        if workers <= 1:
            reader()
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="unickpt-read") as pool:
                for f in [pool.submit(reader) for _ in range(workers)]:
                    f.result()
    finally:
        if verify_pool is not None:  # every piece read is settled (or skipped after a failure)
            verify_pool.shutdown(wait=True)
    if failures:
        raise failures[0]


def verifiers(readers: int) -> int:
    """Verifier threads for ``readers`` streams: one per two readers (a checksum runs several
    times faster than a page-cache read delivers bytes), at least one."""
    return max(1, readers // 2)
