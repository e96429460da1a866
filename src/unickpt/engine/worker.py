"""The background save worker: one thread per process running save jobs in submission order.

``api.save(async_save=True)`` snapshots on the caller's thread, then submits the rest (write,
checksums, commit collectives on the ``background`` group) here. Every rank submits the same
saves in the same order, so the collectives of the background group always match across ranks.
The thread is not a daemon: a process that exits waits for its queued saves to commit.
It runs at a lower CPU priority (nice +10 on Linux, per thread; the write and checksum threads
it starts inherit it), so that on a busy host the training threads get the cores first and the
save uses what they leave idle (communication waits, data loading).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["SaveWorker", "SAVE_WORKER"]

T = TypeVar("T")


BACKGROUND_NICE = 10


def _lower_priority() -> None:
    """Make the calling thread (and threads it creates later) yield CPU to training threads."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass


class SaveWorker:
    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="unickpt-save", initializer=_lower_priority)
            fut = self._pool.submit(fn)
            self._pending = [f for f in self._pending if not f.done()] + [fut]
            return fut

    def drain(self) -> None:
        """Wait until every submitted job has finished (errors are reported by their handles)."""
        with self._lock:
            pending = list(self._pending)
        for f in pending:
            try:
                f.result()
            except BaseException:
                pass


SAVE_WORKER = SaveWorker()
